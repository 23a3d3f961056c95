"""Llama -> LazyLlama conversion: tiny random Llamas in every supported layout, a GGUF file written here,
bad input (clear error, non-zero exit, no partial output), and one real SmolLM2-135M conversion."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

import modeling_lazy  # noqa: F401  (registers the Auto classes)
from conversion import convert_llama_to_lazy as cv
from modeling_lazy import LazyLlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, initializer_range=0.2)
QUIET = dict(log=None)


def tiny_llama(folder: Path, max_shard_size="1GB", **overrides) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def logits(model, ids=None):
    ids = torch.arange(40)[None] * 7 % 96 if ids is None else ids
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_same_as_source(source: Path, output: Path):
    expected = logits(LlamaForCausalLM.from_pretrained(source, dtype=torch.float32))
    lazy = LazyLlamaForCausalLM.from_pretrained(output, dtype=torch.float32)
    assert lazy.config.model_type == "lazy_llama"
    assert (logits(lazy) - expected).abs().max().item() <= 1e-4
    return lazy, expected


def no_leftovers(parent: Path, name: str) -> bool:
    return not (parent / name).exists() and not list(parent.glob(f".{name}.*"))


@pytest.mark.parametrize(
    "case",
    [
        dict(num_key_value_heads=4, tie_word_embeddings=True),  # MHA, tied
        dict(num_key_value_heads=2, tie_word_embeddings=False),  # GQA, untied
        dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
        dict(num_key_value_heads=1, head_dim=32,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}, rope_theta=500000.0),
    ],
    ids=["mha-tied", "gqa-untied", "bias", "llama3-rope"],
)
def test_converted_logits_equal_source(tmp_path, case):
    source = tiny_llama(tmp_path / "src", **case)
    summary = cv.convert(source, tmp_path / "out", verify=True, **QUIET)
    assert summary["max_abs_diff"] <= 1e-4
    lazy, expected = assert_same_as_source(source, tmp_path / "out")
    for layer in lazy.model.layers:  # the new parameters exist, float32, exact values
        assert layer.self_attn.tau.dtype == torch.float32 and (layer.self_attn.tau == 0).all()
        assert (layer.self_attn.distance_bias == 0).all()
    # the comparison can fail: a non-zero tau changes the logits
    with torch.no_grad():
        for layer in lazy.model.layers:
            layer.self_attn.tau.fill_(-1.0)
    assert (logits(lazy) - expected).abs().max().item() > 1e-3


def test_sharded_input_and_output_written_completely(tmp_path):
    source = tiny_llama(tmp_path / "src", max_shard_size="40KB", num_key_value_heads=2, tie_word_embeddings=False)
    assert len(list(source.glob("model-*.safetensors"))) > 2
    cv.convert(source, tmp_path / "out", max_shard_size="30KB", bias_window=64, **QUIET)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / name).is_file() for name in shards)
    assert "model.layers.1.self_attn.tau" in index["weight_map"]
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == modeling_lazy.modeling_lazy.AUTO_MAP and config["lazy_bias_window"] == 64
    for name in ("configuration_lazy.py", "modeling_lazy.py", "lazy_attention_torch.py", "README.md",
                 "generation_config.json", "lazy_conversion.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "lazy_conversion.json").read_text())["exact"] is True
    assert_same_as_source(source, out)


def test_pytorch_bin_input_and_lazy_settings(tmp_path):
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    state = LlamaForCausalLM.from_pretrained(source).state_dict()
    (source / "model.safetensors").unlink()
    torch.save({k: v.clone() for k, v in state.items()}, source / "pytorch_model.bin")
    summary = cv.convert(source, tmp_path / "out", tau_init=-0.5, bias_init_std=0.01, bias_window=16,
                         dtype="bfloat16", verify=True, **QUIET)  # verify zeroes tau/bias and compares weights
    assert summary["max_abs_diff"] <= 1e-4
    lazy = LazyLlamaForCausalLM.from_pretrained(tmp_path / "out")
    attn = lazy.model.layers[0].self_attn
    assert lazy.model.embed_tokens.weight.dtype == torch.bfloat16 and attn.tau.dtype == torch.float32
    assert torch.allclose(attn.tau, torch.full_like(attn.tau, -0.5))
    assert attn.distance_bias.shape == (4, 16) and 0.005 < attn.distance_bias.std().item() < 0.02


def _permute_for_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per head (what transformers undoes when reading)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, model: LlamaForCausalLM) -> None:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for layer in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{layer}.{hf}.weight"] = f"blk.{layer}.{gg}.weight"
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy().copy()
        if ".q_proj." in name:
            array = _permute_for_gguf(array, cfg.num_attention_heads)
        elif ".k_proj." in name:
            array = _permute_for_gguf(array, cfg.num_key_value_heads)
        writer.add_tensor(names[name], array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_converts(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False)).eval()
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, model)
    summary = cv.convert(gguf_path, tmp_path / "out", verify=True, **QUIET)
    assert summary["max_abs_diff"] <= 1e-4
    lazy = LazyLlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert (logits(lazy) - logits(model)).abs().max().item() <= 1e-4  # against the model written into the file


# ---------------------------------------------------------------------------------------------------------- bad input


def _refused(tmp_path, capsys, source, message, *extra):
    out_parent = tmp_path / "outs"
    out_parent.mkdir(exist_ok=True)
    code = cv.main([str(source), str(out_parent / "out"), *extra])
    err = capsys.readouterr().err
    assert code != 0
    assert message in err, err
    assert no_leftovers(out_parent, "out")
    return err


def test_refuses_other_architectures_and_features(tmp_path, capsys):
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    config = json.loads((source / "config.json").read_text())
    for patch, message in (
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type 'mistral'"),
        ({"sliding_window": 64}, "sliding-window"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "RoPE type 'longrope'"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized"),
    ):
        (source / "config.json").write_text(json.dumps({**config, **patch}))
        _refused(tmp_path, capsys, source, message)


def test_refuses_missing_and_corrupt_weights(tmp_path, capsys):
    source = tiny_llama(tmp_path / "src", max_shard_size="40KB", num_key_value_heads=2)
    shards = sorted(source.glob("model-*.safetensors"))
    # a shard listed in the index is missing
    shards[1].rename(tmp_path / "moved")
    _refused(tmp_path, capsys, source, f"missing from {source}: {shards[1].name}")
    # a truncated shard
    (tmp_path / "moved").rename(shards[1])
    shards[-1].write_bytes(shards[-1].read_bytes()[:1000])
    _refused(tmp_path, capsys, source, f"cannot read {shards[-1].name}")
    # a complete but wrong file: a tensor is missing
    single = tiny_llama(tmp_path / "single", num_key_value_heads=2)
    state = LlamaForCausalLM.from_pretrained(single).state_dict()
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file({k: v.contiguous() for k, v in state.items()}, single / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path, capsys, single, "missing weights in the source: model.layers.1.mlp.up_proj.weight")
    # no weights at all
    (single / "model.safetensors").unlink()
    _refused(tmp_path, capsys, single, "no weights in")
    _refused(tmp_path, capsys, tmp_path / "nothing-here", "does not exist")


def test_existing_output_needs_overwrite_and_interruption_leaves_nothing(tmp_path, capsys, monkeypatch):
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cv.main([str(source), str(out)]) == 1
    assert "pass --overwrite" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert cv.main([str(source), str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".out.*"))

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(cv.ShardWriter, "flush", interrupted)
    assert cv.main([str(source), str(tmp_path / "fresh")]) == 130
    assert no_leftovers(tmp_path, "fresh")
    # a failing verification (tolerance below round-off) publishes nothing either
    monkeypatch.undo()
    assert cv.main([str(source), str(tmp_path / "fresh"), "--verify", "--verify-tolerance", "-1"]) == 1
    assert "verification failed" in capsys.readouterr().err and no_leftovers(tmp_path, "fresh")


def test_command_line_module(tmp_path):
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    run = subprocess.run([sys.executable, "-m", "conversion.convert_llama_to_lazy", str(source), str(tmp_path / "o")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "model_type 'gemma'" in run.stderr and not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------------- real model

PEAK_SCRIPT = r"""
import sys
from conversion.convert_llama_to_lazy import convert

