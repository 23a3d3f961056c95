"""generate() and the KV cache agree with a no-cache forward: greedy, padding, sampling, beams, chunks."""

import copy

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from modeling_lazy.modeling_lazy import CACHE_FIELD


@pytest.fixture
def model(rng_seed):
    return tiny_model(vocab_size=97)


def _greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, **kwargs)


def test_cached_equals_uncached_greedy(model):
    ids = torch.randint(3, 97, (2, 7))
    cached = _greedy(model, ids, attention_mask=torch.ones_like(ids))
    uncached = _greedy(model, ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert torch.equal(cached, uncached)


def test_cached_decode_logits_equal_full_forward(model):
    ids = torch.randint(3, 97, (1, 15))
    full = model(ids).logits
    cache = DynamicCache(config=model.config)
    out = model(ids[:, :9], cache=cache, use_cache=True)
    steps = [out.logits]
    for t in range(9, 15):
        steps.append(model(ids[:, t:t + 1], cache=getattr(out, CACHE_FIELD), use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_matches_one_shot(model):
    ids = torch.randint(3, 97, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    full = model(ids, attention_mask=mask).logits
    cache = DynamicCache(config=model.config)
    chunks = []
    for start in range(0, 20, 7):
        stop = min(20, start + 7)
        out = model(ids[:, start:stop], attention_mask=mask[:, :stop], cache=cache, use_cache=True)
        chunks.append(out.logits)
    got = torch.cat(chunks, 1)
    assert (got - full)[mask.bool()].abs().max() < 1e-5


def test_chunked_prefill_of_a_left_padded_batch_equals_one_shot(model, monkeypatch):
    """`generate(prefill_chunk_size=20)` of 60-token prompts, one left-padded by 30 (its padding ends inside the
    second chunk), one by 45 (all padding in the second chunk): the same logits and tokens as one prefill, and the
    chunks after the cache run each row causally from its first real key, never the general path."""
    import modeling_lazy.lazy_attention_torch as torch_path

    def general(*args):
        raise AssertionError("the general path ran")

    ids = torch.randint(3, 97, (3, 60))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    mask[2, :45] = 0
    ids = ids * mask
    one_shot = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    monkeypatch.setattr(torch_path, "_general_forward", general)
    chunked = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True, prefill_chunk_size=20)
    assert torch.equal(chunked.sequences, one_shot.sequences)
    torch.testing.assert_close(torch.stack(chunked.logits), torch.stack(one_shot.logits), atol=1e-5, rtol=1e-5)


def test_left_padded_batch_equals_each_prompt_alone(model):
    prompts = [torch.randint(3, 97, (n,)) for n in (8, 3, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    batched = _greedy(model, ids, attention_mask=mask)
    for row, p in enumerate(prompts):
        alone = _greedy(model, p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):]
        # a row that reached EOS alone stops there; in the batch it is then filled with padding
        assert torch.equal(batched[row, width:width + len(alone)], alone), f"row {row}"
        assert (batched[row, width + len(alone):] == 0).all(), f"row {row}"


def test_sampling_and_beam_search_run(model):
    ids = torch.randint(3, 97, (2, 5))
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    sampled = model.generate(ids, attention_mask=mask, do_sample=True, top_k=20, temperature=0.8,
                             max_new_tokens=6, pad_token_id=0)
    assert sampled.shape == (2, 11)
    beams = model.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=6,
                           do_sample=False, pad_token_id=0)
    beams_nocache = model.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2,
                                   max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False)
    assert beams.shape[0] == 4
    assert torch.equal(beams, beams_nocache)  # beam reordering of the cache is right


def test_continue_from_past_key_values(model):
    """generate() continued from a returned cache (with two more prompt tokens) gives at every step the logits of a
    fresh forward of the whole sequence. The mask is given: the first generation may produce the pad token (0),
    which generate() would otherwise take for padding in the second prompt, though the cache holds it as a token."""
    ids = torch.randint(3, 97, (1, 6))
    first = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    cache = copy.deepcopy(getattr(first, CACHE_FIELD))
    extra = torch.randint(3, 97, (1, 2))
    prompt2 = torch.cat([first.sequences, extra], 1)
    continued = model.generate(prompt2, attention_mask=torch.ones_like(prompt2), **{CACHE_FIELD: cache},
                               max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                               output_logits=True)
    assert continued.sequences.shape[1] > prompt2.shape[1]
    with torch.no_grad():
        fresh = model(continued.sequences).logits[0, prompt2.shape[1] - 1:-1]
    torch.testing.assert_close(torch.cat(continued.logits), fresh, atol=1e-5, rtol=1e-5)


def test_logits_to_keep(model):
    ids = torch.randint(3, 97, (2, 9))
    full = model(ids).logits
    torch.testing.assert_close(model(ids, logits_to_keep=1).logits, full[:, -1:])
    torch.testing.assert_close(model(ids, logits_to_keep=3).logits, full[:, -3:])


def _layer_pair():
    from transformers.cache_utils import DynamicLayer

    from modeling_lazy.modeling_lazy import InPlaceDynamicLayer

    return InPlaceDynamicLayer(), DynamicLayer()


def test_in_place_layer_matches_dynamic_layer_through_every_cache_operation(rng_seed):
    """A random sequence of updates (prefill, single tokens, chunks past the spare capacity), crops, beam
    reorders, batch selections, repeats and resets leaves `InPlaceDynamicLayer` holding exactly what
    transformers' concatenating `DynamicLayer` holds; single-token steps write into the buffer without a copy."""
    in_place, plain = _layer_pair()
    batch, heads, dim = 3, 2, 8
    writes_in_place = 0
    torch.set_grad_enabled(False)  # inference (with grad enabled the layer concatenates: the next test)
    for step in range(60):
        action = torch.randint(0, 10, ()).item()
        length = plain.get_seq_length()
        if action == 0 and length > 1:
            remove = int(torch.randint(1, length, ()))
            in_place.crop(-remove)
            plain.crop(-remove)
        elif action == 1 and length:
            order = torch.randint(0, batch, (batch,))
            in_place.reorder_cache(order)
            plain.reorder_cache(order)
        elif action == 2 and length and batch > 1:
            keep = torch.randperm(batch)[: batch - 1]
            in_place.batch_select_indices(keep)
            plain.batch_select_indices(keep)
            batch -= 1
        elif action == 3 and length and batch < 4:
            in_place.batch_repeat_interleave(2)
            plain.batch_repeat_interleave(2)
            batch *= 2
        elif action == 4 and step % 20 == 19:
            in_place.reset()
            plain.reset()
        else:
            new = 1 if action < 8 else int(torch.randint(2, 300, ()))
            keys, values = torch.randn(batch, heads, new, dim), torch.randn(batch, heads, new, dim)
            before = in_place._spare[0].data_ptr() if in_place._spare is not None else None
            got = in_place.update(keys, values)
            want = plain.update(keys, values)
            writes_in_place += before == in_place._spare[0].data_ptr()
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"step {step}: update returned other keys/values"
        assert in_place.get_seq_length() == plain.get_seq_length(), f"step {step}"
        if plain.get_seq_length():
            assert torch.equal(in_place.keys, plain.keys) and torch.equal(in_place.values, plain.values), f"step {step}"
    torch.set_grad_enabled(True)
    assert writes_in_place > 10  # most single-token steps wrote in place


def test_training_calls_that_share_a_cache_backpropagate_through_both(rng_seed):
    """Two training calls that share the cache the first creates (a chunked, truncated-BPTT-style step: one backward
    through both losses). With only tau and distance_bias trained (the keys need no gradient) the first call's
    attention still saved its keys for its backward, so the second must not write into them: the gradients equal
    those through a plain concatenating `DynamicCache`."""
    from transformers import DynamicCache

    from modeling_lazy import is_lazy_parameter

    model = tiny_model(vocab_size=97).train()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_lazy_parameter(name))
    ids = torch.randint(3, 97, (2, 12))
    grads = []
    for cache in (None, DynamicCache()):  # None: the model creates its own (in-place layers)
        model.zero_grad()
        first = model(ids[:, :7], labels=ids[:, :7], use_cache=True, **({CACHE_FIELD: cache} if cache else {}))
        second = model(ids[:, 7:], labels=ids[:, 7:], use_cache=True, **{CACHE_FIELD: getattr(first, CACHE_FIELD)})
        (first.loss + second.loss).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_in_place_layer_concatenates_where_autograd_needs_it(rng_seed):
    """Keys that require grad (a training forward with use_cache=True) are concatenated, so a second update does
    not overwrite a tensor saved for backward; the gradient equals the plain layer's."""
    grads, data = [], torch.randn(1, 2, 5, 4)
    for layer in _layer_pair():
        keys = data.clone().requires_grad_()
        first, _ = layer.update(keys[:, :, :3], keys[:, :, :3])
        second, _ = layer.update(keys[:, :, 3:], keys[:, :, 3:])
        (first.square().sum() + second.sin().sum()).backward()
        grads.append(keys.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_creates_in_place_caches_and_keeps_the_callers(model, dtype):
    """generate() and a forward without a cache create `InPlaceDynamicLayer`s; a cache the caller passes keeps
    its layers. The left-padded greedy generation (sequences and per-step logits) equals the one with a
    concatenating cache."""
    from transformers.cache_utils import DynamicLayer

    from modeling_lazy.modeling_lazy import InPlaceDynamicLayer, append_in_place

    model = model.to(dtype)  # bfloat16: the native decode reads the bf16 views
    ids = torch.randint(3, 97, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    settings = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                    return_dict_in_generate=True, output_logits=True)
    own = model.generate(ids, **settings)
    given = model.generate(ids, **settings, **{CACHE_FIELD: DynamicCache(config=model.config)})
    assert {type(layer) for layer in getattr(own, CACHE_FIELD).layers} == {InPlaceDynamicLayer}
    assert {type(layer) for layer in getattr(given, CACHE_FIELD).layers} == {DynamicLayer}
    assert torch.equal(own.sequences, given.sequences)
    torch.testing.assert_close(torch.stack(own.logits), torch.stack(given.logits), rtol=0, atol=0)
    with torch.no_grad():
        forward_cache = getattr(model(ids, attention_mask=mask, use_cache=True), CACHE_FIELD)
    assert {type(layer) for layer in forward_cache.layers} == {InPlaceDynamicLayer}
    offloading = append_in_place(DynamicCache(config=model.config, offloading=True))  # moves layers: left alone
    assert {type(layer) for layer in offloading.layers} == {DynamicLayer}


def test_compiled_forward_with_a_cache_concatenates_and_continues_in_place(model):
    """An inference forward compiled with fullgraph=True and `use_cache=True` creates its cache inside the graph
    (`InPlaceDynamicLayer` concatenates while traced: no graph break); eager decode steps then continue that cache
    in place, and every step's logits equal a fresh forward of the whole sequence."""
    from modeling_lazy.modeling_lazy import InPlaceDynamicLayer

    ids = torch.randint(3, 97, (2, 12))
    torch.compiler.reset()
    compiled = torch.compile(lambda x: model(x, use_cache=True), backend="eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(ids[:, :9])
        cache = getattr(out, CACHE_FIELD)
        assert {type(layer) for layer in cache.layers} == {InPlaceDynamicLayer}
        assert all(layer._spare is None for layer in cache.layers)  # traced: concatenated, no buffer
        steps = [out.logits]
        for t in range(9, 12):
            steps.append(model(ids[:, t:t + 1], **{CACHE_FIELD: cache}, use_cache=True).logits)
        assert all(layer._spare is not None for layer in cache.layers)  # the eager steps wrote in place
        full = model(ids).logits
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_text_generation_pipeline_matches_generate(tmp_path, rng_seed):
    """transformers' `pipeline("text-generation")` loads a saved LazyLlama through the Auto classes, pads a batch of
    prompts on the left, and returns for each prompt the greedy continuation `generate()` gives it alone."""
    from finetune_fixtures import write_tiny_model
    from transformers import AutoTokenizer, pipeline

    folder = write_tiny_model(tmp_path / "model", seed=rng_seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    generator = pipeline("text-generation", model=str(folder), tokenizer=tokenizer, device="cpu")
    with torch.no_grad():
        for layer in generator.model.model.layers:  # heads that cut weights, a bias that is not all zero
            layer.self_attn.tau.normal_(-0.5, 0.3)
            layer.self_attn.distance_bias.normal_(0.0, 0.5)
    prompts = ["the quick brown fox jumps", "a"]
    outputs = generator(prompts, batch_size=2, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                        return_full_text=False)
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            alone = generator.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                             min_new_tokens=6, do_sample=False)
        assert output[0]["generated_text"] == tokenizer.decode(alone[0, ids.shape[1]:], skip_special_tokens=True), (
            f"{prompt!r}, seed {rng_seed}")
