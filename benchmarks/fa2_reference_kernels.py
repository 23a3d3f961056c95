"""FlashAttention-2-style causal softmax attention in Triton: the yardstick of the static GPU model.

Written for `benchmarks/static_gpu_model.py`, which compiles these kernels ahead of time next to the Lazy
Attention kernels and compares their inner loops; they are never used by the model code. Plain causal
softmax attention over `[B, H, T, D]` contiguous tensors (no GQA, no padding, T a multiple of the blocks),
in the FlashAttention-2 design:

    _fa2_fwd_kernel            one query tile: online softmax in the log2 domain (exp2 of pre-scaled scores),
                               off-diagonal key tiles unmasked, the diagonal tiles in a second loop with the mask
    _fa2_bwd_preprocess_kernel Delta_i = dO_i . O_i
    _fa2_bwd_kernel            one key tile: dk, dv over the query tiles at and below the diagonal, and dq
                               accumulated with float32 atomics (5 matmuls per tile, as FlashAttention-2)
    _flash_decode_kernel       split-K decode (query length 1) with a GQA group's query heads packed as tile
                               rows, so that K and V are read once per KV head; partials combined by a few torch ops

`fa2_forward`, `fa2_backward` and `flash_decode` launch them (on CUDA, or on CPU under TRITON_INTERPRET=1 with
float32 inputs, which is how tests/test_static_gpu_model.py checks them against PyTorch).
"""

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, family and head dim: the fastest in the static model of the
# configurations that would run as FlashAttention-2 does (blocks of 32-128 rows and 64-128 keys, 4 or 8 warps, 2-3
# stages: pipelined loads; one stage loads synchronously, which the serial model cannot charge): no register
# spills and shared memory within the per-block limit (`MAX_SHARED_BYTES` of the static model). Faster builds that
# spill or need more shared memory than a block may have (sm_90 backward at 128 x 128: 264,192 B at D 128) are
# not yardsticks: they could not launch, or would not run as modelled.
CONFIGS = {
    "sm90": {("fwd", 64): (128, 128, 8, 2), ("fwd", 128): (128, 128, 8, 2),
             ("bwd", 64): (64, 128, 8, 2), ("bwd", 128): (32, 128, 8, 2),
             ("decode", 64): (16, 128, 4, 3), ("decode", 128): (16, 128, 4, 3)},
    "sm80": {("fwd", 64): (128, 128, 8, 2), ("fwd", 128): (128, 64, 8, 2),
             ("bwd", 64): (64, 128, 8, 2), ("bwd", 128): (32, 64, 4, 2),
             ("decode", 64): (16, 128, 4, 3), ("decode", 128): (16, 128, 4, 3)},
}
LOG2E = 1.4426950408889634


