"""Loading a checkpoint and a text for the command-line tools (`lazy-inspect`, `lazy-evaluate`).

The tools work on any LazyLlama (converted or trained, saved with or without its code files). A vanilla
Llama is accepted only where it serves as a baseline; anything else is refused with a message that says
what to do.
"""

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAZY_TYPE = "lazy_llama"
BASELINE_TYPES = (LAZY_TYPE, "llama")


class NotALazyLlama(ValueError):
    """The checkpoint is not a LazyLlama (and cannot serve in the role asked for)."""


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` -> CUDA when available, else CPU; anything else is passed to `torch.device`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_causal_lm(name: str, *, role: str = "model", device: str | torch.device = "auto", dtype: str = "float32"):
    """Load `name` (a folder or Hub id) as a causal LM in eval mode on `device`.

    `role="model"` accepts only a LazyLlama; `role="baseline"` also accepts a vanilla Llama. Raises
    `NotALazyLlama` with an actionable message otherwise.
    """
    import modeling_lazy  # noqa: F401  (registers LazyLlama with the Auto classes)
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    config = AutoConfig.from_pretrained(name)
    model_type = getattr(config, "model_type", None)
    allowed = (LAZY_TYPE,) if role == "model" else BASELINE_TYPES
    if model_type not in allowed:
        if role == "model":
            hint = (
                "Convert it to LazyLlama first (every Llama checkpoint converts 1:1), or give it as the baseline "
                "(--baseline) and a LazyLlama as MODEL."
                if model_type == "llama"
                else "These tools measure Lazy Attention, so MODEL must be a LazyLlama checkpoint."
            )
        else:
            hint = "A baseline must be a LazyLlama or a vanilla Llama (same tokenizer as MODEL)."
        raise NotALazyLlama(f"{name} is a {model_type!r} model, not a LazyLlama ({LAZY_TYPE!r}). {hint}")
    model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype])
    return model.to(resolve_device(device) if isinstance(device, str) else device).eval()


def load_tokenizer(name: str):
    """The tokenizer saved with a checkpoint (or given separately); a clear error when there is none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(
            f"No tokenizer could be loaded from {name}: save one with the model or pass --tokenizer DIR ({error})"
        ) from error


def read_token_ids(text_file: str | Path, tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """Tokenise a UTF-8 text file into one 1-D int64 sequence (special tokens as the tokenizer adds them),
    cut to `max_tokens` if given."""
    text = Path(text_file).read_text(encoding="utf-8")
    ids = tokenizer(text)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)
