"""Tensor parallelism (`tp_plan="auto"`) and FSDP2 fine-tuning through `Trainer`, each run with `torchrun` on
2 CPU processes (gloo) against one process or DDP (the worker is tests/distributed_worker.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, tiny_model
from finetune_fixtures import write_corpora, write_tiny_model
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"


def torchrun(*args, nproc: int = 2, script=WORKER) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port())]
    command += [str(script)] if script is not None else []
    result = subprocess.run([*command, *map(str, args)], cwd=ROOT, env=env, timeout=600, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-5000:]
    return result


# ---------------------------------------------------------------------------------------- tensor parallelism

def test_tensor_parallel_two_processes_match_one(tmp_path, rng_seed):
    """`from_pretrained(..., tp_plan="auto")` shards q/k/v/o, tau and distance_bias by heads (GQA: 4 query heads
    over 2 KV heads, one KV head per rank) and lm_head by vocabulary: logits equal one process within 1e-5 and
    greedy decoding of a left-padded batch gives the same tokens, with tied and with untied embeddings."""
    ids = torch.randint(3, 97, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    models, checkpoints = [], []
    for tied in (True, False):
        model = tiny_model(tie_word_embeddings=tied)
        assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
        model.save_pretrained(tmp_path / f"tied-{tied}")
        models.append(model)
        checkpoints.append(tmp_path / f"tied-{tied}")

    torchrun("tp", tmp_path / "inputs.pt", tmp_path / "out.pt", *checkpoints)
    for model, got in zip(models, torch.load(tmp_path / "out.pt")):
        with torch.no_grad():
            want = model(ids, attention_mask=mask).logits
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                    eos_token_id=None)
        assert got["tau"] == (2,) and got["distance_bias"] == (2, model.config.lazy_bias_window)  # half the heads
        assert got["q_proj"][0] == 2 * model.config.head_dim
        assert (got["logits"] - want)[mask.bool()].abs().max() < 1e-5
        assert torch.equal(got["tokens"], tokens)


def test_tensor_parallel_plan_names_every_lazy_parameter():
    from modeling_lazy import LazyLlamaForCausalLM

    model = tiny_model()
    plan = model.tp_plan
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    for name in ("tau", "distance_bias", "q_proj", "k_proj", "v_proj"):
        assert plan[f"model.layers.*.self_attn.{name}"] == "colwise", name
    assert plan["model.layers.*.self_attn"] == "local_params"  # the attention reads its shards as local tensors
    assert LazyLlamaForCausalLM._tp_plan == {"lm_head": "colwise_gather_output"}


# ------------------------------------------------------------------------------------------------------ FSDP2

@pytest.fixture(scope="module")
def finetune_workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    write_corpora(root / "data")
    write_tiny_model(root / "model")
    return root


def _cli(workspace, output_dir, *extra):
    return ["-m", "lazy_llama_tools.finetune", workspace / "model",
            "--train-file", workspace / "data" / "train.txt", "--output-dir", output_dir, "--block-size", "64",
            "--max-train-blocks", "8", "--per-device-train-batch-size", "4", "--max-steps", "1", "--logging-steps", "1",
            "--save-strategy", "no", "--report-to", "none", "--disable-tqdm", "true", "--use-cpu", "true",
            "--seed", "0", "--dataloader-num-workers", "0", "--lazy-lr-multiplier", "3", "--stats-tokens", "32",
            "--ddp-backend", "gloo", *extra]


def _first_loss(output_dir: Path) -> float:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return next(e["loss"] for e in state["log_history"] if "loss" in e)


def _assert_same_weights(a_dir: Path, b_dir: Path, atol: float):
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    for name, tensor in b.items():
        assert a[name].dtype == tensor.dtype, name
        torch.testing.assert_close(a[name], tensor, rtol=1e-5, atol=atol, msg=name)


def test_fsdp2_finetune_command_matches_ddp(finetune_workspace, tmp_path):
    """`lazy-finetune --fsdp-size 2` under torchrun (2 CPU processes, 4 blocks each) gives the loss and the updated
    weights of the DDP run with the same global batch of 8 blocks; the statistics callback runs on a sharded model."""
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    torchrun(*_cli(finetune_workspace, ddp), script=None)
    torchrun(*_cli(finetune_workspace, fsdp, "--fsdp-size", "2"), script=None)
    assert _first_loss(fsdp) == pytest.approx(_first_loss(ddp), rel=1e-5, abs=1e-6)
    _assert_same_weights(fsdp, ddp, atol=1e-6)
    start = load_file(str(finetune_workspace / "model" / "model.safetensors"))
    moved = load_file(str(fsdp / "model.safetensors"))
    assert all(not torch.equal(moved[n], start[n]) for n in start if n.endswith(("tau", "distance_bias")))
    state = json.loads((fsdp / "trainer_state.json").read_text())
    assert "lazy/tau" in next(e for e in state["log_history"] if "loss" in e)


def test_fsdp2_bf16_keeps_lazy_parameters_float32(finetune_workspace, tmp_path):
    """With Trainer's bf16 mixed precision (autocast) FSDP2 keeps float32 weights: tau and distance_bias reach
    the attention in float32 while the matmuls run in bfloat16, and loss and weights equal the DDP run."""
    results = {}
    for mode in ("ddp", "fsdp"):
        out = tmp_path / mode
        torchrun("finetune", mode, finetune_workspace / "model", finetune_workspace / "data", out, "bf16")
        results[mode] = json.loads((out / "result.json").read_text())
    for mode, result in results.items():
        assert result["seen"] == {"tau": "torch.float32", "distance_bias": "torch.float32",
                                  "q_proj_output": "torch.bfloat16"}, mode
    assert results["fsdp"]["loss"] == pytest.approx(results["ddp"]["loss"], rel=1e-5)
    _assert_same_weights(tmp_path / "fsdp", tmp_path / "ddp", atol=1e-6)


def test_fsdp_parameter_casting_mixed_precision_is_refused(finetune_workspace):
    """FSDP2's own mixed precision would hand tau and distance_bias to the forward in bfloat16: refused at load."""
    from transformers.distributed import DistributedConfig

    from modeling_lazy import LazyLlamaForCausalLM

    casting = DistributedConfig(fsdp_size=2, fsdp_mixed_precision=True)
    with pytest.raises(ValueError, match="bf16=True"):
        LazyLlamaForCausalLM.from_pretrained(finetune_workspace / "model", distributed_config=casting)
