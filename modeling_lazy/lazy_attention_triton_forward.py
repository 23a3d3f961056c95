"""Lazy Attention Triton forward kernels and their launchers: the general forward (any layout, with its split-K
decode) and the causal fast-path forward.

    _lse_pass / _out_pass      the general forward's two passes over key tiles
    _lazy_fwd_kernel           one query tile: pass 1 (row log-sum-exp), pass 2 (ReLU(p + tau/n) @ V)
    _lazy_fwd_split_lse_kernel / _lazy_fwd_split_out_kernel
                               split-K decode: each program covers a slice of the keys; partial (max, sum)
                               and partial outputs are combined with a few torch ops (no host sync)
    causal_passes              the causal fast path's two passes, or one, for one query tile (shared with vLLM's
                               paged prefill, lazy_llama_vllm/lazy_attention_paged_triton.py)
    _lazy_value_sums_kernel    the running sums of V along each document's keys, from which training's heads of one
                               pass take U
    _lazy_causal_fwd_kernel    the causal fast path (`LazyMetadata.causal`, query length > 16), or with
                               `DOCUMENTS` the same per document (packed documents, padded rows)
    _forward, _causal_forward  the launchers (`ForwardResult`)

Block skipping (general forward): a key tile with no visible entry for the query tile (other document, padding,
beyond the causal limit) is skipped in both passes; a key tile whose weights a_ij are all zero after pass 1 is
skipped in the `a @ V` product (its V tile is never read; deciding needs the tile's scores, so pass 2 still
computes q k^T). The causal fast path is dense. Shared helpers, constants and the block table:
lazy_attention_triton_common.py; the backward: lazy_attention_triton_backward.py.
"""

import torch
from torch.library import wrap_triton  # a launch torch.compile / make_fx can trace (plain launch in eager)

from .lazy_attention_triton_common import (
    _DEAD_ROW_LSE,
    _DOT_PRECISION,
    _INTERPRET,
    DEAD_ROW_LSE,
    DECODE_MAX_ROWS,
    LOG2E,
    ForwardResult,
    _band_from,
    _causal_band,
    _causal_key_ranges,
    _causal_scores,
    _check_inputs,
    _device_splits,
    _dot,
    _last_dim_contiguous,
    _launch_config,
    _launch_pass1_block_n,
    _load_keys,
    _load_rows,
    _row_threshold,
    _scores,
    _strides,
    _varlen_tiles,
    _visible,
    tl,
    triton,
)

