"""Lazy Attention as Triton kernels: two-pass forward, split-K decode, exact backward.

Math (docs/design.md), per query head h, query i, key j, for visible (i, j):

    s_ij = scaling * <q_i, k_j> + beta_h(pos_i - pos_j)      p_ij = exp(s_ij - LSE_i)
    a_ij = max(0, p_ij + tau_h / n_i)   (float32 test)        o_i  = sum_j a_ij v_j     (no renormalisation)
    m_ij = 1[a_ij > 0],  dP_ij = dO_i . v_j,  Delta_i = sum_j m_ij p_ij dP_ij,  dS_ij = p_ij (m_ij dP_ij - Delta_i)

Visibility comes only from the per-token `LazyMetadata` of `lazy_attention_reference` (no L x L mask):
query i sees key j  <=>  q_seg[i] == k_seg[j]  and  j <= i + Tk - Tq;  n_i = q_pos[i] + 1;
distance = q_pos[i] - k_pos[j], biased only for 0 <= distance < W.

Kernels, in data-flow order:
    _lse_pass / _out_pass      the two passes over key tiles (jit helpers shared by prefill and decode)
    _lazy_fwd_kernel           one query tile: pass 1 (row log-sum-exp), pass 2 (ReLU(p + tau/n) @ V)
    _lazy_fwd_split_lse_kernel / _lazy_fwd_split_out_kernel
                               split-K decode: each program covers a slice of the keys; partial (max, sum)
                               and partial outputs are combined with a few torch ops (no host sync)
    _lazy_causal_fwd_kernel    the forward's causal fast path (`LazyMetadata.causal`, query length > 16): no
                               per-key metadata, loop bounds instead of masks, the distance bias from a per-head
                               band, exp2, loads Triton pipelines; dense (no tile skipping). For training it
                               also stores U_i = sum_j m_ij v_j (one more, exact 0/1, product in pass 2)
    _lazy_paged_fwd_kernel     the causal fast path's passes (`_causal_passes`) for a mixed vLLM step: query tiles of
                               many requests (varlen), K and V through the paged cache's block table
    _lazy_decode_lse_kernel / _lazy_decode_out_kernel
                               the packed decode (`LazyMetadata.causal`, query length <= 16; and paged K/V for
                               serving): a GQA group's query heads x query rows as the rows of one tile, split-K,
                               pass-1 scores kept for pass 2, exp2, pipelined loads
    _lazy_bwd_delta_kernel     backward preprocess: Delta_i = sum_j m p dP (float32) and per-tile d tau partials
    _lazy_bwd_dq_kernel        dq, FlashAttention-2 style with the elastic-softmax dS
    _lazy_bwd_dkdv_kernel      dk, dv (GQA: loops over the query heads of one KV head, never repeats K/V)
                               and per-tile d distance_bias partials
    _lazy_causal_bwd_delta_kernel / _lazy_causal_bwd_dq_kernel / _lazy_causal_bwd_dkdv_kernel
                               the backward's causal fast path (after the causal forward), built like it: Delta
                               and d tau from the forward's U (no pass over the keys); the dq kernel also
                               reduces d distance_bias along the diagonals of each dS tile
Then the launchers (each launch through `wrap_triton`, so that torch.compile and make_fx trace it), the public
`lazy_attention_triton` (the operators and their autograd are in `lazy_attention_ops`),
`lazy_attention_triton_paged_decode` (one token per request against vLLM's paged cache) and
`lazy_attention_triton_paged` (a mixed step of prompts, chunks and decode tokens against it).

Block skipping: a key tile with no visible entry for the query tile (other document, padding, beyond the
causal limit) is skipped in every pass; a key tile whose weights a_ij are all zero after pass 1 is skipped
in the `a @ V` product (its V tile is never read; deciding needs the tile's scores, so pass 2 still
computes q k^T), and in backward its dP = dO V^T and dv products are skipped (dS = -p * Delta there, so
dq and dk stay dense: the softmax normaliser couples them).

Under TRITON_INTERPRET=1 (set before import) the same kernels run on CPU tensors; 16-bit operands are
upcast to float32 before `tl.dot` on that path only (the interpreter's bf16 dot is wrong).
"""

import os
from typing import TYPE_CHECKING

try:
    import triton
    import triton.language as tl
except ImportError as error:  # modeling_lazy catches this and serves every device with the PyTorch path
    raise ImportError(
        "lazy_attention_triton needs the `triton` package (pip install triton, or the project's [gpu] extra); "
        "without it LazyLlama uses its PyTorch attention path."
    ) from error

import torch
from torch.library import wrap_triton  # a launch torch.compile / make_fx can trace (plain launch in eager)

if TYPE_CHECKING:  # annotations only: the ahead-of-time compiler loads this file on its own
    from .lazy_attention_reference import LazyMetadata

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# ---------------------------------------------------------------------------------------------------
# Block configurations (the ones shipped; tests/test_triton_aot.py compiles every one for sm_80/sm_90).
# ---------------------------------------------------------------------------------------------------
MAX_HEAD_DIM = 256
DECODE_MAX_ROWS = 16  # lazy_attention_reference.DECODE_MAX_ROWS (this file is also loaded alone, ahead of time)
SPLIT_MIN_KEYS = 256  # a split-K slice covers at least this many keys
# Row log-sum-exp stored for a row without a normaliser (every visible score -inf, or nothing visible): p = 0 on
# every key, and `_row_threshold` turns tau/n into a large negative, so every weight a_ij of that row is 0.
DEAD_ROW_LSE = 3.0e38
_DEAD_ROW_LSE = tl.constexpr(DEAD_ROW_LSE)  # the same value as the kernels see it

# GPU family -> (kernel kind, padded head dim) -> (BLOCK_M, BLOCK_N, num_warps, num_stages). Padded head
# dims up to 64 use the 64 rows, larger ones the 128 rows (256 runs but is not tuned). Chosen so that no
# build spills registers (tests/test_triton_aot.py); Ampere's mma.sync keeps more of each tile in
# registers than Hopper's wgmma, so its tiles are smaller. Other GPUs use the sm80 table.
_CONFIGS = {
    "sm90": {
        ("fwd", 64): (128, 64, 8, 2),
        ("fwd", 128): (128, 32, 8, 2),
        ("causal_fwd", 64): (128, 64, 8, 2),
        ("causal_fwd", 128): (128, 64, 8, 2),
        ("causal_fwd_u", 64): (128, 64, 8, 2),
        ("causal_fwd_u", 128): (128, 32, 8, 2),
        ("paged_fwd", 64): (128, 64, 8, 2),
        ("paged_fwd", 128): (128, 64, 8, 2),
        ("decode", 64): (16, 64, 4, 2),
        ("decode", 128): (16, 64, 4, 2),
        ("packed_decode", 64): (16, 128, 4, 3),
        ("packed_decode", 128): (16, 128, 4, 3),
        ("delta", 64): (64, 64, 4, 2),
        ("delta", 128): (64, 64, 8, 2),
        ("dq", 64): (64, 64, 4, 2),
        ("dq", 128): (64, 64, 8, 2),
        ("dkdv", 64): (128, 32, 8, 2),
        ("dkdv", 128): (128, 32, 8, 2),
        ("causal_delta", 64): (64, 0, 4, 1),
        ("causal_delta", 128): (32, 0, 4, 1),
        ("causal_dq", 64): (128, 64, 8, 2),
        ("causal_dq", 128): (128, 32, 8, 2),
        ("causal_dkdv", 64): (64, 64, 4, 2),
        ("causal_dkdv", 128): (32, 128, 8, 2),
    },
    "sm80": {
        ("fwd", 64): (64, 64, 8, 2),
        ("fwd", 128): (64, 32, 8, 2),
        ("causal_fwd", 64): (128, 64, 8, 2),
        ("causal_fwd", 128): (64, 32, 4, 2),
        ("causal_fwd_u", 64): (128, 32, 8, 2),
        ("causal_fwd_u", 128): (64, 32, 8, 2),
        ("paged_fwd", 64): (128, 64, 8, 2),
        ("paged_fwd", 128): (64, 32, 4, 2),
        ("decode", 64): (16, 64, 4, 2),
        ("decode", 128): (16, 64, 4, 2),
        ("packed_decode", 64): (16, 128, 4, 3),
        ("packed_decode", 128): (16, 128, 4, 3),
        ("delta", 64): (64, 64, 4, 2),
        ("delta", 128): (64, 64, 8, 2),
        ("dq", 64): (64, 32, 8, 2),
        ("dq", 128): (64, 32, 8, 2),
        ("dkdv", 64): (64, 32, 8, 2),
        ("dkdv", 128): (32, 64, 8, 2),
        ("causal_delta", 64): (64, 0, 4, 1),
        ("causal_delta", 128): (32, 0, 4, 1),
        ("causal_dq", 64): (64, 32, 8, 2),
        ("causal_dq", 128): (64, 32, 8, 2),
        ("causal_dkdv", 64): (64, 64, 8, 2),
        ("causal_dkdv", 128): (32, 64, 8, 2),
    },
}


def _gpu_family(device: torch.device) -> str:
    """`"sm90"` for Hopper and newer, `"sm80"` for older GPUs; the interpreter (CPU) runs the sm90 blocks."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] < 9:
        return "sm80"
    return "sm90"


def _config(kind: str, block_d: int, family: str = "sm90") -> tuple[int, int, int, int]:
    return _CONFIGS[family][(kind, 64 if block_d <= 64 else 128)]


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr, acc=None):
    """`acc + a @ b` (acc None: 0) with a float32 accumulator (operands upcast on the interpreter only)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _visible(q_seg, q_key_idx, KSEG, keys, Tk):
    """`[BM, BN]` bool: same segment and causal; `keys` are key indices, `q_key_idx` query rows in key coords."""
    k_seg = tl.load(KSEG + keys, mask=keys < Tk, other=-3)
    return (q_seg[:, None] == k_seg[None, :]) & (keys[None, :] <= q_key_idx[:, None])


@triton.jit
def _load_rows(ptr, stride, idx, offs_d, n, D: tl.constexpr):
    """`[len(idx), BLOCK_D]` tile of rows `idx` (< n) of a `[n, D]` matrix with row stride `stride`; 0 padded."""
    return tl.load(ptr + idx[:, None] * stride + offs_d[None, :], mask=(idx[:, None] < n) & (offs_d[None, :] < D),
                   other=0.0)


