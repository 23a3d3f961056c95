"""Fine-tune a LazyLlama (or a Llama, converted on load) with `transformers.Trainer` and `datasets`.

Command (every `transformers.TrainingArguments` option is accepted too, hyphenated, e.g. `--max-steps`,
`--eval-strategy`, `--save-steps`, `--gradient-checkpointing`, `--resume-from-checkpoint last`; the underscore
spellings still work and print a deprecation line):

    lazy-finetune DIR --train-file train.txt --eval-file test.txt --output-dir out \
        --mode lazy-only --lazy-lr-multiplier 10 --block-size 256 --max-steps 200

Python recipe (what `main` does):

    model, tokenizer = load_model(path)                       # Llama folders convert at tau = 0 (exact)
    train = packed_dataset(load_documents(files), tokenizer, block_size=256)
    model = configure_trainable(model, mode="lazy-only")      # or "full", or "lora" (PEFT)
    trainer = build_trainer(model, training_args, train, eval_dataset, lazy_lr_multiplier=10.0)
    trainer.train()

Data: text files hold one document per blank-line-separated paragraph block (what `brown_text_file` writes);
JSON-lines files hold one document per record (`--text-column`). Documents are tokenised, ended with EOS and
packed by `lazy_llama_tools.data.pack_token_blocks` into blocks whose `position_ids` restart at 0 at every document
start; the model reads document boundaries from those restarts, so packed documents never see each other
(docs/design.md). Labels are the input ids, except that the first token of every document segment (position 0)
is ignored (-100): it has no history inside its document, and predicting it from the previous document would
train across the boundary that attention hides.

Parameters: `tau` and `distance_bias` never get weight decay and may get their own learning rate
(`lazy_lr_multiplier`). Modes: `full` trains everything; `lazy-only` trains only `tau` and `distance_bias`;
`lora` adds PEFT LoRA adapters on a frozen base model and trains `tau` and `distance_bias` beside them (unless
`lora_train_lazy=False`); they are saved in the adapter file, so `PeftModel.from_pretrained(base, out)` restores
both (`save_lora_adapter` does the same outside `LazyTrainer`).
"""

import dataclasses
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME

from conversion.convert_llama_to_lazy import EXACT_TAU_INIT, ConversionError, check_llama_config, make_shareable
from lazy_llama_tools.cli import DEFAULT_LORA_TARGETS, one_line_errors
from lazy_llama_tools.cli import FINETUNE_MODES as MODES
from lazy_llama_tools.data import pack_token_blocks
from lazy_llama_tools.folders import (
    deferred_signals,
    is_empty_folder,
    publish_folder,
    raise_swallowed_interrupt,
    temporary_folder,
    terminations_as_interrupts,
)
from lazy_llama_tools.loading import (
    LAZY_TYPE,
    ModelNotFound,
    UnusableModel,
    check_text_file,
    missing_model_explained,
    one_line,
    without_gguf_quantization,
)
from lazy_llama_tools.metrics import attention_statistics
from modeling_lazy import is_lazy_parameter
from modeling_lazy.modeling_lazy import LAZY_PARAMETER_NAMES


class FinetuneError(ValueError):
    """Input that `lazy-finetune` cannot train on; the message says what is wrong and what to do."""


# --------------------------------------------------------------------------------------------- model


