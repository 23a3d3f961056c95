"""Convert a vanilla Llama checkpoint into a LazyLlama checkpoint.

    python -m conversion.convert_llama_to_lazy SRC OUT [--tau-init 0.0] [--bias-window 1024]
        [--bias-init-std 0.0] [--dtype auto] [--max-shard-size 2GB] [--verify] [--overwrite]

SRC is a Hugging Face Llama folder (`model.safetensors`, sharded safetensors with an index, or
`pytorch_model*.bin`, read only through `torch.load(weights_only=True)`) or a Llama-architecture GGUF file.
Weight names are Llama's, so every tensor maps 1:1; each layer gains `self_attn.tau` `[heads]` and
`self_attn.distance_bias` `[heads, window]` (float32). With `tau = 0` and `distance_bias = 0` (the defaults)
the result computes exactly what the Llama computes.

Safetensors and `.bin` sources are streamed one source file at a time into output shards of at most
`--max-shard-size`, so peak memory is about one shard (plus the source shard being read), not the model.
A GGUF file is dequantised by transformers as a whole model first (GGUF files are small and quantised).
Everything is written to a hidden temporary directory beside OUT and renamed into place only when complete
(and verified, with `--verify`); any failure or interruption removes it.
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from configuration_lazy import LazyLlamaConfig
from conversion.model_card import write_model_card
from modeling_lazy.modeling_lazy import AUTO_MAP, LazyLlamaForCausalLM, code_files

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SETTINGS_FILE = "lazy_conversion.json"
VERIFY_PROMPT = (
    "The capital of France is Paris. Lazy attention lets a head ignore tokens it does not need, "
    "so the first token no longer has to act as a sink."
)
VERIFY_TOLERANCE = 1e-4


class ConversionError(Exception):
    """A source that cannot be converted; the message says what is wrong and what to do."""


# ----------------------------------------------------------------------------------------------------------
# Source: config checks and tensor streams
# ----------------------------------------------------------------------------------------------------------


def check_llama_config(config: dict) -> None:
    """Refuse anything that is not a plain Llama, naming what is unsupported."""
    model_type = config.get("model_type")
    if model_type == "lazy_llama":
        raise ConversionError("the source is already a LazyLlama checkpoint (model_type 'lazy_llama').")
    if model_type != "llama":
        raise ConversionError(
            f"unsupported architecture: model_type {model_type!r} (architectures {config.get('architectures')}); "
            "only Llama checkpoints (model_type 'llama') can be converted."
        )
    if config.get("sliding_window") is not None or config.get("use_sliding_window"):
        raise ConversionError(
            f"unsupported: sliding-window attention (sliding_window={config.get('sliding_window')!r}); "
            "LazyLlama attention is full causal."
        )
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ConversionError(f"unsupported layer_types {sorted(set(layer_types))}: only 'full_attention' layers.")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConversionError(
            f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    quant = config.get("quantization_config")
    if quant and quant.get("quant_method") != "gguf":  # a folder rebuilt from GGUF holds plain weights
        raise ConversionError(
            f"unsupported: quantized checkpoint (quant_method {quant.get('quant_method')!r}); "
            "convert the unquantized weights."
        )


def build_lazy_config(
    source_config: dict, *, tau_init: float, bias_window: int, bias_init_std: float, dtype: str
) -> LazyLlamaConfig:
    """A `LazyLlamaConfig` with every Llama field of the source, the lazy fields and the full `auto_map`."""
    check_llama_config(source_config)
    fields = {k: v for k, v in source_config.items() if k not in ("quantization_config", "auto_map", "torch_dtype")}
    fields.update(
        model_type=LazyLlamaConfig.model_type,
        architectures=["LazyLlamaForCausalLM"],
        dtype=dtype,
        lazy_tau_init=tau_init,
        lazy_bias_window=bias_window,
        lazy_bias_init_std=bias_init_std,
    )
    try:
        config = LazyLlamaConfig.from_dict(fields)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"invalid configuration: {error}") from error
    config.auto_map = dict(AUTO_MAP)
    return config


def _is_gguf(source: Path) -> bool:
    return source.is_file() and source.suffix.lower() == ".gguf"


def read_source_config(source: Path) -> dict:
    """The source's config as a dict (from `config.json`, or the metadata of a GGUF file)."""
    if _is_gguf(source):
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        try:
            config = load_gguf_checkpoint(str(source), return_tensors=False)["config"]
        except Exception as error:  # not a GGUF file, or an architecture transformers does not read
            raise ConversionError(f"cannot read GGUF metadata of {source}: {error}") from error
        return dict(config)
    if not source.is_dir():
        raise ConversionError(f"{source} is neither a Hugging Face model folder nor a .gguf file.")
    path = source / "config.json"
    if not path.is_file():
        raise ConversionError(f"{source} has no config.json: is it a Hugging Face model folder?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path} is not valid JSON: {error}") from error


