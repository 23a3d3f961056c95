"""The `lazy_llama::triton_paged` operator: one vLLM step against the paged cache with the Triton kernels of
lazy_attention_paged_triton.py, as one graph node for torch.compile, and `lazy_attention_paged`, what the backend
(lazy_attention_backend.py) calls. The model's own operators (same `lazy_llama` namespace) are registered by
modeling_lazy/lazy_attention_ops.py. Importing this file registers the operator; it needs triton (not vLLM).
"""

import torch

from .lazy_attention_paged_triton import lazy_attention_triton_paged


def _triton_paged(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, tau: torch.Tensor, distance_bias: torch.Tensor,
                  scaling: float, max_query_len: int | None, max_seq_len: int | None, num_decodes: int
                  ) -> torch.Tensor:
    """`out [T, Hq, D]` of one vLLM step (see `lazy_attention_triton_paged`)."""
    return lazy_attention_triton_paged(query, (key_cache, value_cache), block_table, query_start_loc, seq_lens, tau,
                                       distance_bias, scaling, max_query_len=max_query_len, max_seq_len=max_seq_len,
                                       num_decodes=num_decodes)


def _triton_paged_fake(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, tau, distance_bias,
                       scaling, max_query_len, max_seq_len, num_decodes):
    return torch.empty_like(query)


def _register() -> None:
    """`lazy_llama::triton_paged`, once per process (an installed copy and another copy of this file share the
    registry, as the model's operators do: lazy_attention_ops._registered). A `triton_op` whose launches go through
    `wrap_triton`; a fake of its own, since the launchers' bodies run on fake tensors only where `wrap_triton`
    traces (not under TRITON_INTERPRET=1, which launches at once)."""
    if not hasattr(torch.ops.lazy_llama, "triton_paged"):
        torch.library.triton_op("lazy_llama::triton_paged", _triton_paged, mutates_args=()).register_fake(
            _triton_paged_fake)


_register()


def lazy_attention_paged(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, tau, distance_bias,
                         scaling, max_query_len=None, max_seq_len=None, num_decodes=0) -> torch.Tensor:
    """One vLLM step against the paged cache with the Triton kernels (`lazy_llama::triton_paged`, forward only).

    query `[T, Hq, D]`; key_cache, value_cache `[num_blocks, Hkv, block_size, D]` views; the other arguments as in
    `lazy_attention_triton_paged`. Returns `[T, Hq, D]` in the query dtype.
    """
    return torch.ops.lazy_llama.triton_paged(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                             tau, distance_bias, float(scaling), max_query_len, max_seq_len,
                                             num_decodes)


__all__ = ["lazy_attention_paged"]
