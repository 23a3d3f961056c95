"""Loading helpers for the command-line tools: a checkpoint, its tokenizer, a text file, a device and the
dtype names (`DTYPES`, shared with `lazy-convert`).

The tools work on any LazyLlama (converted or trained, saved with or without its code files). A vanilla
Llama is accepted only where it serves as a baseline; anything else is refused with a message that says
what to do.
"""

import codecs
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAZY_TYPE = "lazy_llama"
BASELINE_TYPES = (LAZY_TYPE, "llama")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "namespace/name"


class NotALazyLlama(ValueError):
    """The checkpoint is not a LazyLlama (and cannot serve in the role asked for)."""


class ModelNotFound(ValueError):
    """Neither a local model folder nor a Hub repository that could be loaded."""


class UnusableModel(ValueError):
    """A model folder whose files cannot be loaded: missing, corrupt or inconsistent."""


# What `from_pretrained` raises for missing, corrupt or inconsistent files (truncated safetensors, a missing shard,
# config.json that is not JSON or not an object, a tensor shape that disagrees with config.json, a RoPE entry
# without its fields, a value the config class rejects).
LOAD_ERRORS = (OSError, ValueError, TypeError, KeyError, RuntimeError, SafetensorError, StrictDataclassError)


def one_line(error: BaseException, limit: int = 400) -> str:
    """The message of `error` on one line (a KeyError names the missing field), cut to `limit` characters."""
    if isinstance(error, KeyError) and error.args:  # str(KeyError) is the bare key, quoted
        key = error.args[0]
        text = " ".join(key.split()) if isinstance(key, str) and " " in key else f"missing field {key!r}"
    else:
        text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json_object(path, prog: str, hint: str = "") -> dict:
    """The JSON object in the file `path` (a tool's results.json), or `SystemExit` with one line
    (`PROG: error: PATH ...`, then `hint`) saying why it cannot be read or is no object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"{prog}: error: {path} cannot be read ({one_line(error, 200)}){hint}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{prog}: error: {path} holds a JSON {type(data).__name__}, not a run's results")
    return data


def listed(items: list[str], shown: int = 5) -> str:
    """`a, b, c and 4 more`: the first `shown` items of a list for a message."""
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


# ------------------------------------------------------------------------------------------------ arguments


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` -> CUDA when available, else CPU; anything else must name a device this PyTorch can use
    (ValueError otherwise)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"device {name!r} is not available: this PyTorch ({torch.__version__}) is {build}; "
                             "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"device {name!r} is not available in this PyTorch; use --device cpu")
    return device


# ------------------------------------------------------------------------------------------------ models


def check_model_reference(name: str) -> None:
    """Refuse (`ModelNotFound`) a name that can only be a local path but names nothing, or names a file."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFound(f"{name} is a file, not a model folder")
        return
    if not _HUB_ID.match(name) or "--" in name or ".." in name:
        raise ModelNotFound(f"{name}: no such folder")


@contextmanager
def missing_model_explained(name: str):
    """Run a `from_pretrained(name)`; a failure for a name that is no local folder says so (`ModelNotFound`),
    instead of transformers' message about a Hub connection or repository id; a folder whose files cannot be
    loaded (`LOAD_ERRORS`) is `UnusableModel`, one line naming the folder and the cause."""
    check_model_reference(name)
    try:
        yield
    except (ModelNotFound, NotALazyLlama, UnusableModel):
        raise
    except OSError as error:
        if Path(name).expanduser().exists():
            raise _unusable(name, error) from error
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelNotFound(f"{name} is not a local folder, and loading it as a Hub repository id failed: "
                            f"{first}") from error
    except LOAD_ERRORS as error:
        raise _unusable(name, error) from error


def _unusable(name: str, error: BaseException) -> UnusableModel:
    detail = one_line(error)
    config = Path(name).expanduser() / "config.json"
    try:
        if config.is_file() and not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
            detail = "config.json does not hold a JSON object"
    except ValueError:  # not JSON: transformers' message says so
        pass
    return UnusableModel(f"{name} cannot be loaded: {detail} (its files are missing, corrupt or inconsistent: save "
                         "or convert the model again)")


