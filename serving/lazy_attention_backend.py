"""Lazy Attention as a vLLM attention backend over the paged KV cache (exact, PyTorch).

vLLM's own backends compute softmax attention; Elastic-Softmax (`ReLU(softmax + tau / n)`) and the
per-head distance bias need the whole score row and each query's position, so this backend:

1. writes every new token's K and V into the paged cache (`do_kv_cache_update`): the cache of one layer
   is vLLM's logical `[num_blocks, num_kv_heads, block_size, head_size + head_size_v]` view, K in the
   first `head_size` channels, V in the rest (any physical layout vLLM picks);
2. for each step, groups the scheduled requests (`LazyServingMetadata`, built once per step and shared by
   every layer): each prefill or prefill chunk is one group of its own, all single-token decodes form one
   padded group;
3. gathers each group's keys and values from the cache into `[B, Hkv, Tk, D]` and calls the project's
   exact CPU op `lazy_attention_torch` with a `LazyMetadata` built from vLLM's sequence lengths: query i
   of a request with `c` cached tokens has position `c + i` (`n_i = c + i + 1`), key j has position j.

The cached K/V are post-RoPE keys and values, which do not depend on `tau` or the distance bias, so
vLLM's prefix caching and chunked prefill work unchanged. The same PyTorch path runs on every device.
"""

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

from modeling_lazy.lazy_attention_reference import LazyMetadata
from modeling_lazy.lazy_attention_torch import lazy_attention_torch

BACKEND_NAME = "LAZY_ATTN"


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
    key_blocks: torch.Tensor  # [B, Tk] int64: cache block of key j (padding keys: any valid block)
    key_offsets: torch.Tensor  # [B, Tk] int64: slot inside that block
    metadata: LazyMetadata


@dataclass
class LazyServingMetadata(AttentionMetadata):
    num_actual_tokens: int
    groups: list[LazyGroup]


def _lazy_metadata(q_pos: torch.Tensor, key_lengths: torch.Tensor, key_length: int, causal: bool) -> LazyMetadata:
    """Metadata of B requests whose queries sit at `q_pos [B, Tq]` and whose keys are `0 .. key_lengths - 1`
    (padded to `key_length`; padding keys get segment -1 so that nothing sees them)."""
    batch, query_length = q_pos.shape
    k_pos = torch.arange(key_length, dtype=torch.long).expand(batch, key_length).contiguous()
    k_seg = torch.where(k_pos < key_lengths[:, None], 0, -1).to(torch.int32)
    q_seg = torch.zeros(batch, query_length, dtype=torch.int32)
    return LazyMetadata(q_pos, k_pos, q_seg, k_seg, key_length - query_length, causal,
                        q_pos.to(torch.int32), k_pos.to(torch.int32))


class LazyAttentionMetadataBuilder(AttentionMetadataBuilder[LazyServingMetadata]):
    """Turns vLLM's per-step batch description into `LazyGroup`s (positions, cache slots)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def _slots(self, block_row: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return block_row[positions // self.block_size].long(), positions % self.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LazyServingMetadata:
        common = common_attn_metadata
        num_reqs = common.num_reqs
        starts = common.query_start_loc_cpu[: num_reqs + 1].tolist()
        seq_lens = common.seq_lens[:num_reqs].cpu().tolist()
        block_table = common.block_table_tensor[:num_reqs].cpu()
        groups, decodes = [], []
        for req in range(num_reqs):
            start, stop, key_length = starts[req], starts[req + 1], seq_lens[req]
            query_length = stop - start
            if query_length == 0:
                continue
            if query_length == 1:
                decodes.append(req)
                continue
            keys = torch.arange(key_length)
            blocks, offsets = self._slots(block_table[req], keys)
            q_pos = keys[key_length - query_length:][None]  # cached tokens c, then c + i
            metadata = _lazy_metadata(q_pos, torch.tensor([key_length]), key_length, causal=True)
            groups.append(LazyGroup(slice(start, stop), 1, query_length, blocks[None], offsets[None], metadata))
        if decodes:
            lengths = torch.tensor([seq_lens[r] for r in decodes])
            key_length = int(lengths.max())
            keys = torch.arange(key_length).expand(len(decodes), key_length)
            keys = torch.minimum(keys, (lengths - 1)[:, None])  # padding repeats the last real key
            rows = block_table[decodes]
            blocks = torch.gather(rows, 1, keys // self.block_size).long()
            offsets = keys % self.block_size
            q_pos = (lengths - 1)[:, None]
            causal = bool((lengths == key_length).all())
            metadata = _lazy_metadata(q_pos, lengths, key_length, causal)
            token_index = torch.tensor([starts[r] for r in decodes])
            groups.append(LazyGroup(token_index, len(decodes), 1, blocks, offsets, metadata))
        return LazyServingMetadata(num_actual_tokens=common.num_actual_tokens, groups=groups)


class LazyAttentionImpl(AttentionImpl[LazyServingMetadata]):
    """Exact Lazy Attention of one layer; `tau` and `distance_bias` are this rank's heads (float32)."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, *, tau: torch.Tensor, distance_bias: torch.Tensor):
        unsupported = {
            "a quantized KV cache (kv_cache_dtype)": kv_cache_dtype != "auto",
            "ALiBi": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "logit soft-capping": logits_soft_cap not in (None, 0),
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
        }
        refused = [name for name, present in unsupported.items() if present]
        if refused:
            raise ValueError(
                f"LazyLlama on vLLM does not support {', '.join(refused)}: Lazy Attention here is full causal "
                "decoder attention over a K/V cache in the model dtype. Remove those options."
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
        valid = slots >= 0  # padded tokens carry -1
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[:count][valid], value[:count][valid]
        else:
            key, value = key[:count], value[:count]
        block_size = kv_cache.shape[2]
        head_size = key.shape[-1]
        kv_cache[slots // block_size, :, slots % block_size, :head_size] = key.to(kv_cache.dtype)
        kv_cache[slots // block_size, :, slots % block_size, head_size:] = value.to(kv_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """query `[T, Hq, D]`; output `[T, Hq, Dv]` (written in place and returned)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("LazyLlama on vLLM does not fuse output quantization.")
        if attn_metadata is None:  # vLLM's profiling run: no cache yet, nothing to attend
            return output
        heads = torch.arange(kv_cache.shape[1], device=kv_cache.device)[None, :, None]
        for group in attn_metadata.groups:
            # one gather straight into [B, Hkv, Tk, D + Dv]: each (request, head) matrix is contiguous
            cached = kv_cache[group.key_blocks[:, None, :], heads, group.key_offsets[:, None, :]]
            k, v = cached[..., : self.head_size], cached[..., self.head_size:]
            q = query[group.token_index].view(group.batch, group.query_length, self.num_heads, self.head_size)
            out = lazy_attention_torch(q.transpose(1, 2), k, v, self.tau, self.distance_bias, group.metadata,
                                       self.scale)  # [B, Tq, Hq, Dv]
            output[group.token_index] = out.reshape(-1, self.num_heads, out.shape[-1]).to(output.dtype)
        return output


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


__all__ = ["LazyAttentionBackend", "register_backend_name"]
