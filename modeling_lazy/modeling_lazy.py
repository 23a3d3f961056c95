"""LazyLlama: Llama with Lazy Attention ("Attention Needs to Focus", arXiv 2601.00919).

Read top to bottom in the order data flows: the attention functions (`eager` reference and the fused
`lazy` one), the attention module with its two new parameters, the decoder layer, the pre-trained base
class, the base model, the causal-LM head and Llama's three task heads. Everything not listed here is
Llama's, reused unchanged.
The math and the attention backends are described in docs/design.md (in the LazyLlama repository).

The file only uses sibling imports, so it travels flat with a checkpoint (`trust_remote_code=True`).
"""

import copy
import errno
import glob
import os
import re
import shutil
import uuid
from collections.abc import Callable

import torch
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.generation import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.utils import can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

try:  # transformers >= 5.2x: also per-row (2-D) selections
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers 5.19: Llama's int / 1-D selection

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The last `logits_to_keep` positions (0: all), or the positions a 1-D tensor names."""
        selection = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, selection, :]

try:  # flat copy next to a checkpoint (trust_remote_code)
    from .configuration_lazy import LazyLlamaConfig
except ImportError:  # installed project: the config lives in its own package
    from configuration_lazy import LazyLlamaConfig
from .lazy_attention_ops import lazy_attention
from .lazy_attention_reference import LazyMetadata, lazy_attention_reference

logger = logging.get_logger(__name__)

# Name of the cache field of model outputs: `cache` since transformers 5.2x, `past_key_values` before.
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# The two parameters Lazy Attention adds to every attention layer (float32, one entry per query head).
LAZY_PARAMETER_NAMES = ("tau", "distance_bias")
REFUSED_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")


def eager_lazy_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference Lazy Attention that materialises `a_ij` (after the ReLU); supports `output_attentions` and dropout.

    query `[B, Hq, Tq, D]`, key/value `[B, Hkv, Tk, D]`; the mask information arrives as
    `kwargs["lazy_metadata"]`, the `LazyMetadata` built once per forward by the model. `dropout` (training
    only) drops weights `a_ij` as Llama's eager attention drops softmax weights.
    Returns `(out [B, Tq, Hq, D], weights [B, Hq, Tq, Tk] float32)`.
    """
    return lazy_attention_reference(query, key, value, module.tau, module.distance_bias, kwargs["lazy_metadata"],
                                     scaling, dropout=dropout)


def lazy_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Fused Lazy Attention through the op layer (`lazy_attention_ops`): Triton kernels on CUDA, the exact PyTorch
    path elsewhere, as its decision table says (also under torch.compile).

    Same inputs as `eager_lazy_attention_forward` (the attention module routes calls that need weights or
    dropout to that one); returns `(out [B, Tq, Hq, D], None)`.
    """
    return lazy_attention(query, key, value, module.tau, module.distance_bias, kwargs["lazy_metadata"], scaling), None


AttentionInterface.register("lazy", lazy_attention_forward)
# The model builds its own compact metadata; no HF mask is ever needed for the "lazy" key.
AttentionMaskInterface.register("lazy", lambda *args, **kwargs: None)


class LazyLlamaRotaryEmbedding(LlamaRotaryEmbedding):
    """Llama's RoPE, unchanged (dimension-wise positional discrimination)."""


