"""Lazy Attention Triton backward kernels and their launchers `_backward` (general) and `_causal_backward`.

Math (docs/design.md): m_ij = 1[a_ij > 0], dP_ij = dO_i . v_j, Delta_i = sum_j m_ij p_ij dP_ij,
dS_ij = p_ij (m_ij dP_ij - Delta_i); dq, dk from dS, dv from a, d tau and d distance_bias from float32 partials.

    _lazy_bwd_delta_kernel     general backward preprocess: Delta (float32) and per-tile d tau partials
    _lazy_bwd_dq_kernel        dq, FlashAttention-2 style with the elastic-softmax dS
    _lazy_bwd_dkdv_kernel      dk, dv (GQA: loops over the query heads of one KV head, never repeats K/V)
                               and per-tile d distance_bias partials
    _lazy_causal_bwd_delta_kernel / _lazy_causal_bwd_dq_kernel / _lazy_causal_bwd_dkdv_kernel
                               the causal fast path's backward (after `_causal_forward` with `store_u`): Delta and
                               d tau from the forward's U, d distance_bias along the diagonals of each dS tile
    _backward                  launches the general kernels, or (`causal`, > 16 query rows) `_causal_backward`

Block skipping (general backward): a key tile whose weights are all zero for the query tile reads no V and skips
its dP = dO V^T and dv products (dS = -p * Delta there, so dq and dk stay dense: the softmax normaliser couples
them). The forward kernels: lazy_attention_triton_forward.py; shared helpers: lazy_attention_triton_common.py.
"""

import torch
from torch.library import wrap_triton  # a launch torch.compile / make_fx can trace (plain launch in eager)

from .lazy_attention_triton_common import (
    _DEAD_ROW_LSE,
    _DOT_PRECISION,
    _INTERPRET,
    DECODE_MAX_ROWS,
    LOG2E,
    BackwardResult,
    _band_from,
    _causal_band,
    _causal_key_ranges,
    _causal_scores,
    _check_inputs,
    _dot,
    _last_dim_contiguous,
    _launch_config,
    _load_keys,
    _load_rows,
    _recomputed_weight,
    _row_threshold,
    _scores,
    _strides,
    _varlen_tiles,
    _visible,
    tl,
    triton,
)

# ---------------------------------------------------------------------------------------------------
# General backward (per-key metadata, block skipping)
# ---------------------------------------------------------------------------------------------------


# Index helpers take no tensor (see `_query_tile_ids` in lazy_attention_triton_forward.py: torch.compile's mutation
# analysis counts every tensor a call takes as written when a store address depends on that call's results).
@triton.jit
def _bwd_query_ids(Hq, Tq, Tk, GROUPS, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Prologue shared by the Delta and dq kernels: which query tile of which query head, and the end of its keys.
    Grid: (cdiv(Tq, BM), B*Hq)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    hk = h // GROUPS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = rows < Tq
    hi = tl.minimum(Tk, (pid_m + 1) * BLOCK_M + Tk - Tq)  # keys past the tile's last row are never visible
    return pid_m, pid_bh, b, h, hk, rows, offs_d, row_mask, hi


@triton.jit
def _bwd_query_loads(Q, DO, TAU, QPOS, QSEG, LSE, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh,
                     stride_dot, pid_bh, b, h, rows, offs_d, row_mask, Tq, D: tl.constexpr):
    """The tile's queries, output gradients, positions, segments, log-sum-exp, 1 / n and ReLU threshold."""
    q = _load_rows(Q + b * stride_qb + h * stride_qh, stride_qt, rows, offs_d, Tq, D)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, stride_dot, rows, offs_d, Tq, D)
    q_pos = tl.load(QPOS + b * Tq + rows, mask=row_mask, other=0)
    q_seg = tl.load(QSEG + b * Tq + rows, mask=row_mask, other=-4)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * Tq + rows, mask=row_mask, other=_DEAD_ROW_LSE)
    inv_n = 1.0 / (q_pos + 1).to(tl.float32)
    threshold = _row_threshold(tl.load(TAU + h), q_pos, lse)
    return q, do, q_pos, q_seg, lse, inv_n, threshold


