"""The chunked CPU op against the materialising reference where the chunk machinery matters.

The model-level tests use a handful of tokens (one chunk); here the sequences span several chunks, the
bias window is shorter and longer than the sequence, queries follow a cache, and tau has both signs.
"""

import pytest
import torch

from modeling_lazy import lazy_attention_reference as ref
from modeling_lazy import lazy_attention_torch as ops


def _inputs(bsz, heads, kv_heads, q_len, past, dim, window, tau, dtype=torch.float32):
    k_len = q_len + past
    q = torch.randn(bsz, heads, q_len, dim, dtype=dtype) * 2
    k = torch.randn(bsz, kv_heads, k_len, dim, dtype=dtype)
    v = torch.randn(bsz, kv_heads, k_len, dim, dtype=dtype)
    tau = torch.as_tensor(tau, dtype=torch.float32).expand(heads).clone()
    bias = torch.randn(heads, window) * 0.5
    return [t.requires_grad_() for t in (q, k, v, tau, bias)]


def _decided_rows(q, k, v, tau, bias, meta, margin=1e-7) -> torch.Tensor:
    """`[B, Tq, Hq]` True where every visible entry of the query row has |p_ij + tau_h / n_i| >= `margin` (or is
    exactly 0, as ties like p = 1, tau = -1, n = 1 are in every implementation), computed in float64, or the head
    has tau >= 0 (p + tau/n >= 0 in any precision). Elsewhere the ReLU's decision is within float32 rounding of its
    kink, where either side is a correct result."""
    zero = torch.zeros_like(tau, dtype=torch.float64)
    _, probs = ref.lazy_attention_reference(q.detach().double(), k.detach().double(), v.detach().double(), zero,
                                            bias.detach().double(), meta, 8**-0.5)
    _, ones = ref.lazy_attention_reference(q.detach().double(), k.detach().double(), v.detach().double(),
                                           zero + 1, zero[:, None] + torch.zeros_like(bias, dtype=torch.float64),
                                           meta, 8**-0.5)
    visible = ones > 0  # tau = 1 gives every visible entry a positive weight
    shifted = (probs + tau.detach().double()[None, :, None, None] / (meta.q_pos + 1)[:, None, :, None].double()).abs()
    near_kink = visible & (shifted > 0) & (shifted < margin) & (tau.detach() < 0)[None, :, None, None]
    return ~near_kink.any(-1).transpose(1, 2)


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
    meta = ref.LazyMetadata.from_mask(mask, query_length=spec["q_len"], batch_size=spec["bsz"],
                                      past_length=spec["past"])
    q, k, v, tau, bias = _inputs(spec["bsz"], heads, spec["kv_heads"], spec["q_len"], spec["past"], 8,
                                 spec["window"], tau_value)
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, 8**-0.5)
    got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, 8**-0.5)
    valid = mask[:, spec["past"]:].bool()
    torch.testing.assert_close(got[valid], want[valid], atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")

    # The ReLU's gradient jumps at p = -tau/n: a query row (and head) with an entry within float32 rounding of
    # it gets no output gradient, which takes the row out of every gradient (dS_ij = 0 along it). At these sizes
    # (hundreds of thousands of entries) a few rows are left out; no draw avoids them all.
    decided = _decided_rows(q, k, v, tau, bias, meta)
    assert decided[valid].float().mean() >= 0.75, "too many rows at the ReLU's kink to compare gradients"
    grad_out = torch.randn_like(want) * (valid[:, :, None] & decided)[..., None]
    g_want = torch.autograd.grad(want, [q, k, v, tau, bias], grad_out)
    g_got = torch.autograd.grad(got, [q, k, v, tau, bias], grad_out)
    for name, a, b in zip("q k v tau bias".split(), g_got, g_want):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=f"d{name}, seed {rng_seed}")
    assert g_got[4].abs().max() > 0 and g_got[0].abs().max() > 0


