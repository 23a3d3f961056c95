"""Lazy Attention in plain PyTorch: the reference and the memory-efficient CPU path.

Math (SPEC section 1), per query head h, query i, key j, for visible (i, j):

    s_ij = scaling * <q_i, k_j> + beta_h(pos_i - pos_j)       beta_h(d) = distance_bias[h, d] if 0 <= d < W else 0
    p_ij = exp(s_ij - LSE_i)                                   LSE over the visible keys of row i, float32
    a_ij = max(0, p_ij + tau_h / n_i)                          n_i = pos_i + 1; a_ij = 0 for masked (i, j)
    o_i  = sum_j a_ij v_j                                      no renormalisation; an all-zero row gives 0

Visibility is described by per-token integer tensors rather than an L x L mask, so that every backend
(this file and the Triton kernels) reads the same compact inputs:

    q_pos [B, Tq], k_pos [B, Tk]  int64   positions (restart at 0 per packed document)
    q_seg [B, Tq], k_seg [B, Tk]  int32   query i sees key j  <=>  q_seg[i] == k_seg[j]  and  j <= i + Tk - Tq
                                          (padding keys carry -1, padded query rows -2: they see nothing)

`lazy_attention_metadata` builds them from a 2-D padding mask and/or `position_ids`.
"""

import math

import torch


