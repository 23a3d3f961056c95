"""Lazy Attention in plain PyTorch: the exact, memory-efficient path used on CPUs.

The math and the metadata are defined in `lazy_attention_reference` (docs/design.md walks through both).
Query chunks are computed against the keys they can see; a chunk's rows see all their keys at once, so
their normaliser is exact in one pass. Nothing of size L x L is kept, and the backward recomputes each
chunk from q, k, v. Packed documents and padded batches run the causal chunks on each document's slice.
Inference with a few query rows (decode) takes a one-pass path instead, which can read only the value rows that
carry a nonzero weight.

The file is over 600 lines on purpose: the causal, per-document and general chunk loops and the decode paths share
the chunk state, the band table and the cached parameter facts, and a checkpoint carries this path as one file.
"""

import math
import weakref

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from .lazy_attention_cpu import available as cpu_ops_available
from .lazy_attention_cpu import lazy_decode_cpu, lazy_elastic_rows
from .lazy_attention_reference import (
    LazyMetadata,
    compute_dtype,
    distance_bias_scores,
    lazy_visibility,
)

# ---------------------------------------------------------------------------------------------------
# Memory-efficient path: query chunks against the (causally needed) keys. A chunk's rows see all their
# keys at once, so their normaliser is exact in one pass; nothing of size L x L is kept, and the
# backward recomputes each chunk from q, k, v.
#
# Two layouts share the chunk loop:
#   causal  (no padding, one document per row, positions = index + a per-row constant; checked once per
#           call): visibility is plain causal and the distance is a function of (row, key) indices only,
#           so one `[H, C, C + W - 1]` table holds the distance bias AND the causal -inf of the keys
#           near the diagonal; keys left of that band are visible with zero bias and need no pass at
#           all. The weights come from one fused `softmax` over cache-resident rows.
#   general (padding, packed documents): per-token segments and positions build an explicit mask.
# ---------------------------------------------------------------------------------------------------

_CHUNK_ELEMENTS = 1 << 19  # score elements (B * Hq * rows * keys) per chunk and thread: 2 MB of float32, cache-sized
_MIN_ROWS = 16


def _chunk_rows(bsz: int, num_heads: int, q_len: int, k_len: int) -> int:
    """Query rows per chunk. Every op of a chunk is one parallel region whose start-up cost grows with the
    thread count, so the score buffer grows with the threads; it never depends on L beyond `rows * k_len`,
    so extra memory stays linear in L. (Under torch.compile the thread count is not traceable: one thread's budget.)"""
    threads = 1 if torch.compiler.is_compiling() else torch.get_num_threads()
    budget = _CHUNK_ELEMENTS * max(1, threads)
    rows = budget // max(1, bsz * num_heads * k_len)
    return int(min(q_len, max(_MIN_ROWS, rows)))


def _band_table(distance_bias: torch.Tensor, rows: int, k_len: int, dtype) -> tuple[torch.Tensor, int]:
    """Distance bias plus causal mask for the keys near a chunk's diagonal.

    A chunk whose first row sees keys up to index i0 needs bias or masking only on keys
    `[i0 - Wb + 1, i0 + rows)`, `Wb = min(W, k_len)`; column c of that band has distance `r + Wb - 1 - c`
    for row r. Returns `(table [H, rows, rows + Wb - 1], Wb)`: `distance_bias[h, d]` for `0 <= d < W`,
    `-inf` for `d < 0` (future keys), 0 beyond the window.
    """
    heads = distance_bias.shape[0]
    width = min(distance_bias.shape[-1], k_len)
    device = distance_bias.device
    ext = torch.cat([  # distance d at index d + rows - 1, d in [-(rows - 1), rows + width - 2]
        torch.full((heads, rows - 1), float("-inf"), dtype=dtype, device=device),
        distance_bias[:, :width].to(dtype),
        torch.zeros(heads, rows - 1, dtype=dtype, device=device),
    ], dim=1).flip(-1)  # reversed: distance rows + Wb - 2 - x at index x
    # row r, column c (distance r + Wb - 1 - c) is at reversed index c + rows - 1 - r: a Hankel view of the
    # reversed rows, read with positive strides and copied once (a gather would index every element)
    hankel = ext.as_strided((heads, rows, rows + width - 1), (ext.shape[1], 1, 1))
    return hankel.flip(1), width


def _diagonal_sums(d_s: torch.Tensor, k_lo: int, width: int) -> torch.Tensor:
    """`[H, width]`: entry d sums `d_s[b, h, r, k_lo + r + width - 1 - d]` over b and r (one distance each).

    `d_s` is a contiguous `[B, H, rows, k_end]` chunk; the band of keys starts at `k_lo` (may be negative).
    """
    if k_lo < 0:  # the band starts left of key 0: give the diagonals their missing (zero) columns
        d_s = torch.nn.functional.pad(d_s, (-k_lo, 0))
        k_lo = 0
    bsz, heads, rows, keys = d_s.shape
    diagonals = d_s.as_strided((bsz, heads, rows, width), (heads * rows * keys, rows * keys, keys + 1, 1),
                               d_s.storage_offset() + k_lo)
    return diagonals.sum(dim=(0, 2)).flip(-1)


class _Workspace:
    """Flat buffers reused by every chunk of one call: fresh multi-MB tensors page-fault on every chunk."""

    def __init__(self, count: int, numel: int, dtype, device):
        self.buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]

    def view(self, index: int, *shape: int) -> torch.Tensor:
        return self.buffers[index][: math.prod(shape)].view(shape)


def _tau_mode(tau: torch.Tensor) -> str:
    """`"zero"` (plain softmax), `"negative"` (all tau <= 0: the ReLU also zeroes future keys) or `"positive"`.

    Under torch.compile the answer would need a host sync, so the always-exact `"positive"` is used.
    """
    if torch.compiler.is_compiling():
        return "positive"
    low, high = (x.item() for x in torch.aminmax(tau.detach()))
    if low == 0.0 and high == 0.0:
        return "zero"
    return "negative" if high <= 0.0 else "positive"


