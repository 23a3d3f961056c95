"""Configuration of LazyLlama: a Llama whose attention is Lazy Attention (arXiv 2601.00919).

Every `LlamaConfig` field keeps its meaning; three fields are added:

- `lazy_bias_window` (int, default 1024): W, the number of distances `0..W-1` that own a learnable
  per-head bias `distance_bias[h, d]`; distances `>= W` get no bias (attention stays fully causal).
- `lazy_tau_init` (float, default -1.0): the initial Elastic-Softmax offset `tau_h` of a new model (the paper's
  init for training from scratch). Converting a Llama starts from tau = 0 instead (`lazy-convert --tau-init`,
  default 0): there LazyLlama computes exactly what the source Llama does.
- `lazy_bias_init_std` (float, default 1e-3): standard deviation of the initial distance bias.

This file imports nothing from this project, so it can travel with a checkpoint on its own.
"""

import logging
import math

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import LlamaConfig

# Sizes that must be whole numbers >= 1; None means "derive it" for the last two (LlamaConfig does).
_POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "max_position_embeddings", "num_key_value_heads", "head_dim")
_DERIVED_IF_NONE = ("num_key_value_heads", "head_dim")


class _LlamaIntoLazyLlama(logging.Filter):
    """Drops transformers' warning that a config of type `llama` instantiates a `lazy_llama` one ("... not
    supported and can yield errors"): a vanilla Llama config.json is meant to load into LazyLlamaConfig. The same
    warning about any other model type passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(f"You are using a model of type `llama` to instantiate a model of type "
                                              f"`{LazyLlamaConfig.model_type}`")


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@strict
class LazyLlamaConfig(LlamaConfig):
    r"""Configuration for [`LazyLlamaModel`] and [`LazyLlamaForCausalLM`].

    A vanilla Llama `config.json` loads into this class unchanged (the lazy fields take their defaults).

    ```python
    >>> from configuration_lazy import LazyLlamaConfig
    >>> config = LazyLlamaConfig(hidden_size=256, num_attention_heads=4, lazy_bias_window=512)
    ```
    """

    model_type = "lazy_llama"
    # Tensor parallelism (`from_pretrained(..., tp_plan="auto")`): Llama's plan, plus the two per-head parameters
    # sharded with their query heads ("colwise" shards dim 0, like q_proj's output rows; GQA keeps each rank's
    # query heads with their key/value heads as long as num_key_value_heads divides by the TP size), and the
    # attention module run on its local shards ("local_params").
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.tau": "colwise",
        "layers.*.self_attn.distance_bias": "colwise",
        "layers.*.self_attn": "local_params",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    lazy_bias_window: int = 1024
    lazy_tau_init: float | int = -1.0
    lazy_bias_init_std: float | int = 1e-3

    def __post_init__(self, **kwargs):
        # Checked here, before the strict-dataclass validators, so that bad values raise a plain ValueError.
        self.validate_lazy_fields()
        kwargs.pop("model_type", None)  # a vanilla Llama config.json says "llama": this class is "lazy_llama"
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """`PreTrainedConfig.from_dict` (what `from_pretrained` and `AutoConfig` call), checked again afterwards:
        it sets the keyword arguments (`from_pretrained(path, lazy_bias_window=0)`) after construction."""
        result = super().from_dict(config_dict, **kwargs)
        (result[0] if isinstance(result, tuple) else result).validate_lazy_fields()
        return result

    def validate_lazy_fields(self):
        """Reject inconsistent values with a ValueError that says what to change.

        Run at construction (`__post_init__`), after `from_dict`/`from_pretrained` has set its keyword arguments,
        and, as a `@strict` class validator, by `validate()`, which `save_pretrained` calls: a value set on the
        attribute afterwards is refused before anything is written.
        """
        for name in _POSITIVE_SIZES:
            value = getattr(self, name)
            if not (value is None and name in _DERIVED_IF_NONE or _is_positive_int(value)):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        window = self.lazy_bias_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"lazy_bias_window must be an integer >= 1 (the number of distances with a learnable bias), "
                f"got {self.lazy_bias_window!r}."
            )
        for name in ("lazy_tau_init", "lazy_bias_init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if self.lazy_bias_init_std < 0:
            raise ValueError(f"lazy_bias_init_std must be >= 0, got {self.lazy_bias_init_std!r}.")
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads != 0 and self.head_dim is None:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads ({heads}), "
                "or head_dim must be given."
            )
        if kv_heads is not None and heads % kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads}) "
                "for grouped-query attention: pick a num_key_value_heads that divides it."
            )


# What each field must hold, for the ValueError that replaces the strict dataclass's type error on these fields
# (`LazyLlamaConfig(lazy_bias_window=1.5)` raises a ValueError, as `lazy_bias_window=0` does).
_FIELD_KINDS = {name: "an integer >= 1" for name in _POSITIVE_SIZES}
_FIELD_KINDS.update(lazy_bias_window="an integer >= 1", lazy_tau_init="a finite number",
                    lazy_bias_init_std="a finite number >= 0")
_strict_setattr = LazyLlamaConfig.__setattr__


def _setattr_with_value_errors(self, name, value):
    try:
        _strict_setattr(self, name, value)
    except StrictDataclassFieldValidationError as error:
        if name not in _FIELD_KINDS:
            raise
        raise ValueError(f"{name} must be {_FIELD_KINDS[name]}, got {value!r}.") from error


LazyLlamaConfig.__setattr__ = _setattr_with_value_errors
_CONFIG_LOGGER = logging.getLogger("transformers.configuration_utils")
if not any(type(f).__name__ == _LlamaIntoLazyLlama.__name__ for f in _CONFIG_LOGGER.filters):  # once per process
    _CONFIG_LOGGER.addFilter(_LlamaIntoLazyLlama())

__all__ = ["LazyLlamaConfig"]