class LazyLlamaAttention(nn.Module):
    """Llama attention whose softmax is Elastic-Softmax, plus a learnable per-head distance bias.

    New parameters (float32, belong to query heads):
        tau `[num_attention_heads]`: Elastic-Softmax offset, `a = ReLU(softmax + tau / n)`.
        distance_bias `[num_attention_heads, lazy_bias_window]`: added to the score at distance `d < W`.
    """

    def __init__(self, config: LazyLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.tau = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.distance_bias = nn.Parameter(torch.empty(self.num_heads, config.lazy_bias_window, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        """`nn.Module._apply` (behind `.to()`, `.half()`, `.bfloat16()`, `.cuda()`...) keeping tau and
        distance_bias (and their gradients) float32 when the rest of the layer is cast to a 16-bit float.

        In bfloat16 most AdamW updates of size lr round away on values near 1, so the two parameters would stop
        training; the kernels read them in float32 anyway. A cast to float64 (gradient checks) is followed, and a
        16-bit cast after it gives float32 again. The values are converted from the originals, so nothing is
        rounded to 16 bits on the way.
        """
        originals = {}
        for name in LAZY_PARAMETER_NAMES:
            param = self._parameters.get(name)
            if param is not None and param.dtype in (torch.float32, torch.float64):
                originals[id(param)] = param
                if param.grad is not None:
                    originals[id(param.grad)] = param.grad

        def keep_float32(tensor):
            converted = fn(tensor)
            if id(tensor) in originals and converted.dtype in (torch.bfloat16, torch.float16):
                return tensor.to(device=converted.device, dtype=torch.float32)
            return converted

        return super()._apply(keep_float32 if originals else fn, recurse)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        lazy_metadata: LazyMetadata,
        cache: Cache | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, Hq, T, D]
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, Hkv, T, D]
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)  # [B, Hkv, Tk, D]

        implementation = self.config._attn_implementation
        if implementation in REFUSED_IMPLEMENTATIONS:
            raise ValueError(_refusal_message(implementation))
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_lazy_attention_forward
        )
        dropout = self.attention_dropout if self.training else 0.0
        if attention_interface is lazy_attention_forward and (output_attentions or dropout > 0):
            # The fused path never materialises the weights (and has no dropout): this call uses the reference.
            # A user-registered attention function is called as it is (it answers for its own weights).
            logger.warning_once(
                f'attn_implementation="{implementation}" computes calls with output_attentions=True or attention '
                "dropout (training) with the reference (eager) Lazy Attention, which materialises the L x L weights."
            )
            attention_interface = eager_lazy_attention_forward
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            None,
            dropout=dropout,
            scaling=self.scaling,
            lazy_metadata=lazy_metadata,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # [B, T, Hq * D]
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


def is_lazy_parameter(name: str) -> bool:
    """True for a parameter Lazy Attention adds (`...self_attn.tau`, `...self_attn.distance_bias`)."""
    return name.rsplit(".", 1)[-1] in LAZY_PARAMETER_NAMES


def lazy_attention_modules(model: nn.Module) -> list["LazyLlamaAttention"]:
    """The Lazy Attention layers of a model, in layer order (works through wrappers such as PEFT or DDP)."""
    return [module for module in model.modules() if isinstance(module, LazyLlamaAttention)]


def _refusal_message(implementation: str) -> str:
    return (
        f'attn_implementation="{implementation}" cannot express Elastic-Softmax (ReLU(softmax + tau/n) with a '
        'per-head distance bias). Use attn_implementation="lazy" (the default: Triton kernels on CUDA, an exact '
        'memory-efficient PyTorch path elsewhere) or "eager" (the reference that can return attention weights).'
    )


class LazyLlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: LazyLlamaConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LazyLlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        lazy_metadata: LazyMetadata | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            lazy_metadata=lazy_metadata,
            cache=cache,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


# Files that make a checkpoint self-contained for `trust_remote_code=True` (all flat, sibling imports).
MODELING_FILES = (
    "modeling_lazy.py", "lazy_attention_ops.py", "lazy_attention_reference.py", "lazy_attention_torch.py",
    "lazy_attention_triton.py", "lazy_attention_triton_common.py", "lazy_attention_triton_forward.py",
    "lazy_attention_triton_backward.py", "lazy_attention_triton_decode.py", "lazy_attention_cpu.py",
)
AUTO_MAP = {
    "AutoConfig": "configuration_lazy.LazyLlamaConfig",
    "AutoModel": "modeling_lazy.LazyLlamaModel",
    "AutoModelForCausalLM": "modeling_lazy.LazyLlamaForCausalLM",
    "AutoModelForSequenceClassification": "modeling_lazy.LazyLlamaForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_lazy.LazyLlamaForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_lazy.LazyLlamaForQuestionAnswering",
}


def code_files() -> list[str]:
    """Absolute paths of the code files a checkpoint carries (config first)."""
    import inspect

    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.abspath(inspect.getfile(LazyLlamaConfig))]
    files += [os.path.join(here, name) for name in MODELING_FILES if os.path.exists(os.path.join(here, name))]
    return files


def _saved_weights(variant: str | None) -> re.Pattern:
    """The names of the weight files and index a save of `variant` writes (as transformers names them)."""
    tag = re.escape(f".{variant}" if variant else "")
    return re.compile(rf"model{tag}(-\d{{5}}-of-\d{{5}})?\.safetensors|model\.safetensors\.index{tag}\.json")


