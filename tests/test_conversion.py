"""Llama -> LazyLlama conversion: tiny random Llamas in every supported layout, a GGUF file written here,
bad input (clear error, non-zero exit, no partial output), and one real SmolLM2-135M conversion."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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


def _seed(out: Path) -> int:
    """The `--seed` of the conversion in `out`: tells two conversions of one source apart."""
    return json.loads((out / "lazy_conversion.json").read_text())["seed"]


def _complete(out: Path) -> bool:
    """`out` holds a whole conversion: it loads and its settings are there."""
    LazyLlamaForCausalLM.from_pretrained(out)
    return (out / "lazy_conversion.json").is_file()


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
    settings = json.loads((out / "lazy_conversion.json").read_text())
    assert settings["exact"] is True
    assert settings["source"] == source.name  # no local path: lazy-push publishes this file
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
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_gguf(path: Path, model: LlamaForCausalLM, *, rope_scaling: tuple | None = None,
                    extra_tensors: dict | None = None, leave_out: tuple = ()) -> None:
    """`model` as llama.cpp writes a Llama; `rope_scaling` (type, factor) as its metadata, `extra_tensors` (name:
    float32 array) added and `leave_out` tensor names dropped, to make files a Llama is not."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    if rope_scaling:
        writer.add_rope_scaling_type(rope_scaling[0])
        writer.add_rope_scaling_factor(rope_scaling[1])
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
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm",
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
        if names[name] not in leave_out:
            writer.add_tensor(names[name], array)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
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


def _llama3_divisors(config: LlamaConfig) -> np.ndarray:
    """What llama.cpp stores as rope_freqs.weight for a "llama3" RoPE: plain frequency / scaled frequency."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim, theta = config.head_dim, config.rope_parameters["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (plain / scaled).float().numpy()


@pytest.mark.parametrize("rope", [
    pytest.param(dict(rope_type="linear", factor=4.0), id="linear"),
    pytest.param(dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=16), id="llama3-one-frequency-between"),
    pytest.param(dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=2.0,
                      original_max_position_embeddings=64), id="llama3-not-meta-setting"),
])
def test_gguf_rope_scaling_is_carried_over(tmp_path, rope):
    """transformers' GGUF reader leaves a Llama's RoPE scaling out (linear: metadata; Llama 3.x: the rope_freqs
    tensor of per-frequency divisors); the converter reads it, and the result equals the source Llama (past the
    original length too, where the scaling matters)."""
    import gguf

    torch.manual_seed(0)
    config = LlamaConfig(**TINY, num_key_value_heads=2, rope_parameters={**rope, "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).eval()
    if rope["rope_type"] == "linear":
        write_tiny_gguf(tmp_path / "tiny.gguf", model, rope_scaling=(gguf.RopeScalingType.LINEAR, rope["factor"]))
    else:
        write_tiny_gguf(tmp_path / "tiny.gguf", model, extra_tensors={"rope_freqs.weight": _llama3_divisors(config)})
    summary = cv.convert(tmp_path / "tiny.gguf", tmp_path / "out", verify=True, **QUIET)
    assert summary["max_abs_diff"] <= 1e-4
    lazy = LazyLlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = torch.arange(120)[None] * 7 % 96
    assert (logits(lazy, ids) - logits(model, ids)).abs().max().item() <= 1e-4
    assert lazy.config.rope_parameters["rope_type"] == rope["rope_type"]


# ---------------------------------------------------------------------------------------------------------- bad input


def test_gguf_files_that_are_not_exactly_a_llama_are_refused(tmp_path, capsys):
    """transformers' GGUF loader drops tensors it has no place for and fills missing ones at random: the converter
    checks the file's tensors (and its RoPE scaling) first and refuses in one line, writing nothing."""
    import gguf

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False)).eval()
    bias = np.zeros(64, dtype=np.float32)
    experts = np.zeros((2, 96, 64), dtype=np.float32)
    cases = [
        (dict(leave_out=("blk.1.ffn_up.weight",)), "lacks tensors a Llama needs: blk.1.ffn_up.weight"),
        (dict(extra_tensors={"blk.0.attn_q.bias": bias}), "has no place for (blk.0.attn_q.bias)"),
        (dict(extra_tensors={"blk.0.ffn_up_exps.weight": experts}), "has no place for (blk.0.ffn_up_exps.weight)"),
        (dict(extra_tensors={"rope_freqs.weight": np.linspace(1, 3, 8, dtype=np.float32)[::-1].copy()}),
         "match no Llama 3.x setting"),
        (dict(rope_scaling=(gguf.RopeScalingType.YARN, 4.0)), "uses RoPE scaling 'yarn'"),
    ]
    for number, (change, message) in enumerate(cases):
        path = tmp_path / f"case{number}.gguf"
        write_tiny_gguf(path, model, **change)
        err = _refused(tmp_path, capsys, path, message)
        assert message in err.strip().splitlines()[-1], err  # one line




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
        ({"vocab_size": "96"}, "invalid configuration: vocab_size must be an integer >= 1, got '96'"),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be an integer >= 1"),
        ({"rope_parameters": "default"}, "rope_parameters must be a JSON object, got a str ('default')"),
        ({"quantization_config": "bnb"}, "quantization_config must be a JSON object, got a str ('bnb')"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}},
         "rope_theta must be a positive number, got 'abc'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
         "invalid configuration: Missing required keys in `rope_parameters` for 'rope_type'='yarn': {'factor'}"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": "x"}},
         "invalid configuration: the RoPE scaling factor must be a positive number, got 'x'"),
        ({"pad_token_id": 10**6}, "invalid configuration: the model cannot be built from it (AssertionError"),
        # refused from the weights' names, before a model of that many layers is built (that took minutes)
        ({"num_hidden_layers": 3_200_000}, "num_hidden_layers = 3200000, but the weights hold layers 0-1 (2 layers)"),
        ({"num_hidden_layers": 10**30}, "but the weights hold layers 0-1"),
        ({"num_hidden_layers": 1}, "num_hidden_layers = 1, but the weights hold layers 0-1 (2 layers)"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": -2.0}},
         "the RoPE scaling factor must be a positive number, got -2.0"),
        ({"dtype": 3}, 'dtype must be a name such as "bfloat16", got 3'),
    ):
        (source / "config.json").write_text(json.dumps({**config, **patch}))
        err = _refused(tmp_path, capsys, source, message)
        assert message in err.strip().splitlines()[-1], err  # one line