@triton.jit
def _lazy_bwd_delta_kernel(Q, K, V, TAU, BIAS, QPOS, KPOS, QSEG, KSEG, LSE, DO, DELTA, DTAU_PART,
                           stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                           stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                           Hq, Tq, Tk, W, GROUPS, scaling,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                           UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Backward preprocess: the elastic-softmax Delta_i = sum_j m_ij p_ij dP_ij (NOT rowsum(dO * O)).

    Also writes this tile's d tau partial, sum_i (1/n_i) sum_j m_ij dP_ij, to DTAU_PART [B * Hq, q tiles].
    Only row sums live across the loop, so this sweep is light; all-dead key tiles read no V.
    """
    scaling = tl.cast(scaling, tl.float32)  # Inductor passes Python floats as float64
    pid_m, pid_bh, b, h, hk, rows, offs_d, row_mask, hi = _bwd_query_ids(Hq, Tq, Tk, GROUPS, BLOCK_M, BLOCK_D)
    q, do, q_pos, q_seg, lse, inv_n, threshold = _bwd_query_loads(
        Q, DO, TAU, QPOS, QSEG, LSE, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot, pid_bh, b,
        h, rows, offs_d, row_mask, Tq, D)
    K_ = K + b * stride_kb + hk * stride_kh
    V_ = V + b * stride_vb + hk * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    delta = tl.zeros([BLOCK_M], tl.float32)  # sum_j m p dP
    m_dp_sum = tl.zeros([BLOCK_M], tl.float32)  # sum_j m dP
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + offs_n
        visible = _visible(q_seg, rows + Tk - Tq, KSEG + b * Tk, keys, Tk)
        if tl.max(visible.to(tl.int32)) > 0:
            k = _load_rows(K_, stride_kt, keys, offs_d, Tk, D)
            s = _scores(q, k, KPOS + b * Tk, BIAS + h * W, q_pos, visible, keys, Tk, W, scaling, UPCAST, PRECISION)
            p = _recomputed_weight(s, lse[:, None])
            alive = visible & (p + threshold[:, None] > 0.0)
            if tl.max(alive.to(tl.int32)) > 0:  # all-dead tile: m dP = 0, no V read
                v = _load_rows(V_, stride_vt, keys, offs_d, Tk, D)
                dp = tl.where(alive, _dot(do, tl.trans(v), UPCAST, PRECISION), 0.0)
                m_dp_sum += tl.sum(dp, 1)
                delta += tl.sum(p * dp, 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * Tq + rows, delta, mask=row_mask)
    tl.store(DTAU_PART + pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m,
             tl.sum(tl.where(row_mask, m_dp_sum * inv_n, 0.0), 0))


@triton.jit
def _lazy_bwd_dq_kernel(Q, K, V, TAU, BIAS, QPOS, KPOS, QSEG, KSEG, LSE, DO, DELTA, DQ,
                        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                        stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                        Hq, Tq, Tk, W, GROUPS, scaling,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dq_i = scaling * sum_j dS_ij k_j with dS = p (m dP - Delta), as in FlashAttention-2.

    dq stays dense (an all-dead tile still has dS = -p * Delta), but such a tile reads no V and skips dO V^T.
    """
    scaling = tl.cast(scaling, tl.float32)  # Inductor passes Python floats as float64
    pid_m, pid_bh, b, h, hk, rows, offs_d, row_mask, hi = _bwd_query_ids(Hq, Tq, Tk, GROUPS, BLOCK_M, BLOCK_D)
    q, do, q_pos, q_seg, lse, inv_n, threshold = _bwd_query_loads(
        Q, DO, TAU, QPOS, QSEG, LSE, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot, pid_bh, b,
        h, rows, offs_d, row_mask, Tq, D)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * Tq + rows, mask=row_mask, other=0.0)
    K_ = K + b * stride_kb + hk * stride_kh
    V_ = V + b * stride_vb + hk * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + offs_n
        visible = _visible(q_seg, rows + Tk - Tq, KSEG + b * Tk, keys, Tk)
        if tl.max(visible.to(tl.int32)) > 0:
            k = _load_rows(K_, stride_kt, keys, offs_d, Tk, D)
            s = _scores(q, k, KPOS + b * Tk, BIAS + h * W, q_pos, visible, keys, Tk, W, scaling, UPCAST, PRECISION)
            p = _recomputed_weight(s, lse[:, None])
            alive = visible & (p + threshold[:, None] > 0.0)
            if tl.max(alive.to(tl.int32)) > 0:
                v = _load_rows(V_, stride_vt, keys, offs_d, Tk, D)
                dp = tl.where(alive, _dot(do, tl.trans(v), UPCAST, PRECISION), 0.0)
                ds = p * (dp - delta[:, None])
            else:
                ds = -p * delta[:, None]
            acc += _dot(ds.to(k.dtype), k, UPCAST, PRECISION)
    tl.store(DQ + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
             (acc * scaling).to(DQ.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < D))


