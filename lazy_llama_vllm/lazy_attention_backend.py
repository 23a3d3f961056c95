"""Lazy Attention as a vLLM attention backend over the paged KV cache (exact; PyTorch on CPU, Triton on CUDA).

vLLM's own backends compute softmax attention; Elastic-Softmax (`ReLU(softmax + tau / n)`) and the
per-head distance bias need the whole score row and each query's position, so this backend:

1. asks vLLM for the head-major cache layout (`LBHNC`): one layer's cache is a contiguous
   `[num_blocks, num_kv_heads, block_size, 2 * head_size]` tensor whose (block, head) pages this backend
   fills as `block_size` keys followed by `block_size` values (`LazyPageLayout`; value heads of another size
   are refused);
2. writes every new token's K and V into their pages (`do_kv_cache_update`);
3. for each step, groups the scheduled requests (`LazyServingMetadata`, built once per step and shared by
   every layer, with every index tensor the layers need): prefills or prefill chunks of the same query and
   key length form one group, all single-token decodes form one padded group;
4. per layer and group, copies the group's keys and values out of the cache with one `index_select` of
   token rows (the step's row index, shared by every layer, stops at each group's longest request, not at
   the end of its last page), straight into contiguous `[2, B, Hkv, Tk, D]` keys and values, and calls
   the project's exact PyTorch op (`lazy_attention(..., backend="torch")`, the op layer's entry point) with a
   `LazyMetadata` built from vLLM's sequence
   lengths: query i of a request with `c` cached tokens has position `c + i` (`n_i = c + i + 1`), key j
   has position j. A decode group (one token per request) skips that copy: the native CPU op of
   `modeling_lazy.lazy_attention_cpu` (float32, bfloat16 or float16) reads each request's pages in place through
   its block table, one call per layer and step (the PyTorch op stays for prefills, or when the native op is not
   installed).

Small work (every decode group of a usual batch, the cache writes of decode steps) runs on the calling thread
only (`_one_thread`): vLLM's CPU worker keeps an OpenMP team of one thread per bound core, and every ATen op
past the parallel grain wakes that team. On a machine whose cores are busy each wake-up waits for a core
(milliseconds, measured on the benchmark's 2-core machine) for microseconds of work, and a decode layer here
runs a dozen such ops where vLLM's own CPU attention runs one kernel.

On CUDA, steps 3 and 4 are replaced by one Triton op per layer, `lazy_attention_paged` (`lazy_llama::triton_paged`),
which reads K and V through the block table (the varlen causal kernel for prompts and chunks, the packed decode for
the decode requests, which the builder asks vLLM to put first). As in the model, `LAZY_LLAMA_BACKEND` (auto |
triton | torch) chooses; `triton` with `TRITON_INTERPRET=1` runs the kernels on CPU tensors (the tests do).

The cached K/V are post-RoPE keys and values, which do not depend on `tau` or the distance bias, so
vLLM's prefix caching and chunked prefill work unchanged.
"""

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from modeling_lazy.lazy_attention_cpu import cache_write_supported, decode_supported, lazy_cache_write, lazy_decode_cpu
from modeling_lazy.lazy_attention_ops import lazy_attention, uses_triton
from modeling_lazy.lazy_attention_reference import LazyMetadata

try:  # the Triton paged step; without triton `use_triton` is False and no step is built for it
    from .lazy_attention_paged_op import lazy_attention_paged
except ImportError:
    lazy_attention_paged = None

BACKEND_NAME = "LAZY_ATTN"
# Groups whose scores have at most this many elements (batch * heads * queries * keys; a decode batch of 64 at
# 4k keys is 2.4M) and cache writes of at most this many values run on one thread (`_one_thread`).
_ONE_THREAD_MAX_ELEMENTS = 1 << 20


@contextmanager
def _one_thread(small: bool):
    """Run the block's ATen ops on the calling thread alone when `small` (see the module docstring)."""
    threads = torch.get_num_threads()
    if not small or threads == 1:
        yield
        return
    # vLLM's CPU worker replaces `torch.set_num_threads` by a no-op once it has bound its threads; the
    # binding stays (the team's threads are kept, only the count used by the next parallel region changes)
    torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(threads)