def test_refuses_unreadable_tokenizer_and_generation_config_files_in_one_line(tmp_path, capsys):
    """They are copied as they are: a corrupt one would give a checkpoint whose weights load and tokenizer fails."""
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    capsys.readouterr()  # the source's own save
    for name, content, message in (
        ("tokenizer.json", b"{not json", "tokenizer.json is not valid JSON text"),
        ("tokenizer_config.json", bytes(range(128, 256)), "tokenizer_config.json is not valid JSON text ('utf-8'"),
        ("special_tokens_map.json", b"[1, 2]", "special_tokens_map.json must hold a JSON object, got [1, 2]"),
        ("generation_config.json", b"", "generation_config.json is not valid JSON text"),
        ("tokenizer.json", b'{"model": {"type": "Nonsense"}}', "tokenizer.json is not a tokenizer the tokenizers"),
    ):
        (source / name).write_bytes(content)
        err = _refused(tmp_path, capsys, source, message)
        assert len(err.strip().splitlines()) == 1 and "remove it to convert without it" in err, err
        (source / name).unlink()


def test_refuses_a_config_json_that_is_not_a_json_object(tmp_path, capsys):
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    for content, message in ((bytes(range(128, 256)), "config.json is not UTF-8 text"),
                             (b"[1, 2]", "config.json must hold a JSON object of model settings, got [1, 2]"),
                             (b"null", "must hold a JSON object of model settings, got null")):
        (source / "config.json").write_bytes(content)
        err = _refused(tmp_path, capsys, source, message)
        assert message in err.strip().splitlines()[-1], err  # one line