def load_model(path: str, tau_init: float = EXACT_TAU_INIT, bias_init_std: float = 0.0, dtype=torch.float32,
               distributed_config=None):
    """Load a LazyLlama or a plain Llama folder as `LazyLlamaForCausalLM`, plus its tokenizer.

    A Llama checkpoint has no `tau`/`distance_bias`; they are initialised to `tau_init` and N(0, `bias_init_std`)
    (defaults 0 and 0: the exact conversion, logits identical to the Llama's). A LazyLlama checkpoint keeps its
    own values. Weights load in `dtype` (float32 by default; mixed precision is the Trainer's job).
    Anything but a LazyLlama or a plain Llama (`check_llama_config`, as `lazy-convert` refuses it) is refused
    before any model is built (`FinetuneError`), and so is a folder whose files cannot be loaded
    (`ModelNotFound`, `UnusableModel`, `FinetuneError` for a missing tokenizer): each a one-line message.
    `distributed_config` (a `transformers.DistributedConfig`, e.g. `fsdp_size=N` under torchrun) shards the model
    at load time with FSDP2; `Trainer` then trains it as it is.
    """
    from transformers import AutoTokenizer

    from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM

    with missing_model_explained(path):
        source, _ = LazyLlamaConfig.get_config_dict(path)
    if source.get("model_type") != LAZY_TYPE:
        try:
            check_llama_config(source)
        except ConversionError as error:
            raise FinetuneError(f"{path}: {error} lazy-finetune trains a LazyLlama, or a Llama that it converts on "
                                "load.") from None
    with missing_model_explained(path):
        config = LazyLlamaConfig.from_pretrained(path, lazy_tau_init=tau_init, lazy_bias_init_std=bias_init_std)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise FinetuneError(f"no tokenizer could be loaded from {path} ({one_line(error, 200)}): save the "
                            "tokenizer files with the model") from None
    with missing_model_explained(path):
        model = LazyLlamaForCausalLM.from_pretrained(path, config=without_gguf_quantization(config), dtype=dtype,
                                                     distributed_config=distributed_config)
    return model, tokenizer


