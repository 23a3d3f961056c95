"""LazyLlama model package: importing it registers the classes with the Auto classes of transformers.

The math, the gradients, the metadata and the attention backends are described in docs/design.md.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from configuration_lazy import LazyLlamaConfig

from .modeling_lazy import (
    LAZY_PARAMETER_NAMES,
    InPlaceDynamicLayer,
    LazyLlamaForCausalLM,
    LazyLlamaForQuestionAnswering,
    LazyLlamaForSequenceClassification,
    LazyLlamaForTokenClassification,
    LazyLlamaModel,
    LazyLlamaPreTrainedModel,
    append_in_place,
    is_lazy_parameter,
    lazy_attention_modules,
)

AutoConfig.register(LazyLlamaConfig.model_type, LazyLlamaConfig, exist_ok=True)
AutoModel.register(LazyLlamaConfig, LazyLlamaModel, exist_ok=True)
AutoModelForCausalLM.register(LazyLlamaConfig, LazyLlamaForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(LazyLlamaConfig, LazyLlamaForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(LazyLlamaConfig, LazyLlamaForTokenClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(LazyLlamaConfig, LazyLlamaForQuestionAnswering, exist_ok=True)

__all__ = [
    "LAZY_PARAMETER_NAMES",
    "InPlaceDynamicLayer",
    "LazyLlamaConfig",
    "LazyLlamaForCausalLM",
    "LazyLlamaForQuestionAnswering",
    "LazyLlamaForSequenceClassification",
    "LazyLlamaForTokenClassification",
    "LazyLlamaModel",
    "LazyLlamaPreTrainedModel",
    "append_in_place",
    "is_lazy_parameter",
    "lazy_attention_modules",
]