def source_weight_files(source: Path) -> tuple[str, list[Path]]:
    """(`"safetensors"` or `"bin"`, the weight files in order); every file an index lists must exist."""
    for kind, single, index in (
        ("safetensors", "model.safetensors", "model.safetensors.index.json"),
        ("bin", "pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (source / index).is_file():
            try:
                weight_map = json.loads((source / index).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise ConversionError(f"{source / index} is not a valid weight index: {error}") from error
            files = sorted(set(weight_map.values()))
            missing = [name for name in files if not (source / name).is_file()]
            if missing:
                raise ConversionError(f"shard(s) listed in {index} are missing from {source}: {', '.join(missing)}")
            return kind, [source / name for name in files]
        if (source / single).is_file():
            return kind, [source / single]
    raise ConversionError(
        f"no weights in {source}: expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json."
    )


def _iter_file(path: Path, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of one source file, one at a time (safetensors are memory-mapped; .bin never unpickles)."""
    try:
        if kind == "safetensors":
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        else:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
            names = list(state)
            for name in names:
                yield name, state.pop(name)
    except ConversionError:
        raise
    except Exception as error:  # truncated or corrupt file
        raise ConversionError(f"cannot read {path.name}: {type(error).__name__}: {error}") from error


def _canonical_name(name: str) -> str | None:
    """The LazyLlama name of a source tensor (None for tensors to drop, e.g. stale RoPE buffers)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if not name.startswith(("model.", "lm_head.")):  # a bare LlamaModel checkpoint
        name = "model." + name
    return name


# ----------------------------------------------------------------------------------------------------------
# Output: shards written one at a time
# ----------------------------------------------------------------------------------------------------------


def parse_size(size: str | int) -> int:
    """Bytes in "5GB", "500MB", "64KiB" or a plain integer."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(text)
    except ValueError:
        raise ConversionError(f"cannot parse size {size!r}: use e.g. 2GB, 500MB or a number of bytes.") from None


class ShardWriter:
    """Collect tensors into shards of at most `max_bytes` and write each one as soon as it is full."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.buffer, self.buffer_bytes, self.total_bytes = {}, 0, 0
        self.shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffer_bytes + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = tensor.contiguous()
        self.buffer_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.buffer:
            return
        path = self.folder / f".shard-{len(self.shards) + 1:05d}.safetensors"
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.buffer)))
        self.buffer, self.buffer_bytes = {}, 0

    def finish(self) -> list[str]:
        """Name the shards as transformers does (`model.safetensors`, or `model-0000i-of-0000n` + index)."""
        self.flush()
        count = len(self.shards)
        if count == 1:
            os.replace(self.shards[0][0], self.folder / "model.safetensors")
            return ["model.safetensors"]
        weight_map, names = {}, []
        for number, (path, keys) in enumerate(self.shards, 1):
            name = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(path, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
            names.append(name)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


# ----------------------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------------------


def _expected_shapes(config: LazyLlamaConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of this config holds (tied `lm_head.weight` left out)."""
    with torch.device("meta"):
        model = LazyLlamaForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _gguf_tensors(source: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantised tensors of a GGUF Llama, through transformers' own GGUF loader (whole model in memory)."""
    from transformers import LlamaForCausalLM

    try:
        model = LlamaForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype)
    except Exception as error:
        raise ConversionError(f"cannot load GGUF weights from {source}: {type(error).__name__}: {error}") from error
    state = model.state_dict()
    del model
    for name in list(state):
        yield name, state.pop(name)


def _copy_tokenizer(source: Path, folder: Path, log) -> None:
    if _is_gguf(source):
        from gguf import GGUFReader

        if "tokenizer.ggml.model" not in GGUFReader(str(source)).fields:
            log("  the GGUF file has no tokenizer: none written")
            return
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name).save_pretrained(folder)
        return
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, folder / name)
    if not copied:
        log(f"  {source} has no tokenizer files: none written")


