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