def without_gguf_quantization(config):
    """`config` without the `quantization_config` that a folder rebuilt from a GGUF load can carry: its
    tensors are plain (dequantised) ones, and the note would make transformers look for a GGUF file and
    Trainer refuse to train a "quantized" model. Other quantization configs are kept."""
    quantization = getattr(config, "quantization_config", None)
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    if method == "gguf":
        del config.quantization_config
    return config


def load_causal_lm(name: str, *, role: str = "model", device: str | torch.device = "auto", dtype: str = "float32"):
    """Load `name` (a folder or Hub id) as a causal LM in eval mode on `device`.

    `dtype`: a name of `DTYPES`, or `"auto"` for the dtype the checkpoint stores. `role="model"` accepts only a
    LazyLlama; `role="baseline"` also accepts a vanilla Llama. Raises `NotALazyLlama`, `ModelNotFound` or
    `UnusableModel` (missing, corrupt or inconsistent files) with an actionable message otherwise.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    import modeling_lazy  # noqa: F401  (registers LazyLlama with the Auto classes)

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    device = resolve_device(device) if isinstance(device, str) else device
    with missing_model_explained(name):
        config = without_gguf_quantization(AutoConfig.from_pretrained(name))
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
    with missing_model_explained(name):
        model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=DTYPES.get(dtype, dtype))
    return model.to(device).eval()


def load_tokenizer(name: str):
    """The tokenizer saved with a checkpoint (or given separately); a clear error when there is none."""
    from transformers import AutoTokenizer

    check_model_reference(name)
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(
            f"No tokenizer could be loaded from {name}: save one with the model or pass --tokenizer DIR ({error})"
        ) from error


def check_same_vocabulary(tokenizer, model, baseline, baseline_name: str) -> None:
    """Refuse a baseline that reads token ids differently from MODEL: its own tokenizer (if it has one) must
    have MODEL's vocabulary, else its config must have MODEL's `vocab_size`. Scores of different
    vocabularies are not comparable (and ids past the smaller one index nothing)."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(baseline_name)
    except (OSError, ValueError, TypeError):
        theirs = None
    if theirs is not None:
        ours, other = tokenizer.get_vocab(), theirs.get_vocab()
        if ours != other:
            differing = sum(other.get(token) != index for token, index in ours.items()) + len(set(other) - set(ours))
            raise ValueError(f"the baseline {baseline_name} has another vocabulary ({len(other)} tokens, {differing} "
                             f"differing from MODEL's {len(ours)}): its scores would not be comparable; give a "
                             "baseline that shares MODEL's tokenizer")
    elif baseline.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the baseline {baseline_name} has vocab_size {baseline.config.vocab_size}, MODEL "
                         f"{model.config.vocab_size}: its scores would not be comparable; give a baseline that "
                         "shares MODEL's tokenizer")


# ------------------------------------------------------------------------------------------------ text


def check_output_file(path: str | Path, what: str = "output file") -> None:
    """Refuse (ValueError) an output file that could not be written, before the work that produces it: a folder,
    a missing parent folder, or one this process cannot write to."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder: give a file name")
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK) or path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{what} {path} cannot be written (no permission, or a read-only file system); "
                         "choose another path")


def check_text_file(path: str | Path, what: str = "text file") -> None:
    """Refuse (ValueError, FileNotFoundError) a missing, empty, blank-only or non-UTF-8 file, reading it in
    chunks (memory does not grow with the file)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{what} {path} is not a file")
    if path.stat().st_size == 0:
        raise ValueError(f"{what} {path} is empty")
    decoder, offset, blank = codecs.getincrementaldecoder("utf-8")(), 0, True
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            try:
                text = decoder.decode(chunk)
            except UnicodeDecodeError as error:
                raise ValueError(f"{what} {path} is not UTF-8 text (invalid byte at offset "
                                 f"{offset + error.start}): convert it to UTF-8") from None
            blank = blank and not text.strip()
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"{what} {path} is not UTF-8 text (it ends inside a character)") from None
    if blank:
        raise ValueError(f"{what} {path} holds only whitespace")


def read_token_ids(text_file: str | Path, tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """Tokenise a UTF-8 text file into one 1-D int64 sequence (special tokens as the tokenizer adds them),
    cut to `max_tokens` if given. ValueError for a file that gives no tokens."""
    check_text_file(text_file)
    ids = tokenizer(Path(text_file).read_text(encoding="utf-8"))["input_ids"]
    if not ids:
        raise ValueError(f"{text_file} gives no tokens with this tokenizer")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)
