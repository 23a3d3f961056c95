"""Lazy Attention Triton kernels, shared room: constants, block table, build list, shared jit helpers, launch helpers.

The Triton code lives in flat files (a checkpoint carries them beside `modeling_lazy.py`; they import each other
relatively, so `trust_remote_code` finds every one). Open:

    lazy_attention_triton.py           the entry point `lazy_attention_triton` and the map of the kernels
    lazy_attention_triton_common.py    this file: the triton import guard, the constants (MAX_HEAD_DIM, DECODE_MAX_ROWS,
                                       SPLIT_MIN_KEYS, DEAD_ROW_LSE, LOG2E), the block table `_CONFIGS` (`_config`,
                                       `_launch_config`), the ahead-of-time build list `AOT_BUILDS` with each
                                       kernel's file and pointer types (`AOT_KERNELS`), the `@triton.jit` helpers more
                                       than one family calls, the launchers' input checks and stride helpers, and the
                                       named results `ForwardResult` / `BackwardResult`
    lazy_attention_triton_forward.py   the general forward (and its split-K decode) and the causal fast-path forward
    lazy_attention_triton_backward.py  the general backward and the causal fast-path backward
    lazy_attention_triton_decode.py    the packed decode (plain layout and paged caches)
    lazy_attention_ops.py              the operators and the table that picks a launcher for each call
    lazy_llama_vllm/lazy_attention_paged_triton.py   vLLM's paged prefill kernel and its entry points, and
    lazy_llama_vllm/lazy_attention_paged_op.py       their operator (the vLLM plugin's; not shipped with checkpoints)

Math and design: docs/design.md; the kernel map: lazy_attention_triton.py's docstring.

Under TRITON_INTERPRET=1 (set before import) the kernels run on CPU tensors; 16-bit operands are upcast to float32
before `tl.dot` on that path only (the interpreter's bf16 dot is wrong).
"""

import os
from typing import NamedTuple

try:
    import triton
    import triton.language as tl
except ImportError as error:  # modeling_lazy catches this and serves every device with the PyTorch path
    raise ImportError(
        "lazy_attention_triton needs the `triton` package (pip install triton, or the project's [gpu] extra); "
        "without it LazyLlama uses its PyTorch attention path."
    ) from error

import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# ---------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------
MAX_HEAD_DIM = 256
DECODE_MAX_ROWS = 16  # lazy_attention_reference.DECODE_MAX_ROWS (these files are also loaded alone, ahead of time)
SPLIT_MIN_KEYS = 256  # a split-K slice covers at least this many keys
# Row log-sum-exp stored for a row without a normaliser (every visible score -inf, or nothing visible): p = 0 on
# every key, and `_row_threshold` turns tau/n into a large negative, so every weight a_ij of that row is 0.
DEAD_ROW_LSE = 3.0e38
_DEAD_ROW_LSE = tl.constexpr(DEAD_ROW_LSE)  # the same value as the kernels see it
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# ---------------------------------------------------------------------------------------------------
# Block configurations (the ones shipped; tests/test_triton_aot.py compiles every one for sm_80/sm_90).
# ---------------------------------------------------------------------------------------------------