def _write_generation_config(source: Path, folder: Path, config: LazyLlamaConfig) -> None:
    if not _is_gguf(source) and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", folder / "generation_config.json")
        return
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(folder)


def _source_card_metadata(source: Path) -> dict:
    """License and base model found in the source (its README metadata, or GGUF `general.*` fields)."""
    found = {}
    if _is_gguf(source):
        from transformers.modeling_gguf_pytorch_utils import read_field
        from gguf import GGUFReader

        reader = GGUFReader(str(source))
        for key, field in (("license", "general.license"), ("base_model", "general.name")):
            if field in reader.fields:
                value = read_field(reader, field)
                found[key] = value[0] if isinstance(value, list) and value else value
        return found
    readme = source / "README.md"
    if readme.is_file():
        from huggingface_hub import ModelCard

        with contextlib.suppress(Exception):
            data = ModelCard.load(readme).data
            found = {k: getattr(data, k, None) for k in ("license", "base_model") if getattr(data, k, None)}
    return found


def convert(
    source: str | Path,
    output: str | Path,
    *,
    tau_init: float = 0.0,
    bias_window: int = 1024,
    bias_init_std: float = 0.0,
    dtype: str = "auto",
    max_shard_size: str | int = "2GB",
    verify: bool = False,
    verify_tolerance: float = VERIFY_TOLERANCE,
    overwrite: bool = False,
    seed: int = 0,
    base_model: str | None = None,
    license: str | None = None,
    log=print,
) -> dict:
    """Convert the Llama at `source` into a LazyLlama folder `output` (see the module docstring).

    `log` is a print-like function for progress messages (None: silent). Returns a summary dict (`output`,
    `shards`, `dtype`, `bytes`, and `max_abs_diff` when verified). Raises
    `ConversionError` for bad input; `output` is then left untouched (never half-written).
    """
    quiet = log is None
    log = log or (lambda *args: None)
    source, output = Path(source).expanduser().resolve(), Path(output).expanduser().resolve()
    if not source.exists():
        raise ConversionError(f"source {source} does not exist.")
    if output == source or output in source.parents or source in output.parents:
        raise ConversionError(f"OUT ({output}) must not be SRC, inside it, or contain it.")
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise ConversionError(f"{output} already exists and is not empty: pass --overwrite to replace it.")
    if dtype != "auto" and dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}.")
    max_bytes = parse_size(max_shard_size)
    if max_bytes <= 0:
        raise ConversionError(f"--max-shard-size must be positive, got {max_shard_size!r}.")

    source_config = read_source_config(source)
    check_llama_config(source_config)
    gguf = _is_gguf(source)
    if gguf:
        source_format, files = "gguf", [source]
    else:
        source_format, files = source_weight_files(source)
    source_dtype = source_config.get("dtype") or source_config.get("torch_dtype") or "float32"
    if gguf:
        source_dtype = "float32"  # transformers dequantises GGUF tensors to float32
    out_dtype_name = source_dtype if dtype == "auto" else dtype
    if out_dtype_name not in DTYPES:
        raise ConversionError(f"source dtype {out_dtype_name!r} is not supported: pass --dtype float32|bfloat16|float16.")
    out_dtype = DTYPES[out_dtype_name]
    config = build_lazy_config(
        source_config, tau_init=tau_init, bias_window=bias_window, bias_init_std=bias_init_std, dtype=out_dtype_name
    )
    expected = _expected_shapes(config)
    lazy_names = [n for n in expected if n.endswith(("self_attn.tau", "self_attn.distance_bias"))]

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        log(f"Converting {source} ({source_format}, {len(files)} file(s)) -> {output} [{out_dtype_name}]")
        writer = ShardWriter(tmp, max_bytes)
        seen = set()
        tensors = _gguf_tensors(source, out_dtype) if gguf else (
            item for path in _progress(files, "reading source files", quiet) for item in _iter_file(path, source_format)
        )
        for name, tensor in tensors:
            name = _canonical_name(name)
            if name is None or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            if name not in expected:
                raise ConversionError(f"unexpected tensor {name!r} in the source: not part of a Llama with this config.")
            if tuple(tensor.shape) != expected[name]:
                raise ConversionError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {expected[name]}."
                )
            if name in seen:
                raise ConversionError(f"tensor {name!r} appears twice in the source.")
            seen.add(name)
            writer.add(name, tensor.to(out_dtype) if tensor.is_floating_point() else tensor)
        missing = [n for n in expected if n not in seen and n not in lazy_names]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ConversionError(f"missing weights in the source: {shown}.")
        generator = torch.Generator().manual_seed(seed)
        for name in lazy_names:  # the new Lazy Attention parameters, always float32
            shape = expected[name]
            if name.endswith("tau"):
                writer.add(name, torch.full(shape, float(tau_init), dtype=torch.float32))
            else:
                writer.add(name, torch.randn(shape, generator=generator, dtype=torch.float32) * bias_init_std)
        shards = writer.finish()

        config.save_pretrained(tmp)
        for path in code_files():
            shutil.copyfile(path, tmp / os.path.basename(path))
        _copy_tokenizer(source, tmp, log)
        _write_generation_config(source, tmp, config)
        settings = {
            "source": str(source),
            "source_format": source_format,
            "tau_init": tau_init,
            "bias_window": bias_window,
            "bias_init_std": bias_init_std,
            "seed": seed,
            "dtype": out_dtype_name,
            "exact": tau_init == 0 and bias_init_std == 0,
        }
        (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
        card = _source_card_metadata(source)
        write_model_card(
            tmp,
            base_model=base_model or card.get("base_model"),
            conversion={k: v for k, v in settings.items() if k != "source"},
            license=license or card.get("license"),
            repo_id=output.name,
        )
        summary = {"output": str(output), "shards": shards, "dtype": out_dtype_name, "bytes": writer.total_bytes}
        log(f"  wrote {len(shards)} shard(s), {writer.total_bytes / 1e6:.1f} MB")

        if verify:
            diff = verify_conversion(source, tmp, dtype=out_dtype, log=log)
            summary["max_abs_diff"] = diff
            if not diff <= verify_tolerance:
                raise ConversionError(
                    f"verification failed: max abs logit difference {diff:.3e} > tolerance {verify_tolerance:.1e}."
                )
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp and safetensors create owner-only files
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        _publish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"Done: {output}")
    return summary