def test_causal_layout_detection():
    cpu = torch.device("cpu")
    assert ref.LazyMetadata.from_mask(query_length=5, batch_size=2, past_length=3, device=cpu).causal
    assert ref.LazyMetadata.from_mask(None, torch.arange(7, 12)[None], query_length=5, batch_size=1, device=cpu).causal
    assert ref.LazyMetadata.from_mask(torch.ones(2, 8, dtype=torch.long), query_length=5, past_length=3).causal  # all 1
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 0] = 0
    assert not ref.LazyMetadata.from_mask(mask, query_length=8, batch_size=2, device=cpu).causal
    packed = torch.cat([torch.arange(3), torch.arange(5)])[None]
    assert not ref.LazyMetadata.from_mask(None, packed, query_length=8, batch_size=1, device=cpu).causal
    meta = ref.LazyMetadata.from_mask(mask, query_length=5, batch_size=2, past_length=3, device=cpu)
    assert meta.key_offset == 3 and meta.key_length == 8
    assert meta.q_pos32.dtype == torch.int32 and torch.equal(meta.k_pos32.long(), meta.k_pos)


def _all_layout_metadata(kind: str, q_len: int, past: int, bsz: int):
    cpu = torch.device("cpu")
    if kind == "causal":
        return ref.LazyMetadata.from_mask(query_length=q_len, batch_size=bsz, past_length=past, device=cpu)
    mask = torch.ones(bsz, past + q_len, dtype=torch.long)
    mask[0, :2] = 0
    return ref.LazyMetadata.from_mask(mask, query_length=q_len, batch_size=bsz, past_length=past, device=cpu)


@pytest.mark.parametrize("layout", ["causal", "padded"])
@pytest.mark.parametrize("tau_value", [-0.5, 0.0, 0.7])
def test_rows_whose_scores_are_all_minus_inf_give_zero(layout, tau_value, rng_seed):
    """A `-inf` distance bias at small distances leaves early rows without a normaliser: output 0, no NaN,
    in the reference and the CPU path alike (forward and gradients)."""
    heads, q_len, past, bsz, dim = 2, 9, 0, 2, 8
    meta = _all_layout_metadata(layout, q_len, past, bsz)
    q, k, v, tau, bias = _inputs(bsz, heads, 1, q_len, past, dim, 6, tau_value)
    with torch.no_grad():
        bias[0, :3] = float("-inf")  # head 0: rows at positions 0..2 see only -inf scores
        bias[1, 0] = float("-inf")  # head 1: only the row at position 0
    want, weights = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
    assert torch.isfinite(want).all() and torch.isfinite(got).all(), f"seed {rng_seed}"
    first = meta.q_pos[1] <= 2  # row 1 is unpadded in both layouts: positions 0..2 are dead for head 0
    assert (want[1, first, 0] == 0).all() and (weights[1, 0, first] == 0).all()
    assert (got[1, first, 0] == 0).all()
    valid = meta.q_seg >= 0
    torch.testing.assert_close(got[valid], want[valid], atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")
    grad_out = torch.randn_like(want) * valid[:, :, None, None]
    finite_bias = [x for x in (q, k, v, tau)]
    g_want = torch.autograd.grad(want, finite_bias + [bias], grad_out)
    g_got = torch.autograd.grad(got, finite_bias + [bias], grad_out)
    for name, a, b in zip("q k v tau bias".split(), g_got, g_want):
        assert torch.isfinite(a).all(), f"d{name} not finite, seed {rng_seed}"
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=f"d{name}, seed {rng_seed}")


def test_longer_key_buffer_than_the_call_attends(rng_seed):
    """A static cache hands every layer its whole preallocated buffer: only `metadata.key_length` keys count."""
    heads, q_len, past, bsz, dim = 2, 3, 5, 1, 8
    meta = ref.LazyMetadata.from_mask(query_length=q_len, batch_size=bsz, past_length=past, device=torch.device("cpu"))
    q, k, v, tau, bias = _inputs(bsz, heads, 2, q_len, past, dim, 4, -0.3)
    junk = torch.randn(bsz, 2, 7, dim)  # unwritten slots of the buffer
    k_buf, v_buf = torch.cat([k, junk], 2), torch.cat([v, junk], 2)
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    for fn in (ref.lazy_attention_reference, ops.lazy_attention_torch):
        got = fn(q, k_buf, v_buf, tau, bias, meta, dim**-0.5)
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"{fn.__name__}, seed {rng_seed}")


def _visible_pairs(meta) -> torch.Tensor:
    """`[B, Tq, Tk]` bool from the metadata's own fields, by the definition (same segment, `j <= i + key_offset`)."""
    q_len, k_len = meta.q_pos.shape[1], meta.key_length
    rows = torch.arange(q_len)[:, None] + int(meta.key_offset)
    return (meta.q_seg[:, :, None] == meta.k_seg[:, None, :]) & (torch.arange(k_len)[None, :] <= rows)