# GPU family -> (kernel kind, padded head dim) -> (BLOCK_M, BLOCK_N, num_warps, num_stages). Padded head
# dims up to 64 use the 64 rows, larger ones the 128 rows (256 runs but is not tuned). Chosen so that no
# build spills registers or needs more shared memory than a block may have (tests/test_triton_aot.py), then by the
# static GPU model (benchmarks/static_gpu_model.py) where it was swept among builds with pipelined loads (2+ stages:
# the model does not charge load latency, so it would otherwise prefer 1 stage): the causal forward (sm90 D 64:
# 128 x 128), the causal backward's dq and dk/dv (at D 64, 4 warps on 64 x 64 tiles model faster than 8 on
# larger ones; at D 128 those spill); Ampere's mma.sync keeps more of each tile in registers than Hopper's wgmma,
# so its tiles are smaller. Other GPUs use the sm80 table.
_CONFIGS = {
    "sm90": {
        ("fwd", 64): (128, 64, 8, 2),
        ("fwd", 128): (128, 32, 8, 2),
        ("causal_fwd", 64): (128, 128, 8, 2),
        ("causal_fwd", 128): (128, 64, 8, 2),
        ("causal_fwd_u", 64): (128, 64, 8, 2),
        ("causal_fwd_u", 128): (128, 32, 8, 2),
        ("causal_fwd_u1", 64): (128, 128, 8, 2),
        ("causal_fwd_u1", 128): (128, 64, 8, 2),
        ("value_sums", 64): (64, 0, 4, 2),
        ("value_sums", 128): (32, 0, 4, 2),
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
        ("causal_dq", 64): (64, 64, 4, 2),
        ("causal_dq", 128): (128, 64, 8, 2),
        ("causal_dkdv", 64): (64, 64, 4, 2),
        ("causal_dkdv", 128): (32, 128, 8, 2),
        ("causal_dkdv_documents", 64): (64, 64, 4, 2),
        ("causal_dkdv_documents", 128): (32, 128, 8, 2),
    },
    "sm80": {
        ("fwd", 64): (64, 64, 8, 2),
        ("fwd", 128): (64, 32, 8, 2),
        ("causal_fwd", 64): (128, 64, 8, 2),
        ("causal_fwd", 128): (64, 32, 4, 2),
        ("causal_fwd_u", 64): (128, 32, 8, 2),
        ("causal_fwd_u", 128): (64, 32, 8, 2),
        ("causal_fwd_u1", 64): (128, 64, 8, 2),
        ("causal_fwd_u1", 128): (64, 32, 8, 2),
        ("value_sums", 64): (64, 0, 4, 2),
        ("value_sums", 128): (32, 0, 4, 2),
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
        ("causal_dq", 64): (64, 64, 4, 2),
        ("causal_dq", 128): (64, 32, 4, 2),
        ("causal_dkdv", 64): (32, 64, 4, 2),
        ("causal_dkdv", 128): (32, 64, 4, 2),
        ("causal_dkdv_documents", 64): (32, 64, 4, 2),
        ("causal_dkdv_documents", 128): (32, 64, 4, 2),
    },
}


def _gpu_family(device: torch.device) -> str:
    """`"sm90"` for Hopper and newer, `"sm80"` for older GPUs; the interpreter (CPU) runs the sm90 blocks."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] < 9:
        return "sm80"
    return "sm90"


def _config(kind: str, block_d: int, family: str = "sm90") -> tuple[int, int, int, int]:
    return _CONFIGS[family][(kind, 64 if block_d <= 64 else 128)]


def _pass1_block_n(kind: str, block_d: int, family: str = "sm90") -> int:
    """The key tile of the causal forward's pass 1 (`causal_passes`' BLOCK_N1): the build's own BN, except in the
    training build of two passes (`causal_fwd_u`), whose BN is narrow because pass 2 also holds U's accumulator:
    its pass 1, which holds neither accumulator, takes the inference build's wider tiles (`causal_fwd`, same BM)."""
    block_m, block_n = _config(kind, block_d, family)[:2]
    if kind == "causal_fwd_u":
        wide_m, wide_n = _config("causal_fwd", block_d, family)[:2]
        if wide_m == block_m:
            return max(block_n, wide_n)
    return block_n


def _launch_config(kind: str, block_d: int, device: torch.device) -> tuple[int, int, int, int]:
    """`_config` for the GPU family of `device` (what every launcher calls: one place picks the family)."""
    return _config(kind, block_d, _gpu_family(device))


