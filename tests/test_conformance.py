"""LazyLlama behaves like a first-class transformers model (what transformers' own Llama suite checks, in our words):
static caches, torch.compile, inputs past `max_position_embeddings`, attention weights and dropout, the three task
heads, and the deprecated `past_key_values` name. Distributed runs (TP, FSDP2) are in test_distributed.py."""

import copy
import os
import warnings
from collections import defaultdict
from unittest import mock

import pytest
import torch
from conftest import randomize_lazy, run_without_project, tiny_config, tiny_model
from reference64 import lazy_llama_logits64
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    CompileConfig,
    DataCollatorWithFlattening,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    StaticCache,
)

from modeling_lazy import (
    LazyLlamaForCausalLM,
    LazyLlamaForQuestionAnswering,
    LazyLlamaForSequenceClassification,
    LazyLlamaForTokenClassification,
    LazyLlamaModel,
)


def left_padded(lengths, vocab=97):
    """`(ids, mask)` `[B, max(lengths)]`: random prompts of the given lengths, left-padded with token 0."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,))
        mask[row, width - n:] = 1
    return ids, mask


def llama_twin(config) -> LlamaForCausalLM:
    """A Llama with the same config (the lazy_* fields dropped)."""
    return LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.to_dict().items() if not k.startswith("lazy_")}))


# ------------------------------------------------------------------------------------------------ static cache

def _chunked_logits(model, ids, mask, cache, chunks, pad_mask_to=None):
    """Feed `ids` in chunks through `cache`; the mask grows with the tokens seen (or is padded to `pad_mask_to`,
    as `generate()` passes it for a static cache)."""
    logits, start = [], 0
    for size in chunks:
        stop = start + size
        step_mask = None if mask is None else mask[:, :stop]
        if step_mask is not None and pad_mask_to is not None:
            step_mask = torch.nn.functional.pad(step_mask, (0, pad_mask_to - stop))
        out = model(ids[:, start:stop], attention_mask=step_mask, cache=cache, use_cache=True)
        logits.append(out.logits)
        start = stop
    return torch.cat(logits, 1)


@pytest.mark.parametrize("layout", ["offset, no mask", "arange over left padding", "mask positions + offset"])
@pytest.mark.parametrize("cache_class", [DynamicCache, StaticCache])
@torch.no_grad()
def test_given_positions_reach_the_cached_keys(layout, cache_class, rng_seed):
    """position_ids the caller gives every call (not the mask's `cumsum - 1`) set the cached keys' distances too:
    prefill then single- and multi-token steps through a cache give the logits of one cache-free call of all the
    tokens, as for Llama (whose cached keys carry their rotary positions), on a model whose tau and bias matter."""
    model = tiny_model()
    ids, mask = left_padded([13, 9])
    if layout == "offset, no mask":
        mask = None
        positions = torch.arange(13)[None].expand(2, -1) + torch.tensor([[3], [11]])
    elif layout == "arange over left padding":  # what code written for Llama passes: the padding counted
        positions = torch.arange(13)[None].expand(2, -1)
    else:
        positions = (mask.cumsum(-1) - 1).clamp(min=0) + 5
    full = model(ids, attention_mask=mask, position_ids=positions).logits
    cache = DynamicCache(config=model.config) if cache_class is DynamicCache else StaticCache(
        config=model.config, max_cache_len=16)
    logits, start = [], 0
    for size in (7, 1, 3, 1, 1):
        stop = start + size
        out = model(ids[:, start:stop], attention_mask=None if mask is None else mask[:, :stop],
                    position_ids=positions[:, start:stop], cache=cache, use_cache=True)
        logits.append(out.logits)
        start = stop
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    assert (torch.cat(logits, 1) - full)[valid].abs().max() < 1e-5, f"seed {rng_seed}"


def test_given_positions_reach_the_cached_keys_of_a_static_buffer(rng_seed):
    """The compiled static cache's metadata (the written length a tensor, keys over the whole buffer) gives the
    cached keys the positions an eager call gives them, when the call's positions are given."""
    from modeling_lazy.lazy_attention_reference import lazy_attention_metadata

    ids, mask = left_padded([10, 7])
    positions = torch.arange(10)[None].expand(2, -1) + torch.randint(0, 50, (2, 1))
    past, q_len, buffer = 8, 2, 16
    eager = lazy_attention_metadata(mask, positions[:, past:], past, q_len, 2, torch.device("cpu"))
    buffer_mask = torch.nn.functional.pad(mask, (0, buffer - past - q_len))
    static = lazy_attention_metadata(buffer_mask, positions[:, past:], torch.tensor(past), q_len, 2,
                                     torch.device("cpu"), key_length=buffer)
    written = mask.bool()
    assert torch.equal(static.q_pos, eager.q_pos)
    assert torch.equal(static.k_pos[:, :past + q_len][written], eager.k_pos[written])
    assert torch.equal(eager.k_pos[written], positions[written]), f"seed {rng_seed}"


@pytest.mark.parametrize("implementation", ["lazy", "eager"])
def test_static_cache_logits_equal_dynamic_cache(implementation, rng_seed):
    """Prefill, single-token and multi-token steps through a StaticCache (which hands every layer its whole
    preallocated buffer) give the dynamic cache's logits to 1e-5 on a model whose tau and bias matter."""
    model = tiny_model(attn_implementation=implementation)
    ids, mask = left_padded([14, 9])
    chunks = [8, 1, 3, 1, 1]
    valid = mask.bool()
    dynamic = _chunked_logits(model, ids, mask, DynamicCache(config=model.config), chunks)
    full = model(ids, attention_mask=mask).logits
    assert (dynamic - full)[valid].abs().max() < 1e-5
    for pad_to in (None, 20):  # the mask as users pass it, and padded to the buffer as generate() passes it
        static = _chunked_logits(model, ids, mask, StaticCache(config=model.config, max_cache_len=20), chunks, pad_to)
        assert (static - dynamic)[valid].abs().max() < 1e-5, pad_to
    # no mask at all (the call in the bug report)
    plain = _chunked_logits(model, ids, None, StaticCache(config=model.config, max_cache_len=16), chunks)
    reference = _chunked_logits(model, ids, None, DynamicCache(config=model.config), chunks)
    assert (plain - reference).abs().max() < 1e-5


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers offloads through CUDA streams")


def _greedy(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          eos_token_id=None, **kwargs)


@pytest.mark.parametrize("implementation, cache_implementation", [
    ("lazy", "static"), ("eager", "static"), ("lazy", "sliding_window"),
    pytest.param("lazy", "offloaded", marks=NEEDS_CUDA),
    pytest.param("lazy", "offloaded_static", marks=NEEDS_CUDA),
])
def test_generate_with_cache_implementation_equals_dynamic(implementation, cache_implementation, rng_seed):
    """Greedy tokens of a left-padded batch are those of the default dynamic cache ("sliding_window" gives Llama,
    which has no sliding layers, a static cache)."""
    model = tiny_model(attn_implementation=implementation)
    ids, mask = left_padded([7, 3, 5])
    if torch.cuda.is_available() and "offloaded" in cache_implementation:
        model, ids, mask = model.cuda(), ids.cuda(), mask.cuda()
    reference = _greedy(model, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(_greedy(model, ids, mask, cache_implementation=cache_implementation), reference)


def test_static_cache_beam_search_and_continuation(rng_seed):
    """Beam search reorders a StaticCache like a dynamic one; a user's StaticCache carries over to a second call."""
    model = tiny_model()
    ids, mask = left_padded([6, 4])
    beams = dict(num_beams=3, num_return_sequences=2)
    static = _greedy(model, ids, mask, cache_implementation="static", **beams)
    assert torch.equal(static, _greedy(model, ids, mask, **beams))

    prompt = ids[:1, -4:]
    cache = StaticCache(config=model.config, max_cache_len=32)
    first = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None, cache=cache)
    follow = torch.cat([first, torch.randint(3, 97, (1, 2))], 1)
    # every token is real, also a generated pad token 0 (a mask taken from the ids would hide it in the second call
    # only, after the first one's later tokens saw it: then continued and fresh differ for Llama too)
    real = dict(attention_mask=torch.ones_like(follow), max_new_tokens=4, do_sample=False, pad_token_id=0,
                eos_token_id=None)
    continued = model.generate(follow, cache=cache, **real)
    assert torch.equal(continued, model.generate(follow, **real))


def test_pad_tokens_inside_a_prompt_split_no_document(rng_seed):
    """A prompt holding the pad token mid-row: `generate()` zeroes the mask there and continues the positions after
    it, which must not start a document (padding's fill positions are not compared). With tau = 0 and a zero bias
    the logits and tokens are a Llama twin's; with tau of both signs the logits are the float64 oracle's, and a row
    fed whole generates what it generates continuing a cache that holds its first part."""
    ids = torch.randint(3, 97, (2, 10))
    ids[0, 4:7] = 0  # pad tokens inside row 0
    ids[1, :3] = 0  # left padding in row 1
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # what generate() builds
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)

    lazy = tiny_model()
    with torch.no_grad():
        for layer in lazy.model.layers:
            layer.self_attn.tau.zero_()
            layer.self_attn.distance_bias.zero_()
    llama = llama_twin(lazy.config).eval()
    llama.load_state_dict(lazy.state_dict(), strict=False)
    with torch.no_grad():
        got = lazy(ids, attention_mask=mask, position_ids=positions).logits
        want = llama(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(lazy.generate(ids, attention_mask=mask, **greedy),
                       llama.generate(ids, attention_mask=mask, **greedy))

    model = tiny_model()
    with torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=positions).logits.double()
    want = lazy_llama_logits64(model, ids, mask, positions)
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)
    row = ids[:1]
    for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=32)):
        model.generate(row[:, :7], attention_mask=torch.ones_like(row[:, :7]), max_new_tokens=1, do_sample=False,
                       pad_token_id=0, eos_token_id=None, cache=cache)  # the first part, up to its pad tokens
        continued = model.generate(row, cache=cache, **greedy)
        assert torch.equal(continued, model.generate(row, **greedy)), type(cache).__name__


