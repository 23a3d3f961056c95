"""Serve LazyLlama with vLLM: an out-of-tree vLLM plugin (model + Lazy Attention backend).

Installed with the project, vLLM finds `register` through the `vllm.general_plugins` entry point in every
process it starts, so `vllm serve <converted folder>` and `vllm.LLM(model=<folder>)` need no extra flag.
This package imports vLLM only inside `register` and in its submodules.
"""

ARCHITECTURE = "LazyLlamaForCausalLM"


def register() -> None:
    """Make `lazy_llama` configs loadable and `LazyLlamaForCausalLM` servable (safe to call repeatedly)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from configuration_lazy import LazyLlamaConfig

    AutoConfig.register(LazyLlamaConfig.model_type, LazyLlamaConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "lazy_llama_vllm.lazy_llama:LazyLlamaForCausalLM")


__all__ = ["ARCHITECTURE", "register"]