@triton.jit
def _lazy_bwd_dkdv_kernel(Q, K, V, TAU, BIAS, QPOS, KPOS, QSEG, KSEG, LSE, DELTA, DO, DK, DV, DBIAS_PART,
                          stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                          stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                          Hq, Hkv, Tq, Tk, W, GROUPS, scaling,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                          UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dk, dv for one key tile of one KV head (sum over its GROUPS query heads); d distance_bias partials.

    Grid: (cdiv(Tk, BN), B * Hkv). The bias partial of (batch, query head, key tile) is a private float32
    row of DBIAS_PART [B * Hq * cdiv(Tk, BN), W], reduced by the launcher; several entries of one tile share
    a distance, so the scatter into that private row uses `atomic_add` (no other program touches it).
    """
    scaling = tl.cast(scaling, tl.float32)  # Inductor passes Python floats as float64
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = (pid_bkv // Hkv).to(tl.int64)
    hk = (pid_bkv % Hkv).to(tl.int64)
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_mask = keys < Tk
    kv_mask = k_mask[:, None] & (offs_d[None, :] < D)
    k = tl.load(K + b * stride_kb + hk * stride_kh + keys[:, None] * stride_kt + offs_d[None, :], mask=kv_mask,
                other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + keys[:, None] * stride_vt + offs_d[None, :], mask=kv_mask,
                other=0.0)
    k_pos = tl.load(KPOS + b * Tk + keys, mask=k_mask, other=0)
    k_seg = tl.load(KSEG + b * Tk + keys, mask=k_mask, other=-3)
    offset = Tk - Tq
    first_row = tl.maximum(pid_n * BLOCK_N - offset, 0)  # rows before it cannot see this tile (causal)
    start = (first_row // BLOCK_M) * BLOCK_M
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, GROUPS):
        h = hk * GROUPS + g
        bh = b * Hq + h
        threshold_h = tl.load(TAU + h)
        bias_row = BIAS + h * W
        dbias_row = DBIAS_PART + (bh * tl.num_programs(0) + pid_n) * W
        for start_m in range(start, Tq, BLOCK_M):
            rows = start_m + offs_m
            row_mask = rows < Tq
            q_seg = tl.load(QSEG + b * Tq + rows, mask=row_mask, other=-4)
            visible = (q_seg[:, None] == k_seg[None, :]) & (keys[None, :] <= (rows + offset)[:, None])
            if tl.max(visible.to(tl.int32)) > 0:
                tile_mask = row_mask[:, None] & (offs_d[None, :] < D)
                q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                            mask=tile_mask, other=0.0)
                q_pos = tl.load(QPOS + b * Tq + rows, mask=row_mask, other=0)
                lse = tl.load(LSE + bh * Tq + rows, mask=row_mask, other=_DEAD_ROW_LSE)
                delta = tl.load(DELTA + bh * Tq + rows, mask=row_mask, other=0.0)
                s = _dot(q, tl.trans(k), UPCAST, PRECISION) * scaling
                dist = q_pos[:, None] - k_pos[None, :]
                in_window = visible & (dist >= 0) & (dist < W)
                s += tl.load(bias_row + dist, mask=in_window, other=0.0)
                p = tl.where(visible, _recomputed_weight(s, lse[:, None]), 0.0)
                a = tl.where(visible, tl.maximum(p + _row_threshold(threshold_h, q_pos, lse)[:, None], 0.0),
                             0.0)
                do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dot + offs_d[None, :],
                             mask=tile_mask, other=0.0)
                if tl.max(a) > 0.0:
                    dp = _dot(do, tl.trans(v), UPCAST, PRECISION)
                    ds = p * (tl.where(a > 0.0, dp, 0.0) - delta[:, None])
                    dv += _dot(tl.trans(a.to(do.dtype)), do, UPCAST, PRECISION)
                else:  # every weight of the tile is zero: m = 0, so dS = -p * Delta and dv gets nothing
                    ds = -p * delta[:, None]
                dk += _dot(tl.trans(ds.to(q.dtype)), q, UPCAST, PRECISION)
                tl.atomic_add(dbias_row + dist, ds, mask=in_window, sem="relaxed")
    out_off = b * stride_kb + hk * stride_kh + keys[:, None] * stride_kt + offs_d[None, :]
    tl.store(DK + out_off, (dk * scaling).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * stride_vb + hk * stride_vh + keys[:, None] * stride_vt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


# ---------------------------------------------------------------------------------------------------
# Causal fast path, backward (the forward took `_lazy_causal_fwd_kernel`). Same key ranges, band and exp2 as the
# forward: p = exp2(s - LSE_i log2(e)) with the stored natural-unit LSE, loop bounds instead of visibility tests,
# no per-key metadata, unconditional (pipelined) loads. Dense: no tile skipping.
#     _lazy_causal_bwd_delta_kernel   Delta_i = dO_i . (O_i - t_i U_i) (= sum_j m p dP, t_i = tau_h / n_i) and the
#                                     d tau partials from the U the training forward stored; no key loop
#     _lazy_causal_bwd_dq_kernel      dq and the d distance_bias partials, per query tile
#     _lazy_causal_bwd_dkdv_kernel    dk, dv terms per key tile and query head (GQA: summed by the launcher) on
#                                     transposed tiles; query tiles at the causal limit, in the window, beyond it
# d distance_bias, in the dq kernel: a (query tile, key tile) pair holds only BM + BN - 1 distances,
# base + (r - c) (base = m0 + offset - n0). `_diagonal_sums` cuts the dS tile into square S x S blocks (S = 32, or BN
# if smaller) and shears each along its rows (entry (r, (r + c) mod S) to column c), so that each column of a block
# holds two diagonals, told apart by whether r + c wraps: the shear stays inside a warp's rows (one shuffle per
# score where a row's S columns sit one per lane) and a tile gives 2 BM BN / S float32 atomics into the query
# tile's private row instead of one per score. Key tiles beyond the window have no bias and no bias gradient.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _causal_bwd_tile(x, y, band, start, diagonal, lse2, threshold, scale_log2,
                     BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """`(p, t)` of one (query tile, key tile) pair from `x y^T`, `t = p + tau/n` (the weight before the ReLU; m = 1
    where t > 0, the float32 threshold test): `[BM, BN]` from (q, k) with `lse2`, `threshold` as `[BM, 1]`, or
    transposed, `[BN, BM]` from (k, q) with them as `[1, BM]`. A key no row may see (after the row, or a padded
    row's) has p = 0 exactly (the band's -inf, a dead row's log-sum-exp), so `dS = p (m dP - Delta)` is 0 there
    whatever m is: no visibility mask for dS, only for the weights `ReLU(t)` of tiles at the causal limit (with
    tau > 0 they would be tau/n there)."""
    s = _causal_scores(x, y, band, start, diagonal, scale_log2, BIAS, False, UPCAST, PRECISION)
    p = tl.exp2(s - lse2)
    return p, p + threshold


@triton.jit
def _diagonal_sums(t, ROWS: tl.constexpr, COLS: tl.constexpr, S: tl.constexpr):
    """`(near, far)` `[ROWS // S, COLS // S, S]` float32 sums of a `[ROWS, COLS]` tile along its diagonals, by
    square `S x S` blocks (a, e): near[a, e, c] of the block's entries with row - column = S (a - e) - c, far[a, e, c]
    of those with row - column = S (a - e) + S - c (rows and columns of the whole tile). Each block is sheared
    along its rows (entry (r, (r + c) mod S) to column c), which keeps every exchange inside a warp's rows, then
    summed down its columns."""
    blocks = tl.permute(tl.reshape(t, [ROWS // S, S, COLS // S, S]), [0, 2, 1, 3])
    r = tl.arange(0, S)[None, None, :, None]
    c = tl.arange(0, S)[None, None, None, :]
    sheared = tl.gather(blocks, tl.broadcast_to((r + c) % S, [ROWS // S, COLS // S, S, S]), 3)
    near = tl.sum(sheared * tl.where(r + c < S, 1.0, 0.0), 2)  # a 0 / 1 factor: FFMAs into the sum, not selects
    return near, tl.sum(sheared, 2) - near


@triton.jit
def _causal_bwd_query_tiles(q, do, lse2, threshold, delta, acc, K, V, stride_kt, stride_vt, band, diagonal,
                            dbias_row, base, lo, hi, Tk, W, scale_log2, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr, BIAS: tl.constexpr,
                            DIAGONAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Key tiles [lo, hi) of one query tile: acc += dS @ K and, with `BIAS`, the diagonal sums of dS into the
    private bias row at distances base - start_n + r (near) and that - BM (wrapped)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = _load_keys(K, stride_kt, keys, offs_d, Tk, D, BLOCK_D, DIAGONAL)
        v = _load_keys(V, stride_vt, keys, offs_d, Tk, D, BLOCK_D, DIAGONAL)
        p, t = _causal_bwd_tile(q, k, band, start_n, diagonal, lse2[:, None], threshold[:, None], scale_log2, BIAS,
                                UPCAST, PRECISION)
        m = tl.where(t > 0.0, 1.0, 0.0)  # float32 1 / 0 (one FSET; a boolean across the product costs more)
        ds = p * (m * _dot(do, tl.trans(v), UPCAST, PRECISION) - delta[:, None])
        acc = _dot(ds.to(k.dtype), k, UPCAST, PRECISION, acc)
        if BIAS:  # 2 BM BN / S atomics per tile, into the program's private row: relaxed (the default, acq_rel,
            # puts GPU-wide memory barriers beside each)
            S: tl.constexpr = min(BLOCK_N, 32)
            near, far = _diagonal_sums(ds, BLOCK_M, BLOCK_N, S)
            blocks = tl.arange(0, BLOCK_M // S)[:, None, None] - tl.arange(0, BLOCK_N // S)[None, :, None]
            dist = base - start_n + blocks * S - tl.arange(0, S)[None, None, :]
            tl.atomic_add(dbias_row + dist, near, mask=(dist >= 0) & (dist < W), sem="relaxed")
            tl.atomic_add(dbias_row + dist + S, far, mask=(dist + S >= 0) & (dist + S < W), sem="relaxed")
    return acc


@triton.jit
def _lazy_causal_bwd_delta_kernel(OUT, U, DO, TAU, QPOS, QSEG, LSE, DELTA, THR, LSE_ROWS, DTAU_PART, DQ, DK, DV,
                                  stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot, stride_qb,
                                  stride_qh, stride_qt, stride_dkb, stride_dkh, stride_dkt, Hq, Tq, T_ROWS,
                                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                                  DOCUMENTS: tl.constexpr = False):
    """Causal fast path's Delta from the forward's U (the U identity, docs/design.md): with t_i = tau_h / n_i,
    `Delta_i = dO_i . (O_i - t_i U_i)` (= sum_j m p dP) and the tile's d tau partial `sum_i dO_i . U_i / n_i`
    (= sum_i sum_j m dP / n_i). OUT, U, DO `[B, Tq, Hq, D]` (strides `stride_o*` for OUT and U). No pass over the
    keys. O and U are read as stored (the input dtype, as FlashAttention's rowsum(dO * O) reads O). Also
    each row's threshold THR `[B, Hq, T_ROWS]` (`_row_threshold`, the forward's: -1e30 for a dead row), which the
    dk/dv kernel reads instead of dividing in every tile, and a copy of LSE, LSE_ROWS `[B, Hq, T_ROWS]`: rows Tq ..
    T_ROWS - 1 (T_ROWS >= Tq) get a dead row's (-1e30, DEAD_ROW_LSE), so a tile past the end reads them unmasked.
    Grid (cdiv(T_ROWS, BM), B * Hq). `DOCUMENTS`: rows of no document
    (QSEG < 0: padding, whose O and U the forward wrote 0) read no O, U or dO (their Delta and d tau terms are 0),
    and get their gradients here: 0 into DQ (the query's strides, `stride_q*`), DK and DV (`[B, Hq, Tk = Tq, D]`,
    strides `stride_dk*`: the dk/dv kernel's outputs), which the dq and dk/dv kernels' work lists leave out."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = rows < Tq
    live = row_mask
    if DOCUMENTS:
        live = row_mask & (tl.load(QSEG + b * Tq + rows, mask=row_mask, other=-1) >= 0)
        padding = (row_mask & ~live)[:, None] & (offs_d[None, :] < D)
        tl.store(DQ + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                 tl.zeros([BLOCK_M, BLOCK_D], DQ.dtype.element_ty), mask=padding)
        kv = b * stride_dkb + h * stride_dkh + rows[:, None] * stride_dkt + offs_d[None, :]
        tl.store(DK + kv, tl.zeros([BLOCK_M, BLOCK_D], DK.dtype.element_ty), mask=padding)
        tl.store(DV + kv, tl.zeros([BLOCK_M, BLOCK_D], DV.dtype.element_ty), mask=padding)
    mask = live[:, None] & (offs_d[None, :] < D)
    offs = b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + offs_d[None, :]
    o = tl.load(OUT + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dot + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    # (a padding row of a documents layout may carry any position; its U is 0)
    q_pos = tl.maximum(tl.load(QPOS + b * Tq + rows, mask=row_mask, other=0), 0)
    inv_n = 1.0 / (q_pos + 1).to(tl.float32)
    tau_h = tl.load(TAU + h)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * Tq + rows, mask=row_mask, other=_DEAD_ROW_LSE)
    padded_rows = pid_bh.to(tl.int64) * T_ROWS + rows
    tl.store(THR + padded_rows, _row_threshold(tau_h, q_pos, lse), mask=rows < T_ROWS)
    tl.store(LSE_ROWS + padded_rows, lse, mask=rows < T_ROWS)
    do_u = tl.sum(do * u, 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * Tq + rows, tl.sum(do * o, 1) - tau_h * inv_n * do_u,
             mask=row_mask)
    tl.store(DTAU_PART + pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m, tl.sum(do_u * inv_n, 0))


@triton.jit
def _lazy_causal_bwd_dq_kernel(Q, K, V, TAU, BAND, QPOS, QSEG, LSE, DO, DELTA, DQ, DBIAS_PART, DOCS, TILES,
                               stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                               stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                               Hq, Tq, Tk, W, GROUPS, BAND_LEN, scale_log2, scaling,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                               DOCUMENTS: tl.constexpr = False):
    """Causal fast path of `_lazy_bwd_dq_kernel`: dq_i = scaling sum_j dS_ij k_j over the forward's three key
    ranges, and the query tile's d distance_bias partial, a private float32 row of DBIAS_PART
    [programs, W] (which no other program adds to). Grid (cdiv(Tq, BM), B * Hq), or with `DOCUMENTS` (see
    `_lazy_causal_fwd_kernel`) (len(TILES), Hq)."""
    # Inductor passes Python floats as float64
    scale_log2, scaling = tl.cast(scale_log2, tl.float32), tl.cast(scaling, tl.float32)
    tl.static_assert(BLOCK_N <= BLOCK_M)  # `_diagonal_sums`' square blocks tile the dS tile
    if DOCUMENTS:
        h = tl.program_id(1).to(tl.int64)
        doc = tl.load(TILES + 2 * tl.program_id(0))
        m0 = tl.load(TILES + 2 * tl.program_id(0) + 1)
        row = tl.maximum(doc, 0) * 3
        b = tl.load(DOCS + row).to(tl.int64)
        start = tl.load(DOCS + row + 1).to(tl.int64)
        length = tl.where(doc >= 0, tl.load(DOCS + row + 2), 0)
        q_len = length
        k_len = length
    else:
        pid_bh = tl.program_id(1)
        b = (pid_bh // Hq).to(tl.int64)
        h = (pid_bh % Hq).to(tl.int64)
        m0 = tl.program_id(0) * BLOCK_M
        start = 0
        q_len = Tq
        k_len = Tk
    hk = h // GROUPS
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    row_offs = (b * Hq + h) * Tq + start  # the (batch row, head) row of LSE and DELTA, at the document's start
    q_ = Q + b * stride_qb + h * stride_qh + start * stride_qt
    q = _load_rows(q_, stride_qt, rows, offs_d, q_len, D)
    do = _load_rows(DO + b * stride_dob + h * stride_doh + start * stride_dot, stride_dot, rows, offs_d, q_len, D)
    q_pos = tl.load(QPOS + b * Tq + start + rows, mask=row_mask, other=0)
    # the causal forward stores log2 units; a dead row's DEAD_ROW_LSE gives p = 0 (threshold -1e30)
    lse2 = tl.load(LSE + row_offs + rows, mask=row_mask, other=_DEAD_ROW_LSE)
    threshold = _row_threshold(tl.load(TAU + h), q_pos, lse2)
    far, full, hi = _causal_key_ranges(m0, q_len, k_len, W, BLOCK_M, BLOCK_N)
    K_ = K + b * stride_kb + hk * stride_kh + start * stride_kt
    V_ = V + b * stride_vb + hk * stride_vh + start * stride_vt
    band = BAND + h * BAND_LEN + (BLOCK_M + BLOCK_N) + m0 + k_len - q_len  # band of distance m0 + offset - start_n
    diagonal = tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_N)[None, :]
    delta = tl.load(DELTA + row_offs + rows, mask=row_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dbias_row = DBIAS_PART + (tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)) * W
    args = (K_, V_, stride_kt, stride_vt, band, diagonal, dbias_row, m0 + k_len - q_len)
    acc = _causal_bwd_query_tiles(q, do, lse2, threshold, delta, acc, *args, 0, far, k_len, W, scale_log2,
                                  BLOCK_M, BLOCK_N, BLOCK_D, D, False, False, UPCAST, PRECISION)
    acc = _causal_bwd_query_tiles(q, do, lse2, threshold, delta, acc, *args, far, full, k_len, W, scale_log2,
                                  BLOCK_M, BLOCK_N, BLOCK_D, D, True, False, UPCAST, PRECISION)
    acc = _causal_bwd_query_tiles(q, do, lse2, threshold, delta, acc, *args, full, hi, k_len, W, scale_log2,
                                  BLOCK_M, BLOCK_N, BLOCK_D, D, True, True, UPCAST, PRECISION)
    tl.store(DQ + b * stride_qb + h * stride_qh + (start + rows)[:, None] * stride_qt + offs_d[None, :],
             (acc * scaling).to(DQ.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < D))


@triton.jit
def _causal_dkdv_tiles(dk, dv, k, v, Q, DO, THR, LSE, DELTA, band, n0, lo, hi, Tq, offset, stride_qt,
                       stride_dot, scale_log2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       D: tl.constexpr, BIAS: tl.constexpr, DIAGONAL: tl.constexpr, UPCAST: tl.constexpr,
                       PRECISION: tl.constexpr, DOCUMENTS: tl.constexpr):
    """Query tiles [lo, hi) (step BM) of one key tile and one query head, on transposed `[BN, BM]` tiles:
    dk += dS^T Q, dv += a^T dO. No load is masked (a masked load costs a select per loaded value). Without
    `DOCUMENTS`, rows past Tq (last tile) read Q, dO and Delta from row Tq - 1 and the Delta kernel's padded rows of
    LSE and THR, whose dead-row values make p = 0 and m = 0. With `DOCUMENTS` the tiles end at the document's end
    (a document's rows are followed by the next document's), so only its first tile can start before it: rows < 0
    read row 0 and lie before every key of the document, where the band's -inf makes p = 0 (so dS = 0) and the
    causal test (that tile is at the causal limit) a = 0. The thresholds come from THR (the Delta kernel's): a
    division here would run per score element of the transposed tile."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    diagonal = offs_m[None, :] - tl.arange(0, BLOCK_N)[:, None]  # [BN, BM] row (query) - column (key)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        if DOCUMENTS:
            rows_in = tl.maximum(rows, 0)
            lse_rows = rows_in
        else:
            rows_in = tl.minimum(rows, Tq - 1)
            lse_rows = rows
        q = _load_keys(Q, stride_qt, rows_in, offs_d, Tq, D, BLOCK_D, False)
        do = _load_keys(DO, stride_dot, rows_in, offs_d, Tq, D, BLOCK_D, False)
        lse = tl.load(LSE + lse_rows)
        threshold = tl.load(THR + lse_rows)[None, :]
        p, t = _causal_bwd_tile(k, q, band + start_m, n0, diagonal, lse[None, :], threshold, scale_log2, BIAS,
                                UPCAST, PRECISION)
        a = tl.maximum(t, 0.0)
        # key <= row + offset: from the tile's diagonal offsets (fewer instructions) at D 64; from the keys and rows at
        # D 128, where the offsets' registers made the sm_80 build spill
        if DIAGONAL and BLOCK_D <= 64:
            a = tl.where(diagonal >= n0 - start_m - offset, a, 0.0)
        elif DIAGONAL:
            a = tl.where(n0 + tl.arange(0, BLOCK_N)[:, None] <= (rows + offset)[None, :], a, 0.0)
        dv = _dot(a.to(do.dtype), do, UPCAST, PRECISION, dv)
        # dS = p (m dP - Delta). A boolean m held across the dP product is packed into predicate bits and unpacked
        # again, per score element; instead m is a float32 1 / 0 (one FSET a score) where registers allow (D <= 64),
        # else p carries it as its sign (p = 0 gives dS = 0 either way)
        if BLOCK_D <= 64:
            m = tl.where(t > 0.0, 1.0, 0.0)
            ds = p * (m * _dot(v, tl.trans(do), UPCAST, PRECISION) - tl.load(DELTA + rows_in)[None, :])
        else:
            p_signed = tl.where(t > 0.0, p, -p)
            dp = _dot(v, tl.trans(do), UPCAST, PRECISION)
            ds = tl.abs(p_signed) * (tl.where(p_signed > 0.0, dp, 0.0) - tl.load(DELTA + rows_in)[None, :])
        dk = _dot(ds.to(q.dtype), q, UPCAST, PRECISION, dk)
    return dk, dv


@triton.jit
def _lazy_causal_bwd_dkdv_kernel(Q, K, V, BAND, LSE, DELTA, THR, DO, DK, DV, DOCS, TILES,
                                 stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                                 stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                                 stride_dkb, stride_dkh, stride_dkt, Hq, Tq, Tk, T_ROWS, W, GROUPS, BAND_LEN,
                                 scale_log2, scaling, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_D: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                                 DOCUMENTS: tl.constexpr = False):
    """Causal fast path of `_lazy_bwd_dkdv_kernel`: the dk, dv terms of one key tile from one query head (the bias
    gradient comes from the dq kernel). LSE and THR: the Delta kernel's `[B, Hq, T_ROWS]` rows (LSE_ROWS, THR).
    DK, DV `[B, Hq, Tk, D]` (strides `stride_dk*`): the gradients themselves without GQA, float32 per-query-head
    terms the launcher sums over each group with it (a loop over the group here would keep every loop's invariants
    live at once: spills). Grid: (cdiv(Tk, BN), B * Hq), or with `DOCUMENTS` (see `_lazy_causal_fwd_kernel`; TILES
    of BN-key tiles) (len(TILES), Hq)."""
    # Inductor passes Python floats as float64
    scale_log2, scaling = tl.cast(scale_log2, tl.float32), tl.cast(scaling, tl.float32)
    if DOCUMENTS:
        h = tl.program_id(1).to(tl.int64)
        doc = tl.load(TILES + 2 * tl.program_id(0))
        n0 = tl.load(TILES + 2 * tl.program_id(0) + 1)
        row = tl.maximum(doc, 0) * 3
        b = tl.load(DOCS + row).to(tl.int64)
        start = tl.load(DOCS + row + 1).to(tl.int64)
        length = tl.where(doc >= 0, tl.load(DOCS + row + 2), 0)
        q_len = length
        k_len = length
        # key and query tiles end at the document's end (see `_causal_dkdv_tiles`): the work list's tiles from
        # its start, moved back by the key tiles' overhang; `phase` the query tiles' (their starts are -phase
        # mod BM)
        n0 = n0 - (BLOCK_N - length % BLOCK_N) % BLOCK_N
        phase = (BLOCK_M - length % BLOCK_M) % BLOCK_M
    else:
        pid_bh = tl.program_id(1)
        b = (pid_bh // Hq).to(tl.int64)
        h = (pid_bh % Hq).to(tl.int64)
        n0 = tl.program_id(0) * BLOCK_N
        start = 0
        q_len = Tq
        k_len = Tk
        phase = 0
    hk = h // GROUPS
    offs_d = tl.arange(0, BLOCK_D)
    keys = n0 + tl.arange(0, BLOCK_N)
    keys_in = tl.maximum(keys, 0) if DOCUMENTS else keys  # keys < 0 (a document's first tile): key 0's, not stored
    k = _load_rows(K + b * stride_kb + hk * stride_kh + start * stride_kt, stride_kt, keys_in, offs_d, k_len, D)
    v = _load_rows(V + b * stride_vb + hk * stride_vh + start * stride_vt, stride_vt, keys_in, offs_d, k_len, D)
    offset = k_len - q_len
    # query tiles: [first, near) cross the causal limit, [near, far) see the whole key tile inside the bias window,
    # [far, q_len) see it entirely at distances >= W (min distance m0 + offset - (n0 + BN - 1))
    first = (tl.maximum(n0 - offset, -phase) + phase) // BLOCK_M * BLOCK_M - phase
    near = tl.maximum(first, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - offset + phase, 0), BLOCK_M) * BLOCK_M - phase)
    far = tl.maximum(near, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 + W - offset + phase, 0), BLOCK_M) * BLOCK_M - phase)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    row_offs = (b * Hq + h) * Tq + start  # the (batch row, head) row of DELTA, at the document's start
    padded = (b * Hq + h) * T_ROWS + start  # of THR and LSE (rows past Tq without documents: `_causal_dkdv_tiles`)
    args = (k, v, Q + b * stride_qb + h * stride_qh + start * stride_qt,
            DO + b * stride_dob + h * stride_doh + start * stride_dot, THR + padded, LSE + padded,
            DELTA + row_offs, BAND + h * BAND_LEN + (BLOCK_M + BLOCK_N) + offset,
            n0)  # the band pointer + m0: the band of distance m0 + offset - n0
    dk, dv = _causal_dkdv_tiles(dk, dv, *args, first, tl.minimum(near, q_len), q_len, offset, stride_qt, stride_dot,
                                scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, D, True, True, UPCAST, PRECISION, DOCUMENTS)
    dk, dv = _causal_dkdv_tiles(dk, dv, *args, near, tl.minimum(far, q_len), q_len, offset, stride_qt, stride_dot,
                                scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, D, True, False, UPCAST, PRECISION, DOCUMENTS)
    dk, dv = _causal_dkdv_tiles(dk, dv, *args, far, q_len, q_len, offset, stride_qt, stride_dot,
                                scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, D, False, False, UPCAST, PRECISION, DOCUMENTS)
    out = b * stride_dkb + h * stride_dkh + (start + keys)[:, None] * stride_dkt + offs_d[None, :]
    kv_mask = (keys[:, None] < k_len) & (offs_d[None, :] < D)
    if DOCUMENTS:
        kv_mask &= keys[:, None] >= 0
    tl.store(DK + out, (dk * scaling).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


def _with_gradient_buffer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x, empty gradient with x's strides)`; x is made contiguous when its layout cannot be mirrored."""
    x = _last_dim_contiguous(x)
    grad = torch.empty_like(x)
    if grad.stride() != x.stride():  # e.g. a slice of a larger cache: kernels index both with x's strides
        x = x.contiguous()
        grad = torch.empty_like(x)
    return x, grad


def _backward(grad_out, query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse, scaling,
              causal=False, out=None, u=None, documents=None, work_lists=None) -> BackwardResult:
    """Launch Delta (with d tau partials), dq, then dk/dv (with d distance_bias partials); no atomics across programs.

    `causal` (the metadata's plain causal layout) runs the causal fast path for query lengths > 16, as the forward
    does; it needs the forward's `out` and `u` (`_causal_forward(..., store_u=True)`); so does `documents` (the
    forward's document table: the causal fast path per document; its runs of padding get zero gradients;
    `work_lists`, a dict the caller may keep per document table, holds the work lists built from it).
    Returns `BackwardResult(dq, dk, dv, d_tau [Hq] float32, d_bias [Hq, W] float32)`."""
    block_d = _check_inputs(query, key)
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len, window = key.shape[1], key.shape[2], distance_bias.shape[-1]
    (query, dq), (key, dk), (value, dv) = (_with_gradient_buffer(x) for x in (query, key, value))
    grad_out = _last_dim_contiguous(grad_out)
    if (causal and q_len > DECODE_MAX_ROWS) or documents is not None:
        if out is None or u is None:
            raise ValueError("the causal fast-path backward needs the forward's out and U (store_u=True)")
        return _causal_backward(grad_out, query, key, value, dq, dk, dv, tau, distance_bias, q_pos, q_seg, lse,
                                scaling, block_d, out, u, documents, work_lists)
    groups = num_heads // kv_heads
    tau32 = tau.detach().to(torch.float32).contiguous()
    bias32 = distance_bias.detach().to(torch.float32).contiguous()
    common = dict(BLOCK_D=block_d, D=dim, UPCAST=_INTERPRET, PRECISION=_DOT_PRECISION[query.dtype])
    delta_m, delta_n, delta_warps, delta_stages = _launch_config("delta", block_d, query.device)
    dq_m, dq_n, dq_warps, dq_stages = _launch_config("dq", block_d, query.device)
    kv_m, kv_n, kv_warps, kv_stages = _launch_config("dkdv", block_d, query.device)
    delta = torch.empty(bsz, num_heads, q_len, dtype=torch.float32, device=query.device)
    dtau_part = torch.empty(bsz, num_heads, triton.cdiv(q_len, delta_m), dtype=torch.float32, device=query.device)
    k_tiles = triton.cdiv(k_len, kv_n)
    dbias_part = torch.zeros(bsz, num_heads, k_tiles, window, dtype=torch.float32, device=query.device)
    # The arguments all three kernels share: inputs, per-token metadata, strides (dO is [B, Tq, Hq, D]), sizes.
    inputs = dict(Q=query, K=key, V=value, TAU=tau32, BIAS=bias32, QPOS=q_pos, KPOS=k_pos, QSEG=q_seg, KSEG=k_seg,
                  LSE=lse)
    strides = dict(**_strides("q", query), **_strides("k", key), **_strides("v", value),
                   **_strides("do", grad_out, h=2, t=1))
    sizes = dict(Tq=q_len, Tk=k_len, W=window, GROUPS=groups)
    wrap_triton(_lazy_bwd_delta_kernel)[(triton.cdiv(q_len, delta_m), bsz * num_heads)](
        **inputs, DO=grad_out, DELTA=delta, DTAU_PART=dtau_part, **strides, Hq=num_heads, **sizes, scaling=scaling,
        BLOCK_M=delta_m, BLOCK_N=delta_n, num_warps=delta_warps, num_stages=delta_stages, **common)
    wrap_triton(_lazy_bwd_dq_kernel)[(triton.cdiv(q_len, dq_m), bsz * num_heads)](
        **inputs, DO=grad_out, DELTA=delta, DQ=dq, **strides, Hq=num_heads, **sizes, scaling=scaling,
        BLOCK_M=dq_m, BLOCK_N=dq_n, num_warps=dq_warps, num_stages=dq_stages, **common)
    wrap_triton(_lazy_bwd_dkdv_kernel)[(k_tiles, bsz * kv_heads)](
        **inputs, DELTA=delta, DO=grad_out, DK=dk, DV=dv, DBIAS_PART=dbias_part, **strides,
        Hq=num_heads, Hkv=kv_heads, **sizes, scaling=scaling,
        BLOCK_M=kv_m, BLOCK_N=kv_n, num_warps=kv_warps, num_stages=kv_stages, **common)
    return BackwardResult(dq, dk, dv, dtau_part.sum(dim=(0, 2)), dbias_part.sum(dim=(0, 2)))


def _causal_backward(grad_out, query, key, value, dq, dk, dv, tau, distance_bias, q_pos, q_seg, lse, scaling,
                     block_d, out, u, documents=None, work_lists=None) -> BackwardResult:
    """The causal fast-path backward (after `_causal_forward` with `store_u`: its `out` and `u`, and its `documents`
    table if any): Delta from U, dq, dk/dv; `_backward`'s results. With documents, the Delta kernel writes the zero
    gradients of the table's runs of padding (no fill first), and the dq and dk/dv work lists hold the documents'
    tiles only."""
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len, window = key.shape[1], key.shape[2], distance_bias.shape[-1]
    tau32 = tau.detach().to(torch.float32).contiguous()
    common = dict(Q=query, K=key, V=value, DO=grad_out,
                  **_strides("q", query), **_strides("k", key), **_strides("v", value),
                  **_strides("do", grad_out, h=2, t=1), Hq=num_heads, Tq=q_len, Tk=k_len, W=window,
                  GROUPS=num_heads // kv_heads, scale_log2=scaling * LOG2E, BLOCK_D=block_d, D=dim, UPCAST=_INTERPRET,
                  PRECISION=_DOT_PRECISION[query.dtype], DOCUMENTS=documents is not None)

    # per tile height: dq's query tiles and dk/dv's key tiles share one when their heights agree
    work_lists = {} if work_lists is None else work_lists

    def grid(block, length=q_len):  # (work list, grid) of `block`-row tiles of `length` rows (the queries, or for
        # dk/dv the keys, cached ones included) per (batch row, head), or the documents' tiles
        if documents is None:
            return lse, (triton.cdiv(length, block), bsz * num_heads)
        name = ("backward", block, bsz * q_len)  # the documents' tiles only
        if name not in work_lists:
            work_lists[name] = _varlen_tiles(documents[:, 2].clamp(min=0), bsz * q_len, block)
        return work_lists[name], (work_lists[name].shape[0], num_heads)

    dkdv_kind = "causal_dkdv" if documents is None else "causal_dkdv_documents"
    band, pad = _causal_band(distance_bias, scaling, block_d, query.device)  # the forward's, kept with distance_bias

    def launch(kernel, kind, rows_per_program, length, **arguments):  # each kernel its own band view and work list
        block_m, block_n, num_warps, num_stages = _launch_config(kind, block_d, query.device)
        work, programs = grid(rows_per_program(block_m, block_n), length)
        wrap_triton(kernel)[programs](**common, **arguments,
                                      BAND=_band_from(band, pad, block_m, block_n),
                                      BAND_LEN=band.stride(1),
                                      DOCS=lse if documents is None else documents, TILES=work,
                                      BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)

    groups = num_heads // kv_heads  # with GQA: float32 terms per query head, summed over each group below
    dk_out, dv_out = (dk, dv) if groups == 1 else (
        torch.empty(bsz, num_heads, k_len, dim, dtype=torch.float32, device=query.device) for _ in range(2))
    delta = torch.empty(bsz, num_heads, q_len, dtype=torch.float32, device=query.device)
    # the thresholds and a copy of the LSE with a dead row's values for a dk/dv query tile past the end (plain
    # layout: unmasked loads there)
    t_rows = q_len if documents is not None else q_len + _launch_config(dkdv_kind, block_d, query.device)[0]
    thresholds = torch.empty(bsz, num_heads, t_rows, dtype=torch.float32, device=query.device)
    lse_rows = torch.empty_like(thresholds)
    delta_m, _, delta_warps, delta_stages = _launch_config("causal_delta", block_d, query.device)
    dtau_part = torch.empty(bsz, num_heads, triton.cdiv(t_rows, delta_m), dtype=torch.float32, device=query.device)
    wrap_triton(_lazy_causal_bwd_delta_kernel)[(triton.cdiv(t_rows, delta_m), bsz * num_heads)](
        OUT=out, U=u, DO=grad_out, TAU=tau32, QPOS=q_pos, QSEG=q_seg, LSE=lse, DELTA=delta, THR=thresholds,
        LSE_ROWS=lse_rows, DTAU_PART=dtau_part, DQ=dq, DK=dk_out, DV=dv_out, DOCUMENTS=documents is not None,
        **_strides("o", out, h=2, t=1), **_strides("do", grad_out, h=2, t=1), **_strides("q", query),
        **_strides("dk", dk_out), Hq=num_heads, Tq=q_len, T_ROWS=t_rows,
        BLOCK_M=delta_m, BLOCK_D=block_d, D=dim, num_warps=delta_warps, num_stages=delta_stages)
    dq_rows = _launch_config("causal_dq", block_d, query.device)[0]
    dq_programs = grid(dq_rows)[1][0]  # one private d distance_bias row per (program, head) of the dq kernel
    dbias_part = torch.zeros(bsz if documents is None else 1, num_heads, dq_programs, window, dtype=torch.float32,
                             device=query.device)
    launch(_lazy_causal_bwd_dq_kernel, "causal_dq", lambda block_m, block_n: block_m, q_len, TAU=tau32, QPOS=q_pos,
           QSEG=q_seg, LSE=lse, DELTA=delta, DQ=dq, DBIAS_PART=dbias_part, scaling=scaling)
    launch(_lazy_causal_bwd_dkdv_kernel, dkdv_kind, lambda block_m, block_n: block_n, k_len, LSE=lse_rows,
           DELTA=delta, THR=thresholds, T_ROWS=t_rows, DK=dk_out, DV=dv_out, **_strides("dk", dk_out),
           scaling=scaling)
    if groups > 1:
        dk.copy_(dk_out.view(bsz, kv_heads, groups, k_len, dim).sum(2))
        dv.copy_(dv_out.view(bsz, kv_heads, groups, k_len, dim).sum(2))
    return BackwardResult(dq, dk, dv, dtau_part.sum(dim=(0, 2)), dbias_part.sum(dim=(0, 2)))