def test_assisted_and_prompt_lookup_decoding_equal_greedy(rng_seed):
    """Candidate-verifying decoding (a LazyLlama assistant, prompt lookup) crops and re-extends the cache: the
    tokens are plain greedy's."""
    model, assistant = tiny_model(), tiny_model(num_hidden_layers=1)
    prompt = torch.randint(3, 97, (1, 6)).repeat(1, 2)  # repeated n-grams give prompt lookup candidates
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    greedy = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, assistant_model=assistant, **kwargs), greedy)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=3, **kwargs), greedy)


def test_continuous_batching_is_refused_with_one_line(rng_seed):
    """transformers' continuous batching admits only its softmax backends: each of its three entries gets one
    ValueError that names the alternatives (not transformers' advice to switch to sdpa, which LazyLlama refuses)."""
    model = tiny_model()
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    entries = {
        "generate_batch": lambda: model.generate_batch(inputs=[[1, 5, 6]], generation_config=config),
        "init_continuous_batching": lambda: model.init_continuous_batching(generation_config=config),
        "generate(paged)": lambda: model.generate(torch.tensor([[1, 5, 6]]), cache_implementation="paged",
                                                  max_new_tokens=3, pad_token_id=0),
    }
    for name, call in entries.items():
        with pytest.raises(ValueError, match="cannot run transformers' continuous batching") as raised:
            call()
        message = str(raised.value)
        assert "\n" not in message and "make serve" in message and "generate()" in message, name
    assert model.config._attn_implementation == "lazy"