def _launch_pass1_block_n(kind: str, block_d: int, device: torch.device) -> int:
    """`_pass1_block_n` for the GPU family of `device`."""
    return _pass1_block_n(kind, block_d, _gpu_family(device))


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time build list: every kernel at every block kind it ships with (benchmarks/aot_compile_table.py
# compiles each for sm_80 and sm_90 and both head dims; tests/test_triton_aot.py checks them for spills).
# ---------------------------------------------------------------------------------------------------

# Element type of each pointer argument, per kernel: "input" is the query's dtype (float16, bfloat16, float32).
_GENERAL = dict(Q="input", K="input", V="input", TAU="fp32", BIAS="fp32", QPOS="i32", KPOS="i32", QSEG="i32",
                KSEG="i32")
_CAUSAL = dict(Q="input", K="input", V="input", TAU="fp32", BAND="fp32", QPOS="i32", DOCS="i32", TILES="i32")
AOT_KERNELS = {  # kernel -> (module that defines it, pointer element types)
    "_lazy_fwd_kernel": ("modeling_lazy.lazy_attention_triton_forward", dict(_GENERAL, OUT="input", LSE="fp32")),
    "_lazy_fwd_split_lse_kernel": ("modeling_lazy.lazy_attention_triton_forward",
                                   dict(_GENERAL, M_PART="fp32", L_PART="fp32")),
    "_lazy_fwd_split_out_kernel": ("modeling_lazy.lazy_attention_triton_forward",
                                   dict(_GENERAL, LSE="fp32", O_PART="fp32")),
    "_lazy_causal_fwd_kernel": ("modeling_lazy.lazy_attention_triton_forward",
                                dict(_CAUSAL, OUT="input", LSE="fp32", U="input", VSUM="fp32", KEYS="i32")),
    "_lazy_value_sums_kernel": ("modeling_lazy.lazy_attention_triton_forward",
                                dict(V="input", TAU="fp32", DOCS="i32", VSUM="fp32")),
    "_lazy_paged_fwd_kernel": ("lazy_llama_vllm.lazy_attention_paged_triton",
                               dict(Q="input", K="input", V="input", TAU="fp32", BAND="fp32", BLOCK_TABLE="i32",
                                    QUERY_START="i32", KLEN="i32", TILES="i32", OUT="input")),
    "_lazy_decode_lse_kernel": ("modeling_lazy.lazy_attention_triton_decode",
                                dict(Q="input", K="input", BAND="fp32", KLEN="i32", KSTART="i32", BLOCK_TABLE="i32",
                                     QPOS="i32", QSEG="i32", KSEG="i32", KPOS="i32", SCORES="fp32", M_PART="fp32",
                                     L_PART="fp32")),
    # O_PART as the split-K partials (float32); with one split it is the output (the store converts to its dtype)
    "_lazy_decode_out_kernel": ("modeling_lazy.lazy_attention_triton_decode",
                                dict(V="input", TAU="fp32", QPOS="i32", KLEN="i32", KSTART="i32", BLOCK_TABLE="i32",
                                     QSEG="i32", KSEG="i32", SCORES="fp32", M_PART="fp32", L_PART="fp32",
                                     LSE="fp32", O_PART="fp32")),
    "_lazy_bwd_delta_kernel": ("modeling_lazy.lazy_attention_triton_backward",
                               dict(_GENERAL, LSE="fp32", DO="input", DELTA="fp32", DTAU_PART="fp32")),
    "_lazy_bwd_dq_kernel": ("modeling_lazy.lazy_attention_triton_backward",
                            dict(_GENERAL, LSE="fp32", DO="input", DELTA="fp32", DQ="input")),
    "_lazy_bwd_dkdv_kernel": ("modeling_lazy.lazy_attention_triton_backward",
                              dict(_GENERAL, LSE="fp32", DELTA="fp32", DO="input", DK="input", DV="input",
                                   DBIAS_PART="fp32")),
    "_lazy_causal_bwd_delta_kernel": ("modeling_lazy.lazy_attention_triton_backward",
                                      dict(OUT="input", U="input", DO="input", TAU="fp32", QPOS="i32", QSEG="i32",
                                           LSE="fp32", DELTA="fp32", THR="fp32", LSE_ROWS="fp32", DTAU_PART="fp32",
                                           DQ="input", DK="input", DV="input")),
    "_lazy_causal_bwd_dq_kernel": ("modeling_lazy.lazy_attention_triton_backward",
                                   dict(_CAUSAL, QSEG="i32", LSE="fp32", DO="input", DELTA="fp32", DQ="input",
                                        DBIAS_PART="fp32")),
    "_lazy_causal_bwd_dkdv_kernel": ("modeling_lazy.lazy_attention_triton_backward",
                                     dict(_CAUSAL, LSE="fp32", DELTA="fp32", THR="fp32", DO="input", DK="input",
                                          DV="input")),
}


class AotBuild(NamedTuple):
    """One shipped build: `kernel` (an `AOT_KERNELS` name) at the `_CONFIGS` block kind `kind`."""

    kernel: str
    kind: str
    matmul: bool = True  # uses tl.dot (so sm_90 with 16-bit inputs must use wgmma)
    page_size: int = 0  # PAGE_SIZE (> 0: K/V through a block table of pages of that many keys)
    documents: bool = False  # DOCUMENTS (the causal fast path per document: packed documents, padded rows)
    key_start: bool = False  # KEY_START (the packed decode from per-row first keys: left-padded batches)
    key_mask: bool = False  # KEY_MASK (the packed decode of any layout: masks with holes, a static cache's buffer)


AOT_BUILDS = (
    AotBuild("_lazy_fwd_kernel", "fwd"),
    AotBuild("_lazy_causal_fwd_kernel", "causal_fwd"),
    AotBuild("_lazy_causal_fwd_kernel", "causal_fwd_u"),
    AotBuild("_lazy_causal_fwd_kernel", "causal_fwd", documents=True),
    AotBuild("_lazy_causal_fwd_kernel", "causal_fwd", documents=True, key_start=True),
    AotBuild("_lazy_causal_fwd_kernel", "causal_fwd_u", documents=True),
    AotBuild("_lazy_causal_fwd_kernel", "causal_fwd_u1"),
    AotBuild("_lazy_causal_fwd_kernel", "causal_fwd_u1", documents=True),
    AotBuild("_lazy_value_sums_kernel", "value_sums", matmul=False),
    AotBuild("_lazy_value_sums_kernel", "value_sums", matmul=False, documents=True),
    AotBuild("_lazy_paged_fwd_kernel", "paged_fwd", page_size=16),
    AotBuild("_lazy_fwd_kernel", "decode"),
    AotBuild("_lazy_fwd_split_lse_kernel", "decode"),
    AotBuild("_lazy_fwd_split_out_kernel", "decode"),
    AotBuild("_lazy_decode_lse_kernel", "packed_decode"),
    AotBuild("_lazy_decode_out_kernel", "packed_decode"),
    AotBuild("_lazy_decode_lse_kernel", "packed_decode", key_start=True),
    AotBuild("_lazy_decode_out_kernel", "packed_decode", key_start=True),
    AotBuild("_lazy_decode_lse_kernel", "packed_decode", key_mask=True),
    AotBuild("_lazy_decode_out_kernel", "packed_decode", key_mask=True),
    AotBuild("_lazy_decode_lse_kernel", "packed_decode", page_size=16),
    AotBuild("_lazy_decode_out_kernel", "packed_decode", page_size=16),
    AotBuild("_lazy_bwd_delta_kernel", "delta"),
    AotBuild("_lazy_bwd_dq_kernel", "dq"),
    AotBuild("_lazy_bwd_dkdv_kernel", "dkdv"),
    AotBuild("_lazy_causal_bwd_delta_kernel", "causal_delta", matmul=False),
    AotBuild("_lazy_causal_bwd_dq_kernel", "causal_dq"),
    AotBuild("_lazy_causal_bwd_dkdv_kernel", "causal_dkdv"),
    AotBuild("_lazy_causal_bwd_delta_kernel", "causal_delta", matmul=False, documents=True),
    AotBuild("_lazy_causal_bwd_dq_kernel", "causal_dq", documents=True),
    AotBuild("_lazy_causal_bwd_dkdv_kernel", "causal_dkdv_documents", documents=True),
)


# ---------------------------------------------------------------------------------------------------
# Named launcher results
# ---------------------------------------------------------------------------------------------------


class ForwardResult(NamedTuple):
    """What a forward launcher returns: `out [B, Tq, Hq, D]` in the query dtype, `lse [B, Hq, Tq]` float32 (the
    causal fast path's in log2 units, the others' in natural units; DEAD_ROW_LSE for a row without a normaliser),
    and `u [B, Tq, Hq, D]` float32 (`U_i = sum_j m_ij v_j`, the causal training forward's only, else None)."""

    out: torch.Tensor
    lse: torch.Tensor
    u: torch.Tensor | None = None


class BackwardResult(NamedTuple):
    """What a backward launcher returns: the gradients of query, key, value (their dtypes and shapes), and of tau
    `[Hq]` and distance_bias `[Hq, W]` in float32."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    d_tau: torch.Tensor
    d_bias: torch.Tensor


# ---------------------------------------------------------------------------------------------------
# Shared jit helpers (general kernels: per-key metadata; causal fast path and decode: loop bounds and a band)
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
def _recomputed_weight(s, lse):
    """The general backward's `p = exp(s - LSE)`, at most 1 as a softmax weight is. Its tiles differ from the
    forward's, so a score can come back an ulp off the one the forward summed: a lone visible key (a first token,
    p = 1 exactly there) would read p = 1 + ulp, and at tau = -1 its weight max(0, p - 1), 0 in the forward, alive."""
    return tl.minimum(tl.exp(s - lse), 1.0)


@triton.jit
def _row_threshold(tau_h, q_pos, lse):
    """`tau_h / n_i` in float32 for a row with a normaliser; -1e30 (every weight 0) for a dead row."""
    return tl.where(lse < 1.0e38, tau_h / (q_pos + 1).to(tl.float32), -1.0e30)


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
def _cache_rows(BT, keys, k_len, base, stride_b, stride_t, PAGE_SIZE: tl.constexpr):
    """int64 `[BN]` offsets of the cache rows of `keys` of one (batch row, KV head); `base`: the head's offset plus,
    contiguous, the batch row's; paged, each key's block comes from the batch row's block table `BT`."""
    if PAGE_SIZE > 0:
        block = tl.load(BT + keys // PAGE_SIZE, mask=keys < k_len, other=0).to(tl.int64)
        return base + block * stride_b + (keys % PAGE_SIZE) * stride_t
    else:
        return base + keys.to(tl.int64) * stride_t


# ---------------------------------------------------------------------------------------------------
# Launch helpers
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


def _device_splits(batch_heads: int, q_tiles: int, key_length: int, device: torch.device) -> int:
    """Split-K factor for short queries: enough programs to fill the GPU, each over >= SPLIT_MIN_KEYS keys."""
    if device.type != "cuda" or not torch.cuda.is_available():  # CPU (interpreter), or fake CUDA tensors (tracing)
        return 1
    programs = batch_heads * q_tiles
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), key_length // SPLIT_MIN_KEYS))


