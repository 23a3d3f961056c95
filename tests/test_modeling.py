"""The model against an independent float64 implementation of the math (docs/design.md), and against Llama."""

import json

import pytest
import torch
from conftest import randomize_lazy, tiny_config, tiny_model
from reference64 import lazy_llama_logits64
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, MistralConfig
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM

IMPLEMENTATIONS = ["eager", "lazy"]


# ----------------------------------------------------------------------------- config

def test_vanilla_llama_config_json_loads(tmp_path):
    llama = LlamaConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, num_hidden_layers=1, rope_theta=123.0)
    llama.save_pretrained(tmp_path)
    with CaptureLogger(logging.get_logger("transformers.configuration_utils")) as log:
        config = LazyLlamaConfig.from_pretrained(tmp_path)
    assert "model of type" not in log.out, log.out  # supported: no "may yield errors" warning
    assert config.model_type == "lazy_llama"
    assert config.num_key_value_heads == 2 and config.rope_parameters["rope_theta"] == 123.0
    assert (config.lazy_bias_window, config.lazy_tau_init, config.lazy_bias_init_std) == (1024, -1.0, 1e-3)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


def test_other_model_type_config_still_warns(tmp_path):
    """Only a Llama config.json is read as LazyLlama's own type; another architecture keeps transformers' warning."""
    MistralConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                  num_hidden_layers=1).save_pretrained(tmp_path)
    with CaptureLogger(logging.get_logger("transformers.configuration_utils")) as log:
        LazyLlamaConfig.from_pretrained(tmp_path)
    assert "model of type `mistral`" in log.out, log.out


@pytest.mark.parametrize("bad, message", [
    (dict(lazy_bias_window=0), "lazy_bias_window"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(lazy_tau_init=float("inf")), "lazy_tau_init"),
    (dict(lazy_bias_init_std=float("nan")), "lazy_bias_init_std"),
    (dict(lazy_bias_init_std=-1.0), "lazy_bias_init_std"),
    (dict(hidden_size=66, num_attention_heads=4, head_dim=None), "num_attention_heads"),
    (dict(num_hidden_layers=-1), "num_hidden_layers must be an integer >= 1"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be an integer >= 1"),
    (dict(vocab_size=0), "vocab_size must be an integer >= 1"),
    (dict(intermediate_size=-8), "intermediate_size must be an integer >= 1"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be an integer >= 1"),
    (dict(head_dim=0), "head_dim must be an integer >= 1"),
    # values of the wrong kind: a ValueError too, not the strict dataclass's own error
    (dict(lazy_bias_window=1.5), "lazy_bias_window must be an integer >= 1, got 1.5"),
    (dict(lazy_bias_window="64"), "lazy_bias_window must be an integer >= 1, got '64'"),
    (dict(lazy_tau_init="-1"), "lazy_tau_init must be a finite number"),
    (dict(lazy_bias_init_std=None), "lazy_bias_init_std must be a finite number >= 0"),
    (dict(hidden_size=32.0), "hidden_size must be an integer >= 1"),
])
def test_invalid_config_raises_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**bad)


def test_a_value_of_the_wrong_kind_set_afterwards_raises_value_error():
    config = tiny_config()
    with pytest.raises(ValueError, match="lazy_bias_window must be an integer >= 1, got 2.5"):
        config.lazy_bias_window = 2.5
    assert config.lazy_bias_window == tiny_config().lazy_bias_window  # the old value stays
    config.lazy_bias_window = 3
    assert config.lazy_bias_window == 3


def test_new_model_initialisation_follows_config():
    model = LazyLlamaForCausalLM(tiny_config(lazy_tau_init=-0.75, lazy_bias_init_std=0.02, lazy_bias_window=300))
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.tau.dtype == torch.float32 and attn.distance_bias.dtype == torch.float32
        assert attn.tau.shape == (4,) and attn.distance_bias.shape == (4, 300)
        assert torch.all(attn.tau == -0.75)
        assert 0.01 < attn.distance_bias.std().item() < 0.03


CASTS = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "to(dtype=float16)": lambda m: m.to(dtype=torch.float16),
    "to(cpu, bfloat16)": lambda m: m.to("cpu", torch.bfloat16),
    "half()": lambda m: m.half(),
    "bfloat16()": lambda m: m.bfloat16(),
}