def _first_finite_distance(distance_bias: torch.Tensor) -> torch.Tensor | None:
    """`[H]`: the smallest distance whose bias is not `-inf` (W when none is), or None when no row can be dead.

    In the causal layout the row at key index i sees distances `0 .. i`, and every distance >= W has bias 0,
    so the row's scores are all `-inf` (it has no normaliser and must give 0, not NaN) iff `i <` this value.
    """
    window = distance_bias.shape[-1]
    if not torch.compiler.is_compiling() and not bool(torch.isneginf(distance_bias).any()):
        return None
    index = torch.arange(window, device=distance_bias.device)
    finite = ~torch.isneginf(distance_bias.detach())
    return torch.where(finite, index, window).amin(-1)


class _CausalChunk:
    """Scores and softmax of one query chunk in the causal layout (buffers 0: scores, 1: probs; with `in_place`
    the probs overwrite the scores in buffer 0: the forward needs no scores afterwards, and one buffer less keeps
    the chunk in cache).

    Forward and backward run the identical ops (a softmax gives the same bits in place or not), so `probs` and the
    ReLU mask agree bitwise.
    """

    def __init__(self, q, k, band, width, start, stop, offset, workspace, first_finite=None, in_place=False):
        bsz, kv_heads, groups, _, dim = q.shape  # q is already scaled by `scaling`
        self.rows = rows = stop - start
        self.i0 = start + offset  # key index of the chunk's first row
        self.k_end = self.i0 + rows
        self.k_lo = self.i0 - width + 1  # first key of the band (may be negative)
        self.q = q[:, :, :, start:stop].reshape(bsz, kv_heads, groups * rows, dim)  # [B, Hkv, G * C, D]
        self.k = k[:, :, : self.k_end]  # [B, Hkv, K, D]
        shape = (bsz, kv_heads * groups, rows, self.k_end)
        scores = workspace.view(0, bsz, kv_heads, groups * rows, self.k_end)
        torch.matmul(self.q, self.k.transpose(2, 3), out=scores)
        scores = scores.view(shape)  # [B, Hq, C, K]
        lo = max(0, self.k_lo)
        scores[..., lo:].add_(band[:, :rows, lo - self.k_lo : rows + width - 1])
        # the band's -inf already hides future keys, but NaN + -inf is NaN: a NaN future key would reach rows
        # that cannot see it, so the future triangle is set, not added
        self.future = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., self.i0 : self.k_end].masked_fill_(self.future, float("-inf"))
        self.probs = torch.softmax(scores, dim=-1, out=scores if in_place else workspace.view(1, *shape))
        self.dead = None
        if first_finite is not None:  # rows whose scores are all -inf: softmax gave NaN, the math gives 0
            row_key = torch.arange(self.i0, self.k_end, device=q.device)
            self.dead = (row_key[None, :] < first_finite[:, None])[None, :, :, None]  # [1, Hq, C, 1]
            self.probs.masked_fill_(self.dead, 0.0)

    def relu_shift(self, shift: torch.Tensor, mode: str, out: torch.Tensor) -> torch.Tensor:
        """`out = max(0, probs + shift)` (out may be probs itself), future keys and dead rows forced to 0."""
        weights = torch.add(self.probs, shift, out=out).clamp_min_(0.0)
        if mode == "positive":  # p = 0 on future keys, but p + tau/n > 0 there
            weights[..., self.i0 : self.k_end].masked_fill_(self.future, 0.0)
            if self.dead is not None:
                weights.masked_fill_(self.dead, 0.0)
        return weights


def _tau_shift(tau, q_pos, start, stop, dtype):
    """`[B, Hq, rows, 1]` = tau_h / n_i for the chunk's rows."""
    inv_n = 1.0 / (q_pos[:, start:stop] + 1).to(dtype)[:, None, :, None]
    return tau.to(dtype)[None, :, None, None] * inv_n, inv_n


def _causal_forward(q, k, v, tau, distance_bias, metadata: LazyMetadata, out, inference=False):
    bsz, kv_heads, groups, q_len, dim = q.shape
    k_len = k.shape[2]
    step = _chunk_rows(bsz, kv_heads * groups, q_len, k_len)
    if (inference and q.dtype == torch.float32 and q.device.type == "cpu" and not torch.compiler.is_compiling()
            and cpu_ops_available()):  # the native op: bias, causal limit, softmax, shift and ReLU in one pass per row
        _causal_forward_kernel(q, k, v, tau, distance_bias, metadata, out, step)
        return
    band, width = _band_table(distance_bias, step, k_len, q.dtype)
    mode = _tau_mode(tau)
    first_finite = _first_finite_distance(distance_bias)
    workspace = _Workspace(1, bsz * kv_heads * groups * step * k_len, q.dtype, q.device)
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        c = _CausalChunk(q, k, band, width, start, stop, metadata.key_offset, workspace, first_finite, in_place=True)
        weights = c.probs
        if mode != "zero":
            c.relu_shift(_tau_shift(tau, metadata.q_pos, start, stop, q.dtype)[0], mode, out=weights)
        w = weights.view(bsz, kv_heads, groups * c.rows, c.k_end)
        o = torch.matmul(w, v[:, :, : c.k_end]).view(bsz, kv_heads * groups, c.rows, dim)
        out[:, start:stop] = o.transpose(1, 2)


def _causal_forward_kernel(q, k, v, tau, distance_bias, metadata: LazyMetadata, out, step):
    """The inference forward of the causal layout with the chunk's Elastic-Softmax from the native op
    `lazy_elastic_rows` (float32 CPU tensors).
    Training keeps the PyTorch chunk, whose forward and backward must agree bitwise on the ReLU mask."""
    bsz, kv_heads, groups, q_len, dim = q.shape
    num_heads = kv_heads * groups
    tau, bias = _as(tau.detach(), torch.float32).contiguous(), _as(distance_bias.detach(), torch.float32).contiguous()
    q_pos = metadata.q_pos.expand(bsz, q_len)  # [B, Tq]; a shared row reads with stride 0
    q_pos = q_pos if q_pos.stride(-1) == 1 else q_pos.contiguous()
    workspace = _Workspace(1, bsz * num_heads * step * k.shape[2], q.dtype, q.device)
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        rows, i0 = stop - start, start + metadata.key_offset
        k_end = i0 + rows
        scores = workspace.view(0, bsz, kv_heads, groups * rows, k_end)
        torch.matmul(q[:, :, :, start:stop].reshape(bsz, kv_heads, groups * rows, dim), k[:, :, :k_end].transpose(2, 3),
                     out=scores)
        lazy_elastic_rows(scores.view(bsz, num_heads, rows, k_end), i0, tau, bias, q_pos, start)
        o = torch.matmul(scores, v[:, :, :k_end]).view(bsz, num_heads, rows, dim)
        out[:, start:stop] = o.transpose(1, 2)


