"""Run under `torchrun` by test_distributed.py (CPU, gloo); rank 0 writes what the test compares.

    tp INPUTS OUT CKPT...       load each with tp_plan="auto": logits, greedy tokens and the local shard shapes
    finetune MODE MODEL DATA OUT [bf16]
                                one Trainer step (MODE ddp, or fsdp: DistributedConfig(fsdp_size=WORLD_SIZE));
                                loss, saved weights, and the dtypes tau / distance_bias / q_proj output had in forward
"""

import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project

import modeling_lazy  # noqa: E402,F401  (registers the Auto classes)

RANK = int(os.environ.get("RANK", 0))
WORLD = int(os.environ.get("WORLD_SIZE", 1))


def tensor_parallel(inputs: str, out: str, *checkpoints: str) -> None:
    from transformers import AutoModelForCausalLM

    data = torch.load(inputs)
    results = []
    for ckpt in checkpoints:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # `tp_plan=` is the spelling users know
            model = AutoModelForCausalLM.from_pretrained(ckpt, tp_plan="auto").eval()
        attn = model.model.layers[0].self_attn
        with torch.no_grad():
            logits = model(data["ids"], attention_mask=data["mask"]).logits
            tokens = model.generate(data["ids"], attention_mask=data["mask"], max_new_tokens=5, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)
        results.append({"logits": logits, "tokens": tokens, "tau": tuple(attn.tau.to_local().shape),
                        "distance_bias": tuple(attn.distance_bias.to_local().shape),
                        "q_proj": tuple(attn.q_proj.weight.to_local().shape)})
    if RANK == 0:
        torch.save(results, out)


def finetune(mode: str, model_dir: str, data_dir: str, out: str, bf16: bool = False) -> None:
    from transformers import AutoTokenizer, TrainingArguments
    from transformers.distributed import DistributedConfig

    from lazy_llama_tools.finetune import build_trainer, load_documents, load_model, packed_dataset

    distributed_config = DistributedConfig(fsdp_size=WORLD) if mode == "fsdp" else None
    model, _ = load_model(model_dir, distributed_config=distributed_config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train = packed_dataset(load_documents([os.path.join(data_dir, "train.txt")]), tokenizer, 64).select(range(8))
    seen = {}

    def record(module, args, kwargs):
        seen.update(tau=str(module.tau.dtype), distance_bias=str(module.distance_bias.dtype),
                    q_proj_output=str(module.q_proj(kwargs["hidden_states"]).dtype))

    model.model.layers[0].self_attn.register_forward_pre_hook(record, with_kwargs=True)
    args = TrainingArguments(out, per_device_train_batch_size=8 // WORLD, max_steps=1, learning_rate=3e-3,
                             logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                             seed=0, ddp_backend="gloo", dataloader_num_workers=0, bf16=bf16)
    trainer = build_trainer(model, args, train, lazy_lr_multiplier=3.0, stats_every_n_logs=1000)
    trainer.train()
    trainer.save_model()
    if RANK == 0:
        loss = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
        with open(os.path.join(out, "result.json"), "w") as handle:
            json.dump({"loss": loss, "seen": seen}, handle)


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "tp":
        tensor_parallel(*rest)
    elif command == "finetune":
        finetune(*rest[:4], bf16=rest[4:] == ["bf16"])
    else:
        raise SystemExit(f"unknown command {command!r}")