def status(key):  # bytes; VmHWM is the peak resident set (heap and mapped source files alike)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as handle:  # reset VmHWM to the current resident set
    handle.write("5")
start = status("VmRSS")
assert status("VmHWM") <= start + 16 * 2**20, "could not reset the peak: measurement invalid"
summary = convert(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3], log=None)
print(f"PEAK {status('VmHWM') - start} {summary['bytes']}")
"""


def test_smollm2_converts_verifies_loads_and_generates(tmp_path):
    from lazy_tools.data import smollm2_llama_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        source = smollm2_llama_dir()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    out = tmp_path / "smollm2-lazy"
    # conversion in a fresh process: its peak resident memory grows by about one source shard (200 MB,
    # memory-mapped) plus one output shard, not by the model (a single 2GB output shard measures ~+550 MB)
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(source), str(out), "50MB"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    peak, total = map(int, run.stdout.split("PEAK")[1].split())
    largest = 49152 * 576 * 4  # the embedding, the largest single tensor (one shard by itself)
    print(f"\nconversion peak extra resident memory {peak / 1e6:.0f} MB for a {total / 1e6:.0f} MB model "
          f"(largest tensor {largest / 1e6:.0f} MB)")
    assert peak < 0.6 * total

    diff = cv.verify_conversion(source, out, log=print)
    print(f"SmolLM2-135M max abs logit difference: {diff:.3e}")
    assert diff <= 1e-4

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LazyLlamaForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=6, do_sample=False)
    text = tokenizer.decode(generated[0, ids.shape[1]:])
    print("generated:", repr(text))
    assert generated.shape[1] == ids.shape[1] + 6 and "Paris" in text