def _causal_backward(q, k, v, tau, distance_bias, metadata: LazyMetadata, d_out, grads):
    dq, dk, dv, d_tau, d_bias = grads
    bsz, kv_heads, groups, q_len, dim = q.shape
    num_heads = kv_heads * groups
    k_len = k.shape[2]
    step = _chunk_rows(bsz, num_heads, q_len, k_len)
    band, width = _band_table(distance_bias, step, k_len, q.dtype)
    mode = _tau_mode(tau)
    first_finite = _first_finite_distance(distance_bias)
    workspace = _Workspace(3, bsz * num_heads * step * k_len, q.dtype, q.device)
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        c = _CausalChunk(q, k, band, width, start, stop, metadata.key_offset, workspace, first_finite)
        rows, k_end = c.rows, c.k_end
        shift, inv_n = _tau_shift(tau, metadata.q_pos, start, stop, q.dtype)
        p = c.probs  # [B, Hq, C, K]
        free = workspace.view(0, *p.shape)  # the scores buffer is free after the softmax
        weights = p if mode == "zero" else c.relu_shift(shift, mode, out=free)
        do = d_out[:, :, :, start:stop].reshape(bsz, kv_heads, groups * rows, dim)
        dv[:, :, :k_end] += torch.matmul(weights.view(bsz, kv_heads, groups * rows, k_end).transpose(2, 3), do)
        alive = torch.sign(weights, out=free)  # m_ij: 1 where a_ij > 0 (weights >= 0)
        d_p = workspace.view(2, bsz, kv_heads, groups * rows, k_end)
        torch.matmul(do, v[:, :, :k_end].transpose(2, 3), out=d_p)
        md_p = d_p.view(p.shape).mul_(alive)  # m_ij * dP_ij
        d_tau += (md_p.sum(-1, keepdim=True) * inv_n).sum(dim=(0, 2, 3))
        d_s = md_p.mul_(p)
        d_s.addcmul_(p, d_s.sum(-1, keepdim=True), value=-1.0)  # p * (m dP - Delta), Delta = sum_j p m dP
        d_s_kv = d_s.view(bsz, kv_heads, groups * rows, k_end)
        dq[:, :, :, start:stop] = torch.matmul(d_s_kv, c.k).view(bsz, kv_heads, groups, rows, dim)
        dk[:, :, :k_end] += torch.matmul(d_s_kv.transpose(2, 3), c.q)
        d_bias[:, :width] += _diagonal_sums(d_s, c.k_lo, width)


class _ChunkState:
    """General layout (padding, packing): one query chunk with an explicit visibility mask."""

    def __init__(self, q, k, tau, distance_bias, metadata: LazyMetadata, visible, start, stop, lse=None):
        # q: [B, Hkv, G, Tq, D] already scaled, k: [B, Hkv, Tk, D] in the compute dtype (GQA never repeats k or v)
        bsz, kv_heads, groups, _, dim = q.shape
        # keys past the chunk's last row are never visible (a static buffer's offset is a tensor: read them all)
        self.k_end = k.shape[2] if metadata.static_buffer else min(k.shape[2], stop + metadata.key_offset)
        rows = stop - start
        self.q = q[:, :, :, start:stop].reshape(bsz, kv_heads, groups * rows, dim)
        self.k = k[:, :, : self.k_end]
        scores = torch.matmul(self.q, self.k.transpose(2, 3)).view(bsz, kv_heads * groups, rows, self.k_end)
        qp, kp = metadata.q_pos[:, start:stop], metadata.k_pos[:, : self.k_end]
        scores.add_(distance_bias_scores(distance_bias, qp, kp, q.dtype))  # [B, Hq, C, K]
        self.visible = visible[:, :, start:stop, : self.k_end]  # [B, 1, C, K]
        scores.masked_fill_(~self.visible, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, C]; -inf for rows that see nothing
        self.lse = lse
        alive = torch.isfinite(lse)[..., None]
        self.probs = torch.exp_(scores.sub_(torch.where(alive, lse[..., None], 0.0)))
        self.inv_n = 1.0 / (qp + 1).to(q.dtype)[:, None, :, None]  # [B, 1, C, 1]
        self.weights = torch.relu(self.probs + tau.to(q.dtype)[None, :, None, None] * self.inv_n)
        self.weights.mul_(self.visible & alive)
        self.shape = (bsz, kv_heads, groups, rows)


def _general_forward(q, k, v, tau, distance_bias, metadata: LazyMetadata, out):
    bsz, kv_heads, groups, q_len, dim = q.shape
    num_heads = kv_heads * groups
    lse = torch.empty(bsz, num_heads, q_len, dtype=q.dtype, device=q.device)
    step = _chunk_rows(bsz, num_heads, q_len, k.shape[2])
    visible = lazy_visibility(metadata)
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        c = _ChunkState(q, k, tau, distance_bias, metadata, visible, start, stop)
        w = c.weights.view(bsz, kv_heads, groups * (stop - start), c.k_end)
        o = torch.matmul(w, v[:, :, : c.k_end]).view(bsz, num_heads, stop - start, dim)
        out[:, start:stop] = o.transpose(1, 2)
        lse[:, :, start:stop] = c.lse
    return lse