def test_refuses_a_pickle_with_code_in_one_line_without_running_it(tmp_path, capsys):
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    (source / "model.safetensors").unlink()
    ran = tmp_path / "ran"

    class Payload:  # what an untrusted .bin can hold: unpickling it would call os.system
        def __reduce__(self):
            return os.system, (f"touch {ran}",)

    torch.save({"model.embed_tokens.weight": Payload()}, source / "pytorch_model.bin")
    message = ("pytorch_model.bin holds objects other than tensors (posix.system), so it cannot be read safely: "
               "convert it to safetensors with a tool you trust")
    err = _refused(tmp_path, capsys, source, message)
    assert "weights_only" not in err and not ran.exists()
    assert message in err.strip().splitlines()[-1], err  # one line


def test_refuses_a_bin_that_is_not_a_state_dict_in_one_line(tmp_path, capsys):
    """What `torch.load(weights_only=True)` reads safely but is no state dict: a wrapped one, other key types, a
    list; with no dtype in config.json (the converter first looks for a floating-point tensor there)."""
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    state = LlamaForCausalLM.from_pretrained(source).state_dict()
    (source / "model.safetensors").unlink()
    config = json.loads((source / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (source / "config.json").write_text(json.dumps(config))
    for content, message in (({"state_dict": state}, "but a dict with keys 'state_dict'"),
                             ({0: 1, **state}, "but a dict with keys 0, 'model.embed_tokens.weight'"),
                             (list(state.values()), "but a list")):
        torch.save(content, source / "pytorch_model.bin")
        message = f"pytorch_model.bin is not a state dict (tensor names to tensors) {message}"
        err = _refused(tmp_path, capsys, source, message)
        assert message in err.strip().splitlines()[-1], err  # one line


def test_refuses_an_unreadable_or_empty_index_in_one_line(tmp_path, capsys):
    source = tiny_llama(tmp_path / "src", max_shard_size="40KB", num_key_value_heads=2)
    index = source / "model.safetensors.index.json"
    for content, message in ((b"\xff\xfe{not text", "is not UTF-8 text: is it a weight index?"),
                             (json.dumps({"weight_map": {}}).encode(), "its `weight_map` is empty")):
        index.write_bytes(content)
        err = _refused(tmp_path, capsys, source, message)
        assert message in err.strip().splitlines()[-1], err  # one line


def test_a_gguf_tokenizer_transformers_cannot_rebuild_is_one_line(tmp_path, capsys):
    import gguf

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2)).eval()
    path = tmp_path / "tiny.gguf"
    original = gguf.GGUFWriter.write_header_to_file

    def with_a_strange_tokenizer(writer, *args, **kwargs):
        writer.add_tokenizer_model("weird")
        writer.add_token_list([f"t{i}" for i in range(96)])
        return original(writer, *args, **kwargs)

    gguf.GGUFWriter.write_header_to_file = with_a_strange_tokenizer
    try:
        write_tiny_gguf(path, model)
    finally:
        gguf.GGUFWriter.write_header_to_file = original
    err = _refused(tmp_path, capsys, path, "cannot rebuild the tokenizer stored in")
    assert "Hugging Face folder instead" in err.strip().splitlines()[-1], err  # one line


@pytest.mark.parametrize("outside", ["../elsewhere/model.safetensors", "{elsewhere}/model.safetensors"],
                         ids=["relative", "absolute"])
def test_refuses_an_index_that_names_files_outside_the_source(tmp_path, capsys, outside):
    from safetensors import safe_open

    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    (tmp_path / "elsewhere").mkdir()
    (source / "model.safetensors").rename(tmp_path / "elsewhere" / "model.safetensors")
    with safe_open(tmp_path / "elsewhere" / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
    shard = outside.format(elsewhere=tmp_path / "elsewhere")
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, shard)}))
    _refused(tmp_path, capsys, source, f"names weight files outside {source} ({shard}): an index may only name "
             "files in its own folder")