def _varlen_tiles(lengths: torch.Tensor, num_tokens: int, block: int, max_length: int | None = None) -> torch.Tensor:
    """`[programs, 2]` int32 work list of a varlen kernel, built on the device (no host sync): (sequence, first row)
    for every `block`-row tile of every sequence (`lengths [R]`, their sum at most `num_tokens`), then (-1, 0) for
    the spare programs of the upper bound `sum_r cdiv(len_r, block) <= (num_tokens + R (block - 1)) // block` (and
    <= R cdiv(max_length, block))."""
    lengths = lengths.to(torch.int64)
    sequences = lengths.numel()
    programs = (num_tokens + sequences * (block - 1)) // block if sequences else 0
    if max_length is not None:
        programs = min(programs, sequences * triton.cdiv(max_length, block))
    tiles = (lengths + block - 1) // block
    ends = tiles.cumsum(0)
    index = torch.arange(programs, device=lengths.device)
    sequence = torch.searchsorted(ends, index, right=True)
    live = sequence < sequences
    sequence = sequence.clamp(max=sequences - 1)
    first = (index - (ends - tiles).index_select(0, sequence)) * block
    return torch.stack([torch.where(live, sequence, -1), torch.where(live, first, 0)], 1).to(torch.int32).contiguous()


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


