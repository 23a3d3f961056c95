"""Lazy Attention Triton packed decode: the kernels and their launcher `_packed_decode`.

The causal layout with query length <= DECODE_MAX_ROWS (the model's decode steps and short chunks), and vLLM's
paged cache (`lazy_llama_vllm/lazy_attention_paged_triton.py` calls `_packed_decode` with a block table). Shared
helpers (`_causal_scores`, `_cache_rows`, the band), constants and the block table live in
lazy_attention_triton_common.py; the operator that launches it is in lazy_attention_ops.py.
"""

import torch
from torch.library import wrap_triton  # a launch torch.compile / make_fx can trace (plain launch in eager)

from .lazy_attention_triton_common import (
    _DEAD_ROW_LSE,
    _DOT_PRECISION,
    _INTERPRET,
    LN2,
    LOG2E,
    ForwardResult,
    _cache_rows,
    _causal_scores,
    _check_inputs,
    _device_splits,
    _dot,
    _kept_band,
    _launch_config,
    _row_threshold,
    _scores,
    _strides,
    _visible,
    tl,
    triton,
)

LN2_ = tl.constexpr(LN2)  # as the kernels see it

# ---------------------------------------------------------------------------------------------------
# Packed decode (plain layout, query length <= DECODE_MAX_ROWS; and vLLM's paged cache). The query heads of one
# GQA group times the query rows are packed as the rows of one tile (`r = g * Tq + t`; rows past G * Tq repeat the
# last one and are not stored), so one program reads each K and V tile of its slice of keys (split-K) once per KV
# head. Query row t of batch row b stands at key index `k_len_b - Tq + t` (`k_len_b`: that row's key length; the
# keys beyond it are invisible, whatever the cache holds there); its distance to key j is that index minus j and
# n = q_pos + 1. Scores are in log2 units (exp2), the distance bias from the causal fast path's band. Two passes:
#     _lazy_decode_lse_kernel   scores of the slice, kept in a float32 scratch (4 bytes per real row and key, less
#                               than re-reading K), and the slice's partial row max / sum of exp2
#     _lazy_decode_out_kernel   combines the partials into each row's log-sum-exp (every program of the row, no
#                               launch in between), then reads the kept scores, not K: weights ReLU(p + tau/n),
#                               `a @ V`; a V tile whose
#                               weights are all zero for every row of the group is not read (its load is masked off)
# Pass 1 runs two loops: keys at distance >= W from every row (no bias, every key visible), then the keys from there
# to the slice's end (band gather; the band's -inf past the causal limit). Pass 2 runs one loop with the causal
# `where` on every tile: without it Triton computes the weights in the `a @ V` operand layout, replicated over the
# warps (4x the exp2). Loads carry masks but no `if`, so Triton pipelines them. PAGE_SIZE > 0: key j of batch row b
# lives in block BLOCK_TABLE[b, j // PAGE_SIZE], slot j % PAGE_SIZE, of a `[num_blocks, Hkv, PAGE_SIZE, D]` cache
# (stride_kb / stride_vb step over blocks).
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _load_cache(ptr, offsets, offs_d, key_mask, D: tl.constexpr):
    """`[BN, BLOCK_D]` cache rows at `offsets`; rows where `key_mask` is false (and columns >= D) read as 0."""
    return tl.load(ptr + offsets[:, None] + offs_d[None, :], mask=key_mask[:, None] & (offs_d[None, :] < D),
                   other=0.0)