def configure_trainable(model, mode: str = "full", lora_r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0,
                        lora_target_modules: list[str] | None = None, lora_train_lazy: bool = True):
    """Set what trains. Returns the model to train (a `peft.PeftModel` for `mode="lora"`).

    - `full`: every parameter.
    - `lazy-only`: only `tau` and `distance_bias`; everything else is frozen (`requires_grad=False`).
    - `lora`: LoRA adapters on `lora_target_modules` (default q/k/v/o projections) through PEFT, on a frozen base
      model; `tau` and `distance_bias` train beside the adapters unless `lora_train_lazy=False`. Save with
      `save_lora_adapter` (or `LazyTrainer`, which does): PEFT alone saves the adapters only.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        targets = list(lora_target_modules or DEFAULT_LORA_TARGETS)
        try:
            config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, task_type="CAUSAL_LM",
                                target_modules=targets)
            model = get_peft_model(model, config)
        except ValueError as error:  # e.g. target modules that the model does not have
            raise FinetuneError(f"LoRA cannot be set up with target modules {targets}: {one_line(error)} (the "
                                "attention and MLP projections are q_proj, k_proj, v_proj, o_proj, gate_proj, "
                                "up_proj, down_proj)") from None
        if lora_train_lazy:  # PEFT's `modules_to_save` names modules: it cannot reach these two parameters
            for name, param in model.named_parameters():
                if is_lazy_parameter(name):
                    param.requires_grad_(True)
        return model
    for name, param in model.named_parameters():
        param.requires_grad_(mode == "full" or is_lazy_parameter(name))
    if mode == "lazy-only":
        # With everything before the first attention frozen, checkpointed layers would see inputs without grad.
        model.enable_input_require_grads()
    return model


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def trained_lazy_parameters(model) -> dict[str, torch.Tensor]:
    """The `tau` and `distance_bias` of a PEFT model that train beside its adapters, by PEFT state-dict name
    (`base_model.model.model.layers.0.self_attn.tau`, ...), float32 on CPU; empty when they are frozen."""
    return {name: param.detach().float().cpu().contiguous() for name, param in model.named_parameters()
            if is_lazy_parameter(name) and param.requires_grad}


def add_lazy_parameters_to_adapter(model, folder) -> int:
    """Write the trained `tau`/`distance_bias` of PEFT `model` into the adapter file PEFT saved in `folder`.

    PEFT saves only adapter weights (and `modules_to_save` modules; these are parameters, not modules), so an
    adapter-only folder would reload with the base model's tau and bias. Stored in `adapter_model.safetensors`
    under their PEFT names, they are set back by `PeftModel.from_pretrained(base, folder)` (PEFT loads every key
    of the file into the model), which also restores them when Trainer resumes from a checkpoint. Returns how many
    tensors were added (0 when tau and bias are frozen).
    """
    from safetensors.torch import load_file, save_file

    lazy = trained_lazy_parameters(model)
    if not lazy:
        return 0
    path = os.path.join(folder, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no PEFT adapter file to add tau and distance_bias to (save the adapter with "
                                "safe_serialization=True first)")
    tensors = load_file(path)
    tensors.update(lazy)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    return len(lazy)


def check_modules_to_save(model) -> None:
    """Warn (once per call) when a PEFT config's `modules_to_save` names `tau` or `distance_bias`: PEFT matches
    module names, these are parameters, so the entry matches nothing and trains nothing."""
    import warnings

    for name, config in getattr(model, "peft_config", {}).items():
        named = sorted(set(getattr(config, "modules_to_save", None) or ()) & set(LAZY_PARAMETER_NAMES))
        if named:
            warnings.warn(f"PEFT adapter {name!r}: modules_to_save={named} matches no module ({', '.join(named)} are "
                          "parameters of the attention modules), so PEFT neither trains nor saves them. Use "
                          "configure_trainable(model, 'lora') (or set requires_grad on them) and save with "
                          "save_lora_adapter or LazyTrainer.", UserWarning, stacklevel=3)


def save_lora_adapter(model, folder) -> None:
    """`model.save_pretrained(folder)` for a PEFT model, plus its trained `tau`/`distance_bias` in the adapter
    file: `PeftModel.from_pretrained(fresh_base, folder)` then reproduces the trained model."""
    check_modules_to_save(model)
    model.save_pretrained(folder)
    add_lazy_parameters_to_adapter(model, folder)


# ---------------------------------------------------------------------------------------------- data


def load_documents(files: list[str], text_column: str = "text"):
    """A `datasets.Dataset` with one document per row in column `text`.

    `.json`/`.jsonl` files: one document per record, read from `text_column`. Any other file is text: documents
    are separated by blank lines (`sample_by="paragraph"`), as in `lazy_llama_tools.data.brown_text_file`.
    """
    from datasets import concatenate_datasets, load_dataset

    if not files:
        raise FinetuneError("no data files given")
    json_files = [f for f in files if f.endswith((".json", ".jsonl"))]
    text_files = [f for f in files if f not in json_files]
    parts = []
    if text_files:
        parts.append(load_dataset("text", data_files=text_files, sample_by="paragraph", split="train"))
    if json_files:
        from datasets.exceptions import DatasetGenerationError

        try:
            part = load_dataset("json", data_files=json_files, split="train")
        except DatasetGenerationError as error:
            cause = error.__cause__ or error
            raise FinetuneError(f"{', '.join(json_files)}: not valid JSON lines ({one_line(cause, 200)}): give one "
                                "JSON object per line") from None
        if text_column not in part.column_names:
            raise FinetuneError(f"JSON-lines files have no column {text_column!r} (columns: {part.column_names}); "
                                "pass --text-column")
        kind = getattr(part.features[text_column], "dtype", None)
        if kind not in ("string", "large_string"):
            raise FinetuneError(f"{', '.join(json_files)}: field {text_column!r} must hold text (a string) in every "
                                f"record, found {part.features[text_column]}")
        part = part.select_columns([text_column])
        if text_column != "text":
            part = part.rename_column(text_column, "text")
        parts.append(part)
    dataset = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    return dataset.filter(lambda row: bool(row["text"] and row["text"].strip()))  # a record without text: skipped


def packed_dataset(documents, tokenizer, block_size: int, docs_per_pack: int = 1000, num_proc: int | None = None):
    """Tokenise documents (one per row of column `text`) and pack them into blocks of `block_size` tokens.

    Returns a `datasets.Dataset` with `input_ids` and `position_ids` (lists of `block_size` ints). Every document
    ends with EOS; positions restart at 0 per document (`pack_token_blocks`). Packing runs over groups of
    `docs_per_pack` documents, each dropping its last partial block.
    """
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        return {"ids": tokenizer(batch["text"], add_special_tokens=True)["input_ids"]}

    def pack(batch):
        try:
            ids, pos = pack_token_blocks(batch["ids"], block_size, eos)
        except ValueError:  # this group holds less than one block
            return {"input_ids": [], "position_ids": []}
        return {"input_ids": ids.tolist(), "position_ids": pos.tolist()}

    tokens = documents.map(tokenize, batched=True, remove_columns=documents.column_names, num_proc=num_proc,
                           desc="tokenising")
    blocks = tokens.map(pack, batched=True, batch_size=docs_per_pack, remove_columns=["ids"], num_proc=num_proc,
                        desc=f"packing into blocks of {block_size}")
    if len(blocks) == 0:
        raise FinetuneError(f"the data holds fewer than {block_size} tokens: no block to train on; give more text or "
                            "a smaller --block-size")
    return blocks


@dataclass
class PackedBlockCollator:
    """Stacks packed blocks into `input_ids`, `position_ids` and `labels` `[B, block_size]` int64.

    `labels` are the input ids with -100 at every position 0 (the first token of each document segment), so no
    loss term predicts one document from another. No `attention_mask`: blocks have no padding, and the model
    derives document boundaries from `position_ids`.
    """

    def __call__(self, features):
        input_ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)
        position_ids = torch.tensor([f["position_ids"] for f in features], dtype=torch.long)
        labels = input_ids.masked_fill(position_ids == 0, -100)
        return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


# ------------------------------------------------------------------------------------------- trainer


class LazyTrainer(Trainer):
    """`Trainer` whose optimizer keeps `tau` and `distance_bias` in their own group: weight decay 0 and learning
    rate `learning_rate * lazy_lr_multiplier` (the scheduler scales every group alike)."""

    def __init__(self, *args, lazy_lr_multiplier: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_lr_multiplier = lazy_lr_multiplier
        check_modules_to_save(self.model)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's save (final model and checkpoints); a PEFT model's trained tau/bias go into its adapter file."""
        super()._save(output_dir, state_dict=state_dict)
        if hasattr(self.model, "peft_config"):
            add_lazy_parameters_to_adapter(self.model, output_dir if output_dir is not None else self.args.output_dir)

    def get_decay_parameter_names(self, model) -> list[str]:
        return [name for name in super().get_decay_parameter_names(model) if not is_lazy_parameter(name)]

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        decay_names = set(self.get_decay_parameter_names(opt_model))
        groups = {"decay": [], "no_decay": [], "lazy": []}
        for name, param in opt_model.named_parameters():
            if not param.requires_grad:
                continue
            key = "lazy" if is_lazy_parameter(name) else "decay" if name in decay_names else "no_decay"
            groups[key].append(param)
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        optimizer_kwargs = dict(optimizer_kwargs)
        lr = optimizer_kwargs.get("lr", self.args.learning_rate)
        param_groups = [
            {"params": groups["decay"], "weight_decay": self.args.weight_decay, "name": "decay"},
            {"params": groups["no_decay"], "weight_decay": 0.0, "name": "no_decay"},
            {"params": groups["lazy"], "weight_decay": 0.0, "lr": lr * self.lazy_lr_multiplier, "name": "lazy"},
        ]
        param_groups = [group for group in param_groups if group["params"]]
        self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
        return self.optimizer