@triton.jit
def _scores(q, k, KPOS, bias_row, q_pos, visible, keys, Tk, W, scaling,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """`[BM, BN]` float32 scores `scaling * q k^T + beta(pos_i - pos_j)`, -inf where not visible."""
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * scaling
    k_pos = tl.load(KPOS + keys, mask=keys < Tk, other=0)
    dist = q_pos[:, None] - k_pos[None, :]
    s += tl.load(bias_row + dist, mask=visible & (dist >= 0) & (dist < W), other=0.0)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _row_threshold(tau_h, q_pos, lse):
    """`tau_h / n_i` in float32 for a row with a normaliser; -1e30 (every weight 0) for a dead row."""
    return tl.where(lse < 1.0e38, tau_h / (q_pos + 1).to(tl.float32), -1.0e30)


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
              SKIP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Pass 2: `sum_j ReLU(p_ij + tau/n_i) v_j` over visible keys in [lo, hi) (float32), plus tile counts."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    visited = tl.full([], 0, tl.int32)
    visible_tiles = tl.full([], 0, tl.int32)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        visible = _visible(q_seg, q_key_idx, KSEG, keys, Tk)
        if tl.max(visible.to(tl.int32)) > 0:
            visible_tiles += 1
            k = _load_rows(K, stride_kt, keys, offs_d, Tk, D)
            s = _scores(q, k, KPOS, bias_row, q_pos, visible, keys, Tk, W, scaling, UPCAST, PRECISION)
            p = tl.exp(s - lse[:, None])
            a = tl.where(visible, tl.maximum(p + threshold[:, None], 0.0), 0.0)  # float32 threshold test
            if (tl.max(a) > 0.0) | (not SKIP):  # all-zero tile: its value block is never read
                visited += 1
                v = _load_rows(V, stride_vt, keys, offs_d, Tk, D)
                acc += _dot(a.to(v.dtype), v, UPCAST, PRECISION)
    return acc, visited, visible_tiles


@triton.jit
def _query_tile_setup(Q, QPOS, QSEG, stride_qb, stride_qh, stride_qt, Hq, Tq, Tk, GROUPS, KEYS_PER_SPLIT,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    """Shared prologue of the forward and split-K kernels: one query tile of one head, its keys [lo, hi).

    Grid: (cdiv(Tq, BM), B * Hq[, splits]); `hi` stops at the tile's causal limit (later keys are never visible).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    hk = (h // GROUPS).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = rows < Tq
    q = tl.load(Q + b * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                mask=row_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    q_pos = tl.load(QPOS + b * Tq + rows, mask=row_mask, other=0)
    q_seg = tl.load(QSEG + b * Tq + rows, mask=row_mask, other=-4)
    offset = Tk - Tq
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(tl.minimum(Tk, (pid_m + 1) * BLOCK_M + offset), lo + KEYS_PER_SPLIT)
    return pid_m, pid_bh, split, b, h, hk, rows, row_mask, q, q_pos, q_seg, rows + offset, lo, hi


@triton.jit
def _lazy_fwd_kernel(Q, K, V, TAU, BIAS, QPOS, KPOS, QSEG, KSEG, OUT, LSE, STATS,
                     stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                     stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                     Hq, Tq, Tk, W, GROUPS, scaling,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                     SKIP: tl.constexpr, WITH_STATS: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr):
    """One query tile of one query head: pass 1 (LSE), pass 2 (output). Grid: (cdiv(Tq, BM), B * Hq)."""
    # One "split" covering every key: lo = 0, hi = the tile's causal limit.
    pid_m, pid_bh, _, b, h, hk, rows, row_mask, q, q_pos, q_seg, q_key_idx, _, hi = _query_tile_setup(
        Q, QPOS, QSEG, stride_qb, stride_qh, stride_qt, Hq, Tq, Tk, GROUPS, Tk, BLOCK_M, BLOCK_D, D)
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
    acc, visited, visible_tiles = _out_pass(q, q_pos, q_seg, q_key_idx, lse, threshold, K_, V_, stride_kt,
                                            stride_vt, KPOS_, KSEG_, bias_row, 0, hi, Tk, W, scaling,
                                            BLOCK_M, BLOCK_N, BLOCK_D, D, SKIP, UPCAST, PRECISION)
    out_ptrs = OUT + b * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_ot + offs_d[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < D))
    tl.store(LSE + pid_bh.to(tl.int64) * Tq + rows, lse, mask=row_mask)
    if WITH_STATS:
        stats = STATS + (pid_bh * tl.num_programs(0) + pid_m) * 2
        tl.store(stats, visited)
        tl.store(stats + 1, visible_tiles)


@triton.jit
def _lazy_fwd_split_lse_kernel(Q, K, BIAS, QPOS, KPOS, QSEG, KSEG, M_PART, L_PART,
                               stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                               Hq, Tq, Tk, W, GROUPS, KEYS_PER_SPLIT, scaling,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Split-K pass 1: partial row max / sum of exp for one slice of keys -> M_PART, L_PART [S, B*Hq, Tq]."""
    pid_m, pid_bh, split, b, h, hk, rows, row_mask, q, q_pos, q_seg, q_key_idx, lo, hi = _query_tile_setup(
        Q, QPOS, QSEG, stride_qb, stride_qh, stride_qt, Hq, Tq, Tk, GROUPS, KEYS_PER_SPLIT, BLOCK_M, BLOCK_D, D)
    m_i, l_i = _lse_pass(q, q_pos, q_seg, q_key_idx, K + b * stride_kb + hk * stride_kh, stride_kt,
                         KPOS + b * Tk, KSEG + b * Tk, BIAS + h * W, lo, hi, Tk, W, scaling,
                         BLOCK_M, BLOCK_N, BLOCK_D, D, UPCAST, PRECISION)
    part = (split * tl.num_programs(1) + pid_bh).to(tl.int64) * Tq + rows
    tl.store(M_PART + part, m_i, mask=row_mask)
    tl.store(L_PART + part, l_i, mask=row_mask)


@triton.jit
def _lazy_fwd_split_out_kernel(Q, K, V, TAU, BIAS, QPOS, KPOS, QSEG, KSEG, LSE, O_PART, STATS,
                               stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                               stride_vb, stride_vh, stride_vt,
                               Hq, Tq, Tk, W, GROUPS, KEYS_PER_SPLIT, scaling,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               D: tl.constexpr, SKIP: tl.constexpr, WITH_STATS: tl.constexpr,
                               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Split-K pass 2: partial float32 output of one key slice -> O_PART [S, B, Tq, Hq, D] (summed after)."""
    pid_m, pid_bh, split, b, h, hk, rows, row_mask, q, q_pos, q_seg, q_key_idx, lo, hi = _query_tile_setup(
        Q, QPOS, QSEG, stride_qb, stride_qh, stride_qt, Hq, Tq, Tk, GROUPS, KEYS_PER_SPLIT, BLOCK_M, BLOCK_D, D)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * Tq + rows, mask=row_mask, other=_DEAD_ROW_LSE)
    threshold = _row_threshold(tl.load(TAU + h), q_pos, lse)
    acc, visited, visible_tiles = _out_pass(q, q_pos, q_seg, q_key_idx, lse, threshold,
                                            K + b * stride_kb + hk * stride_kh, V + b * stride_vb + hk * stride_vh,
                                            stride_kt, stride_vt, KPOS + b * Tk, KSEG + b * Tk, BIAS + h * W,
                                            lo, hi, Tk, W, scaling, BLOCK_M, BLOCK_N, BLOCK_D, D, SKIP, UPCAST,
                                            PRECISION)
    offs_d = tl.arange(0, BLOCK_D)
    out_ptrs = (O_PART + ((split.to(tl.int64) * (tl.num_programs(1) // Hq) + b) * Tq + rows[:, None]) * Hq * D
                + h * D + offs_d[None, :])
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & (offs_d[None, :] < D))
    if WITH_STATS:
        stats = STATS + ((split * tl.num_programs(1) + pid_bh) * tl.num_programs(0) + pid_m) * 2
        tl.store(stats, visited)
        tl.store(stats + 1, visible_tiles)


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

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _causal_key_ranges(m0, Tq, Tk, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`(far, full, hi)` key bounds of the query rows [m0, m0 + BM) (see the section comment)."""
    offset = Tk - Tq
    hi = tl.minimum(Tk, m0 + BLOCK_M + offset)
    full = (m0 + offset + 1) // BLOCK_N * BLOCK_N  # keys below it are visible to row m0, hence to every row
    far = tl.maximum(m0 + offset - W + 1, 0) // BLOCK_N * BLOCK_N  # keys below it are >= W behind every row
    return far, full, hi


@triton.jit
def _load_keys(ptr, stride, keys, offs_d, Tk, D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KEYS: tl.constexpr,
               BT=None, stride_b=0, PAGE_SIZE: tl.constexpr = 0):
    """`[BN, BLOCK_D]` rows `keys` of a `[Tk, D]` matrix; only the tiles at the causal limit can pass Tk.
    PAGE_SIZE > 0: of a paged cache (`_cache_rows`: block table `BT`, `stride_b` between blocks)."""
    if PAGE_SIZE > 0:
        ptrs = ptr + _cache_rows(BT, keys, Tk, 0, stride_b, stride, PAGE_SIZE)[:, None] + offs_d[None, :]
    else:
        ptrs = ptr + keys[:, None] * stride + offs_d[None, :]
    if MASK_KEYS:
        return tl.load(ptrs, mask=(keys[:, None] < Tk) & (offs_d[None, :] < D), other=0.0)
    elif D < BLOCK_D:
        return tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _causal_scores(q, k, band, start_n, diagonal, scale_log2, BIAS: tl.constexpr, BIAS_FIRST: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """`[BM, BN]` float32 scores in log2 units; `band - start_n + diagonal` points at each entry's band value:
    in q.k units starting the q k^T accumulator (`BIAS_FIRST`, pass 1), or in log2 units added after it."""
    if BIAS and BIAS_FIRST:
        return _dot(q, tl.trans(k), UPCAST, PRECISION, tl.load(band - start_n + diagonal)) * scale_log2
    elif BIAS:
        return _dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2 + tl.load(band - start_n + diagonal)
    else:
        return _dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2


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
        s = _causal_scores(q, k, band, start_n, diagonal, scale_log2, BIAS, True, UPCAST, PRECISION)  # [BM, BN]
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
def _causal_passes(q, q_pos, K, V, stride_kt, stride_vt, band_h, BAND_PLANE, TAU_h, m0, Tq, Tk, W, scale_log2,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BT=None, stride_kb=0, stride_vb=0, PAGE_SIZE: tl.constexpr = 0, STORE_U: tl.constexpr = False):
    """Both passes of the causal fast path for the query rows [m0, m0 + BM) of one head (row i at key index
    i + Tk - Tq, n = q_pos + 1), each as three loops (beyond the window / inside it / at the causal limit).
    `band_h`: the head's band row (q.k units `BAND_PLANE` further on); `TAU_h`: the head's tau. PAGE_SIZE > 0:
    K and V are a paged cache (`_load_keys`). Returns `(acc [BM, BLOCK_D] float32, u, alive [BM], lse2 [BM])`;
    `u = sum_j m_ij v_j` (float32) with `STORE_U`, zeros otherwise."""
    offs_m = tl.arange(0, BLOCK_M)
    rows = m0 + offs_m
    far, full, hi = _causal_key_ranges(m0, Tq, Tk, W, BLOCK_M, BLOCK_N)
    band = band_h + (BLOCK_M + BLOCK_N) + m0 + Tk - Tq  # band of distance m0 + offset - start_n
    band_qk = band + BAND_PLANE  # the same in q.k units (pass 1)
    diagonal = offs_m[:, None] - tl.arange(0, BLOCK_N)[None, :]  # [BM, BN] row - column

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a tile of -inf scores keeps exp2() at 0, never NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i, l_i = _causal_lse_tiles(q, m_i, l_i, K, stride_kt, band, diagonal, 0, far, Tk, scale_log2,
                                 BLOCK_N, BLOCK_D, D, False, False, UPCAST, PRECISION, BT, stride_kb, PAGE_SIZE)
    m_i, l_i = _causal_lse_tiles(q, m_i, l_i, K, stride_kt, band_qk, diagonal, far, full, Tk, scale_log2,
                                 BLOCK_N, BLOCK_D, D, True, False, UPCAST, PRECISION, BT, stride_kb, PAGE_SIZE)
    m_i, l_i = _causal_lse_tiles(q, m_i, l_i, K, stride_kt, band_qk, diagonal, full, hi, Tk, scale_log2,
                                 BLOCK_N, BLOCK_D, D, True, True, UPCAST, PRECISION, BT, stride_kb, PAGE_SIZE)
    # a row whose scores are all -inf has no normaliser: p = 0 on every key and no weight (threshold 0 here; the
    # stored LSE is DEAD_ROW_LSE, which both backwards recognise)
    alive = l_i > 0.0
    lse2 = tl.where(alive, m_i + tl.log2(tl.where(alive, l_i, 1.0)), float("inf"))
    threshold = tl.where(alive, tl.load(TAU_h) / (q_pos + 1).to(tl.float32), 0.0)

    q_key_idx = rows + Tk - Tq
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    u = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, u = _causal_out_tiles(q, acc, u, K, V, stride_kt, stride_vt, band, diagonal, q_key_idx, lse2, threshold, 0,
                               far, Tk, scale_log2, BLOCK_N, BLOCK_D, D, False, False, UPCAST, PRECISION,
                               BT, stride_kb, stride_vb, PAGE_SIZE, STORE_U)
    acc, u = _causal_out_tiles(q, acc, u, K, V, stride_kt, stride_vt, band, diagonal, q_key_idx, lse2, threshold, far,
                               full, Tk, scale_log2, BLOCK_N, BLOCK_D, D, True, False, UPCAST, PRECISION,
                               BT, stride_kb, stride_vb, PAGE_SIZE, STORE_U)
    acc, u = _causal_out_tiles(q, acc, u, K, V, stride_kt, stride_vt, band, diagonal, q_key_idx, lse2, threshold,
                               full, hi, Tk, scale_log2, BLOCK_N, BLOCK_D, D, True, True, UPCAST, PRECISION,
                               BT, stride_kb, stride_vb, PAGE_SIZE, STORE_U)
    return acc, u, alive, lse2


@triton.jit
def _lazy_causal_fwd_kernel(Q, K, V, TAU, BAND, QPOS, OUT, LSE, U,
                            stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                            stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                            Hq, Tq, Tk, W, GROUPS, BAND_LEN, scale_log2,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                            UPCAST: tl.constexpr, PRECISION: tl.constexpr, STORE_U: tl.constexpr):
    """Causal fast path, one query tile of one query head: `_causal_passes`. Grid: (cdiv(Tq, BM), B * Hq). LSE in
    natural units. `STORE_U` (training): also U_i = sum_j m_ij v_j into U (float32, OUT's shape and strides), from
    which `_lazy_causal_bwd_delta_kernel` gets Delta and d tau without another pass over the keys."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    hk = (h // GROUPS).to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < Tq
    q = _load_rows(Q + b * stride_qb + h.to(tl.int64) * stride_qh, stride_qt, rows, offs_d, Tq, D)
    q_pos = tl.load(QPOS + b * Tq + rows, mask=row_mask, other=0)
    acc, u, alive, lse2 = _causal_passes(q, q_pos, K + b * stride_kb + hk * stride_kh,
                                         V + b * stride_vb + hk * stride_vh, stride_kt, stride_vt, BAND + h * BAND_LEN,
                                         Hq * BAND_LEN, TAU + h, m0, Tq, Tk, W, scale_log2, BLOCK_M, BLOCK_N, BLOCK_D,
                                         D, UPCAST, PRECISION, STORE_U=STORE_U)
    out_offs = b * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_ot + offs_d[None, :]
    out_mask = row_mask[:, None] & (offs_d[None, :] < D)
    tl.store(OUT + out_offs, acc.to(OUT.dtype.element_ty), mask=out_mask)
    if STORE_U:
        tl.store(U + out_offs, u, mask=out_mask)
    # in log2 units, as the causal backward reads it: a round trip through ln would move a row that sits exactly on
    # the ReLU's kink (a one-key row at tau = -1: p = 1, p + tau / n = 0) to the other side in the backward
    tl.store(LSE + pid_bh.to(tl.int64) * Tq + rows, tl.where(alive, lse2, _DEAD_ROW_LSE), mask=row_mask)


@triton.jit
def _lazy_paged_fwd_kernel(Q, K, V, TAU, BAND, BLOCK_TABLE, QUERY_START, KLEN, TILES, OUT,
                           stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                           stride_tb, stride_ot, stride_oh, Hq, W, GROUPS, BAND_LEN, scale_log2,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                           PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Varlen paged prefill: `_causal_passes` for one query tile of one request and one query head, K and V read
    through the request's block table. Grid: (len(TILES), Hq); TILES [programs, 2] int32 holds (request, first
    query row of the tile), request -1 for a spare program (no rows, no keys). Request r's query rows are
    Q[QUERY_START[r] : QUERY_START[r + 1]], its keys 0 .. KLEN[r] - 1, its row i at position KLEN[r] - q_len + i."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    hk = (h // GROUPS).to(tl.int64)
    request = tl.load(TILES + 2 * pid)
    m0 = tl.load(TILES + 2 * pid + 1)
    live = request >= 0
    r = tl.maximum(request, 0)
    q_start = tl.load(QUERY_START + r)
    Tq = tl.where(live, tl.load(QUERY_START + r + 1) - q_start, 0)
    Tk = tl.where(live, tl.load(KLEN + r), 0)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < Tq
    q = _load_rows(Q + q_start.to(tl.int64) * stride_qt + h.to(tl.int64) * stride_qh, stride_qt, rows, offs_d, Tq, D)
    acc, _, _, _ = _causal_passes(q, rows + Tk - Tq, K + hk * stride_kh, V + hk * stride_vh, stride_kt, stride_vt,
                                  BAND + h * BAND_LEN, Hq * BAND_LEN, TAU + h, m0, Tq, Tk, W, scale_log2,
                                  BLOCK_M, BLOCK_N, BLOCK_D, D, UPCAST, PRECISION,
                                  BLOCK_TABLE + r.to(tl.int64) * stride_tb, stride_kb, stride_vb, PAGE_SIZE)
    out_ptrs = OUT + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h.to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < D))


# ---------------------------------------------------------------------------------------------------
# Packed decode (plain layout, query length <= DECODE_MAX_ROWS; and vLLM's paged cache). The query heads of one
# GQA group times the query rows are packed as the rows of one tile (`r = g * Tq + t`; rows past G * Tq repeat the
# last one and are not stored), so one program reads each K and V tile of its slice of keys (split-K) once per KV
# head. Query row t of batch row b stands at key index `k_len_b - Tq + t` (`k_len_b`: that row's key length; the
# keys beyond it are invisible, whatever the cache holds there); its distance to key j is that index minus j and
# n = q_pos + 1. Scores are in log2 units (exp2), the distance bias from the causal fast path's band. Two passes:
#     _lazy_decode_lse_kernel   scores of the slice, kept in a float32 scratch (4 bytes per real row and key, less
#                               than re-reading K), and the slice's partial row max / sum of exp2
#     (torch)                   combine the partials into each row's log-sum-exp
#     _lazy_decode_out_kernel   reads the kept scores, not K: weights ReLU(p + tau/n), `a @ V`; a V tile whose
#                               weights are all zero for every row of the group is not read (its load is masked off)
# Pass 1 runs two loops: keys at distance >= W from every row (no bias, every key visible), then the keys from there
# to the slice's end (band gather; the band's -inf past the causal limit). Pass 2 runs one loop with the causal
# `where` on every tile: without it Triton computes the weights in the `a @ V` operand layout, replicated over the
# warps (4x the exp2). Loads carry masks but no `if`, so Triton pipelines them. PAGE_SIZE > 0: key j of batch row b
# lives in block BLOCK_TABLE[b, j // PAGE_SIZE], slot j % PAGE_SIZE, of a `[num_blocks, Hkv, PAGE_SIZE, D]` cache
# (stride_kb / stride_vb step over blocks).
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _cache_rows(BT, keys, k_len, base, stride_b, stride_t, PAGE_SIZE: tl.constexpr):
    """int64 `[BN]` offsets of the cache rows of `keys` of one (batch row, KV head); `base`: the head's offset plus,
    contiguous, the batch row's; paged, each key's block comes from the batch row's block table `BT`."""
    if PAGE_SIZE > 0:
        block = tl.load(BT + keys // PAGE_SIZE, mask=keys < k_len, other=0).to(tl.int64)
        return base + block * stride_b + (keys % PAGE_SIZE) * stride_t
    else:
        return base + keys.to(tl.int64) * stride_t


@triton.jit
def _load_cache(ptr, offsets, offs_d, key_mask, D: tl.constexpr):
    """`[BN, BLOCK_D]` cache rows at `offsets`; rows where `key_mask` is false (and columns >= D) read as 0."""
    return tl.load(ptr + offsets[:, None] + offs_d[None, :], mask=key_mask[:, None] & (offs_d[None, :] < D),
                   other=0.0)


@triton.jit
def _decode_rows(KLEN, BLOCK_TABLE, stride_b, stride_h, stride_tb, Hkv, Tq, GROUPS, KEYS_PER_SPLIT,
                 BLOCK_M: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Prologue of both decode passes. Grid: (splits, B * Hkv, cdiv(GROUPS * Tq, BM)). Returns the program's packed
    rows (query head `h`, query row `t`, flat `(b, h, t)` index `row_id`), their key indices, its keys [lo, hi), the
    cache offset of its KV head and its block-table row."""
    split = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = pid_bkv // Hkv
    hk = pid_bkv % Hkv
    packed = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = packed < GROUPS * Tq
    rows = tl.minimum(packed, GROUPS * Tq - 1)  # padding rows repeat the last row: their loads need no mask
    h = hk * GROUPS + rows // Tq
    t = rows % Tq
    k_len = tl.load(KLEN + b)
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(lo + KEYS_PER_SPLIT, k_len)
    if PAGE_SIZE > 0:
        kv_base = hk.to(tl.int64) * stride_h
    else:
        kv_base = b.to(tl.int64) * stride_b + hk.to(tl.int64) * stride_h
    row_id = pid_bkv.to(tl.int64) * GROUPS * Tq + rows
    return (split, b, h, t, row_id, row_mask, k_len, k_len - Tq + t, lo, hi, kv_base,
            BLOCK_TABLE + b.to(tl.int64) * stride_tb)


@triton.jit
def _decode_lse_tiles(q, m_i, l_i, K, BT, kv_base, scores, row_mask, band, diagonal, lo, hi, k_len, stride_kb,
                      stride_kt, scale_log2, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Decode pass 1 over key tiles [lo, hi): scores (log2 units) to `scores + key`, running row max / sum of exp2."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = _load_cache(K, _cache_rows(BT, keys, k_len, kv_base, stride_kb, stride_kt, PAGE_SIZE), offs_d,
                        keys < k_len, D)
        s = _causal_scores(q, k, band, start_n, diagonal, scale_log2, BIAS, True, UPCAST, PRECISION)  # [BM, BN]
        tl.store(scores + keys[None, :], s, mask=row_mask[:, None] & (keys < hi)[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _lazy_decode_lse_kernel(Q, K, BAND, KLEN, BLOCK_TABLE, SCORES, M_PART, L_PART,
                            stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_tb,
                            Hq, Hkv, Tq, W, GROUPS, KEYS_PER_SPLIT, KEY_CAPACITY, BAND_LEN, scale_log2,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                            PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Decode pass 1: scores -> SCORES [B, Hq, Tq, KEY_CAPACITY] (log2 units), partial row max / sum of exp2 ->
    M_PART, L_PART [splits, B, Hq, Tq]. Grid: (splits, B * Hkv, cdiv(GROUPS * Tq, BM))."""
    split, b, h, t, row_id, row_mask, k_len, q_key_idx, lo, hi, kv_base, BT = _decode_rows(
        KLEN, BLOCK_TABLE, stride_kb, stride_kh, stride_tb, Hkv, Tq, GROUPS, KEYS_PER_SPLIT, BLOCK_M, PAGE_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None].to(tl.int64) * stride_qh + t[:, None] * stride_qt
                + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
    far = tl.maximum(k_len - Tq - W + 1, 0) // BLOCK_N * BLOCK_N  # keys below it are >= W behind every row
    band = (BAND + h * BAND_LEN + BLOCK_M + BLOCK_N)[:, None]  # + distance: log2(e) beta_h(distance)
    diagonal = q_key_idx[:, None] - tl.arange(0, BLOCK_N)[None, :]  # distance of tile column n, + start_n
    scores = (SCORES + row_id * KEY_CAPACITY)[:, None]
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a tile of -inf scores keeps exp2() at 0, never NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i, l_i = _decode_lse_tiles(q, m_i, l_i, K, BT, kv_base, scores, row_mask, band, diagonal, lo,
                                 tl.minimum(hi, far), k_len, stride_kb, stride_kt, scale_log2, BLOCK_N, BLOCK_D, D,
                                 PAGE_SIZE, False, UPCAST, PRECISION)
    m_i, l_i = _decode_lse_tiles(q, m_i, l_i, K, BT, kv_base, scores, row_mask, band + Hq * BAND_LEN, diagonal,
                                 tl.maximum(lo, far), hi, k_len, stride_kb, stride_kt, scale_log2, BLOCK_N, BLOCK_D, D,
                                 PAGE_SIZE, True, UPCAST, PRECISION)
    part = (split * tl.num_programs(1) * GROUPS * Tq).to(tl.int64) + row_id  # [splits, B, Hq, Tq]
    tl.store(M_PART + part, m_i, mask=row_mask)
    tl.store(L_PART + part, l_i, mask=row_mask)


@triton.jit
def _lazy_decode_out_kernel(V, TAU, QPOS, KLEN, BLOCK_TABLE, SCORES, LSE2, O_PART,
                            stride_vb, stride_vh, stride_vt, stride_tb,
                            Hq, Hkv, Tq, GROUPS, KEYS_PER_SPLIT, KEY_CAPACITY,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                            PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Decode pass 2: partial float32 outputs of one key slice -> O_PART [splits, B, Tq, Hq, D] (summed after);
    LSE2 [B, Hq, Tq]: row log-sum-exp in log2 units, DEAD_ROW_LSE for a row without a normaliser."""
    split, b, h, t, row_id, row_mask, k_len, q_key_idx, lo, hi, kv_base, BT = _decode_rows(
        KLEN, BLOCK_TABLE, stride_vb, stride_vh, stride_tb, Hkv, Tq, GROUPS, KEYS_PER_SPLIT, BLOCK_M, PAGE_SIZE)
    scores = (SCORES + row_id * KEY_CAPACITY)[:, None]
    lse2 = tl.load(LSE2 + row_id)
    threshold = _row_threshold(tl.load(TAU + h), tl.load(QPOS + b * Tq + t), lse2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        s = tl.load(scores + keys[None, :], mask=(keys < hi)[None, :], other=float("-inf"))
        a = tl.maximum(tl.exp2(s - lse2[:, None]) + threshold[:, None], 0.0)  # float32 threshold test
        a = tl.where(keys[None, :] <= q_key_idx[:, None], a, 0.0)  # keys after the row (tau > 0 would give tau/n)
        live_len = tl.where(tl.max(a) > 0.0, k_len, 0)  # an all-zero tile reads no V
        v = _load_cache(V, _cache_rows(BT, keys, k_len, kv_base, stride_vb, stride_vt, PAGE_SIZE), offs_d,
                        keys < live_len, D)
        acc = _dot(a.to(v.dtype), v, UPCAST, PRECISION, acc)
    out = O_PART + (((split * (tl.num_programs(1) // Hkv) + b).to(tl.int64) * Tq + t[:, None]) * Hq + h[:, None]) * D
    tl.store(out + offs_d[None, :], acc, mask=row_mask[:, None] & (offs_d[None, :] < D))


@triton.jit
def _bwd_query_tile(Q, DO, TAU, QPOS, QSEG, LSE, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot,
                    Hq, Tq, Tk, GROUPS, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
    """Prologue shared by the Delta and dq kernels: one query tile of one query head. Grid: (cdiv(Tq, BM), B*Hq)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    hk = h // GROUPS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = rows < Tq
    q = _load_rows(Q + b * stride_qb + h * stride_qh, stride_qt, rows, offs_d, Tq, D)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, stride_dot, rows, offs_d, Tq, D)
    q_pos = tl.load(QPOS + b * Tq + rows, mask=row_mask, other=0)
    q_seg = tl.load(QSEG + b * Tq + rows, mask=row_mask, other=-4)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * Tq + rows, mask=row_mask, other=_DEAD_ROW_LSE)
    inv_n = 1.0 / (q_pos + 1).to(tl.float32)
    threshold = _row_threshold(tl.load(TAU + h), q_pos, lse)
    hi = tl.minimum(Tk, (pid_m + 1) * BLOCK_M + Tk - Tq)  # keys past the tile's last row are never visible
    return pid_m, pid_bh, b, h, hk, rows, offs_d, row_mask, q, do, q_pos, q_seg, lse, inv_n, threshold, hi


@triton.jit
def _lazy_bwd_delta_kernel(Q, K, V, TAU, BIAS, QPOS, KPOS, QSEG, KSEG, LSE, DO, DELTA, DTAU_PART,
                           stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                           stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                           Hq, Tq, Tk, W, GROUPS, scaling,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                           SKIP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Backward preprocess: the elastic-softmax Delta_i = sum_j m_ij p_ij dP_ij (NOT rowsum(dO * O)).

    Also writes this tile's d tau partial, sum_i (1/n_i) sum_j m_ij dP_ij, to DTAU_PART [B * Hq, q tiles].
    Only row sums live across the loop, so this sweep is light; all-dead key tiles read no V.
    """
    pid_m, pid_bh, b, h, hk, rows, offs_d, row_mask, q, do, q_pos, q_seg, lse, inv_n, threshold, hi = \
        _bwd_query_tile(Q, DO, TAU, QPOS, QSEG, LSE, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh,
                        stride_dot, Hq, Tq, Tk, GROUPS, BLOCK_M, BLOCK_D, D)
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
            p = tl.exp(s - lse[:, None])
            alive = visible & (p + threshold[:, None] > 0.0)
            if (tl.max(alive.to(tl.int32)) > 0) | (not SKIP):  # all-dead tile: m dP = 0, no V read
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
                        SKIP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dq_i = scaling * sum_j dS_ij k_j with dS = p (m dP - Delta), as in FlashAttention-2.

    dq stays dense (an all-dead tile still has dS = -p * Delta), but such a tile reads no V and skips dO V^T.
    """
    pid_m, pid_bh, b, h, hk, rows, offs_d, row_mask, q, do, q_pos, q_seg, lse, inv_n, threshold, hi = \
        _bwd_query_tile(Q, DO, TAU, QPOS, QSEG, LSE, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh,
                        stride_dot, Hq, Tq, Tk, GROUPS, BLOCK_M, BLOCK_D, D)
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
            p = tl.exp(s - lse[:, None])
            alive = visible & (p + threshold[:, None] > 0.0)
            if (tl.max(alive.to(tl.int32)) > 0) | (not SKIP):
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
                          SKIP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dk, dv for one key tile of one KV head (sum over its GROUPS query heads); d distance_bias partials.

    Grid: (cdiv(Tk, BN), B * Hkv). The bias partial of (batch, query head, key tile) is a private float32
    row of DBIAS_PART [B * Hq * cdiv(Tk, BN), W], reduced by the launcher; several entries of one tile share
    a distance, so the scatter into that private row uses `atomic_add` (no other program touches it).
    """
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
                p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
                a = tl.where(visible, tl.maximum(p + _row_threshold(threshold_h, q_pos, lse)[:, None], 0.0),
                             0.0)
                do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dot + offs_d[None, :],
                             mask=tile_mask, other=0.0)
                if (tl.max(a) > 0.0) | (not SKIP):
                    dp = _dot(do, tl.trans(v), UPCAST, PRECISION)
                    ds = p * (tl.where(a > 0.0, dp, 0.0) - delta[:, None])
                    dv += _dot(tl.trans(a.to(do.dtype)), do, UPCAST, PRECISION)
                else:  # every weight of the tile is zero: m = 0, so dS = -p * Delta and dv gets nothing
                    ds = -p * delta[:, None]
                dk += _dot(tl.trans(ds.to(q.dtype)), q, UPCAST, PRECISION)
                tl.atomic_add(dbias_row + dist, ds, mask=in_window)
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
# base + (r - c) (base = m0 + offset - n0). `_diagonal_sums` shears the dS tile (row r + c mod BM of column c) so
# that each row of the result holds one diagonal, or (wrapped entries) the diagonal BM below it: two [BM] float32
# atomics per tile into the query tile's private row instead of one per score. Key tiles beyond the window have
# no bias and no bias gradient.
# ---------------------------------------------------------------------------------------------------

_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _causal_bwd_tile(x, y, band, start, diagonal, visible, lse2, threshold, scale_log2,
                     BIAS: tl.constexpr, DIAGONAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """`(p, m)` of one (query tile, key tile) pair from `x y^T`: `[BM, BN]` from (q, k) with `lse2`, `threshold` as
    `[BM, 1]`, or transposed, `[BN, BM]` from (k, q) with them as `[1, BM]`. `DIAGONAL` tiles clear m where not
    `visible` (p is already 0 there from the band's -inf, but with tau > 0 p + tau/n > 0)."""
    s = _causal_scores(x, y, band, start, diagonal, scale_log2, BIAS, False, UPCAST, PRECISION)
    p = tl.exp2(s - lse2)
    alive = p + threshold > 0.0  # float32 threshold test
    if DIAGONAL:
        alive = alive & visible
    return p, alive


@triton.jit
def _diagonal_sums(t, ROWS: tl.constexpr, COLS: tl.constexpr):
    """`(near, wrapped)` `[ROWS]` float32 sums of a `[ROWS, COLS]` tile (COLS <= ROWS) along its diagonals: near[r]
    of the entries with row - column = r, wrapped[r] of those with row - column = r - ROWS."""
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, COLS)[None, :]
    sheared = tl.gather(t, (r + c) % ROWS, 0)  # sheared[r, c] = t[(r + c) mod ROWS, c]
    wrap = r + c >= ROWS
    return tl.sum(tl.where(wrap, 0.0, sheared), 1), tl.sum(tl.where(wrap, sheared, 0.0), 1)


@triton.jit
def _causal_bwd_query_tiles(q, do, lse2, threshold, delta, acc, K, V, stride_kt, stride_vt, band, diagonal,
                            q_key_idx, dbias_row, base, lo, hi, Tk, W, scale_log2, BLOCK_M: tl.constexpr,
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
        p, alive = _causal_bwd_tile(q, k, band, start_n, diagonal, keys[None, :] <= q_key_idx[:, None],
                                    lse2[:, None], threshold[:, None], scale_log2, BIAS, DIAGONAL, UPCAST, PRECISION)
        dp = tl.where(alive, _dot(do, tl.trans(v), UPCAST, PRECISION), 0.0)
        ds = p * (dp - delta[:, None])
        acc = _dot(ds.to(k.dtype), k, UPCAST, PRECISION, acc)
        if BIAS:  # two [BM] atomics per tile, into the program's private row
            near, wrapped = _diagonal_sums(ds, BLOCK_M, BLOCK_N)
            dist = base - start_n + tl.arange(0, BLOCK_M)
            tl.atomic_add(dbias_row + dist, near, mask=(dist >= 0) & (dist < W))
            tl.atomic_add(dbias_row + dist - BLOCK_M, wrapped, mask=(dist >= BLOCK_M) & (dist - BLOCK_M < W))
    return acc


@triton.jit
def _lazy_causal_bwd_delta_kernel(OUT, U, DO, TAU, QPOS, DELTA, DTAU_PART, stride_ob, stride_oh, stride_ot,
                                  stride_dob, stride_doh, stride_dot, Hq, Tq, BLOCK_M: tl.constexpr,
                                  BLOCK_D: tl.constexpr, D: tl.constexpr):
    """Causal fast path's Delta from the forward's U (the U identity, docs/design.md): with t_i = tau_h / n_i,
    `Delta_i = dO_i . (O_i - t_i U_i)` (= sum_j m p dP) and the tile's d tau partial `sum_i dO_i . U_i / n_i`
    (= sum_i sum_j m dP / n_i). OUT, U, DO `[B, Tq, Hq, D]` (strides `stride_o*` for OUT and U). No pass over the
    keys. O is read as stored (the input dtype, as FlashAttention's rowsum(dO * O) reads it), U in float32.
    Grid (cdiv(Tq, BM), B * Hq)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = rows < Tq
    mask = row_mask[:, None] & (offs_d[None, :] < D)
    offs = b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + offs_d[None, :]
    o = tl.load(OUT + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dot + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    inv_n = 1.0 / (tl.load(QPOS + b * Tq + rows, mask=row_mask, other=0) + 1).to(tl.float32)
    do_u = tl.sum(do * u, 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * Tq + rows, tl.sum(do * o, 1) - tl.load(TAU + h) * inv_n * do_u,
             mask=row_mask)
    tl.store(DTAU_PART + pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m, tl.sum(do_u * inv_n, 0))


@triton.jit
def _lazy_causal_bwd_dq_kernel(Q, K, V, TAU, BAND, QPOS, QSEG, LSE, DO, DELTA, DQ, DBIAS_PART,
                               stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                               stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                               Hq, Tq, Tk, W, GROUPS, BAND_LEN, scale_log2, scaling,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Causal fast path of `_lazy_bwd_dq_kernel`: dq_i = scaling sum_j dS_ij k_j over the forward's three key
    ranges, and the query tile's d distance_bias partial, a private float32 row of DBIAS_PART
    [B * Hq * cdiv(Tq, BM), W] (which no other program adds to). Grid (cdiv(Tq, BM), B * Hq)."""
    tl.static_assert(BLOCK_N <= BLOCK_M)  # `_diagonal_sums` wraps each column at most once
    pid_m, pid_bh, b, h, hk, rows, offs_d, row_mask, q, do, q_pos, _, lse, _, threshold, _ = _bwd_query_tile(
        Q, DO, TAU, QPOS, QSEG, LSE, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot,
        Hq, Tq, Tk, GROUPS, BLOCK_M, BLOCK_D, D)
    m0 = pid_m * BLOCK_M
    far, full, hi = _causal_key_ranges(m0, Tq, Tk, W, BLOCK_M, BLOCK_N)
    K_ = K + b * stride_kb + hk * stride_kh
    V_ = V + b * stride_vb + hk * stride_vh
    band = BAND + h * BAND_LEN + (BLOCK_M + BLOCK_N) + m0 + Tk - Tq  # band of distance m0 + offset - start_n
    diagonal = tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_N)[None, :]
    q_key_idx = rows + Tk - Tq
    lse2 = lse  # the causal forward stores log2 units; a dead row's DEAD_ROW_LSE gives p = 0 (threshold -1e30)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * Tq + rows, mask=row_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dbias_row = DBIAS_PART + (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m) * W
    args = (K_, V_, stride_kt, stride_vt, band, diagonal, q_key_idx, dbias_row, m0 + Tk - Tq)
    acc = _causal_bwd_query_tiles(q, do, lse2, threshold, delta, acc, *args, 0, far, Tk, W, scale_log2,
                                  BLOCK_M, BLOCK_N, BLOCK_D, D, False, False, UPCAST, PRECISION)
    acc = _causal_bwd_query_tiles(q, do, lse2, threshold, delta, acc, *args, far, full, Tk, W, scale_log2,
                                  BLOCK_M, BLOCK_N, BLOCK_D, D, True, False, UPCAST, PRECISION)
    acc = _causal_bwd_query_tiles(q, do, lse2, threshold, delta, acc, *args, full, hi, Tk, W, scale_log2,
                                  BLOCK_M, BLOCK_N, BLOCK_D, D, True, True, UPCAST, PRECISION)
    tl.store(DQ + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
             (acc * scaling).to(DQ.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < D))


@triton.jit
def _causal_dkdv_tiles(dk, dv, k, v, Q, DO, QPOS, LSE, DELTA, band, tau_h, n0, lo, hi, Tq, offset, stride_qt,
                       stride_dot, scale_log2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       D: tl.constexpr, BIAS: tl.constexpr, DIAGONAL: tl.constexpr, UPCAST: tl.constexpr,
                       PRECISION: tl.constexpr):
    """Query tiles [lo, hi) (step BM) of one key tile and one query head, on transposed `[BN, BM]` tiles:
    dk += dS^T Q, dv += a^T dO. Rows past Tq (last tile) read row Tq - 1 instead of masking (masked tile loads
    cost registers); their dead-row LSE makes p = 0 and m = 0, so they add nothing."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    keys = n0 + tl.arange(0, BLOCK_N)
    diagonal = offs_m[None, :] - tl.arange(0, BLOCK_N)[:, None]  # [BN, BM] row (query) - column (key)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        rows_in = tl.minimum(rows, Tq - 1)
        q = _load_keys(Q, stride_qt, rows_in, offs_d, Tq, D, BLOCK_D, False)
        do = _load_keys(DO, stride_dot, rows_in, offs_d, Tq, D, BLOCK_D, False)
        lse = tl.load(LSE + rows, mask=rows < Tq, other=_DEAD_ROW_LSE)
        threshold = _row_threshold(tau_h, tl.load(QPOS + rows_in), lse)[None, :]
        p, alive = _causal_bwd_tile(k, q, band + start_m, n0, diagonal, keys[:, None] <= (rows + offset)[None, :],
                                    lse[None, :], threshold, scale_log2, BIAS, DIAGONAL, UPCAST, PRECISION)
        dv = _dot(tl.where(alive, p + threshold, 0.0).to(do.dtype), do, UPCAST, PRECISION, dv)
        dp = tl.where(alive, _dot(v, tl.trans(do), UPCAST, PRECISION), 0.0)
        dk = _dot((p * (dp - tl.load(DELTA + rows_in)[None, :])).to(q.dtype), q, UPCAST, PRECISION, dk)
    return dk, dv


@triton.jit
def _lazy_causal_bwd_dkdv_kernel(Q, K, V, TAU, BAND, QPOS, LSE, DELTA, DO, DK, DV,
                                 stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                                 stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                                 stride_dkb, stride_dkh, stride_dkt, Hq, Tq, Tk, W, GROUPS, BAND_LEN, scale_log2,
                                 scaling, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                 D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Causal fast path of `_lazy_bwd_dkdv_kernel`: the dk, dv terms of one key tile from one query head (the bias
    gradient comes from the dq kernel). DK, DV `[B, Hq, Tk, D]` (strides `stride_dk*`): the gradients themselves
    without GQA, float32 per-query-head terms the launcher sums over each group with it (a loop over the group
    here would keep every loop's invariants live at once: spills). Grid: (cdiv(Tk, BN), B * Hq)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    hk = h // GROUPS
    n0 = pid_n * BLOCK_N
    offs_d = tl.arange(0, BLOCK_D)
    keys = n0 + tl.arange(0, BLOCK_N)
    k = _load_rows(K + b * stride_kb + hk * stride_kh, stride_kt, keys, offs_d, Tk, D)
    v = _load_rows(V + b * stride_vb + hk * stride_vh, stride_vt, keys, offs_d, Tk, D)
    offset = Tk - Tq
    # query tiles: [start, near) cross the causal limit, [near, far) see the whole key tile inside the bias window,
    # [far, Tq) see it entirely at distances >= W (min distance m0 + offset - (n0 + BN - 1))
    start = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M
    near = tl.maximum(start, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M)
    far = tl.maximum(near, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 + W - offset, 0), BLOCK_M) * BLOCK_M)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    bh = pid_bh.to(tl.int64)
    args = (k, v, Q + b * stride_qb + h * stride_qh, DO + b * stride_dob + h * stride_doh, QPOS + b * Tq,
            LSE + bh * Tq, DELTA + bh * Tq, BAND + h * BAND_LEN + (BLOCK_M + BLOCK_N) + offset, tl.load(TAU + h),
            n0)  # the band pointer + m0: the band of distance m0 + offset - n0
    dk, dv = _causal_dkdv_tiles(dk, dv, *args, start, tl.minimum(near, Tq), Tq, offset, stride_qt, stride_dot,
                                scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, D, True, True, UPCAST, PRECISION)
    dk, dv = _causal_dkdv_tiles(dk, dv, *args, near, tl.minimum(far, Tq), Tq, offset, stride_qt, stride_dot,
                                scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, D, True, False, UPCAST, PRECISION)
    dk, dv = _causal_dkdv_tiles(dk, dv, *args, far, Tq, Tq, offset, stride_qt, stride_dot,
                                scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, D, False, False, UPCAST, PRECISION)
    out = b * stride_dkb + h * stride_dkh + keys[:, None] * stride_dkt + offs_d[None, :]
    kv_mask = (keys[:, None] < Tk) & (offs_d[None, :] < D)
    tl.store(DK + out, (dk * scaling).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)

# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------

_DOT_PRECISION = {torch.float32: "ieee", torch.float16: "tf32", torch.bfloat16: "tf32"}


def _check_inputs(query: torch.Tensor, key: torch.Tensor) -> int:
    """The padded head dimension (power of two, >= 16); refuses what the kernels cannot run."""
    if query.dtype not in _DOT_PRECISION or key.dtype != query.dtype:
        raise TypeError(
            f"lazy_attention_triton runs float16, bfloat16 and float32 (query and key alike); got "
            f"{query.dtype} / {key.dtype}. Use LAZY_LLAMA_BACKEND=torch for other dtypes (e.g. float64)."
        )
    dim = query.shape[-1]
    if dim > MAX_HEAD_DIM:
        raise ValueError(f"lazy_attention_triton supports head_dim <= {MAX_HEAD_DIM}, got {dim}; "
                         "use LAZY_LLAMA_BACKEND=torch.")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]}).")
    return max(16, triton.next_power_of_2(dim))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _with_gradient_buffer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x, empty gradient with x's strides)`; x is made contiguous when its layout cannot be mirrored."""
    x = _last_dim_contiguous(x)
    grad = torch.empty_like(x)
    if grad.stride() != x.stride():  # e.g. a slice of a larger cache: kernels index both with x's strides
        x = x.contiguous()
        grad = torch.empty_like(x)
    return x, grad


def _device_splits(batch_heads: int, q_tiles: int, key_length: int, device: torch.device) -> int:
    """Split-K factor for short queries: enough programs to fill the GPU, each over >= SPLIT_MIN_KEYS keys."""
    if device.type != "cuda" or not torch.cuda.is_available():  # CPU (interpreter), or fake CUDA tensors (tracing)
        return 1
    programs = batch_heads * q_tiles
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), key_length // SPLIT_MIN_KEYS))


def _bias_band(distance_bias: torch.Tensor, scaling: float, block_m: int, block_n: int) -> torch.Tensor:
    """`[2, Hq, W + 2 (BM + BN)]` float32 for the causal fast path: at index `d + BM + BN`, `log2(e) beta_h(d)`
    (row 0, log2 units) and `beta_h(d) / scaling` (row 1, q.k units); -inf for d < 0 (keys after the row), 0 for
    d >= W (beyond the window)."""
    heads, window = distance_bias.shape
    neg = block_m + block_n
    bias = distance_bias.detach().to(torch.float32)
    rows = torch.stack([bias * LOG2E, bias / scaling])  # [2, Hq, W]
    # built with cat, not slice assignment: Python indexing of fake CUDA tensors fails on a CPU-only build (tracing)
    return torch.cat([rows.new_full((2, heads, neg), float("-inf")), rows, rows.new_zeros(2, heads, neg)], dim=-1)


def _strides(name: str, x: torch.Tensor, b: int = 0, h: int = 1, t: int = 2) -> dict[str, int]:
    """The kernel keywords `stride_{name}b, stride_{name}h, stride_{name}t` of `x`: its strides along the batch,
    head and token dims (`[B, H, T, D]` by default; `h=2, t=1` for a `[B, T, H, D]` tensor)."""
    return {f"stride_{name}b": x.stride(b), f"stride_{name}h": x.stride(h), f"stride_{name}t": x.stride(t)}


def _forward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling,
             skip=True, num_splits=None, with_stats=False):
    """Launch the general forward (any layout; the key offset is `Tk - Tq`). Returns `(out [B, Tq, Hq, D],
    lse [B, Hq, Tq] float32, stats int32 or None)`. Which launcher serves a call (this one, `_causal_forward`,
    `_packed_decode`) is the op layer's decision table (`lazy_attention_ops.choose_kernel`).

    `num_splits` (None: automatic) > 1 runs the split-K kernels (only used for query length <= 16). `stats` (only
    when `with_stats`) holds per program `(visited key tiles, visible key tiles)`.
    """
    block_d = _check_inputs(query, key)
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len, window = key.shape[1], key.shape[2], distance_bias.shape[-1]
    query, key, value = (_last_dim_contiguous(x) for x in (query, key, value))
    decode = q_len <= DECODE_MAX_ROWS
    block_m, block_n, num_warps, num_stages = _config("decode" if decode else "fwd", block_d,
                                                      _gpu_family(query.device))
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
        stats = torch.zeros(bsz * num_heads, q_tiles, 2, dtype=torch.int32, device=query.device) if with_stats else lse
        wrap_triton(_lazy_fwd_kernel)[(q_tiles, bsz * num_heads)](
            Q=query, K=key, V=value, TAU=tau, BIAS=bias, **positions, OUT=out, LSE=lse, STATS=stats,
            **q_strides, **k_strides, **v_strides, **_strides("o", out, h=2, t=1),
            **sizes, scaling=scaling, SKIP=skip, WITH_STATS=with_stats, **meta)
        return out, lse, stats if with_stats else None
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
    stats = (torch.zeros(num_splits, bsz * num_heads, q_tiles, 2, dtype=torch.int32, device=query.device)
             if with_stats else lse)
    wrap_triton(_lazy_fwd_split_out_kernel)[grid](
        Q=query, K=key, V=value, TAU=tau, BIAS=bias, **positions, LSE=lse, O_PART=o_part, STATS=stats,
        **q_strides, **k_strides, **v_strides, **sizes, KEYS_PER_SPLIT=keys_per_split, scaling=scaling,
        SKIP=skip, WITH_STATS=with_stats, **meta)
    out = o_part.sum(0).to(query.dtype)
    return out, lse, stats.sum(0) if with_stats else None


def _causal_forward(query, key, value, tau, distance_bias, q_pos, scaling, block_d, store_u=False):
    """The causal fast-path forward: `(out [B, Tq, Hq, D], lse [B, Hq, Tq] float32 in log2 units (what
    `_causal_backward` reads), u)`; `store_u` (training): u is
    `U_i = sum_j m_ij v_j`, `[B, Tq, Hq, D]` float32, for `_causal_backward`; otherwise None."""
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    kind = "causal_fwd_u" if store_u else "causal_fwd"
    block_m, block_n, num_warps, num_stages = _config(kind, block_d, _gpu_family(query.device))
    band = _bias_band(distance_bias, scaling, block_m, block_n)
    out = torch.empty(bsz, q_len, num_heads, dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(bsz, num_heads, q_len, dtype=torch.float32, device=query.device)
    u = torch.empty(bsz, q_len, num_heads, dim, dtype=torch.float32, device=query.device) if store_u else None
    wrap_triton(_lazy_causal_fwd_kernel)[(triton.cdiv(q_len, block_m), bsz * num_heads)](
        Q=query, K=key, V=value, TAU=tau.detach().to(torch.float32).contiguous(), BAND=band, QPOS=q_pos,
        OUT=out, LSE=lse, U=u if store_u else lse, STORE_U=store_u,
        **_strides("q", query), **_strides("k", key), **_strides("v", value), **_strides("o", out, h=2, t=1),
        Hq=num_heads, Tq=q_len, Tk=k_len, W=distance_bias.shape[-1], GROUPS=num_heads // kv_heads,
        BAND_LEN=band.shape[-1], scale_log2=scaling * LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, D=dim, UPCAST=_INTERPRET,
        PRECISION=_DOT_PRECISION[query.dtype], num_warps=num_warps, num_stages=num_stages)
    return out, lse, u



def _packed_decode(query, key, value, tau, distance_bias, q_pos, key_lengths, scaling, num_splits=None,
                   block_table=None, key_capacity=None):
    """Launch the packed decode: `(out [B, Tq, Hq, D], lse [B, Hq, Tq] float32)`.

    query `[B, Hq, Tq, D]`, Tq <= DECODE_MAX_ROWS; key, value `[B, Hkv, >= key length, D]`, or with
    `block_table [B, max blocks]` int32 the paged caches `[num_blocks, Hkv, page size, D]`; q_pos `[B, Tq]` int32
    (n = q_pos + 1); key_lengths `[B]` int32: query row t of batch row b stands at key index
    `key_lengths[b] - Tq + t`. `key_capacity` bounds the key lengths (default: the key buffer's length, paged: max
    blocks x page size); the float32 score scratch holds `B x Hq x Tq x key_capacity`. `num_splits`: None, automatic.
    """
    block_d = _check_inputs(query, key)
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, window = key.shape[1], distance_bias.shape[-1]
    groups = num_heads // kv_heads
    page_size = 0 if block_table is None else key.shape[2]
    if key_capacity is None:
        key_capacity = key.shape[2] if block_table is None else block_table.shape[1] * page_size
    block_m, block_n, num_warps, num_stages = _config("packed_decode", block_d, _gpu_family(query.device))
    row_tiles = triton.cdiv(groups * q_len, block_m)
    if num_splits is None:
        num_splits = _device_splits(bsz * kv_heads, row_tiles, key_capacity, query.device)
    keys_per_split = triton.cdiv(triton.cdiv(key_capacity, num_splits), block_n) * block_n
    num_splits = triton.cdiv(key_capacity, keys_per_split)
    grid = (num_splits, bsz * kv_heads, row_tiles)
    band = _bias_band(distance_bias, scaling, block_m, block_n)
    f32 = dict(dtype=torch.float32, device=query.device)
    scores = torch.empty(bsz, num_heads, q_len, key_capacity, **f32)
    m_part = torch.empty(num_splits, bsz, num_heads, q_len, **f32)
    l_part = torch.empty_like(m_part)
    paging = dict(KLEN=key_lengths, BLOCK_TABLE=key_lengths if block_table is None else block_table,
                  stride_tb=0 if block_table is None else block_table.stride(0), PAGE_SIZE=page_size)
    sizes = dict(Hq=num_heads, Hkv=kv_heads, Tq=q_len, GROUPS=groups, KEYS_PER_SPLIT=keys_per_split,
                 KEY_CAPACITY=key_capacity)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, D=dim, UPCAST=_INTERPRET,
                PRECISION=_DOT_PRECISION[query.dtype], num_warps=num_warps, num_stages=num_stages)
    wrap_triton(_lazy_decode_lse_kernel)[grid](
        Q=query, K=key, BAND=band, **paging, SCORES=scores, M_PART=m_part, L_PART=l_part, **_strides("q", query),
        **_strides("k", key), **sizes, W=window, BAND_LEN=band.shape[-1], scale_log2=scaling * LOG2E, **meta)
    m_max = m_part.amax(0)
    l_sum = (l_part * torch.exp2(m_part - m_max)).sum(0)
    alive = l_sum > 0
    lse2 = torch.where(alive, m_max + torch.log2(torch.where(alive, l_sum, 1.0)), DEAD_ROW_LSE)
    o_part = torch.empty(num_splits, bsz, q_len, num_heads, dim, **f32)
    wrap_triton(_lazy_decode_out_kernel)[grid](
        V=value, TAU=tau.detach().to(torch.float32).contiguous(), QPOS=q_pos, **paging, SCORES=scores, LSE2=lse2,
        O_PART=o_part, **_strides("v", value), **sizes, **meta)
    lse = torch.where(alive, lse2 * LN2, DEAD_ROW_LSE)
    return o_part.sum(0).to(query.dtype), lse


def _varlen_tiles(query_start_loc, num_tokens, block_m, max_query_len=None):
    """`[programs, 2]` int32 work list of the varlen paged prefill, built on the device (no host sync): (request,
    first query row) for every `block_m`-row tile of every request, then (-1, 0) for the spare programs of the upper
    bound `sum_r cdiv(q_len_r, BM) <= (T + R (BM - 1)) // BM` (and <= R cdiv(max_query_len, BM))."""
    q_lens = query_start_loc.diff().to(torch.int64)
    requests = q_lens.numel()
    programs = (num_tokens + requests * (block_m - 1)) // block_m
    if max_query_len is not None:
        programs = min(programs, requests * triton.cdiv(max_query_len, block_m))
    tiles = (q_lens + block_m - 1) // block_m
    ends = tiles.cumsum(0)
    index = torch.arange(programs, device=query_start_loc.device)
    request = torch.searchsorted(ends, index, right=True)
    live = request < requests
    request = request.clamp(max=requests - 1)
    first = (index - (ends - tiles).index_select(0, request)) * block_m
    return torch.stack([torch.where(live, request, -1), torch.where(live, first, 0)], 1).to(torch.int32).contiguous()


def _paged_prefill(query, key, value, block_table, query_start_loc, seq_lens, tau, distance_bias, scaling,
                   max_query_len=None):
    """Launch the varlen paged prefill: `out [T, Hq, D]`. query `[T, Hq, D]`; key, value the paged caches
    `[num_blocks, Hkv, page size, D]`; block_table `[R, max blocks]`, query_start_loc `[R + 1]`, seq_lens `[R]`
    int32."""
    block_d = _check_inputs(query, key)
    num_tokens, num_heads, dim = query.shape
    block_m, block_n, num_warps, num_stages = _config("paged_fwd", block_d, _gpu_family(query.device))
    out = torch.empty_like(query)
    tiles = _varlen_tiles(query_start_loc, num_tokens, block_m, max_query_len)
    if tiles.shape[0] == 0:
        return out
    band = _bias_band(distance_bias, scaling, block_m, block_n)
    wrap_triton(_lazy_paged_fwd_kernel)[(tiles.shape[0], num_heads)](
        Q=query, K=key, V=value, TAU=tau.detach().to(torch.float32).contiguous(), BAND=band, BLOCK_TABLE=block_table,
        QUERY_START=query_start_loc, KLEN=seq_lens, TILES=tiles, OUT=out,
        stride_qt=query.stride(0), stride_qh=query.stride(1), **_strides("k", key), **_strides("v", value),
        stride_tb=block_table.stride(0), stride_ot=out.stride(0), stride_oh=out.stride(1),
        Hq=num_heads, W=distance_bias.shape[-1], GROUPS=num_heads // key.shape[1], BAND_LEN=band.shape[-1],
        scale_log2=scaling * LOG2E, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, D=dim, PAGE_SIZE=key.shape[2],
        UPCAST=_INTERPRET, PRECISION=_DOT_PRECISION[query.dtype], num_warps=num_warps, num_stages=num_stages)
    return out

def _backward(grad_out, query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse, scaling,
              skip=True, causal=False, out=None, u=None):
    """Launch Delta (with d tau partials), dq, then dk/dv (with d distance_bias partials); no atomics across programs.

    `causal` (the metadata's plain causal layout) runs the causal fast path for query lengths > 16, as the forward
    does (`skip` is ignored there); it needs the forward's `out` and `u` (`_forward(..., store_u=True)`).
    Returns `(dq, dk, dv, d_tau [Hq] float32, d_bias [Hq, W] float32)`."""
    block_d = _check_inputs(query, key)
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len, window = key.shape[1], key.shape[2], distance_bias.shape[-1]
    (query, dq), (key, dk), (value, dv) = (_with_gradient_buffer(x) for x in (query, key, value))
    grad_out = _last_dim_contiguous(grad_out)
    if causal and q_len > DECODE_MAX_ROWS:
        if out is None or u is None:
            raise ValueError("the causal fast-path backward needs the forward's out and U (store_u=True)")
        return _causal_backward(grad_out, query, key, value, dq, dk, dv, tau, distance_bias, q_pos, q_seg, lse,
                                scaling, block_d, out, u)
    groups = num_heads // kv_heads
    tau32 = tau.detach().to(torch.float32).contiguous()
    bias32 = distance_bias.detach().to(torch.float32).contiguous()
    common = dict(BLOCK_D=block_d, D=dim, SKIP=skip, UPCAST=_INTERPRET, PRECISION=_DOT_PRECISION[query.dtype])
    family = _gpu_family(query.device)
    delta_m, delta_n, delta_warps, delta_stages = _config("delta", block_d, family)
    dq_m, dq_n, dq_warps, dq_stages = _config("dq", block_d, family)
    kv_m, kv_n, kv_warps, kv_stages = _config("dkdv", block_d, family)
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
    return dq, dk, dv, dtau_part.sum(dim=(0, 2)), dbias_part.sum(dim=(0, 2))


def _causal_backward(grad_out, query, key, value, dq, dk, dv, tau, distance_bias, q_pos, q_seg, lse, scaling,
                     block_d, out, u):
    """The causal fast-path backward (after `_causal_forward` with `store_u`: its `out` and `u`): Delta from U, dq,
    dk/dv; `_backward`'s results."""
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, k_len, window = key.shape[1], key.shape[2], distance_bias.shape[-1]
    family = _gpu_family(query.device)
    tau32 = tau.detach().to(torch.float32).contiguous()
    common = dict(Q=query, K=key, V=value, TAU=tau32, QPOS=q_pos, LSE=lse, DO=grad_out,
                  **_strides("q", query), **_strides("k", key), **_strides("v", value),
                  **_strides("do", grad_out, h=2, t=1), Hq=num_heads, Tq=q_len, Tk=k_len, W=window,
                  GROUPS=num_heads // kv_heads, scale_log2=scaling * LOG2E, BLOCK_D=block_d, D=dim, UPCAST=_INTERPRET,
                  PRECISION=_DOT_PRECISION[query.dtype])

    def launch(kernel, kind, programs, **arguments):  # programs(BM, BN) -> grid; each kernel its own band
        block_m, block_n, num_warps, num_stages = _config(kind, block_d, family)
        band = _bias_band(distance_bias, scaling, block_m, block_n)
        wrap_triton(kernel)[programs(block_m, block_n)](**common, **arguments, BAND=band, BAND_LEN=band.shape[-1],
                                           BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
                                           num_stages=num_stages)

    query_tiles = lambda block_m, block_n: (triton.cdiv(q_len, block_m), bsz * num_heads)  # noqa: E731
    delta = torch.empty(bsz, num_heads, q_len, dtype=torch.float32, device=query.device)
    delta_m, _, delta_warps, delta_stages = _config("causal_delta", block_d, family)
    dtau_part = torch.empty(bsz, num_heads, triton.cdiv(q_len, delta_m), dtype=torch.float32, device=query.device)
    wrap_triton(_lazy_causal_bwd_delta_kernel)[query_tiles(delta_m, None)](
        OUT=out, U=u, DO=grad_out, TAU=tau32, QPOS=q_pos, DELTA=delta, DTAU_PART=dtau_part,
        **_strides("o", out, h=2, t=1), **_strides("do", grad_out, h=2, t=1), Hq=num_heads, Tq=q_len,
        BLOCK_M=delta_m, BLOCK_D=block_d, D=dim, num_warps=delta_warps, num_stages=delta_stages)
    dbias_part = torch.zeros(bsz, num_heads, triton.cdiv(q_len, _config("causal_dq", block_d, family)[0]), window,
                             dtype=torch.float32, device=query.device)
    launch(_lazy_causal_bwd_dq_kernel, "causal_dq", query_tiles, QSEG=q_seg, DELTA=delta, DQ=dq, DBIAS_PART=dbias_part,
           scaling=scaling)
    groups = num_heads // kv_heads  # with GQA: float32 terms per query head, summed over each group below
    dk_out, dv_out = (dk, dv) if groups == 1 else (
        torch.empty(bsz, num_heads, k_len, dim, dtype=torch.float32, device=query.device) for _ in range(2))
    launch(_lazy_causal_bwd_dkdv_kernel, "causal_dkdv",
           lambda block_m, block_n: (triton.cdiv(k_len, block_n), bsz * num_heads), DELTA=delta, DK=dk_out,
           DV=dv_out, **_strides("dk", dk_out), scaling=scaling)
    if groups > 1:
        dk.copy_(dk_out.view(bsz, kv_heads, groups, k_len, dim).sum(2))
        dv.copy_(dv_out.view(bsz, kv_heads, groups, k_len, dim).sum(2))
    return dq, dk, dv, dtau_part.sum(dim=(0, 2)), dbias_part.sum(dim=(0, 2))


def _kernel_inputs(key, value, metadata: "LazyMetadata"):
    """`(key, value, (q_pos, k_pos, q_seg, k_seg) int32)`: keys cut to the metadata (a static cache hands over
    a longer buffer) and the per-token metadata the kernels read."""
    if metadata.static_buffer:  # the kernels take the key offset from the shapes (Tk - Tq)
        raise ValueError("lazy_attention_triton needs an int key_offset (keys cut to the written length); a static "
                         "cache's whole buffer (torch.compile) goes to the PyTorch path.")
    k_len = metadata.key_length
    return key[:, :, :k_len], value[:, :, :k_len], (metadata.q_pos32, metadata.k_pos32, metadata.q_seg, metadata.k_seg)


# ---------------------------------------------------------------------------------------------------
# The public functions (the operators and autograd live in lazy_attention_ops)
# ---------------------------------------------------------------------------------------------------


def lazy_attention_triton(query, key, value, tau, distance_bias, metadata: "LazyMetadata", scaling):
    """Lazy Attention with the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), whatever
    `LAZY_LLAMA_BACKEND` says: `lazy_attention_ops.lazy_attention(..., backend="triton")`.

    Args:
        query: `[B, Hq, Tq, D]`; key, value: `[B, Hkv, >= Tk, D]` (float16, bfloat16 or float32; views allowed).
        tau: `[Hq]` float32; distance_bias: `[Hq, W]` float32.
        metadata: the call's `LazyMetadata` (see `lazy_attention_reference`).
        scaling: score scale (head_dim ** -0.5).
    Returns:
        `out [B, Tq, Hq, D]` in the query dtype; differentiable in query, key, value, tau, distance_bias.
    """
    from .lazy_attention_ops import lazy_attention  # the op layer imports this file

    return lazy_attention(query, key, value, tau, distance_bias, metadata, scaling, backend="triton")


def lazy_attention_triton_paged_decode(query, kv_cache, block_table, seq_lens, tau, distance_bias, scaling,
                                       max_seq_len=None):
    """Lazy Attention for one new token per request against vLLM's paged cache (forward only).

    Args:
        query: `[R, Hq, D]`, the token of request r at position `seq_lens[r] - 1` (its key already in the cache).
        kv_cache: one layer's `[num_blocks, Hkv, block_size, 2 D]`: K in the first D channels, V in the last D.
            Or a `(key_cache, value_cache)` pair of `[num_blocks, Hkv, block_size, D]` views (any strides).
        block_table: `[R, max_blocks]` int32; key j of request r is in block `block_table[r, j // block_size]`,
            slot `j % block_size`.
        seq_lens: `[R]` keys per request (the new token's included); keys beyond them are never read.
        tau: `[Hq]` float32; distance_bias: `[Hq, W]` float32; scaling: score scale.
        max_seq_len: an upper bound of seq_lens (int; sizes the float32 score scratch, `R x Hq x max_seq_len`);
            default `max_blocks x block_size`.
    Returns:
        `[R, Hq, D]` in the query dtype.
    """
    key, value = _cache_halves(query, kv_cache)
    seq_lens = seq_lens.to(device=query.device, dtype=torch.int32).contiguous()
    q_pos = (seq_lens - 1).unsqueeze(1).contiguous()
    out, _ = _packed_decode(_last_dim_contiguous(query).unsqueeze(2), key, value, tau, distance_bias, q_pos, seq_lens,
                            float(scaling), block_table=block_table.to(torch.int32).contiguous(),
                            key_capacity=max_seq_len)
    return out.select(1, 0)


def lazy_attention_triton_paged(query, kv_cache, block_table, query_start_loc, seq_lens, tau, distance_bias, scaling,
                                max_query_len=None, max_seq_len=None, num_decodes=0):
    """Lazy Attention for a mixed batch of vLLM requests (whole prompts, prompt chunks, decode tokens) against the
    paged cache (forward only). K and V are read through the block table, never gathered.

    Args:
        query: `[T, Hq, D]`; request r owns rows `query_start_loc[r] : query_start_loc[r + 1]` (q_len_r of them),
            its row i at position `seq_lens[r] - q_len_r + i` (its keys already in the cache); causal.
        kv_cache, block_table, tau, distance_bias, scaling: as in `lazy_attention_triton_paged_decode`.
        query_start_loc: `[R + 1]` int32 cumulative query lengths (0 first); seq_lens: `[R]` keys per request.
        max_query_len: an upper bound of the q_len_r (int; sizes the grid; None: bounded by T and R).
        max_seq_len: for the packed decode (its score scratch); the varlen kernel needs no bound.
        num_decodes: the first `num_decodes` requests have one query row each (vLLM orders decode requests first):
            they run the packed decode (`lazy_attention_triton_paged_decode`: a GQA group per tile, split-K), the
            others the varlen kernel, where a decode token would take a whole query tile per head. `max_query_len=1`
            with T == R means every request.
    Returns:
        `[T, Hq, D]` in the query dtype.
    """
    if max_query_len == 1 and query.shape[0] == seq_lens.shape[0]:
        num_decodes = query.shape[0]
    decoded = None
    if num_decodes:
        decoded = lazy_attention_triton_paged_decode(query.narrow(0, 0, num_decodes), kv_cache,
                                                     block_table.narrow(0, 0, num_decodes),
                                                     seq_lens.narrow(0, 0, num_decodes), tau, distance_bias, scaling,
                                                     max_seq_len)
        if num_decodes == query.shape[0]:
            return decoded
    key, value = _cache_halves(query, kv_cache)
    int32 = dict(device=query.device, dtype=torch.int32)
    rest = lambda x: x.narrow(0, num_decodes, x.shape[0] - num_decodes)  # noqa: E731 (narrow: see _bias_band)
    out = _paged_prefill(_last_dim_contiguous(rest(query)), key, value, rest(block_table).to(**int32).contiguous(),
                         (rest(query_start_loc) - num_decodes).to(**int32).contiguous(),
                         rest(seq_lens).to(**int32).contiguous(), tau, distance_bias, float(scaling), max_query_len)
    return out if decoded is None else torch.cat([decoded, out])


def _cache_halves(query, kv_cache):
    """`(K, V)` views `[num_blocks, Hkv, block_size, D]` of one layer's vLLM cache: `[..., 2 D]` (K first), or a
    `(key_cache, value_cache)` pair of such views with any strides but contiguous channels (e.g. pages that hold a
    block's keys, then its values)."""
    dim = query.shape[-1]
    if isinstance(kv_cache, (tuple, list)):
        key, value = kv_cache
        if key.shape != value.shape or key.dim() != 4 or key.shape[-1] != dim or key.stride(-1) != 1 \
                or value.stride(-1) != 1:
            raise ValueError(f"key/value caches must be [num_blocks, Hkv, block_size, {dim}] views with contiguous "
                             f"channels, got shapes {tuple(key.shape)}, {tuple(value.shape)}")
        return key, value
    if kv_cache.shape[-1] != 2 * dim or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache's last dim must hold K and V of head_dim {dim} ({2 * dim} contiguous channels), "
                         f"got shape {tuple(kv_cache.shape)}, strides {kv_cache.stride()}")
    return kv_cache.narrow(-1, 0, dim), kv_cache.narrow(-1, dim, dim)


def lazy_attention_tile_stats(query, key, value, tau, distance_bias, metadata: "LazyMetadata", scaling,
                              num_splits=None):
    """Forward once with counters (benchmarks only; synchronises): key tiles pass 2 visited vs visible.

    Returns `(visited, visible, density)`: the number of (query tile, key tile) pairs whose `a @ V` product
    pass 2 computed, the number with any visible (causal, same-document, non-padding) entry, and their ratio.
    """
    key, value, positions = _kernel_inputs(key, value, metadata)
    _, _, stats = _forward(query, key, value, tau, distance_bias, *positions, scaling,
                           num_splits=num_splits, with_stats=True)
    visited, visible = (int(x) for x in stats.view(-1, 2).sum(0).tolist())
    return visited, visible, visited / max(1, visible)


__all__ = ["lazy_attention_triton", "lazy_attention_triton_paged",
           "lazy_attention_triton_paged_decode", "lazy_attention_tile_stats"]