def _general_backward(q, k, v, tau, distance_bias, metadata: LazyMetadata, lse, d_out, grads):
    dq, dk, dv, d_tau, d_bias = grads
    bsz, kv_heads, groups, q_len, dim = q.shape
    num_heads = kv_heads * groups
    window = distance_bias.shape[-1]
    step = _chunk_rows(bsz, num_heads, q_len, k.shape[2])
    visible = lazy_visibility(metadata)
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        rows = stop - start
        c = _ChunkState(q, k, tau, distance_bias, metadata, visible, start, stop, lse=lse[:, :, start:stop])
        do = d_out[:, :, :, start:stop].reshape(bsz, kv_heads, groups * rows, dim)
        v_c = v[:, :, : c.k_end]
        d_p = torch.matmul(do, v_c.transpose(2, 3)).view(bsz, num_heads, rows, c.k_end)
        md_p = d_p.masked_fill_(c.weights <= 0, 0.0)  # m_ij * dP_ij
        d_tau += (md_p.sum(-1, keepdim=True) * c.inv_n).sum(dim=(0, 2, 3))
        delta = (c.probs * md_p).sum(-1, keepdim=True)
        d_s = c.probs.mul_(md_p.sub_(delta))  # p * (m dP - Delta), reuses the probs buffer
        d_s_kv = d_s.view(bsz, kv_heads, groups * rows, c.k_end)
        dq[:, :, :, start:stop] = torch.matmul(d_s_kv, c.k).view(bsz, kv_heads, groups, rows, dim)
        dk[:, :, : c.k_end] += torch.matmul(d_s_kv.transpose(2, 3), c.q)
        w = c.weights.view(bsz, kv_heads, groups * rows, c.k_end)
        dv[:, :, : c.k_end] += torch.matmul(w.transpose(2, 3), do)
        dist = metadata.q_pos[:, start:stop, None] - metadata.k_pos[:, None, : c.k_end]
        bucket = torch.where((dist >= 0) & (dist < window), dist, window)  # [B, C, K]
        flat = d_s.permute(1, 0, 2, 3).reshape(num_heads, -1)
        d_bias.index_add_(1, bucket.reshape(-1), flat)


def _document_runs(metadata: LazyMetadata) -> tuple[list[tuple[int, int, int]], bool] | None:
    """`(spans, padded)` when every query sees exactly the keys of its own document so far, documents being runs of
    tokens `(row b, start s, end e)` at positions `0 .. e - s - 1` with no cache: packed documents (restarting
    positions or `cu_seq_lens`), right- or left-padded batches, or both. Each span is then a causal layout of its
    own and runs the causal path on its slice (`padded`: some tokens belong to no span; their output is 0). None
    for any other layout. Computed once per forward (the model's metadata tensors are shared by every layer)."""
    if metadata.causal or metadata.static_buffer or metadata.key_offset != 0:
        return None

    def build():
        k_seg, q_seg = metadata.k_seg.long(), metadata.q_seg.long()
        k_pos, q_pos = metadata.k_pos, metadata.q_pos.expand_as(metadata.k_pos)
        valid = k_seg >= 0
        if q_seg.shape != k_seg.shape or not torch.equal(q_seg, torch.where(valid, k_seg, -2)):
            return None
        if not torch.equal(torch.where(valid, q_pos, 0), torch.where(valid, k_pos, 0)):
            return None
        index = torch.arange(k_seg.shape[1], device=k_seg.device).expand_as(k_seg)
        before = F.pad(k_seg[:, :-1], (1, 0), value=-3)
        after = F.pad(k_seg[:, 1:], (0, 1), value=-3)
        first = valid & (k_seg != before)
        run_start = torch.where(first, index, 0).cummax(-1).values
        if not torch.equal(torch.where(valid, k_pos, 0), torch.where(valid, index - run_start, 0)):
            return None  # positions must restart at 0 in each run (Elastic-Softmax's n_i)
        starts, ends = first.nonzero().tolist(), (valid & (k_seg != after)).nonzero().tolist()
        spans = [(b, s, e + 1) for (b, s), (_, e) in zip(starts, ends)]
        seen = [(b, int(k_seg[b, s])) for b, s, _ in spans]
        if len(set(seen)) != len(seen):
            return None  # a document split by padding: its later tokens see its earlier ones across the gap
        return spans, not bool(valid.all())

    return _parameter_fact(metadata.k_seg, ("documents", id(metadata.q_pos), id(metadata.k_pos)), build)


def document_table(metadata: LazyMetadata) -> torch.Tensor | None:
    """`[R, 3]` int32 on the metadata's device for the Triton kernels' per-document causal path: one row `(batch
    row, first token, length)` per document of `_document_runs`, then one `(batch row, first token, -length)` per
    run of padding before, between or after them (so that the kernels write every token: zeros there); None for
    any other layout. Computed once per forward."""
    runs = _document_runs(metadata)
    if runs is None:
        return None

    def build():
        rows = [(b, s, e - s) for b, s, e in runs[0]]
        bsz, length = metadata.k_seg.shape
        ends = [0] * bsz  # per batch row: where its last document so far ended
        for b, s, e in runs[0]:  # in row-major order
            if s > ends[b]:
                rows.append((b, ends[b], ends[b] - s))
            ends[b] = e
        rows += [(b, end, end - length) for b, end in enumerate(ends) if end < length]
        return torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).to(metadata.k_seg.device)

    return _parameter_fact(metadata.k_seg, ("document_table", id(metadata.q_pos), id(metadata.k_pos)), build)


def _span_metadata(metadata: LazyMetadata, b: int, s: int, e: int) -> LazyMetadata:
    """The causal layout of one span of `_document_runs`."""
    pos = metadata.k_pos[b:b + 1, s:e]
    seg = metadata.k_seg[b:b + 1, s:e]
    return LazyMetadata.from_tensors(pos, pos, seg, seg, key_offset=0, causal=True, positions32=(pos, pos))


def _row_after_cache_metadata(metadata: LazyMetadata, b: int, start: int, first: int) -> LazyMetadata:
    """The causal layout of row b of a left-padded batch after a cache (`left_padding`): its keys from `start`, its
    queries from row `first`, the last of those keys."""
    q_pos, k_pos = metadata.q_pos[b:b + 1, first:], metadata.k_pos[b:b + 1, start:]
    q_seg, k_seg = metadata.q_seg[b:b + 1, first:], metadata.k_seg[b:b + 1, start:]
    return LazyMetadata.from_tensors(q_pos, k_pos, q_seg, k_seg, causal=True, positions32=(q_pos, k_pos))