class LazyAttentionCallback(TrainerCallback):
    """Adds Lazy Attention statistics to every training log and to every evaluation's metrics.

    On a fixed probe batch `[B, T]` of single-document token ids (`attention_statistics`, eager attention, the
    model briefly in eval mode) it logs `lazy/sparsity`, `lazy/sink` (mean weight on the first key) and
    `lazy/tau`, each as a mean and per layer (`lazy/sparsity/layer_00`, ...); evaluation keys carry the `eval_`
    prefix, and `eval_perplexity = exp(eval_loss)` is added. Computed on the main process only.

    It edits the logs in place, so it must run before the reporting callbacks: `build_trainer` puts it first.
    """

    def __init__(self, probe_ids: torch.Tensor, every_n_logs: int = 1):
        self.probe_ids = probe_ids
        self.every_n_logs = max(1, every_n_logs)
        self._train_logs = 0

    def statistics(self, model) -> dict[str, float]:
        if hasattr(model, "get_base_model"):  # PEFT
            model = model.get_base_model()
        was_training = model.training
        model.eval()
        try:
            stats = attention_statistics(model, self.probe_ids.to(next(model.parameters()).device))
        finally:
            model.train(was_training)
        out = {f"lazy/{key}": stats["mean"][key] for key in ("sparsity", "sink", "tau")}
        for index, layer in enumerate(stats["layers"]):
            for key in ("sparsity", "sink", "tau"):
                out[f"lazy/{key}/layer_{index:02d}"] = sum(layer[key]) / len(layer[key])
        return out

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        # An FSDP2-sharded model all-gathers its weights in forward: every rank computes, the main process logs.
        sharded = _is_fsdp_sharded(model)
        if logs is None or model is None or not (state.is_world_process_zero or sharded):
            return
        if "eval_loss" in logs:
            extra = {"eval_perplexity": math.exp(min(logs["eval_loss"], 50.0))}
            extra.update({f"eval_{k}": v for k, v in self.statistics(model).items()})
        elif "loss" in logs:
            self._train_logs += 1
            if (self._train_logs - 1) % self.every_n_logs:
                return
            extra = self.statistics(model)
        else:
            return
        if not state.is_world_process_zero:
            return
        logs.update(extra)
        if state.log_history and all(state.log_history[-1].get(k) == v for k, v in logs.items() if k not in extra):
            state.log_history[-1].update(extra)  # Trainer.log stored a copy before calling us


