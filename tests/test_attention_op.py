"""The chunked CPU op against the materialising reference where the chunk machinery matters.

The model-level tests use a handful of tokens (one chunk); here the sequences span several chunks, the
bias window is shorter and longer than the sequence, queries follow a cache, and tau has both signs.
"""

import pytest
import torch

from modeling_lazy import lazy_attention_torch as ops


def _inputs(bsz, heads, kv_heads, q_len, past, dim, window, tau, dtype=torch.float32):
    k_len = q_len + past
    q = torch.randn(bsz, heads, q_len, dim, dtype=dtype) * 2
    k = torch.randn(bsz, kv_heads, k_len, dim, dtype=dtype)
    v = torch.randn(bsz, kv_heads, k_len, dim, dtype=dtype)
    tau = torch.as_tensor(tau, dtype=torch.float32).expand(heads).clone()
    bias = torch.randn(heads, window) * 0.5
    return [t.requires_grad_() for t in (q, k, v, tau, bias)]


def _threshold_margin(q, k, v, tau, bias, meta) -> float:
    """Smallest non-zero |p_ij + tau_h / n_i| over visible entries, in float64 (exact ties such as p = 1,
    tau = -1, n = 1 on the first row come out exactly 0 in every implementation)."""
    zero = torch.zeros_like(tau, dtype=torch.float64)
    _, probs = ops.lazy_attention_reference(q.detach().double(), k.detach().double(), v.detach().double(), zero,
                                            bias.detach().double(), *meta, 8**-0.5)
    _, ones = ops.lazy_attention_reference(q.detach().double(), k.detach().double(), v.detach().double(),
                                           zero + 1, zero[:, None] + torch.zeros_like(bias, dtype=torch.float64),
                                           *meta, 8**-0.5)
    visible = ones > 0  # tau = 1 gives every visible entry a positive weight
    shifted = probs + tau.detach().double()[None, :, None, None] / (meta[0] + 1)[:, None, :, None].double()
    shifted = shifted[visible].abs()
    return shifted[shifted > 0].min().item()


LAYOUTS = {
    "causal-multi-chunk-short-window": dict(bsz=2, heads=4, kv_heads=2, q_len=300, past=0, window=37),
    "causal-window-longer-than-keys": dict(bsz=1, heads=3, kv_heads=1, q_len=90, past=0, window=200),
    "causal-after-cache": dict(bsz=2, heads=4, kv_heads=4, q_len=70, past=45, window=50),
    "decode": dict(bsz=3, heads=4, kv_heads=2, q_len=1, past=130, window=64),
}
TAUS = {"zero": 0.0, "negative": -1.0, "mixed": [-1.5, 0.7, 0.0, -0.3]}


@pytest.mark.parametrize("tau_kind", list(TAUS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("padded", [False, True])
def test_chunked_op_matches_reference(layout, tau_kind, padded, rng_seed, monkeypatch):
    spec = LAYOUTS[layout]
    monkeypatch.setattr(ops, "_CHUNK_ELEMENTS", 1 << 12)  # force several chunks even at these sizes
    heads = spec["heads"]
    tau_value = TAUS[tau_kind] if tau_kind != "mixed" else TAUS["mixed"][:heads] + [0.2] * (heads - 4)
    k_len = spec["q_len"] + spec["past"]
    mask = torch.ones(spec["bsz"], k_len, dtype=torch.long)
    if padded:
        mask[0, : k_len // 3] = 0  # general layout: padding keys and queries
    meta = ops.lazy_attention_metadata(mask, None, spec["past"], spec["q_len"], spec["bsz"], torch.device("cpu"))
    for _ in range(50):  # the ReLU gradient jumps at p = -tau/n: keep float32 rounding away from it
        q, k, v, tau, bias = _inputs(spec["bsz"], heads, spec["kv_heads"], spec["q_len"], spec["past"], 8,
                                     spec["window"], tau_value)
        if _threshold_margin(q, k, v, tau, bias, meta) > 1e-7:
            break
    want, _ = ops.lazy_attention_reference(q, k, v, tau, bias, *meta, 8**-0.5)
    got = ops.lazy_attention_torch(q, k, v, tau, bias, *meta, 8**-0.5)
    valid = mask[:, spec["past"]:].bool()
    torch.testing.assert_close(got[valid], want[valid], atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")

    grad_out = torch.randn_like(want) * valid[:, :, None, None]
    g_want = torch.autograd.grad(want, [q, k, v, tau, bias], grad_out)
    g_got = torch.autograd.grad(got, [q, k, v, tau, bias], grad_out)
    for name, a, b in zip("q k v tau bias".split(), g_got, g_want):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=f"d{name}, seed {rng_seed}")
    assert g_got[4].abs().max() > 0 and g_got[0].abs().max() > 0


def test_causal_layout_detection():
    meta = ops.lazy_attention_metadata(None, None, 3, 5, 2, torch.device("cpu"))
    assert ops._is_causal_layout(*meta)
    shifted = ops.lazy_attention_metadata(None, torch.arange(7, 12)[None], 0, 5, 1, torch.device("cpu"))
    assert ops._is_causal_layout(*shifted)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 0] = 0
    assert not ops._is_causal_layout(*ops.lazy_attention_metadata(mask, None, 0, 8, 2, torch.device("cpu")))
    packed = torch.cat([torch.arange(3), torch.arange(5)])[None]
    assert not ops._is_causal_layout(*ops.lazy_attention_metadata(None, packed, 0, 8, 1, torch.device("cpu")))