def _staging_folder(target: str) -> str:
    """A new hidden folder for a save to `target`, on the target's file system so that renames are moves: inside
    `target` when it exists (`.saving-PID-XXXXXXXX`: the folder may be a mount point, or its parent read-only),
    else beside it (`.NAME.saving-PID-XXXXXXXX`). Those of saves whose process is gone (killed before it could
    clean up) are removed first."""
    parent, name = (target, "") if os.path.isdir(target) else os.path.split(target)
    prefix = f".{name}.saving-" if name else ".saving-"
    for left in glob.glob(os.path.join(parent, glob.escape(prefix) + "*")):
        pid = os.path.basename(left)[len(prefix):].split("-")[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(left, ignore_errors=True)
        except (ValueError, OSError):
            pass  # not ours, or alive under another user: leave it
    path = os.path.join(parent, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)  # the umask's permissions, as `os.makedirs` would give the target
    return path


def _move_into(staging: str, target: str, weights: re.Pattern) -> None:
    """Put the complete `staging` folder's files at `target`.

    A new `target` is `staging`, renamed. An existing one may hold other things (a Trainer's checkpoints, a
    tokenizer) and is kept (its permissions, a mount), so each file is renamed over its old version: weights and
    their index first, `config.json` last (what a loader reads first), after removing the `weights` files of an
    earlier save that this one does not write (a stale `model.safetensors` would shadow new shards)."""
    if not os.path.isdir(target):
        try:
            os.rename(staging, target)
            return
        except OSError as error:  # another save created it meanwhile: join it file by file
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    names = sorted(os.listdir(staging), key=lambda name: (name == "config.json", weights.fullmatch(name) is None))
    for old in os.listdir(target):
        if weights.fullmatch(old) and old not in names:
            os.remove(os.path.join(target, old))
    for name in names:
        destination = os.path.join(target, name)
        if os.path.isdir(destination) and not os.path.islink(destination):
            shutil.rmtree(destination)
        os.replace(os.path.join(staging, name), destination)


class LazyLlamaPreTrainedModel(PreTrainedModel):
    config_class = LazyLlamaConfig
    config: LazyLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LazyLlamaDecoderLayer"]
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = True  # static-cache decode traces to one graph (tests/test_conformance.py)
    _keep_in_fp32_modules_strict = list(LAZY_PARAMETER_NAMES)
    _can_record_outputs = {
        "hidden_states": LazyLlamaDecoderLayer,
        "attentions": LazyLlamaAttention,
    }

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """`"lazy"` unless asked otherwise; `"eager"` is the reference; softmax-only backends are refused."""
        if requested_attention is None or requested_attention == "lazy":
            return "lazy"
        if requested_attention == "eager":
            return "eager"
        if requested_attention in REFUSED_IMPLEMENTATIONS:
            raise ValueError(_refusal_message(requested_attention))
        raise ValueError(
            f'Unknown attn_implementation="{requested_attention}" for LazyLlama: use "lazy" (default) or "eager".'
        )

    @classmethod
    def prepare_distribute_model(cls, distributed_config, device_map=None):
        """`from_pretrained(distributed_config=...)`, refusing FSDP2's parameter-casting mixed precision.

        `fsdp_mixed_precision=True` makes FSDP2 hand every parameter of a layer to the forward in bfloat16,
        `tau` and `distance_bias` included (one dtype per sharding group); they must stay float32. Autocast
        (`Trainer`'s `bf16=True`) keeps FSDP's weights float32 and runs the matmuls in bfloat16.
        """
        config = distributed_config if isinstance(distributed_config, dict) else vars(distributed_config or {})
        if config.get("fsdp_mixed_precision"):
            raise ValueError(
                "DistributedConfig(fsdp_mixed_precision=True) would cast tau and distance_bias to bfloat16 for the "
                "forward; LazyLlama keeps them float32. Leave it False and train with Trainer's bf16=True (autocast): "
                "FSDP2 keeps float32 weights and the matmuls run in bfloat16."
            )
        return super().prepare_distribute_model(distributed_config, device_map=device_map)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LazyLlamaAttention):
            init.constant_(module.tau, self.config.lazy_tau_init)
            init.normal_(module.distance_bias, mean=0.0, std=self.config.lazy_bias_init_std)

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, push_to_hub: bool = False,
                        **kwargs):
        """`PreTrainedModel.save_pretrained`, plus the flat code files and a full `auto_map`, written so that an
        interrupted save loses nothing.

        The result loads with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` in a Python
        where this project is not installed. Everything is written into a hidden folder first (beside a new
        `save_directory`, inside an existing one) and moved into place when complete (`_move_into`): a new folder
        appears whole, in one rename; into an existing folder each file is renamed over its old version, weights
        first and `config.json` last. `push_to_hub` saves through here, so it uploads the code too; so does
        `save_pretrained(..., push_to_hub=True)`, which uploads the complete folder once it is in place.
        """
        self.config.auto_map = dict(AUTO_MAP)
        state_dict = kwargs.get("state_dict")
        lazy = [p for n, p in self.named_parameters() if is_lazy_parameter(n)]
        if state_dict is None and any(p.dtype != torch.float32 for p in lazy):
            state_dict = self.state_dict()  # e.g. after model.double(): tau and distance_bias are saved float32 anyway
        if state_dict is not None:
            kwargs["state_dict"] = {n: t.float() if is_lazy_parameter(n) else t for n, t in state_dict.items()}
        target = os.path.realpath(os.fspath(save_directory))  # a link to a folder: into that folder
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        writes = is_main_process and (not distributed or torch.distributed.get_rank() == 0)  # transformers' rule
        if not writes or os.path.isfile(target):  # other ranks only join the gathering; a file: transformers says so
            return super().save_pretrained(save_directory, *args, is_main_process=is_main_process,
                                           push_to_hub=push_to_hub, **kwargs)
        hub = {name: kwargs.pop(name) for name in ("repo_id", "commit_message", "create_pr", "private")
               if name in kwargs}
        os.makedirs(os.path.dirname(target), exist_ok=True)
        staging = _staging_folder(target)
        try:
            result = super().save_pretrained(staging, *args, **kwargs)
            for path in code_files():
                shutil.copyfile(path, os.path.join(staging, os.path.basename(path)))
            _move_into(staging, target, _saved_weights(kwargs.get("variant")))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if push_to_hub:
            repo_id = hub.pop("repo_id", os.path.basename(target))
            self.push_to_hub(repo_id, token=kwargs.get("token"), **hub)
        return result

    def push_to_hub(self, repo_id: str, *args, tags: list[str] | None = None, **kwargs):
        """`PreTrainedModel.push_to_hub`, tagged `lazy-attention` and `custom_code`. It saves through
        `save_pretrained` above, so the code files and the full `auto_map` are uploaded too. For a full model
        card (conversion settings, measured statistics, usage) publish a saved folder with `lazy-push`."""
        tags = list(dict.fromkeys(["lazy-attention", "custom_code", *(tags or [])]))
        return super().push_to_hub(repo_id, *args, tags=tags, **kwargs)


