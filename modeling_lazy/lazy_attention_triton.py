"""Lazy Attention as Triton kernels: the entry point `lazy_attention_triton` and the map of the kernel files.

Math (docs/design.md), per query head h, query i, key j, for visible (i, j):

    s_ij = scaling * <q_i, k_j> + beta_h(pos_i - pos_j)      p_ij = exp(s_ij - LSE_i)
    a_ij = max(0, p_ij + tau_h / n_i)   (float32 test)        o_i  = sum_j a_ij v_j     (no renormalisation)
    m_ij = 1[a_ij > 0],  dP_ij = dO_i . v_j,  Delta_i = sum_j m_ij p_ij dP_ij,  dS_ij = p_ij (m_ij dP_ij - Delta_i)

Visibility comes only from the per-token `LazyMetadata` of `lazy_attention_reference` (no L x L mask):
query i sees key j  <=>  q_seg[i] == k_seg[j]  and  j <= i + Tk - Tq;  n_i = q_pos[i] + 1;
distance = q_pos[i] - k_pos[j], biased only for 0 <= distance < W.

Where the code lives (flat files: a checkpoint carries them; they import each other relatively):

    lazy_attention_triton_common.py    constants, the block table `_CONFIGS`, the ahead-of-time build list
                                       `AOT_BUILDS`, the jit helpers several families share, launch helpers,
                                       the launchers' named results `ForwardResult` / `BackwardResult`
    lazy_attention_triton_forward.py   `_forward`: the general forward (any layout; split-K for short queries) with
                                       block skipping; `_causal_forward`: the causal fast path (`LazyMetadata.causal`,
                                       query length > 16; training also stores U_i = sum_j m_ij v_j)
    lazy_attention_triton_backward.py  `_backward`: the general backward (Delta, dq, dk/dv) with block skipping, or
                                       `_causal_backward`, the causal fast path's (Delta from U)
    lazy_attention_triton_decode.py    `_packed_decode`: causal layout, query length <= 16, a GQA group's heads x rows
                                       as the rows of one tile, split-K (also vLLM's paged cache)
    lazy_attention_triton.py           this file: `lazy_attention_triton`, and the launchers re-exported for the op
                                       layer, the tests and the benchmarks
    lazy_attention_ops.py              the operators (`lazy_llama::triton_attention`, ...) and `choose_kernel`, which
                                       picks the launcher for each call
    lazy_llama_vllm/lazy_attention_paged_triton.py   vLLM's paged prefill and the paged entry points, and
    lazy_llama_vllm/lazy_attention_paged_op.py       their operator (the vLLM plugin's; checkpoints do not carry them)

Every launch goes through `wrap_triton`, so that torch.compile and make_fx trace it. Under TRITON_INTERPRET=1 (set
before import) the same kernels run on CPU tensors.
"""

from typing import TYPE_CHECKING

from .lazy_attention_triton_backward import _backward, _causal_backward
from .lazy_attention_triton_common import (
    _INTERPRET,
    DEAD_ROW_LSE,
    DECODE_MAX_ROWS,
    MAX_HEAD_DIM,
    BackwardResult,
    ForwardResult,
    _check_inputs,
    _config,
    _gpu_family,
)
from .lazy_attention_triton_decode import _packed_decode
from .lazy_attention_triton_forward import _causal_forward, _forward

if TYPE_CHECKING:  # annotations only
    from .lazy_attention_reference import LazyMetadata


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


__all__ = ["BackwardResult", "DEAD_ROW_LSE", "DECODE_MAX_ROWS", "ForwardResult", "MAX_HEAD_DIM", "_INTERPRET",
           "_backward", "_causal_backward", "_causal_forward", "_check_inputs", "_config", "_forward", "_gpu_family",
           "_kernel_inputs", "_packed_decode", "lazy_attention_triton"]
