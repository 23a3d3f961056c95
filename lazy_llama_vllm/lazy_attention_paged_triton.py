"""Lazy Attention against vLLM's paged KV cache with the Triton kernels: the varlen paged prefill kernel, its
launchers and the two entry points (checkpoints do not carry this file; the operator that wraps them for vLLM's
backend is in lazy_attention_paged_op.py).

    _lazy_paged_fwd_kernel                the causal fast path's passes (`causal_passes` of
                                          modeling_lazy/lazy_attention_triton_forward.py) for a mixed vLLM step: query
                                          tiles of many requests (varlen), K and V through the cache's block table
    _paged_prefill                        its launcher (work list: `_varlen_tiles`, shared with the model's
                                          packed-document kernels)
    lazy_attention_triton_paged_decode    one token per request: the packed decode (`_packed_decode` of
                                          modeling_lazy/lazy_attention_triton_decode.py) with a block table
    lazy_attention_triton_paged           a mixed step (prompts, chunks, decode tokens): decode tokens first through
                                          the packed decode, the rest through the varlen kernel

The block table (`_CONFIGS`, kind "paged_fwd") and the ahead-of-time build list stay in
modeling_lazy/lazy_attention_triton_common.py with every other kernel's. Importing this file needs triton (not vLLM).
"""

import torch
from torch.library import wrap_triton  # a launch torch.compile / make_fx can trace (plain launch in eager)

from modeling_lazy.lazy_attention_triton_common import (
    _DOT_PRECISION,
    _INTERPRET,
    LOG2E,
    _check_inputs,
    _kept_band,
    _last_dim_contiguous,
    _launch_config,
    _load_rows,
    _strides,
    _varlen_tiles,
    tl,
    triton,
)
from modeling_lazy.lazy_attention_triton_decode import _packed_decode
from modeling_lazy.lazy_attention_triton_forward import causal_passes

# ---------------------------------------------------------------------------------------------------
# The varlen paged prefill kernel and its launcher
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _lazy_paged_fwd_kernel(Q, K, V, TAU, BAND, BLOCK_TABLE, QUERY_START, KLEN, TILES, OUT,
                           stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                           stride_tb, stride_ot, stride_oh, Hq, W, GROUPS, BAND_LEN, scale_log2,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                           PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Varlen paged prefill: `causal_passes` for one query tile of one request and one query head, K and V read
    through the request's block table. Grid: (len(TILES), Hq); TILES [programs, 2] int32 holds (request, first
    query row of the tile), request -1 for a spare program (no rows, no keys). Request r's query rows are
    Q[QUERY_START[r] : QUERY_START[r + 1]], its keys 0 .. KLEN[r] - 1, its row i at position KLEN[r] - q_len + i."""
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor passes Python floats as float64
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
    acc, _, _, _ = causal_passes(q, rows + Tk - Tq, K + hk * stride_kh, V + hk * stride_vh, stride_kt, stride_vt,
                                 BAND + h * BAND_LEN, TAU + h, m0, Tq, Tk, W, scale_log2,
                                  BLOCK_M, BLOCK_N, BLOCK_D, D, UPCAST, PRECISION,
                                  BLOCK_TABLE + r.to(tl.int64) * stride_tb, stride_kb, stride_vb, PAGE_SIZE)
    out_ptrs = OUT + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h.to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_mask[:, None] & (offs_d[None, :] < D))


def _paged_prefill(query, key, value, block_table, query_start_loc, seq_lens, tau, distance_bias, scaling,
                   max_query_len=None):
    """Launch the varlen paged prefill: `out [T, Hq, D]`. query `[T, Hq, D]`; key, value the paged caches
    `[num_blocks, Hkv, page size, D]`; block_table `[R, max blocks]`, query_start_loc `[R + 1]`, seq_lens `[R]`
    int32."""
    block_d = _check_inputs(query, key)
    num_tokens, num_heads, dim = query.shape
    block_m, block_n, num_warps, num_stages = _launch_config("paged_fwd", block_d, query.device)
    out = torch.empty_like(query)
    tiles = _varlen_tiles(query_start_loc.diff(), num_tokens, block_m, max_query_len)
    if tiles.shape[0] == 0:
        return out
    band = _kept_band(distance_bias, scaling, block_m + block_n)  # kept with distance_bias, as the decode's
    wrap_triton(_lazy_paged_fwd_kernel)[(tiles.shape[0], num_heads)](
        Q=query, K=key, V=value, TAU=tau.detach().to(torch.float32).contiguous(), BAND=band, BLOCK_TABLE=block_table,
        QUERY_START=query_start_loc, KLEN=seq_lens, TILES=tiles, OUT=out,
        stride_qt=query.stride(0), stride_qh=query.stride(1), **_strides("k", key), **_strides("v", value),
        stride_tb=block_table.stride(0), stride_ot=out.stride(0), stride_oh=out.stride(1),
        Hq=num_heads, W=distance_bias.shape[-1], GROUPS=num_heads // key.shape[1], BAND_LEN=band.shape[-1],
        scale_log2=scaling * LOG2E, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, D=dim, PAGE_SIZE=key.shape[2],
        UPCAST=_INTERPRET, PRECISION=_DOT_PRECISION[query.dtype], num_warps=num_warps, num_stages=num_stages)
    return out


# ---------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------


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
            default `max_blocks x block_size`. A request whose length exceeds it reads only its first
            `max_seq_len` keys (the scratch is never overrun; its output is then not that request's attention).
    Returns:
        `[R, Hq, D]` in the query dtype.
    """
    key, value = _cache_halves(query, kv_cache)
    seq_lens = seq_lens.to(device=query.device, dtype=torch.int32).contiguous()
    q_pos = (seq_lens - 1).unsqueeze(1).contiguous()
    out = _packed_decode(_last_dim_contiguous(query).unsqueeze(2), key, value, tau, distance_bias, q_pos, seq_lens,
                         float(scaling), block_table=block_table.to(torch.int32).contiguous(),
                         key_capacity=max_seq_len, need_lse=False).out
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


__all__ = ["lazy_attention_triton_paged", "lazy_attention_triton_paged_decode"]