def _is_fsdp_sharded(model) -> bool:
    """True for a model FSDP2 shards (`DistributedConfig(fsdp_size=N)` at load, or accelerate's FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return model is not None and any(isinstance(module, FSDPModule) for module in model.modules())


def probe_from_blocks(dataset, tokens: int = 256, rows: int = 2) -> torch.Tensor:
    """Up to `rows` probe sequences `[rows, T]` for `LazyAttentionCallback`: each is the first `T <= tokens`
    tokens of a packed block that belong to one document (position ids 0..T-1)."""
    chosen, length = [], tokens
    for index in range(min(len(dataset), 64)):
        pos = dataset[index]["position_ids"]
        run = 1
        while run < min(tokens, len(pos)) and pos[run] == run:
            run += 1
        if run >= 2:
            chosen.append(dataset[index]["input_ids"])
            length = min(length, run)
        if len(chosen) == rows:
            break
    if not chosen:
        raise ValueError("no packed block starts with a document of at least 2 tokens")
    return torch.tensor([ids[:length] for ids in chosen], dtype=torch.long)


def build_trainer(model, training_args: TrainingArguments, train_dataset, eval_dataset=None,
                  lazy_lr_multiplier: float = 1.0, probe_ids: torch.Tensor | None = None, stats_every_n_logs: int = 1,
                  callbacks=None) -> LazyTrainer:
    """A `LazyTrainer` on packed blocks with `PackedBlockCollator`, plus `LazyAttentionCallback` (first in line)
    on `probe_ids` (default: a probe from the evaluation blocks, else the training blocks)."""
    if probe_ids is None:
        probe_ids = probe_from_blocks(eval_dataset if eval_dataset is not None else train_dataset)
    trainer = LazyTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=PackedBlockCollator(),
        callbacks=callbacks,
        lazy_lr_multiplier=lazy_lr_multiplier,
    )
    trainer.callback_handler.callbacks.insert(0, LazyAttentionCallback(probe_ids, stats_every_n_logs))
    return trainer


# ------------------------------------------------------------------------------------------------ CLI


def parse_args(argv=None):
    """`(args, training_args)` of a `lazy-finetune` command line: its own options
    (`lazy_llama_tools.cli.parse_finetune`)
    and `transformers.TrainingArguments` from the rest. With `--auto-bf16` (the default) a CUDA GPU with bf16 support
    trains in bf16 mixed precision unless `--bf16`/`--fp16` is given."""

    from lazy_llama_tools.cli import parse_finetune

    args, training_argv = parse_finetune(argv)
    return args, training_arguments(args, training_argv)


def training_arguments(args, training_argv: list[str]) -> TrainingArguments:
    """`TrainingArguments` from the (hyphenated) options `lazy-finetune` does not know itself; exits with argparse's
    one line on unknown or bad options. `args.help_training` prints their help and exits."""
    from transformers import HfArgumentParser

    parser = one_line_errors(HfArgumentParser(TrainingArguments, prog="lazy-finetune", usage="lazy-finetune MODEL "
                                              "--train-file FILE --output-dir DIR [TrainingArguments options]"))
    if args.help_training:
        parser.print_help()
        raise SystemExit(0)
    try:
        training_args, unknown = parser.parse_args_into_dataclasses(args=training_argv, return_remaining_strings=True)
    except ValueError as error:  # TrainingArguments refuses a combination (e.g. --bf16 true on a CPU)
        parser.error(one_line(error))
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (`lazy-finetune --help` and --help-training list "
                     "the options)")
    for field in dataclasses.fields(training_args):  # a NaN learning rate trains a NaN model without a word
        value = getattr(training_args, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            parser.error(f"argument --{field.name.replace('_', '-')}: must be a finite number, got {value}")
    if training_args.learning_rate < 0:
        parser.error(f"argument --learning-rate: must be at least 0, got {training_args.learning_rate}")
    if args.auto_bf16 and not (training_args.bf16 or training_args.fp16) and torch.cuda.is_available() \
            and torch.cuda.is_bf16_supported():
        training_args.bf16 = True
    return training_args


def check_data_and_resume(args, training_args: TrainingArguments) -> None:
    """What can be refused before the model loads: the data files (missing, empty, blank, not UTF-8), a
    `--block-size` below 2, an `--output-dir` that cannot be written, a `--resume-from-checkpoint` folder that
    does not exist or is no checkpoint. `FinetuneError`."""
    for role, files in (("--train-file", args.train_file), ("--eval-file", args.eval_file)):
        for path in files:
            try:
                check_text_file(path, what=role)
            except (OSError, ValueError) as error:
                raise FinetuneError(str(error)) from None
    if args.block_size < 2:
        raise FinetuneError(f"--block-size must be at least 2 (a token and its successor), got {args.block_size}")
    check_output_dir(training_args.output_dir)
    resume = training_args.resume_from_checkpoint
    if resume is not None and resume.lower() not in ("last", "true"):
        if not os.path.isdir(resume):
            raise FinetuneError(f"--resume-from-checkpoint {resume}: no such checkpoint folder (give a checkpoint-N "
                                "folder, or `last` for the newest one in --output-dir)")
        if not os.path.isfile(os.path.join(resume, TRAINER_STATE_NAME)):
            raise FinetuneError(f"--resume-from-checkpoint {resume} is not a complete checkpoint (no "
                                f"{TRAINER_STATE_NAME}): give a checkpoint-N folder that Trainer saved, or `last`")


def check_output_dir(output_dir: str) -> None:
    """`--output-dir` must be a folder (or not exist yet) where checkpoints can be written, beside which the final
    model can be built (`save_final_model`). Creates its parent folders. `FinetuneError` otherwise."""
    out = Path(output_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"--output-dir {output_dir} is a file, not a folder: give a folder path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        temporary_folder(out).rmdir()  # where the final model is built
        if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(out))
    except OSError as error:
        raise FinetuneError(f"--output-dir {output_dir} cannot be written ({error.strerror or error}): choose a "
                            "folder on a writable file system") from None


def newest_complete_checkpoint(output_dir: str) -> tuple[str | None, list[str]]:
    """(the newest `checkpoint-N` folder of `output_dir` that Trainer finished writing, the newer ones it did not).

    Trainer writes a checkpoint in place and `trainer_state.json` last, so a folder without it is one whose save
    was interrupted (or killed): resuming from it would fail."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    steps = {}
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            step = name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
            if step.isdigit() and os.path.isdir(os.path.join(output_dir, name)):
                steps[int(step)] = os.path.join(output_dir, name)
    incomplete = []
    for step in sorted(steps, reverse=True):
        if os.path.isfile(os.path.join(steps[step], TRAINER_STATE_NAME)):
            return steps[step], incomplete
        incomplete.append(steps[step])
    return None, incomplete