def test_torch_export_and_the_executorch_static_cache_export(rng_seed):
    """`torch.export` (as for Llama: `use_cache=False`, since a returned `DynamicCache` is no pytree) of a left-padded
    batch gives eager's logits through `lazy_llama::attention`; transformers' ExecuTorch export
    (`convert_and_export_with_cache`: a static cache in the program) decodes generate()'s greedy tokens, one token
    per call."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(rng_seed)
    ids = torch.randint(3, 97, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    program = torch.export.export(model, (ids,), kwargs={"attention_mask": mask, "use_cache": False})
    assert {str(node.target) for node in program.graph.nodes if "lazy_llama" in str(node.target)} == {
        "lazy_llama.attention.default"}
    torch.testing.assert_close(program.module()(ids, attention_mask=mask, use_cache=False).logits,
                               model(ids, attention_mask=mask, use_cache=False).logits, atol=1e-5, rtol=1e-5)

    from transformers.integrations.executorch import convert_and_export_with_cache
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=24,
                                               cache_config={"batch_size": 1, "max_cache_len": 24})
    step = convert_and_export_with_cache(model).module()
    prompt = ids[1:, :6]
    want = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 6:]
    got, position = [], 0
    for token in prompt[0].tolist():
        logits = step(input_ids=torch.tensor([[token]]), cache_position=torch.tensor([position]))
        position += 1
    for _ in range(len(want)):
        got.append(int(logits[0, -1].argmax()))
        logits = step(input_ids=torch.tensor([[got[-1]]]), cache_position=torch.tensor([position]))
        position += 1
    assert got == want.tolist(), (got, want.tolist())


def test_resize_token_embeddings(rng_seed):
    model = tiny_model(tie_word_embeddings=True)
    ids = torch.randint(3, 97, (1, 8))
    before = model(ids).logits
    model.resize_token_embeddings(110)
    after = model(torch.cat([ids, torch.tensor([[105]])], 1)).logits
    assert after.shape[-1] == 110 and model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(after[:, :8, :97], before, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- torch.compile

def _compile_config():
    config = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")  # graph breaks and shape changes fail
    config._compile_all_devices = True  # compile on CPU too (what transformers' own compile tests do)
    return config


def test_generate_compiled_static_cache_is_one_graph(rng_seed):
    """`generate(cache_implementation="static")` compiles the decode forward into one full graph (fullgraph=True,
    static shapes): two generations with different padded batches reuse it (no recompile, no graph break) and
    give the uncompiled tokens and logits."""
    assert LazyLlamaForCausalLM._can_compile_fullgraph
    model = tiny_model(num_hidden_layers=1)
    batches = [left_padded([6, 3]), left_padded([4, 6])]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                  output_logits=True)
    expected = [model.generate(ids, attention_mask=mask, **kwargs) for ids, mask in batches]
    assert not hasattr(model, "_compiled_call")  # no compilation without a compilable cache

    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    config = _compile_config()
    for index, ((ids, mask), want) in enumerate(zip(batches, expected)):
        stance = "fail_on_recompile" if index else "default"
        with torch.compiler.set_stance(stance):
            got = model.generate(ids, attention_mask=mask, cache_implementation="static", compile_config=config,
                                 **kwargs)
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.logits, want.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert hasattr(model, "_compiled_call")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def test_a_compile_config_compiles_on_cpu_without_private_flags(rng_seed):
    """A plain `CompileConfig` passed to `generate()` compiles on CPU too (transformers alone compiles only on
    accelerators unless its private `_compile_all_devices` is set), with the uncompiled tokens; the caller's
    config is left untouched, and `disable_compile=True` still wins."""
    model = tiny_model(num_hidden_layers=1)
    ids, mask = left_padded([5, 3])
    want = _greedy(model, ids, mask)
    config = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")
    torch.compiler.reset()
    off = _greedy(model, ids, mask, cache_implementation="static", compile_config=config, disable_compile=True)
    assert torch.equal(off, want) and not hasattr(model, "_compiled_call")
    got = _greedy(model, ids, mask, cache_implementation="static", compile_config=config)
    assert torch.equal(got, want) and hasattr(model, "_compiled_call")
    assert config._compile_all_devices is None  # the flag is set on a copy


def test_compiled_forward_without_padding(rng_seed):
    """Without padding `generate()` drops the mask: the compiled decode then masks the unwritten slots by itself."""
    model = tiny_model(num_hidden_layers=1)
    ids = torch.randint(3, 97, (2, 5))
    want = _greedy(model, ids, None)
    torch.compiler.reset()
    got = _greedy(model, ids, None, cache_implementation="static", compile_config=_compile_config())
    assert torch.equal(got, want) and hasattr(model, "_compiled_call")


def test_whole_forward_compiled_with_a_reused_static_cache(rng_seed):
    """transformers' static-cache recipe: `model.forward = torch.compile(model.forward)` and one `StaticCache` reused
    (reset) across `generate()` calls. The first call initialises the cache in its prefill; the second call's
    prefill (17 rows) gets the cache's whole buffer with the written length a tensor, which the operator cuts when
    it runs. Both give the uncompiled tokens and logits (a left-padded batch)."""
    model = tiny_model(num_hidden_layers=2)
    ids, mask = left_padded([17, 12])
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None,
                  return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **kwargs)
    cache = StaticCache(config=model.config, max_cache_len=24)
    torch.compiler.reset()
    model.forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    try:
        for _ in range(2):
            cache.reset()
            got = model.generate(ids, cache=cache, **kwargs)
            assert torch.equal(got.sequences, want.sequences)
            for a, b in zip(got.logits, want.logits):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    finally:
        del model.forward
        torch.compiler.reset()


# ------------------------------------------------------------------------------- past max_position_embeddings

@pytest.mark.parametrize("implementation", ["lazy", "eager"])
def test_input_longer_than_max_position_embeddings_matches_reference(implementation, rng_seed):
    """Like Llama, inputs longer than `max_position_embeddings` run (no refusal) and are exact."""
    model = tiny_model(attn_implementation=implementation, max_position_embeddings=16, lazy_bias_window=8)
    ids, mask = left_padded([40, 33])
    got = model(input_ids=ids, attention_mask=mask).logits.double()
    want = lazy_llama_logits64(model, ids, mask)
    assert (got - want)[mask.bool()].abs().max() < 2e-4
    # decoding across the limit with a cache agrees with no cache
    prompt = ids[:1, -12:]
    cached = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    uncached = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None,
                              use_cache=False)
    assert torch.equal(cached, uncached)


def test_dynamic_rope_changes_logits_past_the_limit_like_llama(rng_seed):
    """`dynamic` RoPE rescales only once the input passes `max_position_embeddings`; a converted model (tau = 0,
    bias = 0) tracks Llama exactly on both sides of the limit, and a Lazy model sees the change too."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = tiny_config(max_position_embeddings=16, rope_parameters=dynamic, lazy_tau_init=0.0, lazy_bias_init_std=0.0)
    llama = llama_twin(config).eval()
    lazy = LazyLlamaForCausalLM(config).eval()
    lazy.load_state_dict(llama.state_dict(), strict=False)
    plain_config = tiny_config(max_position_embeddings=16)
    llama_plain = llama_twin(plain_config).eval()
    llama_plain.load_state_dict(llama.state_dict())
    short, long = torch.randint(3, 97, (1, 12)), torch.randint(3, 97, (1, 40))
    for ids in (short, long):
        torch.testing.assert_close(lazy(ids).logits, llama(ids).logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(llama(short).logits, llama_plain(short).logits, atol=1e-5)
    # past the limit the logits change: by more than 10x the 1e-5 that bounds float noise on the short input
    assert (llama(long).logits - llama_plain(long).logits).abs().max() > 1e-4

    randomize_lazy(lazy)
    lazy_plain = LazyLlamaForCausalLM(tiny_config(max_position_embeddings=16)).eval()
    lazy_plain.load_state_dict(lazy.state_dict())
    assert torch.allclose(lazy(short).logits, lazy_plain(short).logits, atol=1e-5)
    assert (lazy(long).logits - lazy_plain(long).logits).abs().max() > 1e-4


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_padding_free_batch_longer_than_max_positions(flash_kwargs, rng_seed):
    """A `DataCollatorWithFlattening` row longer than `max_position_embeddings` whose documents are not: logits and
    loss equal those of the documents alone (positions restart per document; `cu_seq_lens_q` when given)."""
    model = tiny_model(max_position_embeddings=16)
    docs = [torch.randint(3, 97, (n,)) for n in (12, 15, 9)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": d.tolist()} for d in docs])
    assert batch["input_ids"].shape[1] > model.config.max_position_embeddings
    out = model(**batch)
    alone = [model(d[None], labels=d[None]) for d in docs]
    assert (out.logits - torch.cat([a.logits for a in alone], 1)).abs().max() < 1e-5
    counts = [len(d) - 1 for d in docs]
    per_doc = sum(a.loss * n for a, n in zip(alone, counts)) / sum(counts)
    torch.testing.assert_close(out.loss, per_doc, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ attention weights and dropout

ALL_CLASSES = [LazyLlamaModel, LazyLlamaForCausalLM, LazyLlamaForSequenceClassification,
               LazyLlamaForTokenClassification, LazyLlamaForQuestionAnswering]


def _tensors(value):
    """The tensors of a (nested) output, in order; caches and Nones are skipped."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-calls", "compiled-decode"])
def test_static_cache_attention_weights_span_the_buffer_like_llama(compiled, rng_seed):
    """Under a static cache, `generate(output_attentions=True)` returns weights over the cache's whole buffer,
    `[B, H, q, max_cache_len]` as Llama's eager attention does (what transformers' Llama suite checks in
    `test_generate_compilation_all_outputs`). A converted model (tau = 0, bias = 0) is Llama: its weights equal
    Llama's, the unwritten slots included (0)."""
    config = tiny_config(lazy_tau_init=0.0, lazy_bias_init_std=0.0)
    llama = llama_twin(config).eval()
    llama.set_attn_implementation("eager")
    lazy = LazyLlamaForCausalLM(config).eval()
    lazy.load_state_dict(llama.state_dict(), strict=False)
    lazy.set_attn_implementation("eager")
    ids, mask = left_padded([7, 4])
    buffer = 13  # longer than the 7 + 3 tokens written
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None, output_attentions=True,
                  return_dict_in_generate=True)
    if compiled:
        torch.compiler.reset()
        kwargs["compile_config"] = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")
    got = lazy.generate(ids, attention_mask=mask, cache=StaticCache(config=config, max_cache_len=buffer), **kwargs)
    if compiled:
        assert hasattr(lazy, "_compiled_call")
        kwargs.pop("compile_config")
    want = llama.generate(ids, attention_mask=mask, cache=StaticCache(config=llama.config, max_cache_len=buffer),
                          **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for step, (got_layers, want_layers) in enumerate(zip(got.attentions, want.attentions, strict=True)):
        q_len = ids.shape[1] if step == 0 else 1
        for a, b in zip(got_layers, want_layers, strict=True):
            assert a.shape == b.shape == (2, 4, q_len, buffer), (step, a.shape, b.shape)
            rows = mask.bool() if step == 0 else torch.ones(2, 1, dtype=torch.bool)  # Llama spreads padded rows
            torch.testing.assert_close(a.transpose(1, 2)[rows], b.float().transpose(1, 2)[rows], atol=1e-5, rtol=1e-4)
            written = ids.shape[1] + step
            assert (a[..., written:] == 0).all()

    # tau and bias that matter: the written slots equal a dynamic cache's weights, the rest are 0
    randomize_lazy(lazy)
    dynamic = lazy.generate(ids, attention_mask=mask, **kwargs)
    static = lazy.generate(ids, attention_mask=mask, cache=StaticCache(config=config, max_cache_len=buffer), **kwargs)
    for step, (s_layers, d_layers) in enumerate(zip(static.attentions, dynamic.attentions, strict=True)):
        for a, b in zip(s_layers, d_layers, strict=True):
            assert a.shape[-1] == buffer and b.shape[-1] == ids.shape[1] + step
            torch.testing.assert_close(a[..., : b.shape[-1]], b, atol=1e-5, rtol=1e-4)
            assert (a[..., b.shape[-1]:] == 0).all()


@pytest.mark.parametrize("model_class", ALL_CLASSES, ids=lambda c: c.__name__)
def test_output_attentions_and_tuple_dict_equivalence(model_class, rng_seed):
    """The default "lazy" path answers `output_attentions` (kwarg or config) with the reference weights; tuple
    and dict outputs hold the same tensors."""
    torch.manual_seed(rng_seed)
    model = model_class(tiny_config(num_labels=3)).eval()
    randomize_lazy(model)
    ids, mask = left_padded([9, 6])
    for flags in ({}, {"output_hidden_states": True}, {"output_attentions": True},
                  {"output_hidden_states": True, "output_attentions": True}):
        as_dict = model(ids, attention_mask=mask, use_cache=False, **flags)
        as_tuple = model(ids, attention_mask=mask, use_cache=False, return_dict=False, **flags)
        got, want = _tensors(as_tuple), _tensors(as_dict.to_tuple())
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    attentions = as_dict.attentions
    assert len(attentions) == 2 and attentions[0].shape == (2, 4, 9, 9)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    for a, b in zip(attentions, eager(ids, attention_mask=mask, use_cache=False, output_attentions=True).attentions):
        torch.testing.assert_close(a, b)
    # `output_attentions=True` in the config is honoured too
    configured = model_class(tiny_config(num_labels=3, output_attentions=True)).eval()
    assert len(configured(ids, attention_mask=mask, use_cache=False).attentions) == 2


def test_capture_outputs_is_never_chained():
    """Only the base model records outputs: a head never nests a second capture for the same output."""
    from transformers.utils.output_capturing import CompileableContextVar

    original_set, original_reset = CompileableContextVar.set, CompileableContextVar.reset
    depth = defaultdict(int)

    def counting_set(self, value):
        for key in value:
            depth[key] += 1
            assert depth[key] == 1, f"capture of {key!r} is chained"
        return original_set(self, value)

    def counting_reset(self, token):
        for key in self.context_var.get() or {}:
            depth[key] -= 1
        return original_reset(self, token)

    ids = torch.randint(3, 97, (2, 7))
    for model_class in ALL_CLASSES:
        model = model_class(tiny_config(num_labels=3)).eval()
        with mock.patch.object(CompileableContextVar, "set", counting_set), \
                mock.patch.object(CompileableContextVar, "reset", counting_reset), torch.no_grad():
            out = model(ids, output_attentions=True, output_hidden_states=True)
        assert len(out.attentions) == 2 and len(out.hidden_states) == 3, model_class.__name__


@pytest.mark.parametrize("implementation", ["lazy", "eager"])
def test_attention_dropout_is_applied_in_training_only(implementation, rng_seed):
    """`attention_dropout` drops Elastic-Softmax weights in training (never silently ignored), not in evaluation."""
    model = tiny_model(attn_implementation=implementation, attention_dropout=0.5)
    ids = torch.randint(3, 97, (2, 10))
    clean = model(ids).logits
    torch.testing.assert_close(model(ids).logits, clean)  # eval: deterministic, no dropout
    dropless = tiny_model(attn_implementation=implementation)
    dropless.load_state_dict(model.state_dict())
    torch.testing.assert_close(dropless(ids).logits, clean, atol=1e-5, rtol=1e-5)
    model.train()
    torch.manual_seed(0)
    first = model(ids, labels=ids)
    torch.manual_seed(1)
    second = model(ids).logits
    assert (first.logits - clean).abs().max() > 1e-3 and (first.logits - second).abs().max() > 1e-3
    first.loss.backward()
    tau_grads = [layer.self_attn.tau.grad for layer in model.model.layers]
    assert all(g is not None and torch.isfinite(g).all() for g in tau_grads)


# -------------------------------------------------------------------------------------------------- task heads

HEADS = [
    (AutoModelForSequenceClassification, LazyLlamaForSequenceClassification, dict(labels=torch.tensor([0, 2]))),
    (AutoModelForTokenClassification, LazyLlamaForTokenClassification, dict(labels=torch.randint(0, 3, (2, 8)))),
    (AutoModelForQuestionAnswering, LazyLlamaForQuestionAnswering,
     dict(start_positions=torch.tensor([1, 3]), end_positions=torch.tensor([4, 6]))),
]


@pytest.mark.parametrize("auto_class, head_class, targets", HEADS, ids=lambda x: getattr(x, "__name__", ""))
def test_task_head_trains_saves_and_loads(auto_class, head_class, targets, tmp_path, rng_seed):
    """Each head: loss and gradients (tau and bias included), save/load through its Auto class, and the checkpoint
    a user starts from loads into it with only the new head initialised: a causal LM's for the classifiers, Llama's
    question-answering head's (its base model under `transformer`, Llama's name) for question answering."""
    causal = tiny_model()
    if head_class is LazyLlamaForQuestionAnswering:
        from transformers import LlamaForQuestionAnswering

        config = LlamaConfig(**{k: v for k, v in causal.config.to_dict().items() if not k.startswith("lazy_")})
        source = LlamaForQuestionAnswering(config)
        base = source.transformer
    else:
        source, base = causal, causal.model
    source.save_pretrained(tmp_path / "source")
    (tmp_path / "source" / "config.json").write_text(causal.config.to_json_string())
    head = auto_class.from_pretrained(tmp_path / "source", num_labels=3)
    assert type(head) is head_class and head.config._attn_implementation == "lazy"
    assert head.base_model_prefix == source.base_model_prefix
    for name, tensor in base.state_dict().items():
        assert torch.equal(head.base_model.state_dict()[name], tensor), name

    ids, mask = left_padded([8, 5])
    head.train()
    out = head(ids, attention_mask=mask, **targets)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert head.base_model.layers[0].self_attn.tau.grad.abs().sum() > 0
    assert head.base_model.layers[0].self_attn.distance_bias.grad.abs().sum() > 0

    head.eval()
    head.save_pretrained(tmp_path / "head")
    loaded = auto_class.from_pretrained(tmp_path / "head")
    assert type(loaded) is head_class
    for a, b in zip(_tensors(head(ids, attention_mask=mask).to_tuple()),
                    _tensors(loaded(ids, attention_mask=mask).to_tuple())):
        torch.testing.assert_close(a, b)


def test_sequence_classification_pools_the_last_token_of_left_padded_rows(rng_seed):
    model = LazyLlamaForSequenceClassification(tiny_config(num_labels=3)).eval()
    randomize_lazy(model)
    ids, mask = left_padded([8, 5])
    batched = model(ids, attention_mask=mask).logits
    for row, n in enumerate((8, 5)):
        torch.testing.assert_close(batched[row], model(ids[row:row + 1, -n:]).logits[0], atol=1e-5, rtol=1e-5)


REMOTE_HEADS_SCRIPT = """
import sys, torch
from transformers import (
    AutoModelForQuestionAnswering, AutoModelForSequenceClassification, AutoModelForTokenClassification,
)
path, ids_path, out_path = sys.argv[1:4]
ids = torch.load(ids_path)
out = {}
for auto in (AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoModelForQuestionAnswering):
    model = auto.from_pretrained(path, trust_remote_code=True, num_labels=3).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model)
    base = model.base_model
    assert type(base).__name__ == "LazyLlamaModel" and type(base).__module__ == type(model).__module__
    out[type(model).__name__] = [t for t in model(ids).to_tuple() if isinstance(t, torch.Tensor)]
torch.save(out, out_path)
"""


def test_task_heads_with_trust_remote_code_in_a_python_without_the_project(tmp_path, rng_seed):
    causal = tiny_model()
    causal.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(3, 97, (2, 7))
    torch.save(ids, tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    result = run_without_project(REMOTE_HEADS_SCRIPT, [tmp_path / "ckpt", tmp_path / "ids.pt", tmp_path / "out.pt"],
                                 cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = torch.load(tmp_path / "out.pt")
    assert set(out) == {c.__name__ for _, c, _ in HEADS}
    # the base model is the saved one: the heads' hidden states come from identical weights (question answering
    # keeps its base model under `transformer`, as Llama's does: a causal LM's weights are not its own)
    hidden = causal.model(ids).last_hidden_state
    for _, head_class, _ in HEADS:
        head = head_class.from_pretrained(tmp_path / "ckpt", num_labels=3).eval()
        if head.base_model_prefix == "model":
            torch.testing.assert_close(head.model(ids).last_hidden_state, hidden)
        assert len(out[head_class.__name__]) == len(_tensors(head(ids).to_tuple()))


# --------------------------------------------------------------------------------------------- deprecated names

def _call_warnings(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(**kwargs)
    return out, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@torch.no_grad()
def test_past_key_values_is_the_deprecated_name_of_cache_like_llama(rng_seed):
    """`past_key_values=` works with Llama's FutureWarning; with both names, `cache` wins (Llama's rule)."""
    lazy = tiny_model()
    llama = llama_twin(lazy.config).eval()
    ids = torch.randint(3, 97, (1, 9))
    messages = {}
    for name, model in (("LazyLlamaForCausalLM", lazy), ("LlamaForCausalLM", llama)):
        prefix = model(ids[:, :6], use_cache=True).cache
        want = model(ids[:, 6:], cache=copy.deepcopy(prefix)).logits
        old, old_warnings = _call_warnings(model, input_ids=ids[:, 6:], past_key_values=copy.deepcopy(prefix))
        torch.testing.assert_close(old.logits, want)
        both, both_warnings = _call_warnings(model, input_ids=ids[:, 6:], cache=copy.deepcopy(prefix),
                                             past_key_values=DynamicCache(config=model.config))
        torch.testing.assert_close(both.logits, want)
        messages[name] = [m.replace(name, "MODEL") for m in old_warnings + both_warnings]
        assert any("past_key_values" in m and "cache" in m for m in old_warnings)
        assert any("Both" in m for m in both_warnings)
    assert [m.split(" Using")[0] for m in messages["LazyLlamaForCausalLM"]] == \
        [m.split(" Using")[0] for m in messages["LlamaForCausalLM"]]


# ------------------------------------------------------------------------------------------ PEFT prompt learning

PROMPT_LEARNING = {
    "prefix tuning": lambda peft: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
    "prompt tuning": lambda peft: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
    "p-tuning": lambda peft: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=5,
                                                      encoder_hidden_size=32),
}


@pytest.mark.parametrize("method", list(PROMPT_LEARNING))
def test_peft_prompt_learning_trains_and_generates_like_the_references(method, rng_seed):
    """PEFT's prompt-learning methods on LazyLlama (virtual tokens as cached keys and values for prefix tuning, as
    input embeddings for prompt tuning and p-tuning), on a right-padded batch: with tau = 0 and a zero bias the loss
    and the prompt's gradients are a Llama twin's with the same prompt (the virtual tokens take the first positions
    in both); with tau of both signs and a bias they are eager attention's; `generate()` gives eager attention's
    tokens (prompt tuning and p-tuning: with transformers 5.24 and peft 0.21 a prefix-tuned `generate()` drops the
    prefix, for Llama as for LazyLlama: PEFT hands it over as the deprecated `past_key_values`, which loses against
    the `cache` that `generate()` passes)."""
    peft = pytest.importorskip("peft")
    lazy = tiny_model()
    ids = torch.randint(3, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    init_seed = int(torch.randint(0, 2**31 - 1, ()))

    def prompt_model(base):
        torch.manual_seed(init_seed)  # the same virtual tokens for every base model
        return peft.get_peft_model(copy.deepcopy(base), PROMPT_LEARNING[method](peft))

    def loss_and_grads(model):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        params = [p for p in model.parameters() if p.requires_grad]
        assert params and all(p.dtype == torch.float32 for p in params)
        return loss.detach(), torch.autograd.grad(loss, params)

    exact = copy.deepcopy(lazy)
    with torch.no_grad():
        for layer in exact.model.layers:
            layer.self_attn.tau.zero_()
            layer.self_attn.distance_bias.zero_()
    llama = llama_twin(lazy.config)
    llama.load_state_dict({k: v for k, v in exact.state_dict().items() if not k.endswith(("tau", "distance_bias"))})
    got, want = loss_and_grads(prompt_model(exact)), loss_and_grads(prompt_model(llama.eval()))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)

    model = prompt_model(lazy)
    got = loss_and_grads(model)
    assert all(g.abs().sum() > 0 for g in got[1])
    generates = method != "prefix tuning"
    with torch.no_grad():
        tokens = model.generate(input_ids=ids[:1, :6], max_new_tokens=4, do_sample=False) if generates else None
    model.get_base_model().set_attn_implementation("eager")
    want = loss_and_grads(model)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    if generates:
        with torch.no_grad():
            assert torch.equal(tokens, model.generate(input_ids=ids[:1, :6], max_new_tokens=4, do_sample=False))