class InPlaceDynamicLayer(DynamicLayer):
    """A `DynamicLayer` that writes each step's keys and values into spare capacity instead of concatenating.

    `DynamicLayer.update` concatenates: every generated token copies the layer's whole cache, twice the memory
    traffic of the attention that reads it. This layer keeps a buffer with room to spare (an eighth
    of the length, at least 256 tokens: that much more memory than `DynamicLayer` holds) and returns views of
    its first `length` rows, so a decode step writes one row; a full buffer is replaced by a larger one
    (amortised: about 8 rows copied per token, where concatenation copies them all). Everything
    else is `DynamicLayer`'s: the views are its `keys`/`values`, `crop` keeps writing in place, and a tensor that
    something else put there (beam reordering, batch selection, offloading, a cast) starts a new buffer from it.
    It falls back to concatenation where writing in place could break autograd (with grad enabled: an earlier
    call's attention may have saved the views for its backward, even of keys that need no gradient) or under
    torch.compile. `LazyLlamaModel` and `generate()` give it to the caches they create themselves.
    """

    _spare: tuple[torch.Tensor, torch.Tensor] | None = None  # the key and value buffers
    _views: tuple[torch.Tensor, torch.Tensor] | None = None  # the views of them this layer set as `keys`/`values`

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if (torch.compiler.is_compiling() or torch.is_grad_enabled()
                or key_states.dim() != 4 or value_states.dim() != 4):
            self._spare = self._views = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        spare = self._spare
        if (spare is None or end > spare[0].shape[-2] or self._views is None or self.keys is not self._views[0]
                or self.values is not self._views[1] or key_states.dtype != spare[0].dtype
                or value_states.dtype != spare[1].dtype):
            # first call, full, or `keys`/`values` replaced from outside (beam reorder, batch selection, offloading)
            spare = self._spare = tuple(new.new_empty(*new.shape[:-2], end + max(256, end // 8), new.shape[-1])
                                        for new in (key_states, value_states))
            if length:
                spare[0][..., :length, :] = self.keys
                spare[1][..., :length, :] = self.values
        spare[0][..., length:end, :] = key_states
        spare[1][..., length:end, :] = value_states
        self.keys, self.values = self._views = spare[0][..., :end, :], spare[1][..., :end, :]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """`DynamicLayer.crop`; the shorter views are still the buffers' first rows, so writing goes on in place."""
        in_place = self._views is not None and self.keys is self._views[0] and self.values is self._views[1]
        super().crop(tokens_to_remove)
        if in_place:
            self._views = self.keys, self.values

    def reset(self) -> None:
        self._spare = self._views = None
        super().reset()


def append_in_place(cache: Cache | None) -> Cache | None:
    """Give an unused `DynamicCache` `InPlaceDynamicLayer`s (its plain `DynamicLayer`s only; an offloading cache
    keeps its own). Returns the cache."""
    if type(cache) is DynamicCache and not getattr(cache, "offloading", False):
        if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
            cache.layer_class_to_replicate = InPlaceDynamicLayer
        for index, layer in enumerate(cache.layers):
            if type(layer) is DynamicLayer and not layer.is_initialized:
                cache.layers[index] = InPlaceDynamicLayer()
    return cache


def _cache_lengths(cache: Cache | None, query_length: int) -> tuple[int | torch.Tensor, int]:
    """`(past, key_length)`: cached tokens before this call, and how many keys the layers attend over.

    Eager calls cut the keys to `past + query_length` (a static cache's unwritten slots are never read).
    Under torch.compile a static cache keeps its length as a tensor: reading it as an int would sync with
    the host and recompile at every step, so the layers attend over the cache's whole fixed-size buffer
    (`get_mask_sizes`) with the unwritten slots masked, and `past` stays a tensor (a copy: the cache
    advances it in place while the layers run).
    """
    if cache is None:
        return 0, query_length
    past = cache.get_seq_length()
    if isinstance(past, torch.Tensor):
        if torch.compiler.is_compiling():
            return past.clone(), cache.get_mask_sizes(query_length, 0)[0]
        past = int(past)
    return past, past + query_length


def _fit_padding_mask(attention_mask, key_length: int, past, query_length: int, cache: Cache | None):
    """The 2-D padding mask cut or padded to the `key_length` keys this call attends over.

    A mask of `[B, past + query_length]` is the contract. For a static cache, `generate()` passes it padded
    with zeros to the cache's buffer length (so that its shape is fixed while decoding): eager calls cut it,
    compiled calls (`key_length` = buffer length) keep it. Other shapes are left for the metadata to refuse.
    """
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[-1] == key_length:
        return attention_mask
    if isinstance(past, torch.Tensor):  # compiled static cache: the mask may be shorter than the buffer
        return prepare_padding_mask(attention_mask, key_length, 0)
    if cache is not None and attention_mask.shape[-1] == cache.get_mask_sizes(query_length, 0)[0]:
        return attention_mask[:, :key_length]
    return attention_mask


class LazyLlamaModel(LazyLlamaPreTrainedModel):
    def __init__(self, config: LazyLlamaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [LazyLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LazyLlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Like `LlamaModel.forward`; `attention_mask` must be the 2-D `[B, past + T]` padding mask.

        Without `position_ids`, positions come from the mask (`cumsum - 1`), so Elastic-Softmax's key count
        `n_i = pos_i + 1` of a left-padded row equals that of the same prompt alone.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = append_in_place(DynamicCache(config=self.config))

        bsz, q_len = inputs_embeds.shape[:2]
        if q_len == 0:
            raise ValueError("The input has no tokens (input_ids of shape [batch, 0]): give at least one per row.")
        past, key_length = _cache_lengths(cache, q_len)
        attention_mask = _fit_padding_mask(attention_mask, key_length, past, q_len, cache)
        lazy_metadata = LazyMetadata.from_mask(
            attention_mask, position_ids, query_length=q_len, batch_size=bsz, past_length=past, key_length=key_length,
            device=inputs_embeds.device, cu_seq_lens=kwargs.get("cu_seq_lens_q"),
        )
        # the same rule as `capture_outputs`: the weights it records are the ones the layers return
        output_attentions = bool(kwargs.get("output_attentions", self.config.output_attentions))
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=lazy_metadata.q_pos)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings,
                lazy_metadata=lazy_metadata,
                cache=cache,
                output_attentions=output_attentions,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_FIELD: cache})


class LazyLlamaForCausalLM(LazyLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: LazyLlamaConfig):
        super().__init__(config)
        self.model = LazyLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Like `LlamaForCausalLM.forward`: logits `[B, T, vocab]` (or the last `logits_to_keep`), optional loss."""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )

    def init_continuous_batching(self, *args, **kwargs):
        """Refused with one line: transformers' continuous batching (`generate_batch`, `generate(cache_implementation=
        "paged")`, `transformers serve`) admits only its softmax attention backends (`paged|eager`, `sdpa`, flash)."""
        raise ValueError(
            "LazyLlama cannot run transformers' continuous batching (generate_batch, cache_implementation=\"paged\"): "
            "it admits only softmax attention backends (paged|eager, sdpa, flash), which cannot express "
            "Elastic-Softmax. Batch prompts with generate() (left padding), or serve with vLLM (make serve), whose "
            "LazyLlama backend batches continuously."
        )

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """`generate()`'s decision to compile its decode forward, where a `compile_config` the caller passes
        also compiles on CPU.

        transformers compiles on its own only on accelerators (cuda, xpu, ...) and on CPU only when the private
        flag `compile_config._compile_all_devices` is set; a caller who hands `generate()` a `compile_config`
        asks for compilation, so LazyLlama sets that flag for them (on a copy) unless it is set already.
        Everything else (a static cache, `disable_compile`, quantizers, offloading) is transformers' rule.
        """
        compile_config = generation_config.compile_config
        if compile_config is not None and getattr(compile_config, "_compile_all_devices", None) is None:
            compile_config = copy.copy(compile_config)
            compile_config._compile_all_devices = True
            generation_config = copy.copy(generation_config)
            generation_config.compile_config = compile_config
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' cache choice; a `DynamicCache` it creates (not one the caller passed) appends in place
        (`InPlaceDynamicLayer`)."""
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_FIELD)
        if cache is not None and not getattr(cache, "_is_user_defined", False):
            append_in_place(cache)
        return result

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, cache, **kwargs):
        """What `generate()` passes as `attention_mask` with a compilable (static) cache.

        Llama gets a 4-D mask there; LazyLlama needs the 2-D padding mask (Elastic-Softmax's `n_i` comes
        from it), padded with zeros to the cache's buffer length so that its shape stays fixed while decoding.
        """
        if attention_mask is None or attention_mask.dim() != 2 or cache is None:
            return attention_mask
        kv_length, kv_offset = cache.get_mask_sizes(inputs_embeds.shape[1], 0)
        return prepare_padding_mask(attention_mask, kv_length, kv_offset)


class _LazyLlamaTaskHead:
    """Base of the task heads: transformers' generic heads build their base model with `AutoModel.from_config`;
    this registers `LazyLlamaModel` for the config's class first. (A trust_remote_code copy loads the config and
    the model code as separately hashed modules, so a registration at import time would name another class.)"""

    def __init__(self, config: LazyLlamaConfig):
        AutoModel.register(type(config), LazyLlamaModel, exist_ok=True)
        super().__init__(config)


# Llama's three task heads: transformers' generic heads on a LazyLlamaModel, under Llama's names: `model` for
# sequence and token classification (a causal-LM checkpoint loads into them with only the new head initialised),
# `transformer` for question answering, as `LlamaForQuestionAnswering` has it, so its checkpoints map 1:1.
class LazyLlamaForSequenceClassification(
    _LazyLlamaTaskHead, GenericForSequenceClassification, LazyLlamaPreTrainedModel
):
    ...


class LazyLlamaForTokenClassification(_LazyLlamaTaskHead, GenericForTokenClassification, LazyLlamaPreTrainedModel):
    ...


class LazyLlamaForQuestionAnswering(_LazyLlamaTaskHead, GenericForQuestionAnswering, LazyLlamaPreTrainedModel):
    base_model_prefix = "transformer"


__all__ = [
    "LazyLlamaConfig",
    "LazyLlamaForCausalLM",
    "LazyLlamaForQuestionAnswering",
    "LazyLlamaForSequenceClassification",
    "LazyLlamaForTokenClassification",
    "LazyLlamaModel",
    "LazyLlamaPreTrainedModel",
]