def test_refuses_missing_and_corrupt_weights(tmp_path, capsys):
    source = tiny_llama(tmp_path / "src", max_shard_size="40KB", num_key_value_heads=2)
    shards = sorted(source.glob("model-*.safetensors"))
    # a shard listed in the index is missing
    shards[1].rename(tmp_path / "moved")
    _refused(tmp_path, capsys, source, f"missing from {source}: {shards[1].name}")
    # a truncated shard
    (tmp_path / "moved").rename(shards[1])
    shards[-1].write_bytes(shards[-1].read_bytes()[:1000])
    err = _refused(tmp_path, capsys, source, f"cannot read {shards[-1].name}")
    assert err.splitlines()[-1].startswith("lazy-convert: error: cannot read"), err  # not after the progress bar
    # a complete but wrong file: a tensor is missing
    single = tiny_llama(tmp_path / "single", num_key_value_heads=2)
    state = LlamaForCausalLM.from_pretrained(single).state_dict()
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file({k: v.contiguous() for k, v in state.items()}, single / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path, capsys, single, "missing weights in the source: model.layers.1.mlp.up_proj.weight")
    # a weight stored as integers (a quantized checkpoint's packed values) is not cast to the output dtype
    state["model.layers.1.mlp.up_proj.weight"] = torch.randint(-8, 8, (96, 64), dtype=torch.int32)
    save_file({k: v.contiguous() for k, v in state.items()}, single / "model.safetensors", metadata={"format": "pt"})
    _refused(tmp_path, capsys, single, "tensor 'model.layers.1.mlp.up_proj.weight' is stored as int32")
    # no weights at all
    (single / "model.safetensors").unlink()
    _refused(tmp_path, capsys, single, "no weights in")
    _refused(tmp_path, capsys, tmp_path / "nothing-here", "does not exist")