def test_metadata_from_cu_seq_lens_matches_restarting_positions(rng_seed):
    """Packed documents given as cumulative lengths (TRL's padding-free batches) and as restarting position_ids (the
    fine-tuning collator) describe the same visibility and positions: each token sees its own document's past."""
    lengths = torch.randint(1, 7, (4,)).tolist()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    from_cu = ref.LazyMetadata.from_cu_seq_lens(cu)
    from_positions = ref.LazyMetadata.from_mask(None, positions, query_length=positions.shape[1])
    assert torch.equal(from_cu.q_pos, positions) and torch.equal(from_cu.k_pos, positions), f"seed {rng_seed}"
    assert torch.equal(_visible_pairs(from_cu), _visible_pairs(from_positions)), f"lengths {lengths}"
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    want = (doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    assert torch.equal(_visible_pairs(from_cu)[0], want), f"lengths {lengths}"
    assert from_cu.causal == (len(lengths) == 1)


def test_metadata_from_seq_lens_is_what_a_serving_engine_holds(rng_seed):
    """Requests of different lengths, one query each (a decode batch): request b's query sits at position
    `seq_lens[b] - 1` and sees exactly its own keys 0 .. seq_lens[b] - 1; several queries need one length."""
    seq_lens = torch.randint(1, 9, (3,))
    meta = ref.LazyMetadata.from_seq_lens(seq_lens, key_length=10)
    assert torch.equal(meta.q_pos[:, 0], seq_lens - 1), f"seed {rng_seed}"
    visible = _visible_pairs(meta)[:, 0]
    assert torch.equal(visible, torch.arange(10)[None, :] < seq_lens[:, None]), f"seq_lens {seq_lens.tolist()}"
    assert not meta.causal  # key_length 10 > every request: padded keys
    shifted = ref.LazyMetadata.from_seq_lens(seq_lens, position_offsets=torch.tensor([0, 2, 5]))
    assert torch.equal(shifted.q_pos[:, 0], seq_lens - 1 + torch.tensor([0, 2, 5]))
    prefill = ref.LazyMetadata.from_seq_lens(torch.tensor([6, 6]), query_length=4)
    assert prefill.causal and torch.equal(prefill.q_pos, torch.arange(2, 6).expand(2, 4))
    plain = ref.LazyMetadata.from_mask(query_length=4, batch_size=2, past_length=2)
    for name, a, b in zip(plain._fields, plain, prefill):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
    with pytest.raises(ValueError, match="several query rows need requests of one length"):
        ref.LazyMetadata.from_seq_lens(torch.tensor([6, 5]), query_length=2)
    with pytest.raises(ValueError, match="needs >= query_length"):
        ref.LazyMetadata.from_seq_lens(torch.tensor([1, 5]), query_length=2)


DOCUMENT_LAYOUTS = {  # (batch, length, how the metadata is built) for the per-document path
    "packed-mixed-lengths": (1, 96, "packed"),  # documents of 1, 40 (> window), 3, 1, ... tokens
    "right-padded-batch": (3, 60, "right"),
    "left-padded-batch": (3, 60, "left"),
    "packed-and-padded": (2, 96, "packed+right"),
}


def _document_metadata(kind, bsz, length):
    """`(metadata, mask, positions)` of the layout: documents from restarting positions, padding from the mask."""
    if kind.startswith("packed"):
        docs = [1, 40, 3, 1, 19, 2]
        positions = torch.cat([torch.arange(n) for n in docs])
        positions = torch.cat([positions, torch.arange(length - len(positions))])[None].expand(bsz, length)
        mask = torch.ones(bsz, length, dtype=torch.long)
        if kind.endswith("right"):
            mask[1, 50:] = 0
        return ref.LazyMetadata.from_mask(mask, positions, query_length=length), mask, positions
    lengths = [length, 37, 1]
    mask = torch.zeros(bsz, length, dtype=torch.long)
    for b, n in enumerate(lengths):
        if kind.startswith("right"):
            mask[b, :n] = 1
        else:
            mask[b, length - n:] = 1
    return ref.LazyMetadata.from_mask(mask, query_length=length), mask, None


@pytest.mark.parametrize("tau_kind", ["negative", "mixed"])
@pytest.mark.parametrize("layout", list(DOCUMENT_LAYOUTS))
def test_documents_and_padding_take_the_causal_path_per_document(layout, tau_kind, rng_seed, monkeypatch):
    """Packed documents (restarting positions) and padded batches run the causal path on each document's slice
    (never the general chunks): output and all five gradients against the float64 oracle, padded rows exactly 0."""
    from reference64 import lazy_attention64, token_layout

    def general(*args):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(ops, "_general_forward", general)
    monkeypatch.setattr(ops, "_general_backward", general)
    monkeypatch.setattr(ops, "_CHUNK_ELEMENTS", 1 << 12)
    bsz, length, kind = DOCUMENT_LAYOUTS[layout]
    meta, mask, positions = _document_metadata(kind, bsz, length)
    assert not meta.causal and ops._document_runs(meta) is not None
    heads = 4
    tau_value = -1.0 if tau_kind == "negative" else [-1.5, 0.7, 0.0, -0.3]
    q, k, v, tau, bias = _inputs(bsz, heads, 2, length, 0, 8, 24, tau_value)
    out = ops.lazy_attention_torch(q, k, v, tau, bias, meta, 8**-0.5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, tau, bias), grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, tau, bias)]
    want, _ = lazy_attention64(*leaves, *token_layout(mask, positions, bsz, length), 8**-0.5)
    want = want.transpose(1, 2)
    wanted = torch.autograd.grad(want, leaves, grad.double())
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4, msg=lambda m: f"seed {rng_seed}: {m}")
    padding = meta.q_seg < 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    for name, a, b in zip("q k v tau bias".split(), got, wanted):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-3, msg=lambda m: f"d{name}, seed {rng_seed}: {m}")