def lazy_attention_metadata(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_length: int,
    query_length: int,
    batch_size: int,
    device: torch.device,
    cu_seq_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions and segment ids of queries and keys for one forward call.

    Args:
        attention_mask: `[B, past_length + query_length]` (1 = token, 0 = padding) or None.
        position_ids: `[B or 1, query_length]` or None. When None they come from the mask (`cumsum - 1`),
            so a left-padded row gets the positions its prompt gets alone, or are `past_length + arange`.
        past_length: number of cached keys before this call's tokens.
        cu_seq_lens: optional `[num_docs + 1]` cumulative document lengths of a packed batch of one row.

    Returns:
        `(q_pos [B, Tq] int64, k_pos [B, Tk] int64, q_seg [B, Tq] int32, k_seg [B, Tk] int32)`.
    """
    key_length = past_length + query_length
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] != key_length:
            raise ValueError(
                f"LazyLlama expects a 2-D padding mask of shape [batch, past + new tokens] = "
                f"[{batch_size}, {key_length}], got {tuple(attention_mask.shape)}. 4-D masks cannot express "
                "Elastic-Softmax's per-row key count; pass the tokenizer's attention_mask instead."
            )
        key_valid = attention_mask.to(device=device, dtype=torch.bool)
        mask_pos = key_valid.long().cumsum(-1) - 1
        mask_pos = mask_pos.masked_fill(~key_valid, 1)  # what generate() gives padding positions
    else:
        key_valid = torch.ones(batch_size, key_length, dtype=torch.bool, device=device)
        mask_pos = torch.arange(key_length, device=device).expand(batch_size, key_length)

    if position_ids is None:
        q_pos = mask_pos[:, past_length:]
    else:
        q_pos = position_ids.to(device=device, dtype=torch.long).expand(batch_size, query_length)
    k_pos = torch.cat([mask_pos[:, :past_length], q_pos], dim=1)

    # Segments: packed documents are only meaningful without a cache (training / scoring).
    if cu_seq_lens is not None:
        lengths = cu_seq_lens.diff().to(device)
        seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        seg = seg[:key_length].expand(batch_size, key_length)
    elif past_length == 0 and position_ids is not None:
        diff = torch.diff(k_pos, dim=-1, prepend=k_pos[:, :1] - 1)
        seg = (diff != 1).long().cumsum(-1)
    else:
        seg = torch.zeros(batch_size, key_length, dtype=torch.long, device=device)
    seg = seg.to(torch.int32)
    k_seg = seg.masked_fill(~key_valid, -1)
    q_seg = seg[:, past_length:].masked_fill(~key_valid[:, past_length:], -2)
    return q_pos.contiguous(), k_pos.contiguous(), q_seg.contiguous(), k_seg.contiguous()


def _visible(q_seg: torch.Tensor, k_seg: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
    """`[B, 1, Tq, Tk]` bool: same segment and causal (`k_index <= q_index`, both in key coordinates)."""
    causal = k_index[None, :] <= q_index[:, None]
    return ((q_seg[:, :, None] == k_seg[:, None, :]) & causal)[:, None]


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """float64 inputs are computed in float64 (for gradcheck); everything else in float32."""
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def _distance_bias(distance_bias: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype) -> torch.Tensor:
    """`[B, H, Tq, Tk]`: `distance_bias[h, pos_i - pos_j]` inside the window, 0 outside it."""
    window = distance_bias.shape[-1]
    dist = q_pos[:, :, None] - k_pos[:, None, :]
    in_window = (dist >= 0) & (dist < window)
    bias = distance_bias.to(dtype)[:, dist.clamp(0, window - 1)]  # [H, B, Tq, Tk]
    return (bias * in_window).permute(1, 0, 2, 3)


def lazy_attention_reference(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling):
    """Plain Lazy Attention that materialises the weights (the `"eager"` implementation).

    Args:
        query: `[B, Hq, Tq, D]`; key, value: `[B, Hkv, Tk, D]` (any float dtype; math in float32).
        tau: `[Hq]`; distance_bias: `[Hq, W]`; positions and segments as in the module docstring.
    Returns:
        `(out [B, Tq, Hq, D] in the query dtype, weights [B, Hq, Tq, Tk] float32 after the ReLU)`.
    """
    bsz, num_heads, q_len, _ = query.shape
    groups = num_heads // key.shape[1]
    acc = _compute_dtype(query)
    k = key.to(acc).repeat_interleave(groups, dim=1)
    v = value.to(acc).repeat_interleave(groups, dim=1)
    k_len = k.shape[2]
    visible = _visible(q_seg, k_seg, torch.arange(q_len, device=query.device) + k_len - q_len,
                       torch.arange(k_len, device=query.device))
    scores = torch.matmul(query.to(acc), k.transpose(2, 3)) * scaling
    scores = scores + _distance_bias(distance_bias, q_pos, k_pos, acc)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0))
    n = (q_pos + 1).to(acc)[:, None, :, None]
    weights = torch.relu(probs + tau.to(acc)[None, :, None, None] / n) * visible
    out = torch.matmul(weights, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights


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

_CHUNK_ELEMENTS = 1 << 20  # score elements (B * Hq * rows * keys) per chunk and thread: ~4 MB of float32
_MIN_ROWS = 16


def _chunk_rows(bsz: int, num_heads: int, q_len: int, k_len: int) -> int:
    """Query rows per chunk. Every op of a chunk is one parallel region whose start-up cost grows with the
    thread count, so the score buffer grows with the threads; it never depends on L beyond `rows * k_len`,
    so extra memory stays linear in L."""
    budget = _CHUNK_ELEMENTS * max(1, torch.get_num_threads())
    rows = budget // max(1, bsz * num_heads * k_len)
    return int(min(q_len, max(_MIN_ROWS, rows)))


_causal_memo: tuple = ()


def _is_causal_layout(q_pos, k_pos, q_seg, k_seg) -> bool:
    """True when query i sees exactly keys j <= i + Tk - Tq and pos_i - pos_j = i + Tk - Tq - j.

    Holds for unpadded, unpacked rows whose positions are `index + constant` (any constant per row).
    The model passes the same metadata tensors to every layer, so the answer is memoised on them.
    """
    global _causal_memo
    if len(_causal_memo) == 5 and all(a is b for a, b in zip(_causal_memo[:4], (q_pos, k_pos, q_seg, k_seg))):
        return _causal_memo[4]
    q_len, k_len = q_pos.shape[1], k_pos.shape[1]
    offset = k_len - q_len
    result = offset >= 0
    if result:
        seg = k_seg[:, :1]
        index = torch.arange(k_len, device=k_pos.device)
        base = k_pos[:, :1] - index[:1]
        result = bool(
            (seg >= 0).all() & (k_seg == seg).all() & (q_seg == seg).all()
            & (k_pos == base + index).all() & (q_pos == base + index[offset:]).all()
        )
    _causal_memo = (q_pos, k_pos, q_seg, k_seg, result)
    return result


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
    ext = torch.cat([  # indexed by d + rows - 1, d in [-(rows - 1), rows + width - 2]
        torch.full((heads, rows - 1), float("-inf"), dtype=dtype, device=device),
        distance_bias[:, :width].to(dtype),
        torch.zeros(heads, rows - 1, dtype=dtype, device=device),
    ], dim=1)
    r = torch.arange(rows, device=device)
    c = torch.arange(rows + width - 1, device=device)
    return ext[:, r[:, None] - c[None, :] + (width + rows - 2)], width


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
    """`"zero"` (plain softmax), `"negative"` (all tau <= 0: the ReLU also zeroes future keys) or `"positive"`."""
    low, high = (x.item() for x in torch.aminmax(tau.detach()))
    if low == 0.0 and high == 0.0:
        return "zero"
    return "negative" if high <= 0.0 else "positive"


class _CausalChunk:
    """Scores and softmax of one query chunk in the causal layout (buffers 0: scores, 1: probs).

    Forward and backward run the identical ops, so `probs` and the ReLU mask agree bitwise.
    """

    def __init__(self, q, k, band, width, start, stop, offset, workspace):
        bsz, kv_heads, groups, _, dim = q.shape  # q is already scaled by `scaling`
        self.rows = rows = stop - start
        self.i0 = start + offset  # key index of the chunk's first row
        self.k_end = self.i0 + rows
        self.k_lo = self.i0 - width + 1  # first key of the band (may be negative)
        self.q = q[:, :, :, start:stop].reshape(bsz, kv_heads, groups * rows, dim)
        self.k = k[:, :, : self.k_end]
        shape = (bsz, kv_heads * groups, rows, self.k_end)
        scores = workspace.view(0, bsz, kv_heads, groups * rows, self.k_end)
        torch.matmul(self.q, self.k.transpose(2, 3), out=scores)
        scores = scores.view(shape)
        lo = max(0, self.k_lo)
        scores[..., lo:].add_(band[:, :rows, lo - self.k_lo : rows + width - 1])
        self.probs = torch.softmax(scores, dim=-1, out=workspace.view(1, *shape))

    def relu_shift(self, shift: torch.Tensor, mode: str, out: torch.Tensor) -> torch.Tensor:
        """`out = max(0, probs + shift)` (out may be probs itself), future keys forced to 0."""
        weights = torch.add(self.probs, shift, out=out).clamp_min_(0.0)
        if mode == "positive":  # p = 0 on future keys, but p + tau/n > 0 there
            future = torch.ones(self.rows, self.rows, dtype=torch.bool, device=weights.device).triu_(1)
            weights[..., self.i0 : self.k_end].masked_fill_(future, 0.0)
        return weights


def _tau_shift(tau, q_pos, start, stop, dtype):
    """`[B, Hq, rows, 1]` = tau_h / n_i for the chunk's rows."""
    inv_n = 1.0 / (q_pos[:, start:stop] + 1).to(dtype)[:, None, :, None]
    return tau.to(dtype)[None, :, None, None] * inv_n, inv_n


def _causal_forward(q, k, v, tau, distance_bias, q_pos, offset, out):
    bsz, kv_heads, groups, q_len, dim = q.shape
    k_len = k.shape[2]
    step = _chunk_rows(bsz, kv_heads * groups, q_len, k_len)
    band, width = _band_table(distance_bias, step, k_len, q.dtype)
    mode = _tau_mode(tau)
    workspace = _Workspace(2, bsz * kv_heads * groups * step * k_len, q.dtype, q.device)
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        c = _CausalChunk(q, k, band, width, start, stop, offset, workspace)
        weights = c.probs
        if mode != "zero":
            c.relu_shift(_tau_shift(tau, q_pos, start, stop, q.dtype)[0], mode, out=weights)
        w = weights.view(bsz, kv_heads, groups * c.rows, c.k_end)
        o = torch.matmul(w, v[:, :, : c.k_end]).view(bsz, kv_heads * groups, c.rows, dim)
        out[:, start:stop] = o.transpose(1, 2)


def _causal_backward(q, k, v, tau, distance_bias, q_pos, offset, d_out, dq, dk, dv, d_tau, d_bias):
    bsz, kv_heads, groups, q_len, dim = q.shape
    num_heads = kv_heads * groups
    k_len = k.shape[2]
    step = _chunk_rows(bsz, num_heads, q_len, k_len)
    band, width = _band_table(distance_bias, step, k_len, q.dtype)
    mode = _tau_mode(tau)
    workspace = _Workspace(3, bsz * num_heads * step * k_len, q.dtype, q.device)
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        c = _CausalChunk(q, k, band, width, start, stop, offset, workspace)
        rows, k_end = c.rows, c.k_end
        shift, inv_n = _tau_shift(tau, q_pos, start, stop, q.dtype)
        p = c.probs
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

    def __init__(self, q, k, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, start, stop, offset, lse=None):
        # q: [B, Hkv, G, Tq, D] already scaled, k: [B, Hkv, Tk, D] in the compute dtype (GQA never repeats k or v)
        bsz, kv_heads, groups, _, dim = q.shape
        self.k_end = min(k.shape[2], stop + offset)  # keys past the chunk's last row are never visible
        rows = stop - start
        self.q = q[:, :, :, start:stop].reshape(bsz, kv_heads, groups * rows, dim)
        self.k = k[:, :, : self.k_end]
        scores = torch.matmul(self.q, self.k.transpose(2, 3)).view(bsz, kv_heads * groups, rows, self.k_end)
        qp, kp = q_pos[:, start:stop], k_pos[:, : self.k_end]
        scores.add_(_distance_bias(distance_bias, qp, kp, q.dtype))
        device = q.device
        self.visible = _visible(q_seg[:, start:stop], k_seg[:, : self.k_end],
                                torch.arange(start, stop, device=device) + offset, torch.arange(self.k_end, device=device))
        scores.masked_fill_(~self.visible, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
            lse = lse.masked_fill(torch.isinf(lse), 0.0)  # rows that see nothing: p = 0 everywhere
        self.lse = lse
        self.probs = torch.exp_(scores.sub_(lse[..., None]))
        self.inv_n = 1.0 / (qp + 1).to(q.dtype)[:, None, :, None]  # [B, 1, C, 1]
        self.weights = torch.relu(self.probs + tau.to(q.dtype)[None, :, None, None] * self.inv_n)
        self.weights.mul_(self.visible)
        self.shape = (bsz, kv_heads, groups, rows)


def _general_forward(q, k, v, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, offset, out):
    bsz, kv_heads, groups, q_len, dim = q.shape
    num_heads = kv_heads * groups
    lse = torch.empty(bsz, num_heads, q_len, dtype=q.dtype, device=q.device)
    step = _chunk_rows(bsz, num_heads, q_len, k.shape[2])
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        c = _ChunkState(q, k, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, start, stop, offset)
        w = c.weights.view(bsz, kv_heads, groups * (stop - start), c.k_end)
        o = torch.matmul(w, v[:, :, : c.k_end]).view(bsz, num_heads, stop - start, dim)
        out[:, start:stop] = o.transpose(1, 2)
        lse[:, :, start:stop] = c.lse
    return lse


def _general_backward(q, k, v, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse, offset, d_out,
                      dq, dk, dv, d_tau, d_bias):
    bsz, kv_heads, groups, q_len, dim = q.shape
    num_heads = kv_heads * groups
    window = distance_bias.shape[-1]
    step = _chunk_rows(bsz, num_heads, q_len, k.shape[2])
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        rows = stop - start
        c = _ChunkState(q, k, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, start, stop, offset,
                        lse=lse[:, :, start:stop])
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
        dist = q_pos[:, start:stop, None] - k_pos[:, None, : c.k_end]
        bucket = torch.where((dist >= 0) & (dist < window), dist, window)  # [B, C, K]
        flat = d_s.permute(1, 0, 2, 3).reshape(num_heads, -1)
        d_bias.index_add_(1, bucket.reshape(-1), flat)


def _lazy_forward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling):
    """`(out [B, Tq, Hq, D] compute dtype, lse [B, Hq, Tq] or None in the causal layout)`."""
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    acc = _compute_dtype(query)
    # scaling folded into q once (exact for power-of-two head dims); [B, Hkv, G, Tq, D]
    q = (query.to(acc) * scaling).view(bsz, kv_heads, num_heads // kv_heads, q_len, dim)
    k, v = key.to(acc), value.to(acc)
    offset = k_len - q_len
    out = torch.empty(bsz, q_len, num_heads, dim, dtype=acc, device=query.device)
    if _is_causal_layout(q_pos, k_pos, q_seg, k_seg):
        _causal_forward(q, k, v, tau, distance_bias, q_pos, offset, out)
        return out, None
    return out, _general_forward(q, k, v, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, offset, out)


class LazyAttentionTorchFunction(torch.autograd.Function):
    """Chunked exact Lazy Attention with a recomputing backward (O(L) extra memory per chunk row)."""

    @staticmethod
    def forward(ctx, query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling):
        out, lse = _lazy_forward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling)
        ctx.save_for_backward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse)
        ctx.scaling = scaling
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse = ctx.saved_tensors
        scaling = ctx.scaling
        bsz, num_heads, q_len, dim = query.shape
        kv_heads, k_len = key.shape[1], key.shape[2]
        groups = num_heads // kv_heads
        window = distance_bias.shape[-1]
        acc = _compute_dtype(query)
        q = (query.to(acc) * scaling).view(bsz, kv_heads, groups, q_len, dim)
        k, v = key.to(acc), value.to(acc)
        d_out = grad_out.to(acc).transpose(1, 2).reshape(bsz, kv_heads, groups, q_len, dim)
        offset = k_len - q_len
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        d_tau = torch.zeros(num_heads, dtype=acc, device=query.device)
        d_bias = torch.zeros(num_heads, window + 1, dtype=acc, device=query.device)  # last bucket: outside W
        if lse is None:
            _causal_backward(q, k, v, tau, distance_bias, q_pos, offset, d_out, dq, dk, dv, d_tau, d_bias)
        else:
            _general_backward(q, k, v, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse, offset, d_out,
                              dq, dk, dv, d_tau, d_bias)
        # dS was taken w.r.t. scaled scores: dq = scaling * dS k, and dk = dS^T (scaling q) already
        d_query = (dq * scaling).view(bsz, num_heads, q_len, dim).to(query.dtype)
        return (d_query, dk.to(key.dtype), dv.to(value.dtype), d_tau.to(tau.dtype),
                d_bias[:, :window].to(distance_bias.dtype), None, None, None, None, None)


def lazy_attention_torch(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling):
    """Exact Lazy Attention without any L x L tensor. Same arguments as `lazy_attention_reference`.

    Returns `out [B, Tq, Hq, D]` in the query dtype.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, tau, distance_bias)):
        return LazyAttentionTorchFunction.apply(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg,
                                                float(scaling))
    out, _ = _lazy_forward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, float(scaling))
    return out.to(query.dtype)  # inference (prefill, decode): no autograd bookkeeping


__all__ = ["lazy_attention_metadata", "lazy_attention_reference", "lazy_attention_torch"]
