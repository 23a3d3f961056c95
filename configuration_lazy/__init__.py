"""LazyLlama configuration (importable alone, without the model code)."""

from .configuration_lazy import LazyLlamaConfig

__all__ = ["LazyLlamaConfig"]