# ---------------------------------------------------------------------------------------------------
# General forward (per-key metadata: any padding, packing, key offset)
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _lse_pass(q, q_pos, q_seg, q_key_idx, K, stride_kt, KPOS, KSEG, bias_row, lo, hi, Tk, W, scaling,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Pass 1: running row max and sum of exp over the visible keys in [lo, hi)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile keeps exp() at 0, never NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        visible = _visible(q_seg, q_key_idx, KSEG, keys, Tk)
        if tl.max(visible.to(tl.int32)) > 0:  # tile of another document / padding: skipped
            k = _load_rows(K, stride_kt, keys, offs_d, Tk, D)
            s = _scores(q, k, KPOS, bias_row, q_pos, visible, keys, Tk, W, scaling, UPCAST, PRECISION)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
            m_i = m_new
    return m_i, l_i


@triton.jit
def _out_pass(q, q_pos, q_seg, q_key_idx, lse, threshold, K, V, stride_kt, stride_vt, KPOS, KSEG, bias_row,
              lo, hi, Tk, W, scaling,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Pass 2: `sum_j ReLU(p_ij + tau/n_i) v_j` over visible keys in [lo, hi) (float32)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        visible = _visible(q_seg, q_key_idx, KSEG, keys, Tk)
        if tl.max(visible.to(tl.int32)) > 0:
            k = _load_rows(K, stride_kt, keys, offs_d, Tk, D)
            s = _scores(q, k, KPOS, bias_row, q_pos, visible, keys, Tk, W, scaling, UPCAST, PRECISION)
            p = tl.exp(s - lse[:, None])
            a = tl.where(visible, tl.maximum(p + threshold[:, None], 0.0), 0.0)  # float32 threshold test
            if tl.max(a) > 0.0:  # all-zero tile: its value block is never read
                v = _load_rows(V, stride_vt, keys, offs_d, Tk, D)
                acc += _dot(a.to(v.dtype), v, UPCAST, PRECISION)
    return acc


# Index helpers take no tensor: torch.compile's mutation analysis of a kernel (the triton_op's functionalization)
# follows every store address back through the calls that computed it, and counts each tensor such a call takes as
# written. Store addresses are therefore computed by pointer-free helpers, and the loads are separate calls.
@triton.jit
def _query_tile_ids(Hq, Tq, Tk, GROUPS, KEYS_PER_SPLIT, BLOCK_M: tl.constexpr):
    """Shared prologue of the forward and split-K kernels: which query tile of which head, its keys [lo, hi).

    Grid: (cdiv(Tq, BM), B * Hq[, splits]); `hi` stops at the tile's causal limit (later keys are never visible).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    hk = (h // GROUPS).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < Tq
    offset = Tk - Tq
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(tl.minimum(Tk, (pid_m + 1) * BLOCK_M + offset), lo + KEYS_PER_SPLIT)
    return pid_m, pid_bh, split, b, h, hk, rows, row_mask, rows + offset, lo, hi


@triton.jit
def _query_tile_loads(Q, QPOS, QSEG, stride_qb, stride_qh, stride_qt, b, h, rows, row_mask, Tq,
                      BLOCK_D: tl.constexpr, D: tl.constexpr):
    """The tile's queries, positions and segments."""
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                mask=row_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    q_pos = tl.load(QPOS + b * Tq + rows, mask=row_mask, other=0)
    q_seg = tl.load(QSEG + b * Tq + rows, mask=row_mask, other=-4)
    return q, q_pos, q_seg


@triton.jit
def _lazy_fwd_kernel(Q, K, V, TAU, BIAS, QPOS, KPOS, QSEG, KSEG, OUT, LSE,
                     stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                     stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                     Hq, Tq, Tk, W, GROUPS, scaling,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One query tile of one query head: pass 1 (LSE), pass 2 (output). Grid: (cdiv(Tq, BM), B * Hq)."""
    scaling = tl.cast(scaling, tl.float32)  # Inductor passes Python floats as float64
    # One "split" covering every key: lo = 0, hi = the tile's causal limit.
    _, pid_bh, _, b, h, hk, rows, row_mask, q_key_idx, _, hi = _query_tile_ids(Hq, Tq, Tk, GROUPS, Tk, BLOCK_M)
    q, q_pos, q_seg = _query_tile_loads(Q, QPOS, QSEG, stride_qb, stride_qh, stride_qt, b, h, rows, row_mask, Tq,
                                        BLOCK_D, D)
    offs_d = tl.arange(0, BLOCK_D)
    K_ = K + b * stride_kb + hk * stride_kh
    V_ = V + b * stride_vb + hk * stride_vh
    KPOS_ = KPOS + b * Tk
    KSEG_ = KSEG + b * Tk
    bias_row = BIAS + h * W

    m_i, l_i = _lse_pass(q, q_pos, q_seg, q_key_idx, K_, stride_kt, KPOS_, KSEG_, bias_row, 0, hi, Tk, W,
                         scaling, BLOCK_M, BLOCK_N, BLOCK_D, D, UPCAST, PRECISION)
    lse = tl.where(l_i > 0.0, m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0)), _DEAD_ROW_LSE)
    threshold = _row_threshold(tl.load(TAU + h), q_pos, lse)
    acc = _out_pass(q, q_pos, q_seg, q_key_idx, lse, threshold, K_, V_, stride_kt, stride_vt, KPOS_, KSEG_,
                    bias_row, 0, hi, Tk, W, scaling, BLOCK_M, BLOCK_N, BLOCK_D, D, UPCAST, PRECISION)
    out_ptrs = OUT + b * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_ot + offs_d[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < D))
    tl.store(LSE + pid_bh.to(tl.int64) * Tq + rows, lse, mask=row_mask)


@triton.jit
def _lazy_fwd_split_lse_kernel(Q, K, BIAS, QPOS, KPOS, QSEG, KSEG, M_PART, L_PART,
                               stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                               Hq, Tq, Tk, W, GROUPS, KEYS_PER_SPLIT, scaling,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Split-K pass 1: partial row max / sum of exp for one slice of keys -> M_PART, L_PART [S, B*Hq, Tq]."""
    scaling = tl.cast(scaling, tl.float32)  # Inductor passes Python floats as float64
    pid_m, pid_bh, split, b, h, hk, rows, row_mask, q_key_idx, lo, hi = _query_tile_ids(
        Hq, Tq, Tk, GROUPS, KEYS_PER_SPLIT, BLOCK_M)
    q, q_pos, q_seg = _query_tile_loads(Q, QPOS, QSEG, stride_qb, stride_qh, stride_qt, b, h, rows, row_mask, Tq,
                                        BLOCK_D, D)
    m_i, l_i = _lse_pass(q, q_pos, q_seg, q_key_idx, K + b * stride_kb + hk * stride_kh, stride_kt,
                         KPOS + b * Tk, KSEG + b * Tk, BIAS + h * W, lo, hi, Tk, W, scaling,
                         BLOCK_M, BLOCK_N, BLOCK_D, D, UPCAST, PRECISION)
    part = (split * tl.num_programs(1) + pid_bh).to(tl.int64) * Tq + rows
    tl.store(M_PART + part, m_i, mask=row_mask)
    tl.store(L_PART + part, l_i, mask=row_mask)


@triton.jit
def _lazy_fwd_split_out_kernel(Q, K, V, TAU, BIAS, QPOS, KPOS, QSEG, KSEG, LSE, O_PART,
                               stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                               stride_vb, stride_vh, stride_vt,
                               Hq, Tq, Tk, W, GROUPS, KEYS_PER_SPLIT, scaling,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Split-K pass 2: partial float32 output of one key slice -> O_PART [S, B, Tq, Hq, D] (summed after)."""
    scaling = tl.cast(scaling, tl.float32)  # Inductor passes Python floats as float64
    pid_m, pid_bh, split, b, h, hk, rows, row_mask, q_key_idx, lo, hi = _query_tile_ids(
        Hq, Tq, Tk, GROUPS, KEYS_PER_SPLIT, BLOCK_M)
    q, q_pos, q_seg = _query_tile_loads(Q, QPOS, QSEG, stride_qb, stride_qh, stride_qt, b, h, rows, row_mask, Tq,
                                        BLOCK_D, D)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * Tq + rows, mask=row_mask, other=_DEAD_ROW_LSE)
    threshold = _row_threshold(tl.load(TAU + h), q_pos, lse)
    acc = _out_pass(q, q_pos, q_seg, q_key_idx, lse, threshold, K + b * stride_kb + hk * stride_kh,
                    V + b * stride_vb + hk * stride_vh, stride_kt, stride_vt, KPOS + b * Tk, KSEG + b * Tk,
                    BIAS + h * W, lo, hi, Tk, W, scaling, BLOCK_M, BLOCK_N, BLOCK_D, D, UPCAST, PRECISION)
    offs_d = tl.arange(0, BLOCK_D)
    out_ptrs = (O_PART + ((split.to(tl.int64) * (tl.num_programs(1) // Hq) + b) * Tq + rows[:, None]) * Hq * D
                + h * D + offs_d[None, :])
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & (offs_d[None, :] < D))


# ---------------------------------------------------------------------------------------------------
# Causal fast path (`LazyMetadata.causal`: no padding, one document per row). Query row i sees exactly keys
# 0 .. i + offset (offset = Tk - Tq) at distance i + offset - j, so nothing per key is read: a query tile's key
# tiles split by loop bounds into
#     [0, far)      beyond the bias window for every row: scores only, no bias, no mask
#     [far, full)   inside the window, visible to every row: bias from the band, no mask
#     [full, hi)    crossing the causal limit (at most cdiv(BM, BN) + 1 tiles): band, masked loads
# and the bias comes from a per-head band, `band[h, d + BM + BN] = log2(e) beta_h(d)`, -inf for d < 0 (so pass 1
# needs no causal mask) and 0 beyond the window. Scores are in log2 units (`exp2`); every load is unconditional
# so that Triton pipelines K and V (cp.async). A band tile is a gather (one 4-byte load per score). Pass 2 adds
# it to the scaled q k^T and Triton pipelines it too, through shared memory into the product's register layout
# (it feeds the `a @ V` product). Pass 1 has no second product, so its band load is not pipelined and must
# change register layout through shared memory: starting q k^T from it (the accumulator, with the band in q.k
# units, `beta / scaling`) does that once per tile, where adding it afterwards did it twice.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _causal_lse_tiles(q, m_i, l_i, K, stride_kt, band, diagonal, lo, hi, Tk, scale_log2,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr, BIAS: tl.constexpr,
                      MASK_KEYS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                      BT=None, stride_kb=0, PAGE_SIZE: tl.constexpr = 0):
    """Pass 1 over key tiles [lo, hi): running row max and sum of exp2 (log2 units)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        k = _load_keys(K, stride_kt, start_n + offs_n, offs_d, Tk, D, BLOCK_D, MASK_KEYS, BT, stride_kb, PAGE_SIZE)
        # the bias added after scaling, as pass 2 and the backward add it: the same bits of every score in every
        # pass, so that a weight exactly at the ReLU kink (a one-key row at tau = -1: p = 1, a = 0) gets the same
        # mask everywhere (adding it first, in q.k units, rounds differently and flipped such masks on GPUs)
        s = _causal_scores(q, k, band, start_n, diagonal, scale_log2, BIAS, False, UPCAST, PRECISION)  # [BM, BN]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _causal_out_tiles(q, acc, u, K, V, stride_kt, stride_vt, band, diagonal, q_key_idx, lse2, threshold, lo, hi,
                      Tk, scale_log2, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                      BIAS: tl.constexpr, DIAGONAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                      BT=None, stride_kb=0, stride_vb=0, PAGE_SIZE: tl.constexpr = 0, STORE_U: tl.constexpr = False):
    """Pass 2 over key tiles [lo, hi): `acc += ReLU(p + tau/n) @ V`; `DIAGONAL` tiles mask later keys (with
    tau > 0 a masked key would otherwise get tau/n, not 0). `STORE_U`: also `u += m @ V` (m = 1 where the weight
    is > 0, an exact 0/1 operand) for the backward's Delta."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = _load_keys(K, stride_kt, keys, offs_d, Tk, D, BLOCK_D, DIAGONAL, BT, stride_kb, PAGE_SIZE)
        v = _load_keys(V, stride_vt, keys, offs_d, Tk, D, BLOCK_D, DIAGONAL, BT, stride_vb, PAGE_SIZE)
        s = _causal_scores(q, k, band, start_n, diagonal, scale_log2, BIAS, False, UPCAST, PRECISION)  # [BM, BN]
        a = tl.maximum(tl.exp2(s - lse2[:, None]) + threshold[:, None], 0.0)  # float32 threshold test
        if DIAGONAL:
            a = tl.where(keys[None, :] <= q_key_idx[:, None], a, 0.0)
        acc += _dot(a.to(v.dtype), v, UPCAST, PRECISION)
        if STORE_U:
            u = _dot(tl.where(a > 0.0, 1.0, 0.0).to(v.dtype), v, UPCAST, PRECISION, u)
    return acc, u


@triton.jit
def _causal_one_pass_tiles(q, acc, m_i, l_i, K, V, stride_kt, stride_vt, band, diagonal, lo, hi, Tk, scale_log2,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr, BIAS: tl.constexpr,
                           DIAGONAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                           BT=None, stride_kb=0, stride_vb=0, PAGE_SIZE: tl.constexpr = 0):
    """The one pass of a head with tau >= 0 over key tiles [lo, hi): the running max and sum of pass 1 (the same
    bits) and `acc += p~ @ V` rescaled as the max grows (FlashAttention-2's online softmax)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = _load_keys(K, stride_kt, keys, offs_d, Tk, D, BLOCK_D, DIAGONAL, BT, stride_kb, PAGE_SIZE)
        v = _load_keys(V, stride_vt, keys, offs_d, Tk, D, BLOCK_D, DIAGONAL, BT, stride_vb, PAGE_SIZE)
        s = _causal_scores(q, k, band, start_n, diagonal, scale_log2, BIAS, False, UPCAST, PRECISION)  # [BM, BN]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        acc = _dot(p.to(v.dtype), v, UPCAST, PRECISION, acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def _causal_one_pass(q, K, V, stride_kt, stride_vt, band, diagonal, far, full, hi, Tk, scale_log2,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     BT=None, stride_kb=0, stride_vb=0, PAGE_SIZE: tl.constexpr = 0):
    """`causal_passes` for a head with tau >= 0, in one pass: there the ReLU never cuts (p + tau/n >= 0), so
    `O_i = sum_j p_ij v_j + (tau/n_i) U_i` with U_i the sum of the visible values, which the caller adds (from
    running sums of V): the weights need no normaliser before they are used. Returns `(sum_j p_ij v_j, alive,
    lse2)`."""
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = _causal_one_pass_tiles(q, acc, m_i, l_i, K, V, stride_kt, stride_vt, band, diagonal, 0, far, Tk,
                                           scale_log2, BLOCK_N, BLOCK_D, D, False, False, UPCAST, PRECISION, BT,
                                           stride_kb, stride_vb, PAGE_SIZE)
    acc, m_i, l_i = _causal_one_pass_tiles(q, acc, m_i, l_i, K, V, stride_kt, stride_vt, band, diagonal, far, full,
                                           Tk, scale_log2, BLOCK_N, BLOCK_D, D, True, False, UPCAST, PRECISION, BT,
                                           stride_kb, stride_vb, PAGE_SIZE)
    acc, m_i, l_i = _causal_one_pass_tiles(q, acc, m_i, l_i, K, V, stride_kt, stride_vt, band, diagonal, full, hi,
                                           Tk, scale_log2, BLOCK_N, BLOCK_D, D, True, True, UPCAST, PRECISION, BT,
                                           stride_kb, stride_vb, PAGE_SIZE)
    alive = l_i > 0.0
    lse2 = tl.where(alive, m_i + tl.log2(tl.where(alive, l_i, 1.0)), float("inf"))
    inv_l = tl.where(alive, 1.0 / tl.where(alive, l_i, 1.0), 0.0)
    return acc * inv_l[:, None], alive, lse2


@triton.jit
def _finite_band(BIAS_h, W):
    """Whether the W distances' bias values from BIAS_h are all finite."""
    offs = tl.arange(0, 1024)
    infinite = 0
    for d0 in range(0, W, 1024):
        values = tl.load(BIAS_h + d0 + offs, mask=d0 + offs < W, other=0.0)
        infinite += tl.sum((values == float("-inf")).to(tl.int32), 0)
    return infinite == 0


@triton.jit
def _one_pass_head(TAU_h, BIAS_h, W, STORE_U: tl.constexpr):
    """Whether a head runs `causal_passes` in one pass: at tau = 0; in training (`STORE_U`, where U_i is then the
    sum of every visible value) at tau > 0, and at tau = 0 where none of its W bias values from BIAS_h is -inf (a
    key of -inf bias has no share of U at tau = 0: such a head's U is a product per tile, in two passes)."""
    tau = tl.load(TAU_h)
    if STORE_U:
        one_pass = tau > 0.0
        if tau == 0.0:
            one_pass = _finite_band(BIAS_h, W)
    else:
        one_pass = tau == 0.0
    return one_pass


@triton.jit
def causal_passes(q, q_pos, K, V, stride_kt, stride_vt, band_h, TAU_h, m0, Tq, Tk, W, scale_log2,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BT=None, stride_kb=0, stride_vb=0, PAGE_SIZE: tl.constexpr = 0, STORE_U: tl.constexpr = False,
                   VSUM=None, stride_st=0, PASSES: tl.constexpr = 0, BLOCK_N1: tl.constexpr = 0):
    """The causal fast path for the query rows [m0, m0 + BM) of one head (row i at key index i + Tk - Tq,
    n = q_pos + 1): two passes (the row log-sum-exp, then `ReLU(p + tau/n) @ V`), or one (`_causal_one_pass`: no
    weight is cut): at tau = 0 without `STORE_U`; with it at tau > 0, and at tau = 0 where the head's bias has no
    -inf (`_finite_band`): there U_i is the sum of every visible value, row i + Tk - Tq of
    VSUM (`[Tk, D]` float32, row stride `stride_st`: VSUM[j] = v_0 + ... + v_j, `_lazy_value_sums_kernel`). Each
    pass runs three loops (beyond the window / inside it / at the causal limit). `PASSES` 1 or 2: build only the
    one pass or only the two (the caller runs only heads that take them: `_one_pass_head`), 0: both.
    `band_h`: the head's band row in log2 units (every pass adds it after scaling), from BM + max(BN, BLOCK_N1)
    entries before distance 0; `TAU_h`: the head's tau. `BLOCK_N1` > BN: pass 1's key tiles (`_pass1_block_n`: it
    holds no accumulator, so it can take wider tiles than pass 2 where U's accumulator takes registers).
    PAGE_SIZE > 0: K and V are a paged cache (`_load_keys`). Returns `(acc [BM, BLOCK_D] float32, u, alive [BM],
    lse2 [BM])`; `u = sum_j m_ij v_j` (float32) with `STORE_U`, zeros otherwise."""
    BN1: tl.constexpr = max(BLOCK_N, BLOCK_N1)  # pass 1's key tile
    offs_m = tl.arange(0, BLOCK_M)
    rows = m0 + offs_m
    far, full, hi = _causal_key_ranges(m0, Tq, Tk, W, BLOCK_M, BLOCK_N)
    band = band_h + (BLOCK_M + BN1) + m0 + Tk - Tq  # band of distance m0 + offset - start_n
    diagonal = offs_m[:, None] - tl.arange(0, BLOCK_N)[None, :]  # [BM, BN] row - column

    q_key_idx = rows + Tk - Tq
    tau = tl.load(TAU_h)
    if PASSES == 1:
        one_pass = True
    elif PASSES == 2:
        one_pass = False
    else:
        one_pass = _one_pass_head(TAU_h, band_h + BLOCK_M + BN1, W, STORE_U)
    if one_pass:  # no ReLU cut: `_causal_one_pass`
        acc, alive, lse2 = _causal_one_pass(q, K, V, stride_kt, stride_vt, band, diagonal, far, full, hi, Tk,
                                            scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, D, UPCAST, PRECISION, BT,
                                            stride_kb, stride_vb, PAGE_SIZE)
        u = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if STORE_U:  # U_i = VSUM[i + Tk - Tq]; a dead row gets no weight and no U
            offs_d = tl.arange(0, BLOCK_D)
            ok = (alive & (q_key_idx < Tk))[:, None] & (offs_d[None, :] < D)
            u = tl.load(VSUM + q_key_idx[:, None] * stride_st + offs_d[None, :], mask=ok, other=0.0)
            acc += tl.where(alive, tau / (q_pos + 1).to(tl.float32), 0.0)[:, None] * u
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a tile of -inf scores keeps exp2() at 0, never NaN
        l_i = tl.zeros([BLOCK_M], tl.float32)
        far1, full1, _ = _causal_key_ranges(m0, Tq, Tk, W, BLOCK_M, BN1)
        diagonal1 = offs_m[:, None] - tl.arange(0, BN1)[None, :]
        m_i, l_i = _causal_lse_tiles(q, m_i, l_i, K, stride_kt, band, diagonal1, 0, far1, Tk, scale_log2, BN1,
                                     BLOCK_D, D, False, False, UPCAST, PRECISION, BT, stride_kb, PAGE_SIZE)
        m_i, l_i = _causal_lse_tiles(q, m_i, l_i, K, stride_kt, band, diagonal1, far1, full1, Tk, scale_log2, BN1,
                                     BLOCK_D, D, True, False, UPCAST, PRECISION, BT, stride_kb, PAGE_SIZE)
        m_i, l_i = _causal_lse_tiles(q, m_i, l_i, K, stride_kt, band, diagonal1, full1, hi, Tk, scale_log2, BN1,
                                     BLOCK_D, D, True, True, UPCAST, PRECISION, BT, stride_kb, PAGE_SIZE)
        # a row whose scores are all -inf has no normaliser: p = 0 on every key and no weight (threshold 0 here; the
        # stored LSE is DEAD_ROW_LSE, which both backwards recognise)
        alive = l_i > 0.0
        lse2 = tl.where(alive, m_i + tl.log2(tl.where(alive, l_i, 1.0)), float("inf"))
        threshold = tl.where(alive, tau / (q_pos + 1).to(tl.float32), 0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        acc, u = _causal_out_tiles(q, acc, u, K, V, stride_kt, stride_vt, band, diagonal, q_key_idx, lse2,
                                   threshold, 0, far, Tk, scale_log2, BLOCK_N, BLOCK_D, D, False, False, UPCAST,
                                   PRECISION, BT, stride_kb, stride_vb, PAGE_SIZE, STORE_U)
        acc, u = _causal_out_tiles(q, acc, u, K, V, stride_kt, stride_vt, band, diagonal, q_key_idx, lse2,
                                   threshold, far, full, Tk, scale_log2, BLOCK_N, BLOCK_D, D, True, False, UPCAST,
                                   PRECISION, BT, stride_kb, stride_vb, PAGE_SIZE, STORE_U)
        acc, u = _causal_out_tiles(q, acc, u, K, V, stride_kt, stride_vt, band, diagonal, q_key_idx, lse2,
                                   threshold, full, hi, Tk, scale_log2, BLOCK_N, BLOCK_D, D, True, True, UPCAST,
                                   PRECISION, BT, stride_kb, stride_vb, PAGE_SIZE, STORE_U)
    return acc, u, alive, lse2


@triton.jit
def _lazy_value_sums_kernel(V, TAU, DOCS, VSUM, stride_vb, stride_vh, stride_vt, stride_sb, stride_sh, stride_st,
                            Tk, GROUPS, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                            DOCUMENTS: tl.constexpr = False):
    """The running sums of V along the keys, `VSUM[b, hk, j] = v_0 + ... + v_j` (float32), from which the training
    forward's heads of one pass take U (`causal_passes`). Program (r, hk): batch row r, or with `DOCUMENTS` DOCS
    row r (`_lazy_causal_fwd_kernel`; the sums restart at each document, a run of padding gets none), for key head
    hk. A key head whose query heads all have tau < 0 (two passes, U a product per tile) returns at once."""
    hk = tl.program_id(1)
    one_pass = 0
    for g in range(0, GROUPS):
        one_pass += (tl.load(TAU + hk * GROUPS + g) >= 0.0).to(tl.int32)
    if one_pass == 0:
        return
    if DOCUMENTS:
        b = tl.load(DOCS + 3 * tl.program_id(0)).to(tl.int64)
        start = tl.load(DOCS + 3 * tl.program_id(0) + 1).to(tl.int64)
        length = tl.load(DOCS + 3 * tl.program_id(0) + 2)  # < 0: padding
    else:
        b = tl.program_id(0).to(tl.int64)
        start = 0
        length = Tk
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    v_ptr = V + b * stride_vb + hk.to(tl.int64) * stride_vh + start * stride_vt + offs_d[None, :]
    s_ptr = VSUM + b * stride_sb + hk.to(tl.int64) * stride_sh + start * stride_st + offs_d[None, :]
    carry = tl.zeros([BLOCK_D], tl.float32)
    for t0 in range(0, length, BLOCK_M):
        rows = t0 + offs_m
        mask = (rows < length)[:, None] & (offs_d[None, :] < D)
        v = tl.load(v_ptr + rows[:, None] * stride_vt, mask=mask, other=0.0).to(tl.float32)
        tl.store(s_ptr + rows[:, None] * stride_st, tl.cumsum(v, 0) + carry[None, :], mask=mask)
        carry += tl.sum(v, 0)


@triton.jit
def _lazy_causal_fwd_kernel(Q, K, V, TAU, BAND, QPOS, OUT, LSE, U, DOCS, TILES, VSUM, KEYS,
                            stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                            stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                            stride_sb, stride_sh, stride_st,
                            Hq, Tq, Tk, W, GROUPS, BAND_LEN, scale_log2,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                            UPCAST: tl.constexpr, PRECISION: tl.constexpr, STORE_U: tl.constexpr,
                            DOCUMENTS: tl.constexpr = False, PASSES: tl.constexpr = 0,
                            KEY_START: tl.constexpr = False, BLOCK_N1: tl.constexpr = 0):
    """Causal fast path, one query tile of one query head: `causal_passes`. Grid: (cdiv(Tq, BM), B * Hq). LSE in
    log2 units. `STORE_U` (training): also U_i = sum_j m_ij v_j into U (OUT's dtype, shape and strides), from
    which `_lazy_causal_bwd_delta_kernel` gets Delta and d tau without another pass over the keys; a head that runs
    one pass (no weight is cut, m = 1 on every visible key: `causal_passes`) takes it from VSUM `[B, Hk, Tk, D]`
    float32, the running sums of V along each document's keys (`_lazy_value_sums_kernel`), instead of a product per
    key tile. `PASSES` 1 (2): only the heads of one pass (of two passes) run, the other programs return at once: the
    training launcher runs both builds, each with blocks of its own, so neither holds the other's registers.
    `BLOCK_N1`: pass 1's key tiles where wider than BN (`causal_passes`); BAND from BM + max(BN, BLOCK_N1) entries
    before distance 0.

    `DOCUMENTS`: the rows hold documents (packed, or between padding), each a causal layout of its own at
    positions 0 .. length - 1 (Tq = Tk = the row length): DOCS `[R, 3]` int32 (batch row, first token, length),
    TILES the work list (`_varlen_tiles`: document, first row; -1 for a spare program); program (t, h) runs tile t
    of query head h, grid (len(TILES), Hq). A run of padding is a DOCS row of negative length (`document_table`):
    its tiles write out 0, u 0 and the dead-row LSE, reading nothing, so the launcher fills nothing first.
    `KEY_START` (with `DOCUMENTS`, inference): a document's keys are not its queries' rows but KEYS `[R, 2]` int32
    (first key, key count) of the same batch row, its queries the last of them (cached keys before: a left-padded
    batch's prefill after a cache, each row one document from its first real key)."""
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor passes Python floats as float64
    padding = False
    if DOCUMENTS:
        h = tl.program_id(1)
        doc = tl.load(TILES + 2 * tl.program_id(0))
        m0 = tl.load(TILES + 2 * tl.program_id(0) + 1)
        row = tl.maximum(doc, 0) * 3
        b = tl.load(DOCS + row).to(tl.int64)
        start = tl.load(DOCS + row + 1).to(tl.int64)
        length = tl.where(doc >= 0, tl.load(DOCS + row + 2), 0)
        padding = length < 0
        q_len = tl.abs(length)
        k_len = q_len
        k_start = start
        if KEY_START:
            k_start = tl.load(KEYS + 2 * tl.maximum(doc, 0)).to(tl.int64)
            k_len = tl.load(KEYS + 2 * tl.maximum(doc, 0) + 1)
    else:
        pid_bh = tl.program_id(1)
        b = (pid_bh // Hq).to(tl.int64)
        h = pid_bh % Hq
        m0 = tl.program_id(0) * BLOCK_M
        start = 0
        k_start = 0
        q_len = Tq
        k_len = Tk
    hk = (h // GROUPS).to(tl.int64)
    bh = b * Hq + h
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    if PASSES != 0:  # the heads of the other build return; the padding's tiles are the PASSES == 2 build's
        one_pass = _one_pass_head(TAU + h, BAND + h * BAND_LEN + BLOCK_M + max(BLOCK_N, BLOCK_N1), W, STORE_U)
        if PASSES == 1:
            if padding or not one_pass:
                return
        elif one_pass and not padding:
            return
    if padding:  # (a branch that returns: the document tiles' code is compiled as without it)
        out_offs = b * stride_ob + h.to(tl.int64) * stride_oh + (start + rows)[:, None] * stride_ot + offs_d[None, :]
        out_mask = row_mask[:, None] & (offs_d[None, :] < D)
        zeros = tl.zeros([BLOCK_M, BLOCK_D], OUT.dtype.element_ty)
        tl.store(OUT + out_offs, zeros, mask=out_mask)
        if STORE_U:
            tl.store(U + out_offs, zeros, mask=out_mask)
        tl.store(LSE + bh.to(tl.int64) * Tq + start + rows, tl.full([BLOCK_M], _DEAD_ROW_LSE, tl.float32),
                 mask=row_mask)
        return
    q = _load_rows(Q + b * stride_qb + h.to(tl.int64) * stride_qh + start * stride_qt, stride_qt, rows, offs_d, q_len,
                   D)
    q_pos = tl.load(QPOS + b * Tq + start + rows, mask=row_mask, other=0)
    acc, u, alive, lse2 = causal_passes(q, q_pos, K + b * stride_kb + hk * stride_kh + k_start * stride_kt,
                                        V + b * stride_vb + hk * stride_vh + k_start * stride_vt, stride_kt, stride_vt,
                                        BAND + h * BAND_LEN, TAU + h, m0, q_len, k_len, W, scale_log2, BLOCK_M,
                                        BLOCK_N, BLOCK_D, D, UPCAST, PRECISION, STORE_U=STORE_U,
                                        VSUM=VSUM + b * stride_sb + hk * stride_sh +
                                        k_start * stride_st, stride_st=stride_st, PASSES=PASSES,
                                        BLOCK_N1=BLOCK_N1)
    out_offs = b * stride_ob + h.to(tl.int64) * stride_oh + (start + rows)[:, None] * stride_ot + offs_d[None, :]
    out_mask = row_mask[:, None] & (offs_d[None, :] < D)
    tl.store(OUT + out_offs, acc.to(OUT.dtype.element_ty), mask=out_mask)
    if STORE_U:
        tl.store(U + out_offs, u.to(U.dtype.element_ty), mask=out_mask)
    # in log2 units, as the causal backward reads it: a round trip through ln would move a row that sits exactly on
    # the ReLU's kink (a one-key row at tau = -1: p = 1, p + tau / n = 0) to the other side in the backward
    tl.store(LSE + bh.to(tl.int64) * Tq + start + rows, tl.where(alive, lse2, _DEAD_ROW_LSE), mask=row_mask)


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


def _forward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling,
             num_splits=None) -> ForwardResult:
    """Launch the general forward (any layout; the key offset is `Tk - Tq`). Returns `ForwardResult(out
    [B, Tq, Hq, D], lse [B, Hq, Tq] float32, None)`. Which launcher serves a call (this one, `_causal_forward`,
    `_packed_decode`) is the op layer's decision table (`lazy_attention_ops.choose_kernel`).

    `num_splits` (None: automatic) > 1 runs the split-K kernels (only used for query length <= 16).
    """
    block_d = _check_inputs(query, key)
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len, window = key.shape[1], key.shape[2], distance_bias.shape[-1]
    query, key, value = (_last_dim_contiguous(x) for x in (query, key, value))
    decode = q_len <= DECODE_MAX_ROWS
    block_m, block_n, num_warps, num_stages = _launch_config("decode" if decode else "fwd", block_d, query.device)
    q_tiles = triton.cdiv(q_len, block_m)
    if num_splits is None:
        num_splits = _device_splits(bsz * num_heads, q_tiles, k_len, query.device) if decode else 1
    out = torch.empty(bsz, q_len, num_heads, dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(bsz, num_heads, q_len, dtype=torch.float32, device=query.device)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, D=dim, UPCAST=_INTERPRET,
                PRECISION=_DOT_PRECISION[query.dtype], num_warps=num_warps, num_stages=num_stages)
    tau = tau.detach().to(torch.float32).contiguous()
    bias = distance_bias.detach().to(torch.float32).contiguous()
    positions = dict(QPOS=q_pos, KPOS=k_pos, QSEG=q_seg, KSEG=k_seg)
    q_strides, k_strides, v_strides = _strides("q", query), _strides("k", key), _strides("v", value)
    sizes = dict(Hq=num_heads, Tq=q_len, Tk=k_len, W=window, GROUPS=num_heads // kv_heads)
    if num_splits <= 1:
        wrap_triton(_lazy_fwd_kernel)[(q_tiles, bsz * num_heads)](
            Q=query, K=key, V=value, TAU=tau, BIAS=bias, **positions, OUT=out, LSE=lse,
            **q_strides, **k_strides, **v_strides, **_strides("o", out, h=2, t=1), **sizes, scaling=scaling, **meta)
        return ForwardResult(out, lse)
    keys_per_split = triton.cdiv(triton.cdiv(k_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(k_len, keys_per_split)
    grid = (q_tiles, bsz * num_heads, num_splits)
    m_part = torch.empty(num_splits, bsz * num_heads, q_len, dtype=torch.float32, device=query.device)
    l_part = torch.empty_like(m_part)
    wrap_triton(_lazy_fwd_split_lse_kernel)[grid](
        Q=query, K=key, BIAS=bias, **positions, M_PART=m_part, L_PART=l_part, **q_strides, **k_strides,
        **sizes, KEYS_PER_SPLIT=keys_per_split, scaling=scaling, **meta)
    m_max = m_part.max(0).values
    l_sum = (l_part * torch.exp(m_part - m_max)).sum(0)
    lse = torch.where(l_sum > 0, m_max + torch.log(l_sum), DEAD_ROW_LSE).view(bsz, num_heads, q_len)
    o_part = torch.empty(num_splits, bsz, q_len, num_heads, dim, dtype=torch.float32, device=query.device)
    wrap_triton(_lazy_fwd_split_out_kernel)[grid](
        Q=query, K=key, V=value, TAU=tau, BIAS=bias, **positions, LSE=lse, O_PART=o_part,
        **q_strides, **k_strides, **v_strides, **sizes, KEYS_PER_SPLIT=keys_per_split, scaling=scaling, **meta)
    return ForwardResult(o_part.sum(0).to(query.dtype), lse)


def _causal_forward(query, key, value, tau, distance_bias, q_pos, scaling, block_d, store_u=False,
                    documents=None, work_lists=None, document_keys=None) -> ForwardResult:
    """The causal fast-path forward: `ForwardResult(out [B, Tq, Hq, D], lse [B, Hq, Tq] float32 in log2 units (what
    `_causal_backward` reads), u)`; `store_u` (training): u is `U_i = sum_j m_ij v_j`, `[B, Tq, Hq, D]`, for
    `_causal_backward`, stored as `out` is (the query dtype: `(tau / n) U` is a term of O); otherwise None. Training
    launches three kernels: the running sums of V, then the heads of one pass and the heads of two passes, each build
    with its own blocks (`causal_passes`); inference one.

    `documents` (`[R, 3]` int32: batch row, first token, length; `document_table` of lazy_attention_torch): the
    rows hold documents, each its own causal layout at positions 0 .. length - 1 (packed documents, padded rows; Tq
    = Tk); the table's runs of padding (negative lengths) get out 0, u 0 and the dead-row LSE from the kernel, which
    so writes every token. `document_keys` (`[R, 2]` int32: first key, key count; inference): each document's keys,
    of which its queries are the last (`left_padded_documents`: a left-padded batch after a cache)."""
    if document_keys is not None and (documents is None or store_u):
        raise ValueError("document_keys needs documents and inference (store_u=False)")
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    # training runs the heads of one pass and those of two passes as two launches of their own builds and blocks
    builds = [("causal_fwd_u1", 1), ("causal_fwd_u", 2)] if store_u else [("causal_fwd", 0)]
    configs = [(_launch_config(kind, block_d, query.device), _launch_pass1_block_n(kind, block_d, query.device),
                passes) for kind, passes in builds]
    band, pad = _causal_band(distance_bias, scaling, block_d, query.device)  # kept with distance_bias
    out = torch.empty(bsz, q_len, num_heads, dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(bsz, num_heads, q_len, dtype=torch.float32, device=query.device)
    u = torch.empty_like(out) if store_u else None
    tau_f32 = tau.detach().to(torch.float32).contiguous()
    vsum = lse.view(bsz, num_heads, q_len, 1)
    if store_u:  # the running sums of V, from which the heads of one pass take U (`causal_passes`)
        vsum = torch.empty(bsz, kv_heads, k_len, dim, dtype=torch.float32, device=query.device)
        block_t, _, sum_warps, sum_stages = _launch_config("value_sums", block_d, query.device)
        wrap_triton(_lazy_value_sums_kernel)[(bsz if documents is None else documents.shape[0], kv_heads)](
            V=value, TAU=tau_f32, DOCS=lse if documents is None else documents, VSUM=vsum, **_strides("v", value),
            **_strides("s", vsum), Tk=k_len, GROUPS=num_heads // kv_heads, BLOCK_M=block_t, BLOCK_D=block_d, D=dim,
            DOCUMENTS=documents is not None, num_warps=sum_warps, num_stages=sum_stages)
    work_lists = {} if work_lists is None else work_lists  # the two builds of training share one when their BM agree
    for (block_m, block_n, num_warps, num_stages), block_n1, passes in configs:
        if documents is None:
            tiles, grid = lse, (triton.cdiv(q_len, block_m), bsz * num_heads)
        else:
            name = ("forward", block_m, bsz * q_len)  # every run, padding included: the forward writes every token
            if name not in work_lists:
                work_lists[name] = _varlen_tiles(documents[:, 2].abs(), bsz * q_len, block_m)
            tiles = work_lists[name]
            grid = (tiles.shape[0], num_heads)
        wrap_triton(_lazy_causal_fwd_kernel)[grid](
            Q=query, K=key, V=value, TAU=tau_f32, BAND=_band_from(band, pad, block_m, block_n1), QPOS=q_pos,
            OUT=out, LSE=lse, U=u if store_u else lse, DOCS=lse if documents is None else documents, TILES=tiles,
            VSUM=vsum, KEYS=lse if document_keys is None else document_keys, STORE_U=store_u,
            DOCUMENTS=documents is not None, PASSES=passes, KEY_START=document_keys is not None,
            **_strides("q", query), **_strides("k", key), **_strides("v", value), **_strides("o", out, h=2, t=1),
            **_strides("s", vsum),
            Hq=num_heads, Tq=q_len, Tk=k_len, W=distance_bias.shape[-1], GROUPS=num_heads // kv_heads,
            BAND_LEN=band.stride(1), scale_log2=scaling * LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_N1=block_n1, BLOCK_D=block_d, D=dim, UPCAST=_INTERPRET,
            PRECISION=_DOT_PRECISION[query.dtype], num_warps=num_warps, num_stages=num_stages)
    return ForwardResult(out, lse, u)
