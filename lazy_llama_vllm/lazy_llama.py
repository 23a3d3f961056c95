"""LazyLlama for vLLM: vLLM's Llama with Lazy Attention in every layer.

Everything except attention is vLLM's own Llama (`LlamaDecoderLayer`, `LlamaModel`, `LlamaForCausalLM`:
parallel linear layers, RMSNorm, embeddings, logits, sampling, weight loading, pipeline parallelism).
`LazyLlamaAttention` keeps Llama's projections and RoPE and adds the two per-query-head parameters of
Lazy Attention, sharded with their heads under tensor parallelism:

    tau            [num_heads / tp]      float32   (Elastic-Softmax offset: ReLU(softmax + tau / n))
    distance_bias  [num_heads / tp, W]   float32   (added to the score at distance d < W)

The attention itself runs in `LazyAttentionBackend` over vLLM's paged KV cache.
"""

from collections.abc import Callable

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.utils import set_weight_attrs
from vllm.v1.attention.backend import AttentionType

from .lazy_attention_backend import LazyAttentionBackend, register_backend_name


def _head_sharded_loader(name: str, full_shape: tuple[int, ...]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Check a checkpoint tensor against the config, then load this rank's heads (dim 0)."""
    shard = sharded_weight_loader(0)

    def load(param: torch.Tensor, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != full_shape:
            raise ValueError(
                f"{name}: the checkpoint holds shape {tuple(loaded.shape)} but config.json implies {full_shape} "
                "(num_attention_heads, lazy_bias_window). The config does not match the weights: fix config.json "
                "or re-run lazy-convert."
            )
        shard(param, loaded)

    return load


def check_servable(config, tp_size: int) -> None:
    """Refuse, with one line saying what to change, a LazyLlama config this plugin cannot serve exactly."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size != 0:
        raise ValueError(
            f"LazyLlama: tensor_parallel_size={tp_size} must divide num_attention_heads={heads} "
            "(tau and distance_bias are sharded with their heads); choose another tensor_parallel_size."
        )
    if kv_heads % tp_size != 0 and tp_size % kv_heads != 0:
        raise ValueError(
            f"LazyLlama: tensor_parallel_size={tp_size} and num_key_value_heads={kv_heads} must divide one "
            "another; choose another tensor_parallel_size."
        )
    if getattr(config, "is_causal", True) is False:
        raise ValueError("LazyLlama: Lazy Attention is causal decoder attention; is_causal=False cannot be served.")
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        raise ValueError(
            "LazyLlama: only full causal attention layers are supported (config.layer_types asks for "
            f"{sorted(set(config.layer_types))}); remove layer_types from config.json."
        )
    if getattr(config, "lazy_bias_window", None) is None:
        raise ValueError("LazyLlama: config.json has no lazy_bias_window; convert the model with lazy-convert.")


class LazyLlamaAttention(nn.Module):
    """Llama attention (QKV projection, RoPE, output projection) whose attention is Lazy Attention.

    Same constructor as vLLM's `LlamaAttention`, so `LlamaDecoderLayer(attn_layer_type=...)` builds it.
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_position_embeddings: int = 8192,
        quant_config: QuantizationConfig | None = None,
        bias: bool = False,
        bias_o_proj: bool = False,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
        attn_type: str = AttentionType.DECODER,
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)  # replicated when fewer KV heads than ranks
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        window = config.lazy_bias_window

        self.qkv_proj = QKVParallelLinear(
            hidden_size=hidden_size, head_size=self.head_dim, total_num_heads=num_heads,
            total_num_kv_heads=num_kv_heads, bias=bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=num_heads * self.head_dim, output_size=hidden_size, bias=bias_o_proj,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim, max_position=max_position_embeddings,
            rope_parameters=getattr(config, "rope_parameters", None), is_neox_style=True,
        )
        # float32 whatever the model dtype, like the Hugging Face model (the threshold test needs it)
        self.tau = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.distance_bias = nn.Parameter(torch.zeros(self.num_heads, window, dtype=torch.float32),
                                          requires_grad=False)
        set_weight_attrs(self.tau, {"weight_loader": _head_sharded_loader(f"{prefix}.tau", (num_heads,))})
        set_weight_attrs(self.distance_bias,
                         {"weight_loader": _head_sharded_loader(f"{prefix}.distance_bias", (num_heads, window))})

        register_backend_name()
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
            cache_config=cache_config, quant_config=quant_config, attn_type=attn_type, prefix=f"{prefix}.attn",
            attn_backend=LazyAttentionBackend, tau=self.tau, distance_bias=self.distance_bias,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class LazyLlamaDecoderLayer(LlamaDecoderLayer):
    """vLLM's Llama decoder layer with `LazyLlamaAttention`."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config, attn_layer_type=LazyLlamaAttention)


class LazyLlamaForCausalLM(LlamaForCausalLM):
    """The architecture `LazyLlamaForCausalLM` of a LazyLlama `config.json`, for vLLM."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        check_servable(vllm_config.model_config.hf_config, get_tensor_model_parallel_world_size())
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=LazyLlamaDecoderLayer)


__all__ = ["LazyLlamaForCausalLM", "check_servable"]