def _kept_band(distance_bias: torch.Tensor, scaling: float, pad: int) -> torch.Tensor:
    """`_bias_band` with `pad` (= BM + BN) entries before distance 0, built once per value of `distance_bias` and kept
    with it: every later call (the backward of the same step, every inference call, each decode step) reads the same
    band instead of building it again (6 small device ops). A launch whose BM + BN is smaller reads it from its own
    BM + BN before distance 0 (`_band_from`)."""
    from .lazy_attention_torch import _parameter_fact  # the PyTorch path keeps the per-parameter facts

    return _parameter_fact(distance_bias, ("band", float(scaling), pad),
                           lambda: _bias_band(distance_bias, scaling, pad, 0))


def _band_from(band: torch.Tensor, pad: int, block_m: int, block_n: int) -> torch.Tensor:
    """The view of a band padded with `pad` entries that a launch of blocks `block_m x block_n` reads."""
    return band.narrow(-1, pad - block_m - block_n, band.shape[-1] - pad + block_m + block_n)


CAUSAL_KINDS = ("causal_fwd", "causal_fwd_u1", "causal_fwd_u", "causal_dq", "causal_dkdv", "causal_dkdv_documents")


def _causal_band(distance_bias: torch.Tensor, scaling: float, block_d: int, device: torch.device):
    """`(band, pad)`: the band every causal fast-path launch of this head dim reads (forward and backward: one kept
    band, padded for the largest BM + BN among their builds, pass 1's BN for the forward's)."""
    pad = max(_launch_config(kind, block_d, device)[0] + _launch_pass1_block_n(kind, block_d, device)
              for kind in CAUSAL_KINDS)
    return _kept_band(distance_bias, scaling, pad), pad


def _strides(name: str, x: torch.Tensor, b: int = 0, h: int = 1, t: int = 2) -> dict[str, int]:
    """The kernel keywords `stride_{name}b, stride_{name}h, stride_{name}t` of `x`: its strides along the batch,
    head and token dims (`[B, H, T, D]` by default; `h=2, t=1` for a `[B, T, H, D]` tensor)."""
    return {f"stride_{name}b": x.stride(b), f"stride_{name}h": x.stride(h), f"stride_{name}t": x.stride(t)}