@pytest.mark.parametrize("cast", list(CASTS))
def test_casting_to_16_bit_keeps_tau_and_bias_float32(cast, rng_seed):
    """`.to()` / `.half()` / `.bfloat16()` cast every weight but tau and distance_bias (and their gradients),
    which keep their float32 values bit for bit; the cast model runs and `.float()` / `.double()` still follow."""
    model = tiny_model()
    model(torch.randint(3, 97, (1, 9)), labels=torch.randint(3, 97, (1, 9))).loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    target = torch.float16 if "16" in cast and "bfloat" not in cast or cast == "half()" else torch.bfloat16
    assert CASTS[cast](model) is model
    for name, param in model.named_parameters():
        lazy = name.endswith(("self_attn.tau", "self_attn.distance_bias"))
        assert param.dtype == (torch.float32 if lazy else target), name
        assert param.grad.dtype == param.dtype, name
        if lazy:
            assert torch.equal(param, before[name]) and torch.equal(param.grad, grads[name]), name
    ids = torch.randint(3, 97, (2, 7))
    assert torch.isfinite(model(ids).logits.float()).all()
    model.double()
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    model.float()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n.endswith(".tau"))
    CASTS[cast](model.double())  # from float64 too: a 16-bit cast keeps them float32
    for name, param in model.named_parameters():
        lazy = name.endswith(("self_attn.tau", "self_attn.distance_bias"))
        assert param.dtype == (torch.float32 if lazy else target) == param.grad.dtype, name
        if lazy:
            assert torch.equal(param, before[name]) and torch.equal(param.grad, grads[name]), name


def test_adamw_in_bfloat16_moves_every_tau_and_bias_entry(rng_seed):
    """A bfloat16 model (cast with `.to`) trains tau and distance_bias: 5 AdamW steps at lr 1e-4 move every entry
    (in bfloat16 most of them would round back to where they were)."""
    model = tiny_model(lazy_bias_window=6)
    randomize_lazy(model, tau_scale=0.25)  # |tau| <= 0.5: no head is dead (an all-zero head has no gradient)
    model.to(torch.bfloat16).train()
    lazy = {n: p for n, p in model.named_parameters() if n.endswith(("self_attn.tau", "self_attn.distance_bias"))}
    assert len(lazy) == 4 and all(p.dtype == torch.float32 for p in lazy.values())
    start = {n: p.detach().clone() for n, p in lazy.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    ids = torch.randint(3, 97, (2, 16))  # longer than the window: every distance gets a gradient
    for _ in range(5):
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    for name, param in lazy.items():
        moved = param.detach() != start[name]
        assert moved.all(), f"{name}: {int(moved.sum())} of {moved.numel()} entries moved (seed {rng_seed})"


# ----------------------------------------------------------------------------- logits vs float64 reference

CASES = {
    "gqa-window-short": dict(overrides=dict(lazy_bias_window=4), batch=2, length=13),
    "mha-window-long": dict(overrides=dict(num_key_value_heads=4, lazy_bias_window=64), batch=1, length=17),
    "gqa3-left-padding": dict(overrides=dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96),
                              batch=3, length=11, pad=[0, 4, 7]),
    "packed-documents": dict(overrides=dict(), batch=1, length=16, packed=[5, 1, 7, 3]),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_float64_reference(case, implementation, rng_seed):
    spec = CASES[case]
    model = tiny_model(attn_implementation=implementation, **spec["overrides"])
    ids = torch.randint(3, 97, (spec["batch"], spec["length"]))
    mask = position_ids = None
    if "pad" in spec:
        mask = torch.ones_like(ids)
        for row, pad in enumerate(spec["pad"]):
            mask[row, :pad] = 0
    if "packed" in spec:
        position_ids = torch.cat([torch.arange(n) for n in spec["packed"]])[None]
    got = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits.double()
    want = lazy_llama_logits64(model, ids, mask, position_ids)
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    assert (got - want)[valid].abs().max().item() < 2e-4, f"seed {rng_seed}"


def test_reference_sees_tau_and_bias(rng_seed):
    """Guard against a vacuous comparison: changing tau or the bias changes the logits."""
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 12))
    base = model(ids).logits
    with torch.no_grad():
        model.model.layers[0].self_attn.tau.add_(0.5)
    assert (model(ids).logits - base).abs().max() > 1e-3
    with torch.no_grad():
        model.model.layers[0].self_attn.tau.sub_(0.5)
        model.model.layers[1].self_attn.distance_bias[:, 1].add_(1.0)
    assert (model(ids).logits - base).abs().max() > 1e-3