@pytest.mark.parametrize("native", [True, False], ids=["native-op", "pytorch-chunks"])
def test_left_padded_prefill_after_a_cache_runs_each_row_causally(native, rng_seed, monkeypatch):
    """Inference of a left-padded batch's prompt chunk after cached keys (`generate(prefill_chunk_size=...)`, a
    batched continuation): each row runs the causal path from its first real key (never the general chunks), rows
    whose padding ends among the queries give exactly 0 there, against the float64 oracle on metadata written
    here."""
    from reference64 import lazy_attention64

    def general(*args):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(ops, "_general_forward", general)
    if not native:
        monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", "0")
    monkeypatch.setattr(ops, "_CHUNK_ELEMENTS", 1 << 12)
    bsz, heads, q_len, past = 5, 4, 40, 60
    k_len = q_len + past
    starts = [0, 17, 60, 83, 100]  # padding ending at / inside the queries; a row of padding so far
    mask = (torch.arange(k_len) >= torch.tensor(starts)[:, None]).long()
    meta = ref.LazyMetadata.from_mask(mask, query_length=q_len, past_length=past)
    assert ops.left_padding(meta).tolist() == starts
    q, k, v, tau, bias = _inputs(bsz, heads, 2, q_len, past, 16, 24, [-1.0, 0.6, 0.0, -0.3])
    with torch.no_grad():
        out = ops.lazy_attention_torch(q, k, v, tau, bias, meta, 16**-0.5)
    # the oracle's layout: row b's real keys from starts[b] at positions 0, 1, ...; padding keys in no segment
    index = torch.arange(k_len)
    real = index >= torch.tensor(starts)[:, None]
    k_pos = torch.where(real, index - torch.tensor(starts)[:, None], 0)
    k_seg = torch.where(real, 0, -1)
    q_seg = torch.where(real[:, past:], 0, -2)
    want, _ = lazy_attention64(*(t.detach().double() for t in (q, k, v, tau, bias)), k_pos[:, past:], k_pos, q_seg,
                               k_seg, 16**-0.5)
    want = want.transpose(1, 2)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4, msg=lambda m: f"seed {rng_seed}: {m}")
    padding = ~real[:, past:]
    assert padding[3, :23].all() and not padding[3, 23:].any() and padding[4].all()
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))


def test_a_document_split_by_padding_keeps_the_general_path():
    """A mask with a hole inside one document: its later tokens see its earlier ones across the gap, which no
    per-document slice expresses; the general path runs."""
    meta = ref.LazyMetadata.from_mask(torch.tensor([[1, 1, 0, 1, 1, 1]]), query_length=6)
    assert ops._document_runs(meta) is None