@triton.jit
def _fa2_fwd_tiles(q, m_i, l_i, acc, K, V, rows, lo, hi, scale_log2,
                   BLOCK_N: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr):
    """Online softmax over key tiles [lo, hi); `CAUSAL` masks keys after the row (diagonal tiles only)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = tl.load(K + keys[:, None] * D + offs_d[None, :])
        v = tl.load(V + keys[:, None] * D + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [BM, BN], log2 domain
        if CAUSAL:
            s = tl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _fa2_fwd_kernel(Q, K, V, OUT, LSE, T, scale_log2,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Grid (T / BM, B * H). LSE is stored in log2 units."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_m = tl.program_id(0)
    base = tl.program_id(1).to(tl.int64) * T * D
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + rows[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    diagonal = pid_m * BLOCK_M
    m_i, l_i, acc = _fa2_fwd_tiles(q, m_i, l_i, acc, K + base, V + base, rows, 0, diagonal, scale_log2,
                                   BLOCK_N, D, False)
    m_i, l_i, acc = _fa2_fwd_tiles(q, m_i, l_i, acc, K + base, V + base, rows, diagonal, diagonal + BLOCK_M,
                                   scale_log2, BLOCK_N, D, True)
    tl.store(OUT + base + rows[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty))
    tl.store(LSE + tl.program_id(1).to(tl.int64) * T + rows, m_i + tl.log2(l_i))


@triton.jit
def _fa2_bwd_preprocess_kernel(OUT, DO, DELTA, T, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """Delta_i = dO_i . O_i (float32). Grid (T / BM, B * H)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.program_id(1).to(tl.int64) * T * D + rows[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(OUT + offs).to(tl.float32)
    do = tl.load(DO + offs).to(tl.float32)
    tl.store(DELTA + tl.program_id(1).to(tl.int64) * T + rows, tl.sum(o * do, 1))


@triton.jit
def _fa2_bwd_tiles(k, v, dk, dv, Q, DO, DQ, LSE, DELTA, keys, lo, hi, scale, scale_log2,
                   BLOCK_M: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr):
    """dk, dv over query tiles [lo, hi), dq by atomics; transposed tiles `[BN, BM]` as FlashAttention-2."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q = tl.load(Q + rows[:, None] * D + offs_d[None, :])
        do = tl.load(DO + rows[:, None] * D + offs_d[None, :])
        lse = tl.load(LSE + rows)
        delta = tl.load(DELTA + rows)
        p_t = tl.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :])  # [BN, BM]
        if CAUSAL:
            p_t = tl.where(rows[None, :] >= keys[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
        dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k) * scale  # [BM, D]
        tl.atomic_add(DQ + rows[:, None] * D + offs_d[None, :], dq, sem="relaxed")
    return dk, dv


@triton.jit
def _fa2_bwd_kernel(Q, K, V, DO, DQ, DK, DV, LSE, DELTA, T, scale, scale_log2,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Grid (T / BN, B * H); DQ is a zeroed float32 buffer."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * T * D
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = tl.load(K + base + keys[:, None] * D + offs_d[None, :])
    v = tl.load(V + base + keys[:, None] * D + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    diagonal = pid_n * BLOCK_N
    args = (Q + base, DO + base, DQ + base, LSE + bh * T, DELTA + bh * T, keys)
    dk, dv = _fa2_bwd_tiles(k, v, dk, dv, *args, diagonal, diagonal + BLOCK_N, scale, scale_log2, BLOCK_M, D, True)
    dk, dv = _fa2_bwd_tiles(k, v, dk, dv, *args, diagonal + BLOCK_N, T, scale, scale_log2, BLOCK_M, D, False)
    tl.store(DK + base + keys[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + base + keys[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def _flash_decode_kernel(Q, K, V, O_PART, M_PART, L_PART, Tk, KEYS_PER_SPLIT, scale_log2,
                         GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """One key slice of one KV head for its GROUPS query heads (rows). Grid (splits, B * Hkv).

    Q `[B, Hkv * GROUPS, D]`, K and V `[B, Hkv, Tk, D]`; partial outputs `[splits, B * Hkv * GROUPS, D]` and
    partial (max, sum) in log2 units `[splits, B * Hkv * GROUPS]`.
    """
    split = tl.program_id(0)
    bkv = tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (bkv * GROUPS + heads[:, None]) * D + offs_d[None, :], mask=heads[:, None] < GROUPS, other=0.0)
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(lo + KEYS_PER_SPLIT, Tk)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    kv = bkv * Tk * D
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = tl.load(K + kv + keys[:, None] * D + offs_d[None, :], mask=keys[:, None] < hi, other=0.0)
        v = tl.load(V + kv + keys[:, None] * D + offs_d[None, :], mask=keys[:, None] < hi, other=0.0)
        s = tl.where(keys[None, :] < hi, tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    part = split * tl.num_programs(1) * GROUPS + bkv * GROUPS + heads
    tl.store(O_PART + part[:, None] * D + offs_d[None, :], acc, mask=heads[:, None] < GROUPS)
    tl.store(M_PART + part, m_i, mask=heads < GROUPS)
    tl.store(L_PART + part, l_i, mask=heads < GROUPS)


def _family(device: torch.device) -> str:
    return "sm80" if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9 else "sm90"


def fa2_forward(q, k, v):
    """Causal attention `[B, H, T, D]` -> `(out, lse in log2 units [B, H, T])`."""
    bsz, heads, length, dim = q.shape
    block_m, block_n, warps, stages = CONFIGS[_family(q.device)][("fwd", dim)]
    assert length % block_m == 0, "the reference kernels take T a multiple of the blocks"
    out = torch.empty_like(q)
    lse = torch.empty(bsz, heads, length, dtype=torch.float32, device=q.device)
    _fa2_fwd_kernel[(length // block_m, bsz * heads)](q, k, v, out, lse, length, dim**-0.5 * LOG2E,
                                                      BLOCK_M=block_m, BLOCK_N=block_n, D=dim,
                                                      num_warps=warps, num_stages=stages)
    return out, lse


def fa2_backward(q, k, v, out, lse, grad_out):
    """`(dq, dk, dv)` of `fa2_forward`."""
    bsz, heads, length, dim = q.shape
    block_m, block_n, warps, stages = CONFIGS[_family(q.device)][("bwd", dim)]
    assert length % block_n == 0, "the reference kernels take T a multiple of the blocks"
    delta = torch.empty_like(lse)
    _fa2_bwd_preprocess_kernel[(length // block_m, bsz * heads)](out, grad_out, delta, length, BLOCK_M=block_m,
                                                                D=dim)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _fa2_bwd_kernel[(length // block_n, bsz * heads)](q, k, v, grad_out, dq, dk, dv, lse, delta, length,
                                                      dim**-0.5, dim**-0.5 * LOG2E, BLOCK_M=block_m,
                                                      BLOCK_N=block_n, D=dim, num_warps=warps, num_stages=stages)
    return dq.to(q.dtype), dk, dv


def flash_decode(q, k, v, num_splits):
    """One query per head: q `[B, Hq, 1, D]`, k and v `[B, Hkv, Tk, D]` -> `[B, Hq, 1, D]`."""
    bsz, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    _, block_n, warps, stages = CONFIGS[_family(q.device)][("decode", dim)]
    keys_per_split = triton.cdiv(triton.cdiv(length, num_splits), block_n) * block_n
    splits = triton.cdiv(length, keys_per_split)
    o_part = torch.empty(splits, bsz * heads, dim, dtype=torch.float32, device=q.device)
    m_part = torch.empty(splits, bsz * heads, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    _flash_decode_kernel[(splits, bsz * kv_heads)](q, k, v, o_part, m_part, l_part, length, keys_per_split,
                                                   dim**-0.5 * LOG2E, GROUPS=groups,
                                                   BLOCK_G=max(16, triton.next_power_of_2(groups)), BLOCK_N=block_n,
                                                   D=dim, num_warps=warps, num_stages=stages)
    m_max = m_part.max(0).values
    weight = torch.exp2(m_part - m_max)  # [S, B * Hq]
    out = (o_part * weight[..., None]).sum(0) / (l_part * weight).sum(0)[:, None]
    return out.view(bsz, heads, 1, dim).to(q.dtype)


__all__ = ["CONFIGS", "fa2_forward", "fa2_backward", "flash_decode"]