def test_packed_documents_equal_each_document_alone(rng_seed):
    model = tiny_model()
    lengths = [4, 9, 3]
    docs = [torch.randint(3, 97, (1, n)) for n in lengths]
    packed = model(torch.cat(docs, 1), position_ids=torch.cat([torch.arange(n) for n in lengths])[None]).logits
    alone = torch.cat([model(d).logits for d in docs], 1)
    assert (packed - alone).abs().max() < 1e-5
    # cu_seq_lens (DataCollatorWithFlattening style) gives the same
    cu = torch.tensor([0, 4, 13, 16])
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    flat = model(torch.cat(docs, 1), position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits
    assert (flat - alone).abs().max() < 1e-5
    # and without position_ids they restart in each document, as the mask's do for padding (n_i per document)
    flat = model(torch.cat(docs, 1), cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits
    assert (flat - alone).abs().max() < 1e-5


@pytest.mark.parametrize("cu, message", [
    ([0, 4, 10], "end at 10, but the row has 16"), ([0, 9, 4, 16], "never decrease"), ([0, 4, 13, 17], "end at 17"),
    ([1, 4, 16], "start at 0")])
def test_inconsistent_cu_seq_lens_are_refused_with_one_line(cu, message):
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 16))
    cu = torch.tensor(cu)
    with pytest.raises(ValueError, match=message):
        model(ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="one packed row, but the batch has 2 rows"):
        model(ids.expand(2, -1), cu_seq_lens_q=torch.tensor([0, 16]), cu_seq_lens_k=torch.tensor([0, 16]))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_left_padding_without_position_ids_equals_prompt_alone(implementation, rng_seed):
    model = tiny_model(attn_implementation=implementation)
    prompts = [torch.randint(3, 97, (n,)) for n in (9, 5, 2)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    batched = model(input_ids=ids, attention_mask=mask).logits
    for row, p in enumerate(prompts):
        alone = model(p[None]).logits[0]
        assert (batched[row, width - len(p):] - alone).abs().max() < 1e-5


# ----------------------------------------------------------------------------- exactness vs Llama

@pytest.mark.parametrize("kv_heads, tied", [(4, False), (2, True), (1, False)])
def test_tau_zero_bias_zero_equals_llama(kv_heads, tied, rng_seed):
    config = tiny_config(num_key_value_heads=kv_heads, tie_word_embeddings=tied, lazy_tau_init=0.0,
                         lazy_bias_init_std=0.0)
    llama_config = LlamaConfig(**{k: v for k, v in config.to_dict().items() if not k.startswith("lazy_")})
    llama = LlamaForCausalLM(llama_config).eval()
    for implementation in IMPLEMENTATIONS:
        lazy = LazyLlamaForCausalLM(config).eval()
        missing = lazy.load_state_dict(llama.state_dict(), strict=False).missing_keys
        assert all(k.endswith(("self_attn.tau", "self_attn.distance_bias")) for k in missing)
        lazy.set_attn_implementation(implementation)
        ids = torch.randint(3, 97, (2, 24))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        diff = (lazy(ids, attention_mask=mask).logits - llama(ids, attention_mask=mask).logits)[mask.bool()]
        assert diff.abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------- gradients

def test_lazy_gradients_equal_eager_for_every_parameter(rng_seed):
    eager = tiny_model(attn_implementation="eager", lazy_bias_window=5)
    lazy = tiny_model(attn_implementation="lazy", lazy_bias_window=5)
    lazy.load_state_dict(eager.state_dict())
    ids = torch.randint(3, 97, (2, 14))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (eager, lazy):
        model.train()
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert set(grads[0]) == set(grads[1])
    for name, g in grads[0].items():
        assert g.abs().max() > 0 or "embed" in name, name
        torch.testing.assert_close(grads[1][name], g, atol=2e-6, rtol=1e-4, msg=name)
    assert any(g.abs().max() > 0 for n, g in grads[1].items() if n.endswith("tau"))
    assert any(g.abs().max() > 0 for n, g in grads[1].items() if n.endswith("distance_bias"))


def test_torch_attention_op_gradcheck(rng_seed):
    """Float64 gradcheck of the chunked PyTorch op (forward and recomputing backward) incl. tau and bias."""
    from modeling_lazy import lazy_attention_torch as ops
    from modeling_lazy.lazy_attention_reference import LazyMetadata

    bsz, heads, kv, tq, past, dim, window = 2, 2, 1, 4, 2, 4, 3
    q = torch.randn(bsz, heads, tq, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(bsz, kv, tq + past, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(bsz, kv, tq + past, dim, dtype=torch.float64, requires_grad=True)
    tau = (torch.rand(heads, dtype=torch.float64) - 0.5).requires_grad_()
    bias = torch.randn(heads, window, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(bsz, tq + past, dtype=torch.long)
    mask[1, :2] = 0
    meta = LazyMetadata.from_mask(mask, query_length=tq, batch_size=bsz, past_length=past, device=q.device)
    fn = lambda *x: ops.lazy_attention_torch(*x, meta, dim**-0.5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, tau, bias), eps=1e-6, atol=1e-5)


# ----------------------------------------------------------------------------- implementations and errors

@pytest.mark.parametrize("refused", ["sdpa", "flash_attention_2", "flex_attention"])
def test_softmax_only_implementations_are_refused(refused):
    with pytest.raises(ValueError, match="Elastic-Softmax"):
        LazyLlamaForCausalLM._from_config(tiny_config(), attn_implementation=refused)
    model = tiny_model()
    with pytest.raises(ValueError, match="Elastic-Softmax"):
        model.set_attn_implementation(refused)


def test_default_implementation_is_lazy_and_output_attentions_uses_the_reference(caplog):
    """`output_attentions=True` on the fused default answers with the reference weights (one warning), like eager."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()  # another test may have warned already
    model = tiny_model()
    assert model.config._attn_implementation == "lazy"
    ids = torch.randint(3, 97, (1, 10))
    plain = model(ids).logits
    with caplog.at_level("WARNING"):
        out = model(ids, output_attentions=True)
        model(ids, output_attentions=True)
    assert sum("output_attentions=True" in r.getMessage() for r in caplog.records) == 1  # warned once
    assert model.config._attn_implementation == "lazy"  # only that call used the reference
    torch.testing.assert_close(out.logits, plain, atol=1e-5, rtol=1e-5)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, 10, 10)
    weights = out.attentions[0]
    assert torch.all(weights >= 0) and torch.all(weights.triu(1) == 0)
    assert (weights == 0).any()  # Elastic-Softmax gives exact zeros with tau < 0 heads
    model.set_attn_implementation("eager")
    eager = model(ids, output_attentions=True)
    for a, b in zip(out.attentions, eager.attentions):
        torch.testing.assert_close(a, b)


def test_backend_environment_variable(monkeypatch):
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 8))
    monkeypatch.setenv("LAZY_LLAMA_BACKEND", "torch")
    base = model(ids).logits
    monkeypatch.setenv("LAZY_LLAMA_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LAZY_LLAMA_BACKEND"):
        model(ids)
    monkeypatch.setenv("LAZY_LLAMA_BACKEND", "auto")
    assert torch.equal(model(ids).logits, base)


def test_specification_backend_name_is_read_without_a_warning(monkeypatch):
    """`LAZY_ATTENTION_BACKEND`, the specification's name, works as `LAZY_LLAMA_BACKEND` does, silently; both set to
    different values: the project's name wins, with one line."""
    import warnings

    from modeling_lazy import lazy_attention_ops as ops
    from modeling_lazy import lazy_attention_reference

    model = tiny_model()
    ids = torch.randint(3, 97, (1, 8))
    monkeypatch.delenv("LAZY_LLAMA_BACKEND", raising=False)
    monkeypatch.setenv("LAZY_ATTENTION_BACKEND", "Torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.requested_backend() == "torch"
        base = model(ids).logits
    monkeypatch.setenv("LAZY_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LAZY_ATTENTION_BACKEND"):
        model(ids)
    monkeypatch.setenv("LAZY_LLAMA_BACKEND", "torch")  # the project's own name takes precedence, with one line
    monkeypatch.setattr(lazy_attention_reference, "_WARNED_OLD_NAMES", set())
    with pytest.warns(UserWarning, match="LAZY_LLAMA_BACKEND=torch and LAZY_ATTENTION_BACKEND=bogus disagree"):
        assert torch.equal(model(ids).logits, base)
    monkeypatch.setenv("LAZY_ATTENTION_BACKEND", "TORCH")  # the same choice under both names: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(ids).logits, base)


@pytest.mark.parametrize("old, new, value", [("LAZY_ATTENTION_CPU_KERNEL", "CPU_KERNEL", "0"),
                                             ("LAZYLLAMA_CACHE", "CACHE", "/tmp/somewhere")])
def test_old_environment_names_still_work_with_a_deprecation_line(monkeypatch, old, new, value):
    from modeling_lazy import lazy_attention_reference as reference

    monkeypatch.setattr(reference, "_WARNED_OLD_NAMES", set())
    monkeypatch.delenv("LAZY_LLAMA_" + new, raising=False)
    monkeypatch.setenv(old, value)
    with pytest.warns(FutureWarning, match=f"{old} is deprecated: set LAZY_LLAMA_{new}"):
        assert reference.environment_setting(new) == value
    monkeypatch.setenv("LAZY_LLAMA_" + new, "new-wins")  # the new name takes precedence, silently
    assert reference.environment_setting(new) == "new-wins"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sequence_longer_than_max_position_embeddings_runs_like_llama(implementation, rng_seed):
    """No length refusal (Llama has none): 40 tokens on a 16-position model match the float64 reference."""
    model = tiny_model(attn_implementation=implementation, max_position_embeddings=16, lazy_bias_window=8)
    ids = torch.randint(3, 97, (2, 40))
    got = model(ids).logits.double()
    assert (got - lazy_llama_logits64(model, ids)).abs().max().item() < 2e-4, f"seed {rng_seed}"


def test_empty_input_is_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"no tokens \(input_ids of shape \[batch, 0\]\)"):
        model(torch.zeros(2, 0, dtype=torch.long))


def test_four_dimensional_mask_is_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="2-D padding mask"):
        model(torch.randint(3, 97, (1, 5)), attention_mask=torch.ones(1, 1, 5, 5))


def test_auto_config_resolves_lazy_llama():
    config = AutoConfig.for_model("lazy_llama", hidden_size=32, num_attention_heads=4)
    assert isinstance(config, LazyLlamaConfig)


@pytest.mark.parametrize("bad, message", [
    (dict(lazy_bias_window=0), "lazy_bias_window"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(lazy_tau_init=float("nan")), "lazy_tau_init"),
    (dict(lazy_bias_init_std=-5.0), "lazy_bias_init_std"),
])
def test_from_pretrained_keyword_arguments_are_validated_too(tmp_path, bad, message):
    """`from_pretrained(dir, **kwargs)` sets its keyword arguments after construction: they are checked as well,
    through `LazyLlamaConfig` and through `AutoConfig`."""
    tiny_config(num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        LazyLlamaConfig.from_pretrained(tmp_path, **bad)
    with pytest.raises(ValueError, match=message):
        AutoConfig.from_pretrained(tmp_path, **bad)
    assert LazyLlamaConfig.from_pretrained(tmp_path, lazy_bias_window=7).lazy_bias_window == 7


def test_a_value_set_afterwards_is_refused_before_it_is_saved(tmp_path):
    """`validate()` (which `save_pretrained` runs) includes the LazyLlama checks: nothing is written."""
    from huggingface_hub.errors import StrictDataclassClassValidationError

    config = tiny_config()
    config.lazy_bias_window = 0
    with pytest.raises(StrictDataclassClassValidationError, match="lazy_bias_window must be an integer >= 1"):
        config.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()