def test_refuses_bad_index_window_and_keeps_the_source_dtype(tmp_path, capsys):
    source = tiny_llama(tmp_path / "src", max_shard_size="40KB", num_key_value_heads=2)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    (source / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": list(index["weight_map"])}))
    _refused(tmp_path, capsys, source, "`weight_map` must map tensor names to file names, got a list")
    # a window longer than the model's positions is refused before anything is written (TINY: 256 positions)
    single = tiny_llama(tmp_path / "single", num_key_value_heads=2)
    _refused(tmp_path, capsys, single, "--bias-window 257 is larger than the model's max_position_embeddings (256)",
             "--bias-window", "257")
    cv.convert(single, tmp_path / "fits", bias_window=256, **QUIET)  # the whole range is fine
    # --dtype auto keeps the dtype of the stored tensors when the config names none
    bf16 = tmp_path / "bf16"
    LlamaForCausalLM.from_pretrained(single).to(torch.bfloat16).save_pretrained(bf16)
    config = json.loads((bf16 / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (bf16 / "config.json").write_text(json.dumps(config))
    summary = cv.convert(bf16, tmp_path / "bf16-lazy", **QUIET)
    assert summary["dtype"] == "bfloat16"
    lazy = LazyLlamaForCausalLM.from_pretrained(tmp_path / "bf16-lazy")
    assert lazy.model.embed_tokens.weight.dtype == torch.bfloat16
    assert lazy.model.layers[0].self_attn.tau.dtype == torch.float32
    assert json.loads((tmp_path / "bf16-lazy" / "config.json").read_text())["dtype"] == "bfloat16"


# ------------------------------------------------------------------------------------- concurrency and interrupts

PAUSED_CONVERSION = r"""
import os, sys, time
from conversion import convert_llama_to_lazy as cv

paused, go = sys.argv[1], sys.argv[2]
finish = cv.ShardWriter.finish

def paused_finish(self):  # the hidden temporary folder holds the shards; OUT is untouched so far
    open(paused, "w").close()
    deadline = time.time() + 120
    while not os.path.exists(go) and time.time() < deadline:
        time.sleep(0.02)
    return finish(self)

cv.ShardWriter.finish = paused_finish
sys.exit(cv.main(sys.argv[3:]))
"""


def start_paused(tmp_path: Path, name: str, *args) -> tuple[subprocess.Popen, Path]:
    """A `lazy-convert` process stopped in the middle of writing (it waits for the returned file to exist)."""
    paused, go = tmp_path / f"{name}.paused", tmp_path / f"{name}.go"
    process = subprocess.Popen([sys.executable, "-c", PAUSED_CONVERSION, str(paused), str(go), *map(str, args)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not paused.exists():
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.02)
    return process, go


def test_two_conversions_into_one_out_never_both_win(tmp_path, capsys):
    """A second run into an OUT that another run is writing is refused at once, with and without --overwrite;
    the first one then completes, and OUT is its whole conversion."""
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    out = tmp_path / "out"
    for first_seed, overwrite in ((1, []), (3, ["--overwrite"])):
        first, go = start_paused(tmp_path, f"first-{first_seed}", source, out, "--seed", first_seed, *overwrite)
        assert cv.main([str(source), str(out), "--seed", str(first_seed + 1), *overwrite]) == 1
        assert f"another process (pid {first.pid}) is writing {out}" in capsys.readouterr().err
        go.touch()
        assert first.wait(timeout=300) == 0, first.communicate()
        assert _seed(out) == first_seed and _complete(out)
        assert not list(tmp_path.glob(".out.*"))
    assert cv.main([str(source), str(out), "--seed", "9"]) == 1  # after the fact, without --overwrite: refused
    assert "pass --overwrite" in capsys.readouterr().err and _seed(out) == 3


def test_hangup_cleans_up_and_a_killed_run_is_cleaned_up_later(tmp_path, capsys):
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    process, _ = start_paused(tmp_path, "hangup", source, tmp_path / "out")
    assert list(tmp_path.glob(".out.tmp-*")), "the paused run should have a temporary folder"
    process.send_signal(signal.SIGHUP)  # the terminal was closed
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "interrupted; OUT was left as it was" in err and "Traceback" not in err
    assert no_leftovers(tmp_path, "out")
    # SIGKILL cannot be handled: the temporary folder stays, and the next run into OUT removes it
    process, _ = start_paused(tmp_path, "kill", source, tmp_path / "out")
    process.kill()
    process.communicate(timeout=120)
    assert list(tmp_path.glob(".out.tmp-*"))
    assert cv.main([str(source), str(tmp_path / "out")]) == 0
    assert "left by an interrupted run" in capsys.readouterr().err
    assert not list(tmp_path.glob(".out.*")) and _complete(tmp_path / "out")


@pytest.mark.parametrize("exchange", [True, False], ids=["one-exchange", "two-renames"])
def test_interrupt_while_out_is_replaced_leaves_a_whole_out_and_says_which(tmp_path, capsys, monkeypatch, exchange):
    """SIGTERM right after the first file-system step that touches OUT during the final swap (for the two-rename
    protocol, between the renames): OUT is never missing, and the message names what it holds."""
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    out = tmp_path / "out"
    assert cv.main([str(source), str(out), "--seed", "1"]) == 0
    fired = []

    def signalling(move):
        def wrapper(src, dst, *args, **kwargs):
            result = move(src, dst, *args, **kwargs)
            if out in (Path(src), Path(dst)) and not fired:
                fired.append(move)
                os.kill(os.getpid(), signal.SIGTERM)
            return result
        return wrapper

    monkeypatch.setattr(os, "rename", signalling(os.rename))
    monkeypatch.setattr(os, "replace", signalling(os.replace))
    try:
        from lazy_llama_tools import folders
    except ImportError:  # the code before the swap protocol: the renames above are all there is
        folders = None
    if folders is not None:
        monkeypatch.setattr(folders, "_exchange", signalling(folders._exchange) if exchange else lambda a, b: False)
    capsys.readouterr()
    code = cv.main([str(source), str(out), "--overwrite", "--seed", "2"])
    err = capsys.readouterr().err
    assert fired, "the swap never touched OUT"
    assert code == 130 and out.is_dir(), err
    assert "OUT holds the new conversion" in err and _seed(out) == 2 and _complete(out)
    assert not list(tmp_path.glob(".out.*"))


def test_sigterm_at_any_moment_after_writing_reports_what_out_holds(tmp_path, capsys, monkeypatch):
    """SIGTERM 0-60 ms after "wrote N shard(s)": whatever the moment, OUT is a whole conversion (the old or the
    new one), the message says which, and nothing hidden is left beside it."""
    import threading

    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    out = tmp_path / "out"
    assert cv.main([str(source), str(out), "--seed", "0"]) == 0
    stray = []
    previous = signal.signal(signal.SIGTERM, lambda *args: stray.append(args))  # a late signal must not end pytest
    stderr = sys.stderr
    outcomes = []
    try:
        for seed, delay in enumerate((0.0, 0.001, 0.002, 0.004, 0.008, 0.015, 0.03, 0.06), start=1):
            timers = []

            class Watch:  # stderr that starts the timer when the conversion says it wrote its shards
                def write(self, text):
                    if "wrote" in text and not timers:
                        timers.append(threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)))
                        timers[0].start()
                    return stderr.write(text)

                def flush(self):
                    stderr.flush()

            sys.stderr = Watch()
            before = _seed(out)
            code = cv.main([str(source), str(out), "--overwrite", "--seed", str(seed)])
            timers[0].join()
            sys.stderr = stderr
            err = capsys.readouterr().err
            now = _seed(out)
            assert _complete(out) and not list(tmp_path.glob(".out.*")), (delay, err)
            if code == 0:
                assert now == seed
            else:
                assert code == 130, err
                assert now == (seed if "OUT holds the new conversion" in err else before), (delay, err)
            outcomes.append((delay, code, now == seed))
    finally:
        sys.stderr = stderr
        signal.signal(signal.SIGTERM, previous)
    print("delay, exit code, new conversion in OUT:", outcomes)


# ------------------------------------------------------------------------------------- read-only, full, mounted OUT

MOUNTED_RUNS = r"""
import contextlib, io, json, os, shutil, sys, types
from conversion.convert_llama_to_lazy import main

source, read_only, small, mounted = sys.argv[1:]

def attempt(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([source, *args])
        except BaseException as error:  # what the user would see as a traceback
            code = f"raised {type(error).__name__}: {error}"
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}

results = {"read_only": attempt(read_only + "/models/out"), "full": attempt(small + "/out"),
           "mount_point": attempt(mounted, "--overwrite")}
shutil.disk_usage = lambda path: types.SimpleNamespace(total=10**12, used=0, free=10**12)  # "there is room"
results["fills_up"] = attempt(small + "/out")
results["left_on_full_disk"] = sorted(os.listdir(small))
print("RESULTS" + json.dumps(results))
"""


def test_read_only_full_and_mounted_out_are_refused_in_one_line(tmp_path):
    """In a private mount namespace: OUT on a read-only file system, on one too small for the model (refused
    before converting), on one that fills up while writing, and OUT being a mount point (refused before
    converting, where it used to fail only at the final rename)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare --mount` (root, or user namespaces) to mount a small or read-only file system")
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    read_only, small, mounted = tmp_path / "ro", tmp_path / "small", tmp_path / "mnt" / "out"
    setup = (f"set -e; mkdir -p {read_only} {small} {mounted}; mount -t tmpfs -o size=4m tmpfs {read_only}; "
             f"mkdir {read_only}/models; mount -o remount,ro {read_only}; mount -t tmpfs -o size=64k tmpfs {small}; "
             f"mount -t tmpfs -o size=4m tmpfs {mounted}; set +e; ")
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          setup + f'exec "$0" -c "$1" {source} {read_only} {small} {mounted}', sys.executable,
                          MOUNTED_RUNS], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "RESULTS" in run.stdout, run.stdout + run.stderr
    results = json.loads(run.stdout.split("RESULTS", 1)[1])
    for case, message in (("read_only", "Read-only file system"), ("full", "not enough free space beside"),
                          ("mount_point", "is a mount point"), ("fills_up", "No space left on device")):
        result = results[case]
        lines = [line for line in result["stderr"].splitlines() if line.startswith("lazy-convert:")]
        assert result["code"] == 1 and len(lines) == 1 and message in lines[0], (case, result)
        assert "Traceback" not in result["stderr"] and result["stdout"] == "", (case, result)
        if case != "fills_up":
            assert "Converting" not in result["stderr"], f"{case}: refused only after converting"
    assert results["left_on_full_disk"] == [], "the temporary folder was left on the full disk"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed interrupt below
def test_existing_output_needs_overwrite_and_only_a_model_folder_is_replaced(tmp_path, capsys, monkeypatch):
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cv.main([str(source), str(out)]) == 1
    assert "pass --overwrite" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    # --overwrite replaces a model folder only, never a folder of someone's files
    assert cv.main([str(source), str(out), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "does not look like a model folder" in err and "keep.txt" in err and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()  # an empty folder is as good as none
    assert cv.main([str(source), str(out)]) == 0
    printed = capsys.readouterr()  # progress goes to stderr, as for every tool
    assert printed.out == "" and f"Done: {out}" in printed.err
    assert cv.main([str(source), str(out), "--overwrite", "--seed", "1"]) == 0
    assert _seed(out) == 1 and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".out.*"))

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(cv.ShardWriter, "flush", interrupted)
    assert cv.main([str(source), str(tmp_path / "fresh")]) == 130
    assert "OUT was left as it was" in capsys.readouterr().err
    assert no_leftovers(tmp_path, "fresh")
    # a Ctrl-C whose KeyboardInterrupt Python swallows (it landed in a `__del__` or a weakref callback, where
    # exceptions are only printed) still stops the run before anything is published
    monkeypatch.undo()

    class SignalInDel:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)
            for _ in range(100):  # the handler runs at a check point inside this frame: its exception is ignored
                pass

    def shareable_then_swallowed_interrupt(folder):
        SignalInDel()
        print("still running", file=sys.stderr)

    monkeypatch.setattr(cv, "make_shareable", shareable_then_swallowed_interrupt)
    # Ctrl-C as a terminal delivers it (a pytest started in the background by a shell has SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cv.main([str(source), str(tmp_path / "fresh")]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert "still running" in err and "OUT was left as it was" in err and no_leftovers(tmp_path, "fresh")
    # a failing verification publishes nothing either
    monkeypatch.undo()
    monkeypatch.setattr(cv, "verify_conversion", lambda *args, **kwargs: 1.0)
    assert cv.main([str(source), str(tmp_path / "fresh"), "--verify"]) == 1
    assert "verification failed" in capsys.readouterr().err and no_leftovers(tmp_path, "fresh")


@pytest.mark.parametrize("tolerance", ["-1", "nan", "inf"])
def test_verify_tolerance_is_checked_when_parsed(tmp_path, capsys, tolerance):
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    with pytest.raises(SystemExit) as exit_info:
        cv.main([str(source), str(tmp_path / "out"), "--verify", "--verify-tolerance", tolerance])
    assert exit_info.value.code == 2 and "--verify-tolerance" in capsys.readouterr().err
    assert no_leftovers(tmp_path, "out")


@pytest.mark.parametrize("option, message", [
    (["--max-shard-size", "infGB"], "argument --max-shard-size: expected a positive size such as 2GB, 500MB or a "
                                    "number of bytes, got 'infGB'"),
    (["--max-shard-size", "0"], "argument --max-shard-size: expected a positive size"),
    (["--seed", str(2**64)], f"argument --seed: must be less than {2**64}"),
    (["--seed", "-1"], "argument --seed: must be at least 0"),
    (["--tau-init", "nan"], "argument --tau-init: must be a finite number, got nan"),
    (["--bias-init-std", "inf"], "argument --bias-init-std: must be a finite number, got inf"),
    (["--bias-init-std", "-1"], "argument --bias-init-std: must be at least 0.0, got -1"),
])
def test_sizes_and_seeds_are_checked_when_parsed(tmp_path, capsys, option, message):
    with pytest.raises(SystemExit) as exit_info:
        cv.main([str(tmp_path / "src"), str(tmp_path / "out"), *option])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]
    assert cv.main([str(tmp_path / "src"), str(tmp_path / "out"), "--max-shard-size", "64KiB", "--seed",
                    str(2**64 - 1)]) == 1  # the largest seed and a unit pass the parser (no source here)
    assert "does not exist" in capsys.readouterr().err


def test_convert_checks_the_shard_size_and_seed_before_anything(tmp_path):
    for settings, message in ((dict(max_shard_size="infGB"), "--max-shard-size: expected a positive size"),
                              (dict(seed=2**64), f"--seed must be a whole number from 0 to {2**64 - 1}")):
        with pytest.raises(cv.ConversionError, match=message):
            cv.convert(tmp_path / "src", tmp_path / "out", **settings, **QUIET)


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lazy_llama_tools.data import smollm2_llama_dir

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



def test_a_folder_rebuilt_from_gguf_with_its_stale_quantization_note_converts(tmp_path):
    """A plain folder whose config still names its GGUF source (`quantization_config: gguf`) converts and verifies."""
    source = tiny_llama(tmp_path / "src", num_key_value_heads=2)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    assert cv.convert(source, tmp_path / "out", verify=True, **QUIET)["max_abs_diff"] <= 1e-4
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