def _scaled_inputs(query, key, value, metadata: LazyMetadata, scaling):
    """`(q [B, Hkv, G, Tq, D] scaled, k, v [B, Hkv, Tk, D])` in the compute dtype; keys cut to the metadata."""
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], metadata.key_length
    dtype = compute_dtype(query)
    # scaling folded into q once (exact for power-of-two head dims)
    q = (query.to(dtype) * scaling).view(bsz, kv_heads, num_heads // kv_heads, q_len, dim)
    return q, key[:, :, :k_len].to(dtype), value[:, :, :k_len].to(dtype)


def _lazy_forward(query, key, value, tau, distance_bias, metadata: LazyMetadata, scaling, inference=False):
    """`(out [B, Tq, Hq, D] compute dtype, lse [B, Hq, Tq] or None in the causal layout)`."""
    q, k, v = _scaled_inputs(query, key, value, metadata, scaling)
    bsz, num_heads, q_len, dim = query.shape
    out = torch.empty(bsz, q_len, num_heads, dim, dtype=q.dtype, device=query.device)
    if metadata.causal:
        _causal_forward(q, k, v, tau, distance_bias, metadata, out, inference)
        return out, None
    runs = _document_runs(metadata)
    if runs is not None:  # documents and padding: the causal path per document, nothing spent across them
        spans, padded = runs
        if padded:
            out.zero_()
        for b, s, e in spans:
            _causal_forward(q[b:b + 1, :, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], tau, distance_bias,
                            _span_metadata(metadata, b, s, e), out[b:b + 1, s:e], inference)
        # the general layout's lse shape (what the operator's fake promises); the backward takes the same spans
        return out, torch.zeros(bsz, num_heads, q_len, dtype=q.dtype, device=q.device)
    key_starts = left_padding(metadata) if inference else None
    if key_starts is not None:  # a left-padded batch after a cache: each row causal from its first real key
        k_len = metadata.key_length
        for b, start in enumerate(key_starts.tolist()):
            first = min(q_len, max(0, start - (k_len - q_len)))  # query rows before it are padding: 0
            out[b:b + 1, :first].zero_()
            if first < q_len:
                _causal_forward(q[b:b + 1, :, :, first:], k[b:b + 1, :, start:], v[b:b + 1, :, start:], tau,
                                distance_bias, _row_after_cache_metadata(metadata, b, start, first),
                                out[b:b + 1, first:], inference)
        return out, None
    return out, _general_forward(q, k, v, tau, distance_bias, metadata, out)


def torch_backward(grad_out, query, key, value, tau, distance_bias, metadata: LazyMetadata, lse, scaling):
    """Gradients `(d query, d key, d value, d tau, d distance_bias)` of `_lazy_forward`'s output (it gave `lse`, None
    in the causal layout): each chunk recomputed from q, k, v (O(L) extra memory per chunk row)."""
    q, k, v = _scaled_inputs(query, key, value, metadata, scaling)
    bsz, kv_heads, groups, q_len, dim = q.shape
    d_out = grad_out.to(q.dtype).transpose(1, 2).reshape(bsz, kv_heads, groups, q_len, dim)
    window = distance_bias.shape[-1]
    grads = (
        torch.empty_like(q),  # dq
        torch.zeros_like(k),  # dk
        torch.zeros_like(v),  # dv
        torch.zeros(kv_heads * groups, dtype=q.dtype, device=q.device),  # d tau
        torch.zeros(kv_heads * groups, window + 1, dtype=q.dtype, device=q.device),  # d bias; last: outside W
    )
    runs = None if lse is None else _document_runs(metadata)
    if lse is None:
        _causal_backward(q, k, v, tau, distance_bias, metadata, d_out, grads)
    elif runs is not None:  # as the forward: the causal path per document
        spans, padded = runs
        if padded:
            grads[0].zero_()
        for b, s, e in spans:
            span_grads = (grads[0][b:b + 1, :, :, s:e], grads[1][b:b + 1, :, s:e], grads[2][b:b + 1, :, s:e],
                          *grads[3:])
            _causal_backward(q[b:b + 1, :, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], tau, distance_bias,
                             _span_metadata(metadata, b, s, e), d_out[b:b + 1, :, :, s:e], span_grads)
    else:
        _general_backward(q, k, v, tau, distance_bias, metadata, lse, d_out, grads)
    dq, dk, dv, d_tau, d_bias = grads
    # dS was taken w.r.t. scaled scores: dq = scaling * dS k, and dk = dS^T (scaling q) already
    d_query = (dq * scaling).view(query.shape).to(query.dtype)
    d_key, d_value = (_pad_keys(grad, full) for grad, full in ((dk, key), (dv, value)))
    return d_query, d_key, d_value, d_tau.to(tau.dtype), d_bias[:, :window].to(distance_bias.dtype)


def _pad_keys(grad: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The gradient of `full` from that of its first `grad.shape[2]` keys (a static cache hands over more)."""
    if grad.shape[2] == full.shape[2]:
        return grad.to(full.dtype)
    padded = torch.zeros_like(full)
    padded[:, :, : grad.shape[2]] = grad
    return padded


# ---------------------------------------------------------------------------------------------------
# Decode path (inference only; a few query rows against a long cache). One pass of a few ops per call:
# no chunk loop, no band table, no workspace, no copy of float32 inputs, GQA as `[B, Hkv, G * Tq, Tk]`
# score rows against the shared key/value heads. The causal layout adds the distance bias to the last
# `W` keys of each row (the bias reversed along its window); the general layout (padding) builds the
# bias and the visibility of its `Tq x Tk` entries from the metadata.
#
# Sparse values: with tau < 0 the ReLU zeroes most weights of a long row, so after the weights only the
# value rows that some head of a GQA group needs are gathered (per group as many as the neediest group
# needs; the extra ones have weight 0): exactly the dense sum, with far fewer rows of V read. Used from
# `_SPARSE_V_MIN_KEYS` keys on, when the densest group needs at most `_SPARSE_V_MAX_DENSITY` of them.
# ---------------------------------------------------------------------------------------------------

_SPARSE_V_MIN_KEYS = 4096
_SPARSE_V_MAX_DENSITY = 0.25

# Facts about tau and the distance bias that inference calls would otherwise recompute in every layer and step
# (a reversed copy of the bias, whether it holds -inf, whether tau or the bias is all zero). Keyed by the
# tensor's id (dropped with the tensor) and stamped with its storage, its version counter and the epoch below, so
# an in-place update (load_state_dict, fill_, copy_) or a new tensor is seen at once. Not used under torch.compile.
_PARAMETER_FACTS: dict[int, tuple[weakref.ref, dict]] = {}
# Some updates leave the version counter where it was: a write through `.data`, and the fused optimizers (the
# fused AdamW, transformers' default), which write parameters in place from C++. Every step of a torch.optim
# optimizer therefore starts a new epoch (a hook on all of them), and `forget_parameter_facts` does by hand.
_FACTS_EPOCH = [0]


def forget_parameter_facts(*_) -> None:
    """Forget every fact kept about tau and the distance bias: the next call recomputes them. Call it after writing
    either through `.data`, which PyTorch's version counter does not see (a write under `torch.no_grad()` needs
    nothing); every optimizer step calls it."""
    _FACTS_EPOCH[0] += 1


register_optimizer_step_post_hook(forget_parameter_facts)


def _parameter_fact(tensor: torch.Tensor, what, build):
    """`build()`, computed once per value of `tensor` (see `_PARAMETER_FACTS`). An inference tensor (a model built or
    loaded under `torch.inference_mode()`) has no version counter to stamp, and may change in place unseen: no
    caching."""
    if (torch.compiler.is_compiling() or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
            or tensor.is_inference()):
        return build()
    key = id(tensor)
    entry = _PARAMETER_FACTS.get(key)
    if entry is None or entry[0]() is not tensor:
        entry = _PARAMETER_FACTS[key] = (weakref.ref(tensor, lambda _, key=key: _PARAMETER_FACTS.pop(key, None)), {})
    stamp = (tensor.data_ptr(), tensor._version, _FACTS_EPOCH[0])
    hit = entry[1].get(what)
    if hit is None or hit[0] != stamp:
        hit = entry[1][what] = (stamp, build())
    return hit[1]


def _reversed_bias(distance_bias: torch.Tensor, k_len: int, dtype) -> torch.Tensor:
    """`[Hq, C]`, `C >= k_len`: column `C - 1 - d` holds the bias of distance d (0 for `d >= W`).

    The row whose distance-0 key is key `i` reads its keys `0 .. i` as `narrow(-1, C - 1 - i, i + 1)`: a view,
    no flip or copy per call. C is a power of two (at least 1024), so a generation builds O(log L) tables.
    """
    capacity = max(1024, 1 << (k_len - 1).bit_length())

    def build():
        heads, window = distance_bias.shape
        table = torch.zeros(heads, capacity, dtype=dtype, device=distance_bias.device)
        span = min(window, capacity)
        table[:, capacity - span:] = distance_bias.detach()[:, :span].flip(-1)
        return table

    return _parameter_fact(distance_bias, ("reversed", dtype, capacity), build)


def _has_neginf(distance_bias: torch.Tensor) -> bool:
    """True when some bias entry is -inf (then a row may have no visible finite score)."""
    return _parameter_fact(distance_bias, "neginf", lambda: bool(torch.isneginf(distance_bias).any()))


def _all_zero(tensor: torch.Tensor) -> bool:
    return _parameter_fact(tensor, "zero", lambda: not bool(tensor.detach().count_nonzero()))


def _as(tensor: torch.Tensor, dtype) -> torch.Tensor:
    """`tensor.to(dtype)` without the call when it already is (a no-op `.to` costs microseconds)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _one_row_decode(query, key, value, tau, distance_bias, metadata: LazyMetadata, scaling) -> torch.Tensor:
    """Plain generation (one sequence, one new token, the causal layout, no static buffer): `out [1, 1, Hq, D]`
    from five ops, the distance bias entering as the addend of the score product."""
    _, num_heads, _, dim = query.shape
    kv_heads, k_len = key.shape[1], metadata.key_length
    rows = num_heads // kv_heads
    dtype = compute_dtype(query)
    table = _reversed_bias(distance_bias, k_len, dtype)
    k = _as(key if key.shape[2] == k_len else key.narrow(2, 0, k_len), dtype).reshape(kv_heads, k_len, dim)
    scores = torch.baddbmm(table.narrow(-1, table.shape[-1] - k_len, k_len).view(kv_heads, rows, k_len),
                           _as(query, dtype).reshape(kv_heads, rows, dim), k.transpose(1, 2), alpha=scaling)
    weights = torch.softmax(scores, dim=-1)  # p + tau / n, then the ReLU
    weights.add_(_as(tau, dtype).view(kv_heads, rows, 1), alpha=1.0 / (metadata.q_pos.item() + 1)).clamp_min_(0.0)
    if k_len <= distance_bias.shape[-1] and _has_neginf(distance_bias):
        weights.nan_to_num_(nan=0.0)  # the row sees no finite score (no normaliser): 0, not NaN
    out = None
    if k_len >= _SPARSE_V_MIN_KEYS:
        out = _sparse_value_rows(weights.view(1, kv_heads, rows, k_len), value, k_len, dtype)
    if out is None:
        v = _as(value if value.shape[2] == k_len else value.narrow(2, 0, k_len), dtype)
        out = torch.bmm(weights, v.reshape(kv_heads, k_len, dim))
    return _as(out.view(1, 1, num_heads, dim), query.dtype)


def _kernel_decode(query, key, value, tau, distance_bias, metadata: LazyMetadata, scaling,
                   key_starts=None) -> torch.Tensor:
    """One row per sequence in the causal layout, or left-padded (`key_starts` from `left_padding`): the native CPU op
    (`lazy_attention_cpu`, float32, bfloat16 or float16), which reads each key once and only the value rows some
    head of a GQA group weights. `out [B, 1, Hq, Dv]` in the query dtype."""
    bsz, num_heads = query.shape[:2]
    # left-padded: `left_padding` checked that each query stands where the op puts it by default (the last of its
    # row's real keys); otherwise the positions are passed (a row shared by the batch expanded)
    positions = None if key_starts is not None else metadata.q_pos.expand(bsz, 1).reshape(bsz)
    out = lazy_decode_cpu(query.select(2, 0), key, value, tau, distance_bias, scaling, seq_len=metadata.key_length,
                          positions=positions, key_starts=key_starts)
    return out.view(bsz, 1, num_heads, value.shape[-1])


def left_padding(metadata: LazyMetadata) -> torch.Tensor | None:
    """`key_starts [B]` int32 when each sequence's real keys are `key_starts[b] .. Tk - 1`, at the positions of those
    keys alone (`0 .. Tk - 1 - key_starts[b]`), and its queries the last Tq keys, each seeing the real keys up to
    itself (a query row before `key_starts[b]`, padding, sees none): a left-padded batch, as batched `generate()`
    gives it (one query row when decoding; more in a prefill after a cache, where a row may be all padding so far:
    `key_starts[b] = Tk`). None for any other layout. Computed once per forward (the model's metadata tensors are
    shared by every layer)."""
    if metadata.static_buffer:
        return None

    def build():
        k_len, q_len = metadata.key_length, metadata.q_pos.shape[1]
        q_pos, k_pos, k_seg, q_seg = metadata.q_pos, metadata.k_pos, metadata.k_seg, metadata.q_seg
        # where the last query's document starts, if it is all the real keys; Tk for a row of padding so far (a
        # chunked prefill's short prompt), which only several query rows may have: a decoded row is real
        empty = q_seg[:, -1] < 0
        starts = torch.where(empty, k_len, k_len - 1 - q_pos[:, -1])
        index = torch.arange(k_len, device=k_pos.device)
        real = index >= starts[:, None]
        q_real = real[:, k_len - q_len:]
        # one host sync: every start inside the row, exactly the real keys in segment 0 (padding keys negative) at
        # positions 0 .. (their index - start), and exactly the real queries in segment 0 at their keys' positions
        fits = ((starts >= 0).all() & ~(empty.any() & (q_len == 1)) & ((k_seg >= 0) == real).all()
                & (k_seg <= 0).all()
                & ((k_pos == index - starts[:, None]) | ~real).all() & ((q_seg == 0) == q_real).all()
                & ((q_pos == index[k_len - q_len:] - starts[:, None]) | ~q_real).all())
        return starts.to(torch.int32).contiguous() if bool(fits) else None

    return _parameter_fact(metadata.k_seg, ("left_padding", id(metadata.q_pos), id(metadata.k_pos)), build)


def left_padded_documents(key_starts: torch.Tensor, q_len: int, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(documents [2B, 3], keys [2B, 2])` int32 for the Triton kernels' per-document path of a left-padded batch
    after a cache (`left_padding`'s `key_starts`), built on the device (no host sync): row b is one document (batch
    row, first query row t0, Tq - t0) whose keys are `(key_starts[b], Tk - key_starts[b])` and whose queries are the
    last of them, from t0 = max(0, key_starts[b] - (Tk - Tq)); then the run of padding queries before t0
    `(b, 0, -t0)` (`document_table`'s runs of padding; empty when t0 = 0), keys (0, 0)."""
    starts = key_starts.to(torch.int64)
    rows = torch.arange(starts.numel(), device=starts.device)
    first = (starts - (k_len - q_len)).clamp(0, q_len)
    documents = torch.cat([torch.stack([rows, first, q_len - first], 1),
                           torch.stack([rows, torch.zeros_like(first), -first], 1)])
    keys = torch.cat([torch.stack([starts, k_len - starts], 1), torch.zeros_like(documents[:, :2][: starts.numel()])])
    return documents.to(torch.int32).contiguous(), keys.to(torch.int32).contiguous()


def _decode_scores(query, key, distance_bias, metadata: LazyMetadata, scaling, dtype) -> torch.Tensor:
    """`[B, Hq, Tq, Tk]` biased scores, `-inf` where a key is not visible (no copy of float32 k).

    Every op here costs microseconds of dispatch against a few microseconds of math at short contexts, so
    the causal layout reads the bias as views of a cached reversed copy and touches only the last `W` keys
    of each row; one row of one sequence (plain generation) is a single `baddbmm`.
    """
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], metadata.key_length
    rows = num_heads // kv_heads * q_len
    q = torch.mul(query.to(dtype), scaling).reshape(bsz * kv_heads, rows, dim)
    k = (key if key.shape[2] == k_len else key.narrow(2, 0, k_len)).to(dtype).reshape(bsz * kv_heads, k_len, dim)
    scores = torch.bmm(q, k.transpose(1, 2)).view(bsz, num_heads, q_len, k_len)
    if not metadata.causal:
        scores.add_(distance_bias_scores(distance_bias, metadata.q_pos, metadata.k_pos, dtype))
        return scores.masked_fill_(~lazy_visibility(metadata), float("-inf"))
    window = distance_bias.shape[-1]
    if metadata.static_buffer or torch.compiler.is_compiling():
        table, capacity = distance_bias.to(dtype).flip(-1), window  # column W - 1 - d holds distance d
    else:
        table = _reversed_bias(distance_bias, k_len, dtype)
        capacity = table.shape[-1]
    for row in range(q_len):
        last = metadata.key_offset + row  # key index of this row (distance 0)
        first = max(0, last - window + 1)
        row_scores = scores.select(2, row)  # [B, Hq, Tk]
        row_scores.narrow(-1, first, last + 1 - first).add_(table.narrow(-1, capacity - (last + 1 - first),
                                                                         last + 1 - first))
        if last + 1 < k_len:
            row_scores.narrow(-1, last + 1, k_len - last - 1).fill_(float("-inf"))
    return scores


def _decode_weights(scores, tau, distance_bias, metadata: LazyMetadata, dtype) -> torch.Tensor:
    """`a = max(0, softmax + tau / n)` in place of a fresh softmax buffer; invisible keys and rows without a
    normaliser (softmax gives NaN there: all their scores are -inf) get 0. A NaN score (a NaN in a key or query)
    keeps its row NaN, as in the reference."""
    bsz, num_heads, q_len, k_len = scores.shape
    weights = torch.softmax(scores, dim=-1)
    n = metadata.q_pos.to(dtype).add_(1.0).view(bsz, 1, q_len, 1)
    weights.addcdiv_(tau.to(dtype).view(1, num_heads, 1, 1), n).clamp_min_(0.0)  # p + tau / n, one pass
    if not metadata.causal:
        hidden = ~lazy_visibility(metadata) | torch.isneginf(scores.amax(-1, keepdim=True))  # (NaN: its max)
        return weights.masked_fill_(hidden, 0.0)
    for row in range(q_len - 1):  # future keys: p = 0 there, but p + tau / n > 0 when tau > 0
        first_future = metadata.key_offset + row + 1
        weights.select(2, row).narrow(-1, first_future, k_len - first_future).zero_()
    # a row sees a distance >= W (bias 0) otherwise, and without -inf in the bias its distance 0 is finite
    if metadata.key_offset < distance_bias.shape[-1] and (
            metadata.static_buffer or torch.compiler.is_compiling() or _has_neginf(distance_bias)):
        weights.nan_to_num_(nan=0.0)  # a row without a normaliser is NaN throughout; no other entry is NaN
    return weights


def _sparse_value_rows(weights: torch.Tensor, value: torch.Tensor, k_len: int, dtype) -> torch.Tensor | None:
    """`weights [B, Hkv, R, Tk] @ value[:, :, :Tk]` reading only the value rows some of the R rows needs.

    Each group takes the `m` keys of largest weight over its rows, `m` the most keys any group needs: a group
    that needs fewer also takes keys whose weights are all 0, so the sum is exactly the dense one. None when
    `m` exceeds `_SPARSE_V_MAX_DENSITY` of the keys (the dense product is faster then).
    """
    bsz, kv_heads, rows, _ = weights.shape
    groups = bsz * kv_heads
    w = weights.view(groups, rows, k_len)
    need = w.amax(dim=1)  # [B * Hkv, Tk], > 0 where some row of the group weights the key
    most = int(torch.count_nonzero(need, dim=-1).max())
    if most > _SPARSE_V_MAX_DENSITY * k_len:
        return None
    index = need.topk(most, dim=-1, sorted=False).indices  # [B * Hkv, m]
    w_needed = torch.gather(w, 2, index.unsqueeze(1).expand(groups, rows, most))
    dim = value.shape[-1]
    s_b, s_h, s_t, s_d = value.stride()
    if s_d == 1 and s_t == dim and s_h % dim == 0 and s_b % dim == 0:  # rows of D evenly spaced: one copy per key
        # (a contiguous cache, or the first keys of a larger buffer): index the rows of a flat [rows, D] view
        starts = (torch.arange(bsz, device=w.device) * (s_b // dim))[:, None] + torch.arange(
            kv_heads, device=w.device) * (s_h // dim)
        flat = index + starts.view(groups, 1)
        rows_view = value.as_strided((int(starts.max()) + value.shape[2], dim), (dim, 1))
        v_needed = rows_view.index_select(0, flat.view(-1)).view(groups, most, dim)
    else:
        v_needed = torch.gather(value, 2, index.view(bsz, kv_heads, most, 1).expand(bsz, kv_heads, most, dim))
        v_needed = v_needed.view(groups, most, dim)
    return torch.bmm(w_needed, v_needed.to(dtype)).view(bsz, kv_heads, rows, dim)


def _decode_forward(query, key, value, tau, distance_bias, metadata: LazyMetadata, scaling) -> torch.Tensor:
    """`out [B, Tq, Hq, D]` in the query dtype, for a few query rows (inference only)."""
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], metadata.key_length
    dtype = compute_dtype(query)
    scores = _decode_scores(query, key, distance_bias, metadata, scaling, dtype)
    weights = _decode_weights(scores, tau, distance_bias, metadata, dtype)
    weights = weights.view(bsz, kv_heads, num_heads // kv_heads * q_len, k_len)
    out = None
    if k_len >= _SPARSE_V_MIN_KEYS and not torch.compiler.is_compiling():
        out = _sparse_value_rows(weights, value, k_len, dtype)
    if out is None:
        out = torch.matmul(weights, (value if value.shape[2] == k_len else value.narrow(2, 0, k_len)).to(dtype))
    return out.view(bsz, num_heads, q_len, dim).transpose(1, 2).to(query.dtype)


def softmax_only(query, tau, distance_bias, metadata: LazyMetadata) -> bool:
    """True when `scaled_dot_product_attention` computes this call exactly: tau = 0 and a zero distance bias in
    every head (a checkpoint converted at tau = 0 and not trained since), and SDPA's causal mask (aligned to the
    first key) fits: one query row or no cached keys. The layout and dtype are the decision table's."""
    return (query.shape[2] == 1 or metadata.key_offset == 0) and _all_zero(tau) and _all_zero(distance_bias)


def torch_forward(kernel: str, query, key, value, tau, distance_bias, metadata: LazyMetadata, scaling,
                  key_starts=None):
    """`(out [B, Tq, Hq, D] in the query dtype, lse or None)` of the PyTorch kernel `choose_kernel` named
    (`lazy_attention_ops`): `lse` is what `torch_backward` needs after `torch_train` (None in the causal layout)."""
    if kernel == "torch_train":
        out, lse = _lazy_forward(query, key, value, tau, distance_bias, metadata, scaling)
        return out.to(query.dtype), lse
    if kernel == "torch_sdpa":
        k_len = metadata.key_length
        out = F.scaled_dot_product_attention(
            query, key[:, :, :k_len], value[:, :, :k_len], is_causal=query.shape[2] > 1, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1]).transpose(1, 2)
    elif kernel == "cpu_decode":
        out = _kernel_decode(query, key, value, tau, distance_bias, metadata, scaling, key_starts)
    elif kernel == "torch_one_row":
        out = _one_row_decode(query, key, value, tau, distance_bias, metadata, scaling)
    elif kernel == "torch_decode":
        out = _decode_forward(query, key, value, tau, distance_bias, metadata, scaling)
    else:  # "torch_prefill": no autograd bookkeeping
        out = _lazy_forward(query, key, value, tau, distance_bias, metadata, scaling, inference=True)[0]
    return out.to(query.dtype), None


def lazy_attention_torch(query, key, value, tau, distance_bias, metadata: LazyMetadata, scaling):
    """Exact Lazy Attention without any L x L tensor (the PyTorch path, whatever `LAZY_LLAMA_BACKEND` says):
    `lazy_attention_ops.lazy_attention(..., backend="torch")`. Same arguments as `lazy_attention_reference`;
    returns `out [B, Tq, Hq, D]` in the query dtype."""
    from .lazy_attention_ops import lazy_attention  # the op layer imports this file

    return lazy_attention(query, key, value, tau, distance_bias, metadata, scaling, backend="torch")


__all__ = ["forget_parameter_facts", "lazy_attention_torch", "softmax_only", "torch_backward", "torch_forward"]