def check_block_size(block_size: int, config) -> None:
    """A block must fit the model's positions (`max_position_embeddings`)."""
    if block_size > config.max_position_embeddings:
        raise FinetuneError(f"--block-size {block_size} is more than the model's max_position_embeddings "
                            f"({config.max_position_embeddings}): use at most {config.max_position_embeddings}")


TRAINING_ARGS_JSON = "training_args.json"


def save_final_model(trainer: LazyTrainer, tokenizer, output_dir: str) -> None:
    """Write the trained model (weights, config, tokenizer, `trainer_state.json`, the training arguments as
    `training_args.json`) into a hidden folder beside `output_dir` and move it into place only when complete.

    Only safetensors and JSON: Trainer's pickled `training_args.bin` is left out. Files are made shareable as the
    converter makes its outputs. A new or empty `output_dir` is replaced by the finished folder in one rename; one
    that already holds checkpoints (or an earlier model) receives the finished files one rename each,
    `config.json` last, so it never holds a config beside half-moved weights. A failed write (a full or read-only
    disk) leaves `output_dir` as it was and is a `FinetuneError`."""
    target = Path(output_dir).expanduser().resolve()
    tmp = temporary_folder(target)
    try:
        trainer.save_model(str(tmp))
        if trainer.is_world_process_zero():
            tokenizer.save_pretrained(tmp)
            (tmp / TRAINING_ARGS_NAME).unlink(missing_ok=True)
            (tmp / TRAINING_ARGS_JSON).write_text(trainer.args.to_json_string())
            trainer.state.save_to_json(str(tmp / TRAINER_STATE_NAME))
            make_shareable(tmp)
            if not os.path.lexists(target) or is_empty_folder(target):
                if not publish_folder(tmp, target):
                    raise FinetuneError(f"{output_dir} was filled by another process while the final model was "
                                        "written: nothing was replaced; run again with another --output-dir")
            else:
                for name in sorted((path.name for path in tmp.iterdir()), key=lambda name: name == "config.json"):
                    os.replace(tmp / name, target / name)
    except (OSError, SafetensorError) as error:  # safetensors reports a full disk as a SafetensorError
        reason = getattr(error, "strerror", None) or one_line(error, 200)
        where = f" ({error.filename})" if getattr(error, "filename", None) else ""
        raise FinetuneError(f"cannot write the final model to {output_dir}: {reason}{where}; it was "
                            "not changed (checkpoints, if any, are kept): free some space or choose another "
                            "--output-dir") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def finetune(args, training_args: TrainingArguments) -> LazyTrainer:
    """Everything `lazy-finetune` does: check the input, load, pack, train (resuming if asked), save, evaluate.
    Returns the trainer; `FinetuneError` for input it cannot train on (before any tokenising)."""
    check_data_and_resume(args, training_args)
    distributed_config = None
    if args.fsdp_size > 1:
        from transformers.distributed import DistributedConfig

        distributed_config = DistributedConfig(fsdp_size=args.fsdp_size)
    model, tokenizer = load_model(args.model, args.tau_init, args.bias_init_std,
                                  distributed_config=distributed_config)
    check_block_size(args.block_size, model.config)
    model = configure_trainable(model, args.mode, args.lora_r, args.lora_alpha, args.lora_dropout,
                                args.lora_target_modules, args.lora_train_lazy)
    with training_args.main_process_first(desc="tokenising and packing"):
        train = packed_dataset(load_documents(args.train_file, args.text_column), tokenizer, args.block_size)
        evaluation = None
        if args.eval_file:
            evaluation = packed_dataset(load_documents(args.eval_file, args.text_column), tokenizer, args.block_size)
    if args.max_train_blocks:
        train = train.select(range(min(args.max_train_blocks, len(train))))
    if evaluation is not None and args.max_eval_blocks:
        evaluation = evaluation.select(range(min(args.max_eval_blocks, len(evaluation))))

    probe = probe_from_blocks(evaluation if evaluation is not None else train, args.stats_tokens)
    trainer = build_trainer(model, training_args, train, evaluation, args.lazy_lr_multiplier, probe,
                            args.stats_every_n_logs)

    resume = training_args.resume_from_checkpoint
    if resume is not None and resume.lower() in ("last", "true"):
        resume, incomplete = newest_complete_checkpoint(training_args.output_dir)
        for path in incomplete:
            print(f"skipping {path}: incomplete (no {TRAINER_STATE_NAME}; its save was interrupted)", file=sys.stderr)
        if resume is None:
            print(f"no complete checkpoint in {training_args.output_dir}: starting from scratch", file=sys.stderr)
    try:
        trainer.train(resume_from_checkpoint=resume)
    except ValueError as error:  # torch's optimizer refuses a state of other parameter groups
        if resume is None or "parameter group" not in str(error):
            raise
        raise FinetuneError(f"{resume} was saved by a run with other trainable parameters ({one_line(error, 200)}): "
                            "resume with that run's --mode and LoRA options, or give another --output-dir") from None
    raise_swallowed_interrupt()
    with deferred_signals():  # an interrupt waits until the final model is in place
        save_final_model(trainer, tokenizer, training_args.output_dir)
    if evaluation is not None:
        if trainer.is_world_process_zero():
            print(f"lazy-finetune: final evaluation on {len(evaluation)} blocks of {args.block_size} tokens ...",
                  file=sys.stderr, flush=True)
        metrics = trainer.evaluate()
        trainer.save_state()
        if trainer.is_world_process_zero() and "eval_loss" in metrics:
            print(f"lazy-finetune: eval_loss {metrics['eval_loss']:.4f}, perplexity "
                  f"{math.exp(min(metrics['eval_loss'], 50.0)):.2f}", file=sys.stderr, flush=True)
    return trainer


def main(argv=None) -> None:
    """`python -m lazy_llama_tools.finetune`: the `lazy-finetune` command (`lazy_llama_tools.cli.lazy_finetune` parses
    its own
    options before importing torch). See the module docstring; `--help` lists every option."""
    from lazy_llama_tools.cli import parse_finetune

    run(*parse_finetune(argv))


def run(args, training_argv: list[str]) -> None:
    """Fine-tune as the parsed `lazy-finetune` options and the TrainingArguments command line say."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import modeling_lazy  # noqa: F401  (registers LazyLlama with the Auto classes)

    training_args = training_arguments(args, training_argv)
    try:
        with terminations_as_interrupts():  # SIGTERM and SIGHUP stop the run as Ctrl-C does
            finetune(args, training_args)
    except (FinetuneError, ModelNotFound, UnusableModel) as error:
        raise SystemExit(f"lazy-finetune: error: {one_line(error, 1000)}") from None
    except KeyboardInterrupt:
        checkpoint, _ = newest_complete_checkpoint(training_args.output_dir)
        where = (f"the newest complete checkpoint is {checkpoint}: continue with --resume-from-checkpoint last"
                 if checkpoint else "no checkpoint was saved")
        print(f"lazy-finetune: interrupted; {where}.", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