@triton.jit
def _decode_rows(k_len, k_start, stride_b, stride_h, Hkv, Tq, GROUPS, KEYS_PER_SPLIT, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Prologue of both decode passes (`k_len`, `k_start`: the program's sequence's key count and first visible key,
    loaded by the kernel: an index helper takes no tensor, see `_query_tile_ids` in lazy_attention_triton_forward.py).
    Grid: (splits, B * Hkv, cdiv(GROUPS * Tq, BM)). Returns the program's packed rows (query head `h`, query row `t`,
    flat `(b, h, t)` index `row_id`), their key indices, its keys [lo, hi) (lo from the key tile holding `k_start`)
    and the cache offset of its KV head."""
    split = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = pid_bkv // Hkv
    hk = pid_bkv % Hkv
    packed = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = packed < GROUPS * Tq
    rows = tl.minimum(packed, GROUPS * Tq - 1)  # padding rows repeat the last row: their loads need no mask
    h = hk * GROUPS + rows // Tq
    t = rows % Tq
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(lo + KEYS_PER_SPLIT, k_len)
    lo = tl.maximum(lo, k_start // BLOCK_N * BLOCK_N)  # left padding: key tiles before the first real key are skipped
    if PAGE_SIZE > 0:
        kv_base = hk.to(tl.int64) * stride_h
    else:
        kv_base = b.to(tl.int64) * stride_b + hk.to(tl.int64) * stride_h
    row_id = pid_bkv.to(tl.int64) * GROUPS * Tq + rows
    return split, b, h, t, row_id, row_mask, k_len - Tq + t, lo, hi, kv_base


@triton.jit
def _decode_lse_tiles(q, m_i, l_i, K, BT, kv_base, scores, row_mask, band, diagonal, lo, hi, k_len, k_start,
                      stride_kb, stride_kt, scale_log2, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      D: tl.constexpr, PAGE_SIZE: tl.constexpr, BIAS: tl.constexpr, KEY_START: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr, KEY_MASK: tl.constexpr = False, q_seg=None,
                      q_pos=None, q_key_idx=None, KSEG=None, KPOS=None, W=0):
    """Decode pass 1 over key tiles [lo, hi): scores (log2 units) to `scores + key`, running row max / sum of exp2;
    `KEY_START`: keys before `k_start` (left padding) score -inf. `KEY_MASK`: any layout (the batch row's segments
    `KSEG` and positions `KPOS`, the rows' `q_seg`, `q_pos`): invisible keys score -inf, the band (row 0, log2
    units, `band` at distance 0) is gathered at each pair's position distance."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = _load_cache(K, _cache_rows(BT, keys, k_len, kv_base, stride_kb, stride_kt, PAGE_SIZE), offs_d,
                        keys < k_len, D)
        if KEY_MASK:
            visible = _visible(q_seg, q_key_idx, KSEG, keys, k_len)
            s = _scores(q, k, KPOS, band, q_pos, visible, keys, k_len, W, scale_log2, UPCAST, PRECISION)
        else:
            s = _causal_scores(q, k, band, start_n, diagonal, scale_log2, BIAS, True, UPCAST, PRECISION)  # [BM, BN]
        if KEY_START:
            s = tl.where((keys >= k_start)[None, :], s, float("-inf"))
        tl.store(scores + keys[None, :], s, mask=row_mask[:, None] & (keys < hi)[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _lazy_decode_lse_kernel(Q, K, BAND, KLEN, KSTART, BLOCK_TABLE, QPOS, QSEG, KSEG, KPOS, SCORES, M_PART, L_PART,
                            stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_tb, stride_sb,
                            Hq, Hkv, Tq, W, GROUPS, KEYS_PER_SPLIT, KEY_CAPACITY, BAND_LEN, scale_log2,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                            PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                            KEY_START: tl.constexpr = False, KEY_MASK: tl.constexpr = False):
    """Decode pass 1: scores -> SCORES [B, Hq, Tq, KEY_CAPACITY] (log2 units), partial row max / sum of exp2 ->
    M_PART, L_PART [splits, B, Hq, Tq]. `KEY_START`: batch row b's keys start at KSTART[b] (left padding).
    `KEY_MASK`: any layout: query row (b, t) sees key j when QSEG[b, t] == KSEG[b, j] and j is not after it, at
    distance QPOS[b, t] - KPOS[b, j] (`stride_sb`: the batch stride of KSEG and KPOS; one loop, the band gathered).
    Grid: (splits, B * Hkv, cdiv(GROUPS * Tq, BM))."""
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor passes Python floats as float64
    k_len = tl.minimum(tl.load(KLEN + tl.program_id(1) // Hkv), KEY_CAPACITY)  # never past the score scratch
    k_start = tl.load(KSTART + tl.program_id(1) // Hkv) if KEY_START else 0
    split, b, h, t, row_id, row_mask, q_key_idx, lo, hi, kv_base = _decode_rows(
        k_len, k_start, stride_kb, stride_kh, Hkv, Tq, GROUPS, KEYS_PER_SPLIT, BLOCK_M, BLOCK_N, PAGE_SIZE)
    BT = BLOCK_TABLE + b.to(tl.int64) * stride_tb
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None].to(tl.int64) * stride_qh + t[:, None] * stride_qt
                + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
    far = tl.maximum(k_len - Tq - W + 1, 0) // BLOCK_N * BLOCK_N  # keys below it are >= W behind every row
    band = (BAND + h * BAND_LEN + BLOCK_M + BLOCK_N)[:, None]  # + distance: log2(e) beta_h(distance)
    diagonal = q_key_idx[:, None] - tl.arange(0, BLOCK_N)[None, :]  # distance of tile column n, + start_n
    scores = (SCORES + row_id * KEY_CAPACITY)[:, None]
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a tile of -inf scores keeps exp2() at 0, never NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if KEY_MASK:  # positions, not key indices, give the distances: no far loop
        meta = b.to(tl.int64) * stride_sb
        m_i, l_i = _decode_lse_tiles(q, m_i, l_i, K, BT, kv_base, scores, row_mask, band, diagonal, lo, hi, k_len,
                                     k_start, stride_kb, stride_kt, scale_log2, BLOCK_N, BLOCK_D, D, PAGE_SIZE, True,
                                     False, UPCAST, PRECISION, True, tl.load(QSEG + b * Tq + t),
                                     tl.load(QPOS + b * Tq + t), q_key_idx, KSEG + meta, KPOS + meta, W)
    else:
        m_i, l_i = _decode_lse_tiles(q, m_i, l_i, K, BT, kv_base, scores, row_mask, band, diagonal, lo,
                                     tl.minimum(hi, far), k_len, k_start, stride_kb, stride_kt, scale_log2, BLOCK_N,
                                     BLOCK_D, D, PAGE_SIZE, False, KEY_START, UPCAST, PRECISION)
        m_i, l_i = _decode_lse_tiles(q, m_i, l_i, K, BT, kv_base, scores, row_mask, band + Hq * BAND_LEN, diagonal,
                                     tl.maximum(lo, far), hi, k_len, k_start, stride_kb, stride_kt, scale_log2,
                                     BLOCK_N, BLOCK_D, D, PAGE_SIZE, True, KEY_START, UPCAST, PRECISION)
    part = (split * tl.num_programs(1) * GROUPS * Tq).to(tl.int64) + row_id  # [splits, B, Hq, Tq]
    tl.store(M_PART + part, m_i, mask=row_mask)
    tl.store(L_PART + part, l_i, mask=row_mask)


@triton.jit
def _lazy_decode_out_kernel(V, TAU, QPOS, KLEN, KSTART, BLOCK_TABLE, QSEG, KSEG, SCORES, M_PART, L_PART, LSE, O_PART,
                            stride_vb, stride_vh, stride_vt, stride_tb, stride_sb,
                            Hq, Hkv, Tq, GROUPS, KEYS_PER_SPLIT, KEY_CAPACITY, NUM_SPLITS,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                            PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                            KEY_START: tl.constexpr = False, STORE_LSE: tl.constexpr = True,
                            KEY_MASK: tl.constexpr = False):
    """Decode pass 2: each row's log-sum-exp from pass 1's partials (log2 units; DEAD_ROW_LSE for a row without a
    normaliser), then the outputs of one key slice -> O_PART [splits, B, Tq, Hq, D] (float32 partials summed after;
    with one split the output itself, in its dtype). `STORE_LSE`: the first split also stores LSE [B, Hq, Tq] in
    natural units (a backward's; inference skips it). `KEY_MASK`: any layout, as in pass 1 (weights of keys a row
    does not see are 0; a key no row of the tile sees is not read)."""
    k_len = tl.minimum(tl.load(KLEN + tl.program_id(1) // Hkv), KEY_CAPACITY)
    k_start = tl.load(KSTART + tl.program_id(1) // Hkv) if KEY_START else 0
    split, b, h, t, row_id, row_mask, q_key_idx, lo, hi, kv_base = _decode_rows(
        k_len, k_start, stride_vb, stride_vh, Hkv, Tq, GROUPS, KEYS_PER_SPLIT, BLOCK_M, BLOCK_N, PAGE_SIZE)
    BT = BLOCK_TABLE + b.to(tl.int64) * stride_tb
    scores = (SCORES + row_id * KEY_CAPACITY)[:, None]
    m_max = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    for part in range(0, NUM_SPLITS):  # the split-K combine of pass 1's partials, in every program of the row
        index = part * tl.num_programs(1) * GROUPS * Tq + row_id
        m_part = tl.load(M_PART + index)
        m_new = tl.maximum(m_max, m_part)
        l_sum = l_sum * tl.exp2(m_max - m_new) + tl.load(L_PART + index) * tl.exp2(m_part - m_new)
        m_max = m_new
    alive = l_sum > 0.0
    lse2 = tl.where(alive, m_max + tl.log2(tl.where(alive, l_sum, 1.0)), _DEAD_ROW_LSE)
    if STORE_LSE:  # by the first split
        tl.store(LSE + row_id, tl.where(alive, lse2 * LN2_, _DEAD_ROW_LSE), mask=row_mask & (t * 0 + split == 0))
    threshold = _row_threshold(tl.load(TAU + h), tl.load(QPOS + b * Tq + t), lse2)
    q_seg = tl.load(QSEG + b * Tq + t) if KEY_MASK else 0
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        s = tl.load(scores + keys[None, :], mask=(keys < hi)[None, :], other=float("-inf"))
        a = tl.maximum(tl.exp2(s - lse2[:, None]) + threshold[:, None], 0.0)  # float32 threshold test
        if KEY_MASK:  # invisible keys (tau > 0 would give them tau/n); a key no row sees is not read
            visible = _visible(q_seg, q_key_idx, KSEG + b.to(tl.int64) * stride_sb, keys, k_len)
            a = tl.where(visible, a, 0.0)
            seen = tl.max(visible.to(tl.int32), 0) > 0
        else:
            a = tl.where(keys[None, :] <= q_key_idx[:, None], a, 0.0)  # keys after the row (tau > 0: tau/n)
            seen = keys >= k_start  # left padding: never read (NaN * 0 is NaN)
        live_len = tl.where(tl.max(a) > 0.0, k_len, 0)  # an all-zero tile reads no V
        v = _load_cache(V, _cache_rows(BT, keys, k_len, kv_base, stride_vb, stride_vt, PAGE_SIZE), offs_d,
                        seen & (keys < live_len), D)
        acc = _dot(a.to(v.dtype), v, UPCAST, PRECISION, acc)
    out = O_PART + (((split * (tl.num_programs(1) // Hkv) + b).to(tl.int64) * Tq + t[:, None]) * Hq + h[:, None]) * D
    tl.store(out + offs_d[None, :], acc.to(O_PART.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < D))


# ---------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------


def _packed_decode(query, key, value, tau, distance_bias, q_pos, key_lengths, scaling, num_splits=None,
                   block_table=None, key_capacity=None, key_starts=None, need_lse=True, key_mask=None):
    """Launch the packed decode: `ForwardResult(out [B, Tq, Hq, D], lse [B, Hq, Tq] float32 or None, None)`.

    query `[B, Hq, Tq, D]`, Tq <= DECODE_MAX_ROWS; key, value `[B, Hkv, >= key length, D]`, or with
    `block_table [B, max blocks]` int32 the paged caches `[num_blocks, Hkv, page size, D]`; q_pos `[B, Tq]` int32
    (n = q_pos + 1); key_lengths `[B]` int32: query row t of batch row b stands at key index
    `key_lengths[b] - Tq + t`; key_starts `[B]` int32 or None: batch row b's first visible key (left padding; the
    positions count from there). `key_capacity` bounds the key lengths (default: the key buffer's length, paged:
    max blocks x page size; a longer key length counts as `key_capacity`, so the float32 score scratch,
    `B x Hq x Tq x key_capacity`, is never overrun). `num_splits`: None,
    automatic. `need_lse=False` (inference) skips the log-sum-exp. `key_mask`: None, or `(q_seg [B, Tq], k_seg
    [B, >= key length], k_pos [B, >= key length])` int32 of a `LazyMetadata` (contiguous rows): any layout, query row
    t of batch row b seeing key j when their segments match and j is not after it, at the distance of their
    positions (padding anywhere, a static cache's unwritten slots; not with `key_starts` or a block table). Two
    launches, a third summing the split-K partials when there are several; the band is built once per value of
    `distance_bias`.
    """
    block_d = _check_inputs(query, key)
    bsz, num_heads, q_len, dim = query.shape
    kv_heads, window = key.shape[1], distance_bias.shape[-1]
    groups = num_heads // kv_heads
    page_size = 0 if block_table is None else key.shape[2]
    if key_capacity is None:
        key_capacity = key.shape[2] if block_table is None else block_table.shape[1] * page_size
    block_m, block_n, num_warps, num_stages = _launch_config("packed_decode", block_d, query.device)
    row_tiles = triton.cdiv(groups * q_len, block_m)
    if num_splits is None:
        num_splits = _device_splits(bsz * kv_heads, row_tiles, key_capacity, query.device)
    keys_per_split = triton.cdiv(triton.cdiv(key_capacity, num_splits), block_n) * block_n
    num_splits = triton.cdiv(key_capacity, keys_per_split)
    grid = (num_splits, bsz * kv_heads, row_tiles)
    band = _kept_band(distance_bias, scaling, block_m + block_n)
    f32 = dict(dtype=torch.float32, device=query.device)
    scores = torch.empty(bsz, num_heads, q_len, key_capacity, **f32)
    m_part = torch.empty(num_splits, bsz, num_heads, q_len, **f32)
    l_part = torch.empty_like(m_part)
    lse = torch.empty(bsz, num_heads, q_len, **f32) if need_lse else None
    out = torch.empty(bsz, q_len, num_heads, dim, dtype=query.dtype, device=query.device)
    o_part = out[None] if num_splits == 1 else torch.empty(num_splits, bsz, q_len, num_heads, dim, **f32)
    paging = dict(KLEN=key_lengths, KSTART=key_lengths if key_starts is None else key_starts,
                  BLOCK_TABLE=key_lengths if block_table is None else block_table,
                  stride_tb=0 if block_table is None else block_table.stride(0), PAGE_SIZE=page_size,
                  KEY_START=key_starts is not None, KEY_MASK=key_mask is not None)
    q_seg, k_seg, k_pos = (q_pos, key_lengths, key_lengths) if key_mask is None else (
        t.to(torch.int32).contiguous() for t in key_mask)
    layout = dict(QSEG=q_seg, KSEG=k_seg, stride_sb=k_seg.stride(0) if key_mask is not None else 0)
    sizes = dict(Hq=num_heads, Hkv=kv_heads, Tq=q_len, GROUPS=groups, KEYS_PER_SPLIT=keys_per_split,
                 KEY_CAPACITY=key_capacity)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, D=dim, UPCAST=_INTERPRET,
                PRECISION=_DOT_PRECISION[query.dtype], num_warps=num_warps, num_stages=num_stages)
    wrap_triton(_lazy_decode_lse_kernel)[grid](
        Q=query, K=key, BAND=band, **paging, QPOS=q_pos, **layout, KPOS=k_pos, SCORES=scores, M_PART=m_part,
        L_PART=l_part, **_strides("q", query),
        **_strides("k", key), **sizes, W=window, BAND_LEN=band.shape[-1], scale_log2=scaling * LOG2E, **meta)
    wrap_triton(_lazy_decode_out_kernel)[grid](
        V=value, TAU=tau.detach().to(torch.float32).contiguous(), QPOS=q_pos, **paging, **layout, SCORES=scores,
        M_PART=m_part, L_PART=l_part, LSE=m_part if lse is None else lse, O_PART=o_part, **_strides("v", value),
        **sizes, NUM_SPLITS=num_splits, STORE_LSE=need_lse, **meta)
    if num_splits > 1:  # one reduction, float32 inside, converted as it stores
        torch.sum(o_part, 0, out=out)
    return ForwardResult(out, lse)