def register_backend_name() -> None:
    """Give the backend its name in vLLM's backend enum (the `Attention` layer looks its class up there)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, f"{__name__}.LazyAttentionBackend")


@dataclass
class LazyGroup:
    """Requests attended together: queries `[B, Tq]` at `token_index`, keys gathered from the cache."""

    token_index: slice | torch.Tensor  # rows of the step's flat query tensor, in [B, Tq] order
    batch: int
    query_length: int
    kv_rows: torch.Tensor  # [2 * B * Hkv * Tk] int64: K then V rows of the cache as `[pages * 2 * block, D]`
    metadata: LazyMetadata
    block_table: torch.Tensor  # [B, blocks] int32: the requests' blocks (the native decode op reads the pages in place)
    seq_lens: torch.Tensor  # [B] int32: keys per request


@dataclass
class LazyPagedStep:
    """One step as the paged Triton entry point takes it (device tensors; decode requests first)."""

    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes requests have one query token each


@dataclass
class LazyServingMetadata(AttentionMetadata):
    num_actual_tokens: int
    groups: list[LazyGroup]  # the PyTorch path (empty when `paged` is set)
    paged: LazyPagedStep | None = None  # the Triton path


def use_triton(device: torch.device) -> bool:
    """The model's own choice (the op layer's `uses_triton`, from `LAZY_LLAMA_BACKEND` and the device; every
    cache dtype the backend supports runs on both paths): the paged Triton path on CUDA, PyTorch elsewhere."""
    return uses_triton(device)


@dataclass(frozen=True)
class LazyPageLayout:
    """The one place that knows how this backend lays out a layer's KV cache; every reader and writer asks here.

    vLLM hands each layer a contiguous `[num_blocks, Hkv, block_size, 2 * D]` tensor (the head-major LBHNC layout
    this backend requests). This backend alone reads and writes it, so it stores each (block, head) page of
    `block_size * 2D` values as all the page's `block_size` keys followed by all its values: gathered pages are
    then contiguous K and V matrices, and the native CPU ops and the Triton kernels read them as two strided views.
    Seen as rows of D values, key t of (block, head) is row `(block * Hkv + head) * 2 * block_size + t`, its value
    `block_size` rows later.
    """

    num_kv_heads: int
    block_size: int
    head_size: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor, head_size: int) -> "LazyPageLayout":
        """The layout of `kv_cache`, refused with one line when it is not this backend's."""
        if not kv_cache.is_contiguous():
            raise RuntimeError(f"LazyLlama on vLLM needs the LBHNC KV-cache layout; got strides {kv_cache.stride()} "
                               "(unset VLLM_KV_CACHE_LAYOUT).")
        if kv_cache.shape[-1] != 2 * head_size:
            raise ValueError(f"LazyLlama on vLLM needs value heads of the key head size {head_size}; this cache holds "
                             f"values of {kv_cache.shape[-1] - head_size} (Lazy Attention is defined for Llama's "
                             "equal head sizes).")
        return cls(kv_cache.shape[1], kv_cache.shape[2], head_size)

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(K, V)`: views `[num_blocks, Hkv, block_size, D]` of the pages (the Triton path and the native ops)."""
        pages = kv_cache.view(-1, self.num_kv_heads, 2 * self.block_size, self.head_size)
        return pages[:, :, : self.block_size], pages[:, :, self.block_size:]

    def rows(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache as rows of D values (keys and values alike): what `key_rows` indexes."""
        return kv_cache.view(-1, self.head_size)

    def key_rows(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """`[..., Hkv]` int64 rows of `rows()` holding the keys at `offsets` inside `blocks` (same shapes), one per
        KV head; the values are `block_size` rows later."""
        heads = torch.arange(self.num_kv_heads, device=blocks.device)
        page = blocks.long()[..., None] * self.num_kv_heads + heads
        return page * (2 * self.block_size) + offsets.long()[..., None]

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """`[T, Hkv]` key rows of vLLM's cache slots (`slot = block * block_size + offset`)."""
        return self.key_rows(slots // self.block_size, slots % self.block_size)


class LazyAttentionMetadataBuilder(AttentionMetadataBuilder[LazyServingMetadata]):
    """Turns vLLM's per-step batch description into `LazyGroup`s (positions, cache pages), or, for the Triton
    path, into a `LazyPagedStep`."""

    reorder_batch_threshold = 1  # vLLM puts single-token (decode) requests first: the packed decode takes them

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.layout = LazyPageLayout(kv_cache_spec.num_kv_heads, kv_cache_spec.block_size, kv_cache_spec.head_size)

    def _group(self, requests: list[int], starts: list[int], seq_lens: list[int], block_table: torch.Tensor,
               query_length: int) -> LazyGroup:
        """One group: the last `query_length` tokens of each request are its queries, all its tokens its keys."""
        lengths = torch.tensor([seq_lens[r] for r in requests])
        key_length = int(lengths.max())
        num_blocks = -(-key_length // self.block_size)
        table = block_table[requests, :num_blocks].long()
        # token rows: a shorter request's padding keys repeat its last key (finite; the metadata hides them)
        token = torch.minimum(torch.arange(key_length), lengths[:, None] - 1)  # [B, Tk]
        blocks = torch.gather(table, 1, token // self.block_size)
        key_rows = self.layout.key_rows(blocks, token % self.block_size).transpose(1, 2)  # [B, Hkv, Tk]
        kv_rows = torch.cat([key_rows.reshape(-1), key_rows.reshape(-1) + self.block_size])
        # query i of a request with c cached tokens has position c + i; key j position j; padding keys are hidden
        metadata = LazyMetadata.from_seq_lens(lengths, query_length=query_length, key_length=key_length)
        first = [starts[r] for r in requests]
        if first == list(range(first[0], first[0] + query_length * len(requests), query_length)):
            # consecutive requests (all decodes, which vLLM puts first for this backend): a view, no gather
            token_index = slice(first[0], first[0] + query_length * len(requests))
        else:
            token_index = (torch.tensor(first)[:, None] + torch.arange(query_length)).view(-1).to(self.device)
        return LazyGroup(token_index, len(requests), query_length, kv_rows.to(self.device), metadata,
                         table.to(torch.int32), lengths.to(torch.int32))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LazyServingMetadata:
        common = common_attn_metadata
        num_reqs = common.num_reqs
        starts = common.query_start_loc_cpu[: num_reqs + 1].tolist()
        if use_triton(self.device):
            lengths = [b - a for a, b in zip(starts, starts[1:])]
            num_decodes = next((i for i, n in enumerate(lengths) if n != 1), num_reqs)
            step = LazyPagedStep(common.query_start_loc[: num_reqs + 1].to(torch.int32),
                                 common.seq_lens[:num_reqs].to(torch.int32),
                                 common.block_table_tensor[:num_reqs].to(torch.int32), max(lengths, default=1),
                                 int(common.max_seq_len), num_decodes)
            return LazyServingMetadata(num_actual_tokens=common.num_actual_tokens, groups=[], paged=step)
        seq_lens = common.seq_lens[:num_reqs].cpu().tolist()
        block_table = common.block_table_tensor[:num_reqs].cpu()
        same_shape = defaultdict(list)  # (query length, key length) -> requests; all decodes share one group
        for req in range(num_reqs):
            query_length = starts[req + 1] - starts[req]
            if query_length > 0:
                same_shape[(1, 0) if query_length == 1 else (query_length, seq_lens[req])].append(req)
        with _one_thread(True):  # index tensors of a few thousand entries
            groups = [self._group(requests, starts, seq_lens, block_table, query_length)
                      for (query_length, _), requests in same_shape.items()]
        return LazyServingMetadata(num_actual_tokens=common.num_actual_tokens, groups=groups)


class LazyAttentionImpl(AttentionImpl[LazyServingMetadata]):
    """Exact Lazy Attention of one layer; `tau` and `distance_bias` are this rank's heads (float32)."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, *, tau: torch.Tensor, distance_bias: torch.Tensor):
        unsupported = {
            "a quantized KV cache (kv_cache_dtype)": kv_cache_dtype != "auto",
            "ALiBi": alibi_slopes is not None,
            "a sliding window (`sliding_window` or sliding `layer_types` in config.json)": sliding_window is not None,
            "logit soft-capping": logits_soft_cap not in (None, 0),
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
        }
        refused = [name for name, present in unsupported.items() if present]
        if refused:
            raise ValueError(
                f"LazyLlama on vLLM does not support {', '.join(refused)}: Lazy Attention here is full causal "
                "decoder attention over a K/V cache in the model dtype. Remove those options (engine arguments or "
                "config.json fields)."
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.tau = tau
        self.distance_bias = distance_bias

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Write the step's post-RoPE K `[T, Hkv, D]` and V `[T, Hkv, Dv]` into their cache slots."""
        count = slot_mapping.shape[0]
        slots = slot_mapping.long()
        key, value = key[:count], value[:count]
        layout = LazyPageLayout.of(kv_cache, self.head_size)
        if cache_write_supported(key, value, kv_cache):  # one native call, no index tensors
            lazy_cache_write(key, value, slots, *layout.views(kv_cache))
            return
        valid = slots >= 0  # padded tokens carry -1
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
        key_rows = layout.slot_rows(slots).reshape(-1)  # [T * Hkv], in key's [T, Hkv] order
        rows = layout.rows(kv_cache)
        with _one_thread(key.numel() + value.numel() <= _ONE_THREAD_MAX_ELEMENTS):
            rows[key_rows] = key.reshape(-1, self.head_size).to(kv_cache.dtype)
            rows[key_rows + layout.block_size] = value.reshape(-1, self.head_size).to(kv_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """query `[T, Hq, D]`; output `[T, Hq, Dv]` (written in place and returned)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("LazyLlama on vLLM does not fuse output quantization.")
        if attn_metadata is None:  # vLLM's profiling run: no cache yet, nothing to attend
            return output
        step = attn_metadata.paged
        if step is not None:
            count = attn_metadata.num_actual_tokens
            keys, values = LazyPageLayout.of(kv_cache, self.head_size).views(kv_cache)
            out = lazy_attention_paged(
                query[:count], keys, values, step.block_table, step.query_start_loc,
                step.seq_lens, self.tau, self.distance_bias, self.scale, max_query_len=step.max_query_len,
                max_seq_len=step.max_seq_len, num_decodes=step.num_decodes)
            output[:count] = out.to(output.dtype)
            return output
        kv_heads = kv_cache.shape[1]
        rows = LazyPageLayout.of(kv_cache, self.head_size).rows(kv_cache)  # K and V rows: one gather of rows
        native = decode_supported(query, kv_cache, kv_cache)
        for group in attn_metadata.groups:
            if native and group.query_length == 1 and isinstance(group.token_index, slice):
                self._kernel_decode(group, query, kv_cache, output)
                continue
            key_length = group.metadata.key_length
            small = group.batch * self.num_heads * group.query_length * key_length <= _ONE_THREAD_MAX_ELEMENTS
            with _one_thread(small):
                # one copy of the rows the group reads: contiguous [2, B, Hkv, Tk, D]
                kv = rows.index_select(0, group.kv_rows).view(2, group.batch, kv_heads, key_length, -1)
                k, v = kv[0], kv[1]
                q = query[group.token_index].view(group.batch, group.query_length, self.num_heads, self.head_size)
                out = lazy_attention(q.transpose(1, 2), k, v, self.tau, self.distance_bias, group.metadata,
                                     self.scale, backend="torch")  # [B, Tq, Hq, Dv]
                out = out.reshape(-1, self.num_heads, out.shape[-1]).to(output.dtype)
                if isinstance(group.token_index, slice):
                    output[group.token_index] = out
                else:
                    output.index_copy_(0, group.token_index, out)
        return output

    def _kernel_decode(self, group: LazyGroup, query, kv_cache, output) -> None:
        """A decode group through the native CPU op, which reads K and V through the block table in place (no copy
        of the cache, one call per layer and step)."""
        kv_heads = kv_cache.shape[1]
        # one parallel region per layer (not a dozen ops): worth the caller's threads once there are enough tasks
        small = group.batch * kv_heads < 8 or group.batch * self.num_heads * group.metadata.key_length < (1 << 14)
        with _one_thread(small):
            keys, values = LazyPageLayout.of(kv_cache, self.head_size).views(kv_cache)
            output[group.token_index] = lazy_decode_cpu(
                query[group.token_index], keys, values, self.tau, self.distance_bias, self.scale,
                seq_lens=group.seq_lens, block_table=group.block_table)


class LazyAttentionBackend(AttentionBackend):
    """Registered as `LAZY_ATTN`; chosen by the LazyLlama model for its attention layers only."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[LazyAttentionImpl]:
        return LazyAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[LazyAttentionMetadataBuilder]:
        return LazyAttentionMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # head-major pages: one index_select gathers [B, Hkv, Tk, D + Dv]


__all__ = ["LazyAttentionBackend", "register_backend_name"]