def _progress(items, description, quiet):
    from tqdm.auto import tqdm

    return tqdm(items, desc=description, unit="file", disable=quiet or len(items) < 2, file=sys.stderr)


def _publish(tmp: Path, output: Path) -> None:
    """Move the complete `tmp` into place; an existing OUT (allowed by --overwrite) is removed only after."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{os.getpid()}"
        os.replace(output, old)
    os.replace(tmp, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()


# ----------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def verify_conversion(source: str | Path, converted: str | Path, *, dtype: torch.dtype = torch.float32, log=print) -> float:
    """Max abs difference between the logits of the source Llama and the converted LazyLlama on a fixed prompt.

    Both are loaded with their weights rounded to `dtype` and computed in float32, so a lossless conversion
    gives float32 round-off only. If the conversion is not exact (tau or distance bias non-zero), the
    difference at the converted settings is printed and the returned figure is with tau and the bias set to
    zero in memory: it checks that every Llama weight arrived intact.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log = log or (lambda *args: None)
    source, converted = Path(source), Path(converted)
    log("  verifying: loading the source Llama ...")
    if _is_gguf(source):
        reference = LlamaForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype)
    else:
        config = LlamaConfig.from_pretrained(str(source))
        if getattr(config, "quantization_config", None):  # a folder rebuilt from GGUF holds plain weights
            del config.quantization_config
        reference = LlamaForCausalLM.from_pretrained(str(source), config=config, dtype=dtype)
    reference = reference.to(torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(converted))
        input_ids = tokenizer(VERIFY_PROMPT, return_tensors="pt").input_ids
    except Exception:  # no tokenizer: fixed token ids
        input_ids = (torch.arange(1, 33) * 7919 % reference.config.vocab_size)[None]
    expected = reference(input_ids=input_ids).logits
    del reference
    log("  verifying: loading the converted LazyLlama ...")
    lazy = LazyLlamaForCausalLM.from_pretrained(str(converted), dtype=dtype).to(torch.float32).eval()
    diff = (lazy(input_ids=input_ids).logits - expected).abs().max().item()
    exact = all(bool((layer.self_attn.tau == 0).all() and (layer.self_attn.distance_bias == 0).all())
                for layer in lazy.model.layers)
    if not exact:
        log(f"  max abs logit difference at the converted tau/distance_bias (not expected to be 0): {diff:.3e}")
        for layer in lazy.model.layers:
            layer.self_attn.tau.zero_()
            layer.self_attn.distance_bias.zero_()
        diff = (lazy(input_ids=input_ids).logits - expected).abs().max().item()
        log(f"  max abs logit difference with tau = 0 and distance_bias = 0: {diff:.3e} "
            f"({input_ids.shape[1]} tokens)")
    else:
        log(f"  max abs logit difference: {diff:.3e} ({input_ids.shape[1]} tokens)")
    return diff if math.isfinite(diff) else float("inf")


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazy-convert",
        description="Convert a Llama checkpoint (HF folder or GGUF file) into a LazyLlama checkpoint.",
    )
    parser.add_argument("source", metavar="SRC", help="Hugging Face Llama folder or Llama .gguf file")
    parser.add_argument("output", metavar="OUT", help="folder to create")
    parser.add_argument("--tau-init", type=float, default=0.0, help="Elastic-Softmax tau of every head (0: exact)")
    parser.add_argument("--bias-window", type=int, default=1024, help="distances with a learnable bias (W)")
    parser.add_argument("--bias-init-std", type=float, default=0.0, help="std of the initial distance bias (0: exact)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weight dtype (auto: the source's)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest output shard, e.g. 2GB, 500MB")
    parser.add_argument("--verify", action="store_true", help="compare logits with the source; fail above tolerance")
    parser.add_argument("--verify-tolerance", type=float, default=VERIFY_TOLERANCE, help="max abs logit difference")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    parser.add_argument("--seed", type=int, default=0, help="seed of the distance-bias initialisation")
    parser.add_argument("--base-model", help="Hub id of the source, for the model card")
    parser.add_argument("--license", help="license of the weights, for the model card")
    return parser


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # clean up the temporary folder on kill
    try:
        summary = convert(
            args.source,
            args.output,
            tau_init=args.tau_init,
            bias_window=args.bias_window,
            bias_init_std=args.bias_init_std,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            verify=args.verify,
            verify_tolerance=args.verify_tolerance,
            overwrite=args.overwrite,
            seed=args.seed,
            base_model=args.base_model,
            license=args.license,
        )
    except ConversionError as error:
        print(f"lazy-convert: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lazy-convert: interrupted; nothing was written to OUT.", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if "max_abs_diff" in summary:
        print(f"max abs logit difference: {summary['max_abs_diff']:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
