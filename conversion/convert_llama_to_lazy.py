"""Convert a vanilla Llama checkpoint into a LazyLlama checkpoint.

    lazy-convert SRC OUT [--tau-init 0.0] [--bias-window 1024]
        [--bias-init-std 0.0] [--dtype auto] [--max-shard-size 2GB] [--verify] [--overwrite]
    (or python -m conversion.convert_llama_to_lazy ...)

SRC is a Hugging Face Llama folder (`model.safetensors`, sharded safetensors with an index, or
`pytorch_model*.bin`, read only through `torch.load(weights_only=True)`) or a Llama-architecture GGUF file.
Weight names are Llama's, so every tensor maps 1:1; each layer gains `self_attn.tau` `[heads]` and
`self_attn.distance_bias` `[heads, window]` (float32). With `tau = 0` and `distance_bias = 0` (the defaults)
the result computes exactly what the Llama computes.

Safetensors and `.bin` sources are streamed one source file at a time into output shards of at most
`--max-shard-size`, so peak memory is about one source shard (plus the source shard being read), not the model.
A GGUF file is dequantised by transformers as a whole model first (GGUF files are small and quantised).

How OUT is written (`lazy_llama_tools.folders`): everything that can be checked is checked before anything is
written (source, settings, OUT, free space); a run holds a lock beside OUT for its whole length, so a second
run into the same OUT is refused at once; the result is built in a hidden temporary folder beside OUT and put
in place by renames only when complete (and verified, with `--verify`), so OUT is always either what it was
or the complete new conversion. Ctrl-C, SIGTERM and SIGHUP remove the temporary folder; one that arrives
while OUT is being replaced waits until the swap is done, and the message says which of the two OUT holds.
SIGKILL can leave the temporary folder: the next run into the same OUT removes it.
"""

import contextlib
import errno
import functools
import json
import math
import os
import pickle
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from configuration_lazy import LazyLlamaConfig
from conversion.checkpoint_files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    SETTINGS_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    names_outside_folder,
)
from conversion.model_card import write_model_card
from lazy_llama_tools.cli import DEFAULT_BIAS_WINDOW, SEED_LIMIT, VERIFY_TOLERANCE, convert_parser, parse_size
from lazy_llama_tools.folders import (
    FolderBusy,
    deferred_signals,
    is_empty_folder,
    lock_target,
    publish_folder,
    raise_swallowed_interrupt,
    remove_leftovers,
    temporary_folder,
    terminations_as_interrupts,
)
from lazy_llama_tools.loading import DTYPES, listed, one_line, without_gguf_quantization
from modeling_lazy.modeling_lazy import (
    AUTO_MAP,
    LazyLlamaForCausalLM,
    code_files,
    is_lazy_parameter,
    lazy_attention_modules,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
VERIFY_PROMPT = (
    "The capital of France is Paris. Lazy attention lets a head ignore tokens it does not need, "
    "so the first token no longer has to act as a sink."
)
SPACE_MARGIN = 1 << 20  # bytes beyond the weights and the tokenizer: config, code, card


class ConversionError(Exception):
    """A source that cannot be converted; the message says what is wrong and what to do."""


# tau every converted head starts from: at 0 (with a zero distance bias) LazyLlama computes exactly the source
# Llama. `LazyLlamaConfig.lazy_tau_init` (-1, the paper's init) is for models trained from scratch.
EXACT_TAU_INIT = 0.0


class ConversionInterrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP during a conversion. `published`: OUT already holds the new conversion (the
    signal arrived while it was being put in place); otherwise OUT is as it was and nothing is left behind."""

    def __init__(self, published: bool):
        super().__init__("published" if published else "not published")
        self.published = published


# ----------------------------------------------------------------------------------------------------------
# Source: config checks and tensor streams
# ----------------------------------------------------------------------------------------------------------


def check_llama_config(config: dict) -> None:
    """Refuse anything that is not a plain Llama, naming what is unsupported."""
    model_type = config.get("model_type")
    if model_type == "lazy_llama":
        raise ConversionError("the source is already a LazyLlama checkpoint (model_type 'lazy_llama').")
    if model_type != "llama":
        raise ConversionError(
            f"unsupported architecture: model_type {model_type!r} (architectures {config.get('architectures')}); "
            "only Llama checkpoints (model_type 'llama') can be converted."
        )
    if config.get("sliding_window") is not None or config.get("use_sliding_window"):
        raise ConversionError(
            f"unsupported: sliding-window attention (sliding_window={config.get('sliding_window')!r}); "
            "LazyLlama attention is full causal."
        )
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ConversionError(f"unsupported layer_types {sorted(set(map(str, layer_types)))}: only 'full_attention' "
                              "layers.")
    rope_field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(rope_field) or {}
    _check_object(rope, rope_field)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConversionError(
            f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is not None and not _positive_number(theta):
        raise ConversionError(f"invalid configuration: rope_theta must be a positive number, got {theta!r}.")
    if "factor" in rope and not _positive_number(rope["factor"]):  # transformers only warns
        raise ConversionError(f"invalid configuration: the RoPE scaling factor must be a positive number, got "
                              f"{rope['factor']!r}.")
    named = config.get("dtype", config.get("torch_dtype"))
    if named is not None and not isinstance(named, str):  # transformers ignores it: `--dtype auto` would not
        raise ConversionError(f"invalid configuration: dtype must be a name such as \"bfloat16\", got {named!r}.")
    quant = config.get("quantization_config")
    _check_object(quant, "quantization_config")
    if quant and quant.get("quant_method") != "gguf":  # a folder rebuilt from GGUF holds plain weights
        raise ConversionError(
            f"unsupported: quantized checkpoint (quant_method {quant.get('quant_method')!r}); "
            "convert the unquantized weights."
        )


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_object(value, name: str) -> None:
    """Refuse a config field that must be a JSON object (or absent) but is something else."""
    if value is not None and not isinstance(value, dict):
        raise ConversionError(f"invalid configuration: {name} must be a JSON object, got a {type(value).__name__} "
                              f"({value!r:.60}).")


def build_lazy_config(
    source_config: dict, *, tau_init: float, bias_window: int | None, bias_init_std: float, dtype: str
) -> LazyLlamaConfig:
    """A `LazyLlamaConfig` with every Llama field of the source, the lazy fields and the full `auto_map`.
    `bias_window` None: `DEFAULT_BIAS_WINDOW`, or `max_position_embeddings` if that is smaller."""
    check_llama_config(source_config)
    if bias_window is None:  # the default, shortened for a model with fewer positions (a bad value is refused below)
        positions = source_config.get("max_position_embeddings")
        usable = isinstance(positions, int) and not isinstance(positions, bool) and positions >= 1
        bias_window = min(DEFAULT_BIAS_WINDOW, positions) if usable else DEFAULT_BIAS_WINDOW
    fields = {k: v for k, v in source_config.items() if k not in ("quantization_config", "auto_map", "torch_dtype")}
    fields.update(
        model_type=LazyLlamaConfig.model_type,
        architectures=["LazyLlamaForCausalLM"],
        dtype=dtype,
        lazy_tau_init=tau_init,
        lazy_bias_window=bias_window,
        lazy_bias_init_std=bias_init_std,
    )
    try:
        config = LazyLlamaConfig.from_dict(fields)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as error:
        raise ConversionError(f"invalid configuration: {one_line(error)}") from error
    limit = config.max_position_embeddings
    if bias_window > limit:
        raise ConversionError(
            f"--bias-window {bias_window} is larger than the model's max_position_embeddings ({limit}): "
            f"distances beyond {limit - 1} never occur, so at most {limit} of them can have a bias."
        )
    config.auto_map = dict(AUTO_MAP)
    return config


def _is_gguf(source: Path) -> bool:
    return source.is_file() and source.suffix.lower() == ".gguf"


GGUF_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                      "ffn_down")
# Llama 3.x ("llama3") RoPE scaling as llama.cpp stores it: only the per-frequency divisors, tensor rope_freqs.weight.
# The settings are found by trying Meta's (low 1, high 4, original 8192) and the ones fitted to the divisors of the
# frequencies between the two bounds; a setting is taken only if transformers computes the file's divisors from it.
LLAMA3_META_SETTING = (1.0, 4.0, 8192)


def checked_gguf_config(source: Path, config: dict) -> dict:
    """The GGUF's config (as transformers reads it) with its RoPE scaling, after checking that its tensors are
    exactly a Llama's: transformers' GGUF loader drops tensors it has no place for (biases, experts) and
    initialises missing ones at random, and reads no RoPE scaling for Llama, so each of those is refused here or
    carried over (linear scaling, Llama 3.x scaling from its rope_freqs tensor)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = GGUFReader(str(source))
    names = {tensor.name for tensor in reader.tensors}
    layers = int(config.get("num_hidden_layers") or 0)
    needed = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{layer}.{name}.weight" for layer in range(layers) for name in GGUF_LAYER_TENSORS}
    if config.get("tie_word_embeddings") is False:
        needed.add("output.weight")
    unknown = sorted(names - needed - {"output.weight", "rope_freqs.weight"})
    if unknown:
        raise ConversionError(f"{source} holds tensors a Llama has no place for ({listed(unknown)}): biases, experts "
                              "or another architecture's weights would be dropped. Not converted.")
    missing = sorted(needed - names)
    if missing:
        raise ConversionError(f"{source} lacks tensors a Llama needs: {listed(missing)}.")
    config = dict(config)
    scaling_field = "llama.rope.scaling.type"
    scaling = str(read_field(reader, scaling_field)[0]) if scaling_field in reader.fields else "none"
    theta = float(config.get("rope_theta", 10000.0))
    if "rope_freqs.weight" in names:
        freqs = next(tensor for tensor in reader.tensors if tensor.name == "rope_freqs.weight")
        parameters = _llama3_parameters(torch.as_tensor(freqs.data.astype("float32")).reshape(-1), config, theta)
        if scaling not in ("none", "") or parameters is None:
            raise ConversionError(
                f"{source} scales RoPE by per-frequency factors (rope_freqs.weight) that match no Llama 3.x "
                "setting: convert the model's Hugging Face folder instead.")
        config["rope_parameters"] = parameters
    elif scaling == "linear":
        factor = float(read_field(reader, "llama.rope.scaling.factor")[0])
        config["rope_parameters"] = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    elif scaling not in ("none", ""):
        raise ConversionError(f"{source} uses RoPE scaling {scaling!r}, which this converter does not read from GGUF "
                              "metadata: convert the model's Hugging Face folder instead.")
    return config


def _llama3_parameters(divisors: torch.Tensor, config: dict, theta: float) -> dict | None:
    """The "llama3" rope parameters whose per-frequency divisors (plain frequency / scaled) are `divisors`, or None."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    if divisors.numel() != head_dim // 2 or not bool(torch.isfinite(divisors).all()) or float(divisors.min()) <= 0:
        return None
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    factor = float(divisors.max())
    candidates = [LLAMA3_META_SETTING]
    between = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if int(between.sum()) >= 2 and factor > 1:
        # there the scaled frequency is (1 - s) f / factor + s f with s = original / (high - low) / wavelength
        # - low / (high - low): a line in 1 / wavelength, which fixes high / low and original / low
        smooth = ((1 / divisors[between] - 1 / factor) / (1 - 1 / factor)).double()
        x = (plain[between] / (2 * math.pi)).double()
        slope, intercept = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), smooth[:, None]).solution[:, 0]
        if float(intercept) < 0:
            high = round(1 - 1 / float(intercept), 4)
            candidates.append((1.0, high, round(float(slope) * (high - 1))))
    elif int(between.sum()) == 1:  # one point of the line: through it, for a few ratios high / low
        smooth = float((1 / divisors[between] - 1 / factor) / (1 - 1 / factor))
        wavelength = float(2 * math.pi / plain[between])
        candidates += [(1.0, high, round((smooth * (high - 1) + 1) * wavelength)) for high in (4.0, 2.0, 8.0, 3.0)]
    for low, high, original in candidates:
        parameters = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                      "original_max_position_embeddings": original, "rope_theta": theta}
        probe = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim,
                            max_position_embeddings=int(config.get("max_position_embeddings") or original),
                            rope_parameters=dict(parameters))
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](probe, "cpu")
        if torch.allclose(plain / scaled.float(), divisors, rtol=1e-4, atol=0):
            return parameters
    return None


def read_source_config(source: Path) -> dict:
    """The source's config as a dict (from `config.json`, or the metadata of a GGUF file)."""
    if _is_gguf(source):
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        try:
            config = load_gguf_checkpoint(str(source), return_tensors=False)["config"]
        except Exception as error:  # not a GGUF file, or an architecture transformers does not read
            raise ConversionError(f"cannot read GGUF metadata of {source}: {error}") from error
        return dict(config)
    if not source.is_dir():
        raise ConversionError(f"{source} is neither a Hugging Face model folder nor a .gguf file.")
    path = source / CONFIG_FILE
    if not path.is_file():
        raise ConversionError(f"{source} has no {CONFIG_FILE}: is it a Hugging Face model folder?")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConversionError(f"{path} is not UTF-8 text: is it a Hugging Face config.json?") from None
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ConversionError(f"{path} must hold a JSON object of model settings, got {json.dumps(config)[:40]}.")
    return config


def source_weight_files(source: Path) -> tuple[str, list[Path]]:
    """(`"safetensors"` or `"bin"`, the weight files in order); every file an index lists must exist."""
    for kind, single, index in (
        ("safetensors", WEIGHTS_FILE, WEIGHTS_INDEX),
        ("bin", "pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (source / index).is_file():
            try:
                weight_map = json.loads((source / index).read_text(encoding="utf-8"))["weight_map"]
            except UnicodeDecodeError:
                raise ConversionError(f"{source / index} is not UTF-8 text: is it a weight index?") from None
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ConversionError(f"{source / index} is not a valid weight index: {error!r}") from error
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConversionError(
                    f"{source / index} is not a valid weight index: `weight_map` must map tensor names to file "
                    f"names, got a {type(weight_map).__name__}."
                )
            files = sorted(set(weight_map.values()))
            if not files:
                raise ConversionError(f"{source / index} is not a valid weight index: its `weight_map` is empty.")
            outside = names_outside_folder(files)
            if outside:
                raise ConversionError(
                    f"{source / index} names weight files outside {source} ({', '.join(outside[:3])}): an index may "
                    "only name files in its own folder; refusing to read them."
                )
            missing = [name for name in files if not (source / name).is_file()]
            if missing:
                raise ConversionError(f"shard(s) listed in {index} are missing from {source}: {', '.join(missing)}")
            return kind, [source / name for name in files]
        if (source / single).is_file():
            return kind, [source / single]
    raise ConversionError(
        f"no weights in {source}: expected {WEIGHTS_FILE}, {WEIGHTS_INDEX}, "
        "pytorch_model.bin or pytorch_model.bin.index.json."
    )


def _source_dtype(source_config: dict, source_format: str, files: list[Path]) -> str:
    """The dtype `--dtype auto` keeps: the config's, else that of the first floating-point tensor stored."""
    if source_format == "gguf":
        return "float32"  # transformers dequantises GGUF tensors to float32
    named = source_config.get("dtype") or source_config.get("torch_dtype")
    if isinstance(named, str) and named != "auto":
        return named
    path = files[0]
    if source_format == "safetensors":
        with contextlib.suppress(Exception):  # an unreadable file is reported when it is read
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    stored = SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype())
                    if stored:
                        return stored
    else:
        for _, tensor in _iter_file(path, source_format):
            if tensor.is_floating_point():
                return str(tensor.dtype).removeprefix("torch.")
    return "float32"


_JSON_COMPANIONS = tuple(name for name in (*TOKENIZER_FILES, GENERATION_CONFIG_FILE) if name.endswith(".json"))


def _check_companions(source: Path) -> None:
    """The tokenizer and generation config files of a folder are copied as they are: refuse, before anything is
    written, one that cannot be read (the checkpoint would load its weights and fail on its tokenizer)."""
    for name in _JSON_COMPANIONS:
        path = source / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConversionError(f"{path} is not valid JSON text ({one_line(error)}): restore it from the model's "
                                  "original files, or remove it to convert without it.") from None
        if not isinstance(value, dict):
            raise ConversionError(f"{path} must hold a JSON object, got {json.dumps(value)[:40]}: restore it from the "
                                  "model's original files, or remove it to convert without it.")
    if (source / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(source / "tokenizer.json"))
        except Exception as error:  # the library's own parse error, whatever its type
            raise ConversionError(f"{source / 'tokenizer.json'} is not a tokenizer the tokenizers library can read "
                                  f"({one_line(error, 200)}): restore it from the model's original files, or remove "
                                  "it to convert without it.") from None


def _check_layer_count(count: int, source_format: str, files: list[Path]) -> None:
    """`num_hidden_layers` against the layers the safetensors headers name, before a model of that many layers is
    built to check shapes against (a typo such as 3200000 for 32 would take minutes and gigabytes first)."""
    if source_format != "safetensors":
        return
    layers = set()
    for path in files:
        with contextlib.suppress(Exception), safe_open(str(path), framework="pt") as handle:  # reported when read
            layers.update(int(found[1]) for name in handle.keys() if (found := _LAYER_INDEX.match(name)))
    if layers and count != max(layers) + 1:
        raise ConversionError(f"config.json gives num_hidden_layers = {count}, but the weights hold layers 0-"
                              f"{max(layers)} ({max(layers) + 1} layers): correct num_hidden_layers or the weights.")


_LAYER_INDEX = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def _iter_file(path: Path, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of one source file, one at a time (safetensors are memory-mapped; .bin never unpickles)."""
    try:
        if kind == "safetensors":
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        else:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(
                    isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in state.items()):
                found = f"a dict with keys {listed([repr(k) for k in state])}" if isinstance(state, dict) else \
                    f"a {type(state).__name__}"
                raise ConversionError(f"{path.name} is not a state dict (tensor names to tensors) but {found}: save "
                                      "the model with save_pretrained and convert that folder.")
            names = list(state)
            for name in names:
                yield name, state.pop(name)
    except ConversionError:
        raise
    except pickle.UnpicklingError as error:  # torch.load(weights_only=True) met something it will not unpickle
        named = re.search(r"GLOBAL (\S+)", str(error))
        what = f" ({named[1]})" if named else ""
        raise ConversionError(
            f"{path.name} holds objects other than tensors{what}, so it cannot be read safely: convert it to "
            "safetensors with a tool you trust, or use a safetensors copy of the model."
        ) from None
    except Exception as error:  # truncated or corrupt file
        raise ConversionError(f"cannot read {path.name}: {type(error).__name__}: {error}") from error


def _canonical_name(name: str) -> str | None:
    """The LazyLlama name of a source tensor (None for tensors to drop, e.g. stale RoPE buffers)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if not name.startswith(("model.", "lm_head.")):  # a bare LlamaModel checkpoint
        name = "model." + name
    return name


# ----------------------------------------------------------------------------------------------------------
# Output: shards written one at a time
# ----------------------------------------------------------------------------------------------------------


class ShardWriter:
    """Collect tensors into shards of at most `max_bytes` and write each one as soon as it is full."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.buffer, self.buffer_bytes, self.total_bytes = {}, 0, 0
        self.shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffer_bytes + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = tensor.contiguous()
        self.buffer_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.buffer:
            return
        path = self.folder / f".shard-{len(self.shards) + 1:05d}.safetensors"
        try:
            save_file(self.buffer, str(path), metadata={"format": "pt"})
        except SafetensorError as error:  # an I/O error in safetensors' own writer: give it back its errno
            code = re.search(r"os error (\d+)", str(error))
            number = int(code[1]) if code else errno.EIO
            raise OSError(number, os.strerror(number) if code else str(error), str(path)) from error
        self.shards.append((path, list(self.buffer)))
        self.buffer, self.buffer_bytes = {}, 0

    def finish(self) -> list[str]:
        """Name the shards as transformers does (`model.safetensors`, or `model-0000i-of-0000n` + index)."""
        self.flush()
        count = len(self.shards)
        if count == 1:
            os.replace(self.shards[0][0], self.folder / WEIGHTS_FILE)
            return [WEIGHTS_FILE]
        weight_map, names = {}, []
        for number, (path, keys) in enumerate(self.shards, 1):
            name = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(path, self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
            names.append(name)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names


# ----------------------------------------------------------------------------------------------------------
# Conversion: a plan (everything checked before writing), the weights, the other files, publication
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ConversionPlan:
    """What `convert` will write, worked out from the source and the settings before anything is written."""

    source: Path
    output: Path
    source_format: str  # "safetensors", "bin" or "gguf"
    files: list[Path]  # source weight files, in reading order
    config: LazyLlamaConfig
    dtype_name: str  # of the Llama weights; tau and distance_bias are float32
    expected: dict[str, tuple[int, ...]]  # name -> shape of every tensor to write (tied lm_head left out)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def lazy_names(self) -> list[str]:
        return [name for name in self.expected if is_lazy_parameter(name)]

    @property
    def weight_bytes(self) -> int:
        size = self.dtype.itemsize
        return sum(math.prod(shape) * (4 if is_lazy_parameter(name) else size) for name, shape in self.expected.items())


def _expected_shapes(config: LazyLlamaConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of this config holds (tied `lm_head.weight` left out)."""
    try:
        with torch.device("meta"):
            model = LazyLlamaForCausalLM(config)
    except (ValueError, TypeError, KeyError, ZeroDivisionError, AssertionError) as error:  # values the config lets by
        raise ConversionError(f"invalid configuration: the model cannot be built from it ({type(error).__name__}: "
                              f"{one_line(error)}).") from error
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def plan_conversion(source: Path, output: Path, *, tau_init: float, bias_window: int | None, bias_init_std: float,
                    dtype: str) -> ConversionPlan:
    """Read and check the source and the settings (nothing is written): the `ConversionPlan`, or
    `ConversionError` naming what is wrong."""
    if not source.exists():
        raise ConversionError(f"source {source} does not exist.")
    if output == source or output in source.parents or source in output.parents:
        raise ConversionError(f"OUT ({output}) must not be SRC, inside it, or contain it.")
    if dtype != "auto" and dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}.")
    source_config = read_source_config(source)
    check_llama_config(source_config)
    if _is_gguf(source):
        source_config = checked_gguf_config(source, source_config)
        source_format, files = "gguf", [source]
    else:
        source_format, files = source_weight_files(source)
        _check_companions(source)
    dtype_name = _source_dtype(source_config, source_format, files) if dtype == "auto" else dtype
    if dtype_name not in DTYPES:
        raise ConversionError(f"source dtype {dtype_name!r} is not supported: pass --dtype {'|'.join(DTYPES)}.")
    config = build_lazy_config(
        source_config, tau_init=tau_init, bias_window=bias_window, bias_init_std=bias_init_std, dtype=dtype_name
    )
    _check_layer_count(config.num_hidden_layers, source_format, files)
    return ConversionPlan(source, output, source_format, files, config, dtype_name, _expected_shapes(config))


def _check_output_path(output: Path) -> None:
    """What can be refused about OUT without its lock: a mount point or a file."""
    if os.path.ismount(output):
        raise ConversionError(
            f"{output} is a mount point: the conversion is built beside OUT and renamed into place, which cannot "
            f"replace a mount point; give a folder inside it (e.g. {output / 'model'})."
        )
    if output.is_symlink() or output.exists() and not output.is_dir():
        raise ConversionError(f"{output} exists and is not a folder: give a folder path for OUT.")


def looks_like_model_folder(folder: Path) -> bool:
    """A `config.json` and weights beside it: what `--overwrite` is willing to replace."""
    weights = any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))
    return (folder / CONFIG_FILE).is_file() and weights


def _check_existing_output(output: Path, overwrite: bool) -> None:
    """Under OUT's lock: refuse a non-empty OUT without `--overwrite`, and any OUT that is not a model folder."""
    if not output.exists() or is_empty_folder(output):
        return
    if not overwrite:
        raise ConversionError(f"{output} already exists and is not empty: pass --overwrite to replace it.")
    if not looks_like_model_folder(output):
        shown = listed(sorted(path.name for path in output.iterdir()))
        raise ConversionError(
            f"refusing to replace {output}: it does not look like a model folder (no {CONFIG_FILE} with "
            f"weights beside it) and holds {shown}. Move those files away or choose another OUT."
        )


def _check_free_space(plan: ConversionPlan) -> None:
    tokenizer = 0 if plan.source_format == "gguf" else sum(
        (plan.source / name).stat().st_size for name in TOKENIZER_FILES if (plan.source / name).is_file())
    needed = plan.weight_bytes + tokenizer + SPACE_MARGIN
    free = shutil.disk_usage(plan.output.parent).free
    if free < needed:
        raise ConversionError(
            f"not enough free space beside {plan.output}: the conversion needs about {needed / 1e6:.1f} MB, "
            f"{free / 1e6:.1f} MB are free. Free some space or choose another OUT."
        )


def _output_failure(error: OSError, output: Path) -> ConversionError:
    """`ConversionError` for an OS error while writing beside OUT (read-only, full, ...)."""
    where = f" ({error.filename})" if error.filename else ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = " Free some space there or choose another OUT."
    elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = " Choose an OUT in a folder you can write to."
    else:
        hint = ""
    return ConversionError(
        f"cannot write beside {output}: {error.strerror or error}{where}; OUT was left as it was.{hint}"
    )


def write_weights(plan: ConversionPlan, folder: Path, max_bytes: int, *, tau_init: float, bias_init_std: float,
                  seed: int, quiet: bool) -> tuple[list[str], int]:
    """Stream the source tensors (checked against the plan) and the new Lazy Attention parameters into shards
    in `folder`. Returns (shard names, bytes)."""
    writer = ShardWriter(folder, max_bytes)
    files = None
    if plan.source_format == "gguf":
        tensors = _gguf_tensors(plan.source, plan.dtype)
    else:
        files = _progress(plan.files, "reading source files", quiet)
        tensors = (item for path in files for item in _iter_file(path, plan.source_format))
    seen, tied = set(), plan.config.tie_word_embeddings
    try:
        for name, tensor in tensors:
            name = _canonical_name(name)
            if name is None or (name == "lm_head.weight" and tied):
                continue
            if name not in plan.expected:
                raise ConversionError(f"unexpected tensor {name!r} in the source: not part of a Llama with this "
                                      "config.")
            if tuple(tensor.shape) != plan.expected[name]:
                raise ConversionError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {plan.expected[name]}."
                )
            if name in seen:
                raise ConversionError(f"tensor {name!r} appears twice in the source.")
            if not tensor.is_floating_point():
                raise ConversionError(f"tensor {name!r} is stored as {str(tensor.dtype).removeprefix('torch.')}; a "
                                      "Llama's weights are floating point (a quantized checkpoint?): convert the "
                                      "unquantized model.")
            seen.add(name)
            writer.add(name, tensor.to(plan.dtype))
    finally:
        if files is not None:  # now, also on an error: else the bar ends after its message, on the same line
            files.close()
    lazy_names = plan.lazy_names
    missing = [n for n in plan.expected if n not in seen and n not in lazy_names]
    if missing:
        raise ConversionError(f"missing weights in the source: {listed(missing)}.")
    generator = torch.Generator().manual_seed(seed)
    for name in lazy_names:  # the new Lazy Attention parameters, always float32
        shape = plan.expected[name]
        if name.rsplit(".", 1)[-1] == "tau":
            writer.add(name, torch.full(shape, float(tau_init), dtype=torch.float32))
        else:
            writer.add(name, torch.randn(shape, generator=generator, dtype=torch.float32) * bias_init_std)
    return writer.finish(), writer.total_bytes


def write_companions(plan: ConversionPlan, folder: Path, settings: dict, *, base_model: str | None,
                     license: str | None, log) -> None:
    """Everything beside the weights: config, code files, tokenizer, generation config, settings, model card."""
    plan.config.save_pretrained(folder)
    for path in code_files():
        shutil.copyfile(path, folder / os.path.basename(path))
    _copy_tokenizer(plan.source, folder, log)
    _write_generation_config(plan.source, folder, plan.config)
    (folder / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    card = _source_card_metadata(plan.source)
    write_model_card(
        folder,
        base_model=base_model or card.get("base_model"),
        conversion={k: v for k, v in settings.items() if k != "source"},
        license=license or card.get("license"),
        repo_id=plan.output.name,
    )


def _gguf_tensors(source: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantised tensors of a GGUF Llama, through transformers' own GGUF loader (whole model in memory)."""
    from transformers import LlamaForCausalLM

    try:
        model, info = LlamaForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype,
                                                       output_loading_info=True)
    except Exception as error:
        raise ConversionError(f"cannot load GGUF weights from {source}: {type(error).__name__}: {error}") from error
    left_out = sorted(info.get("missing_keys", ())) + sorted(info.get("unexpected_keys", ()))
    if left_out:  # (the tensor check before should have caught these)
        raise ConversionError(f"the GGUF loader could not place every weight of {source}: {listed(left_out)}.")
    state = model.state_dict()
    del model
    for name in list(state):
        yield name, state.pop(name)


def _copy_tokenizer(source: Path, folder: Path, log) -> None:
    if _is_gguf(source):
        from gguf import GGUFReader

        if "tokenizer.ggml.model" not in GGUFReader(str(source)).fields:
            log("  the GGUF file has no tokenizer: none written")
            return
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        except Exception as error:  # a tokenizer type or field transformers cannot rebuild
            raise ConversionError(f"cannot rebuild the tokenizer stored in {source} ({type(error).__name__}: "
                                  f"{one_line(error, 200)}): convert the model's Hugging Face folder instead."
                                  ) from None
        tokenizer.save_pretrained(folder)
        return
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, folder / name)
    if not copied:
        log(f"  {source} has no tokenizer files: none written")


def _write_generation_config(source: Path, folder: Path, config: LazyLlamaConfig) -> None:
    if not _is_gguf(source) and (source / GENERATION_CONFIG_FILE).is_file():
        shutil.copyfile(source / GENERATION_CONFIG_FILE, folder / GENERATION_CONFIG_FILE)
        return
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(folder)


def _source_card_metadata(source: Path) -> dict:
    """License and base model found in the source (its README metadata, or GGUF `general.*` fields)."""
    found = {}
    if _is_gguf(source):
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import read_field

        reader = GGUFReader(str(source))
        for key, field in (("license", "general.license"), ("base_model", "general.name")):
            if field in reader.fields:
                value = read_field(reader, field)
                found[key] = value[0] if isinstance(value, list) and value else value
        return found
    readme = source / "README.md"
    if readme.is_file():
        from huggingface_hub import ModelCard

        with contextlib.suppress(Exception):
            data = ModelCard.load(readme).data
            found = {k: getattr(data, k, None) for k in ("license", "base_model") if getattr(data, k, None)}
    return found


def convert(
    source: str | Path,
    output: str | Path,
    *,
    tau_init: float = EXACT_TAU_INIT,
    bias_window: int | None = None,
    bias_init_std: float = 0.0,
    dtype: str = "auto",
    max_shard_size: str | int = "2GB",
    verify: bool = False,
    verify_tolerance: float = VERIFY_TOLERANCE,
    overwrite: bool = False,
    seed: int = 0,
    base_model: str | None = None,
    license: str | None = None,
    log=print,
) -> dict:
    """Convert the Llama at `source` into a LazyLlama folder `output` (see the module docstring).

    `log` is a print-like function for progress messages (None: silent). Returns a summary dict (`output`,
    `shards`, `dtype`, `bytes`, and `max_abs_diff` when verified). Raises `ConversionError` for bad input or an
    output that cannot be written, and `ConversionInterrupted` on Ctrl-C (or SIGTERM/SIGHUP where `main`
    turns them into it); `output` is then the old or the complete new folder, never half-written.
    """
    quiet = log is None
    log = log or (lambda *args: None)
    source, output = Path(source).expanduser().resolve(), Path(output).expanduser().resolve()
    if not (isinstance(verify_tolerance, (int, float)) and math.isfinite(verify_tolerance) and verify_tolerance >= 0):
        raise ConversionError(f"the verification tolerance must be a finite number >= 0, got {verify_tolerance!r}.")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as error:
        raise ConversionError(f"--max-shard-size: {error}") from None
    if not (isinstance(seed, int) and 0 <= seed < SEED_LIMIT):
        raise ConversionError(f"--seed must be a whole number from 0 to {SEED_LIMIT - 1}, got {seed!r}.")
    plan = plan_conversion(source, output, tau_init=tau_init, bias_window=bias_window, bias_init_std=bias_init_std,
                           dtype=dtype)
    _check_output_path(output)
    settings = {
        "source": source.resolve().name,  # the name only: the file is published with the model (lazy-push)
        "source_format": plan.source_format,
        "tau_init": tau_init,
        "bias_window": plan.config.lazy_bias_window,
        "bias_init_std": bias_init_std,
        "seed": seed,
        "dtype": plan.dtype_name,
        "exact": tau_init == 0 and bias_init_std == 0,
    }
    published, tmp = False, None
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        with lock_target(output):
            for line in remove_leftovers(output):
                log(f"  {line}")
            _check_existing_output(output, overwrite)
            _check_free_space(plan)
            tmp = temporary_folder(output)
            log(f"Converting {source} ({plan.source_format}, {len(plan.files)} file(s)) -> {output} "
                f"[{plan.dtype_name}]")
            shards, nbytes = write_weights(plan, tmp, max_bytes, tau_init=tau_init, bias_init_std=bias_init_std,
                                           seed=seed, quiet=quiet)
            write_companions(plan, tmp, settings, base_model=base_model, license=license, log=log)
            summary = {"output": str(output), "shards": shards, "dtype": plan.dtype_name, "bytes": nbytes}
            log(f"  wrote {len(shards)} shard(s), {nbytes / 1e6:.1f} MB")
            if verify:
                diff = verify_conversion(source, tmp, dtype=plan.dtype, log=log)
                summary["max_abs_diff"] = diff
                if not diff <= verify_tolerance:
                    raise ConversionError(
                        f"verification failed: max abs logit difference {diff:.3e} > tolerance {verify_tolerance:.1e}."
                    )
            make_shareable(tmp)
            raise_swallowed_interrupt()
            with deferred_signals():  # an interrupt waits until OUT is the old or the new folder, and we know which
                if not publish_folder(tmp, output, replace=overwrite):
                    raise ConversionError(f"{output} was filled by someone else during the conversion: nothing "
                                          "was replaced; pass --overwrite to replace it.")
                published = True
    except KeyboardInterrupt as error:
        _discard(tmp, published)
        raise ConversionInterrupted(published) from error
    except FolderBusy as error:
        raise ConversionError(f"{error}: runs into the same OUT cannot overlap.") from error
    except OSError as error:
        _discard(tmp, published)
        raise _output_failure(error, output) from error
    except BaseException:
        _discard(tmp, published)
        raise
    log(f"Done: {output}")
    return summary


def make_shareable(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only files: give them the modes the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.iterdir()]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _discard(tmp: Path | None, published: bool) -> None:
    """Remove the temporary folder of a failed run (not interruptible: a second Ctrl-C waits for it)."""
    if tmp is not None and not published:
        with deferred_signals():
            shutil.rmtree(tmp, ignore_errors=True)


def _progress(items, description, quiet):
    from tqdm.auto import tqdm

    return tqdm(items, desc=description, unit="file", disable=quiet or len(items) < 2, file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def verify_conversion(
    source: str | Path, converted: str | Path, *, dtype: torch.dtype = torch.float32, log=print
) -> float:
    """Max abs difference between the logits of the source Llama and the converted LazyLlama on a fixed prompt.

    Both are loaded with their weights rounded to `dtype` and computed in float32, so a lossless conversion
    gives float32 round-off only. If the conversion is not exact (tau or distance bias non-zero), the
    difference at the converted settings is printed and the returned figure is with tau and the bias set to
    zero in memory: it checks that every Llama weight arrived intact.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log = log or (lambda *args: None)
    source, converted = Path(source), Path(converted)
    log("  verifying: loading the source Llama ...")
    if _is_gguf(source):  # with the RoPE scaling transformers' GGUF reader leaves out
        config = LlamaConfig(**checked_gguf_config(source, read_source_config(source)))
        reference = LlamaForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, config=config,
                                                     dtype=dtype)
    else:
        config = without_gguf_quantization(LlamaConfig.from_pretrained(str(source)))
        reference = LlamaForCausalLM.from_pretrained(str(source), config=config, dtype=dtype)
    reference = reference.to(torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(converted))
        input_ids = tokenizer(VERIFY_PROMPT, return_tensors="pt").input_ids
    except Exception:  # no tokenizer: fixed token ids
        input_ids = (torch.arange(1, 33) * 7919 % reference.config.vocab_size)[None]
    log(f"  verifying: source logits on {input_ids.shape[1]} tokens ...")
    expected = reference(input_ids=input_ids).logits
    del reference
    log("  verifying: loading the converted LazyLlama ...")
    lazy = LazyLlamaForCausalLM.from_pretrained(str(converted), dtype=dtype).to(torch.float32).eval()
    log(f"  verifying: LazyLlama logits on {input_ids.shape[1]} tokens ...")
    diff = (lazy(input_ids=input_ids).logits - expected).abs().max().item()
    attention = lazy_attention_modules(lazy)
    if not all(bool((m.tau == 0).all() and (m.distance_bias == 0).all()) for m in attention):
        log(f"  max abs logit difference at the converted tau/distance_bias (not expected to be 0): {diff:.3e}")
        for module in attention:
            module.tau.zero_()
            module.distance_bias.zero_()
        diff = (lazy(input_ids=input_ids).logits - expected).abs().max().item()
        log(f"  max abs logit difference with tau = 0 and distance_bias = 0: {diff:.3e} "
            f"({input_ids.shape[1]} tokens)")
    else:
        log(f"  max abs logit difference: {diff:.3e} ({input_ids.shape[1]} tokens)")
    return diff if math.isfinite(diff) else float("inf")


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`python -m conversion.convert_llama_to_lazy`: the `lazy-convert` command (`lazy_llama_tools.cli.lazy_convert`
    parses the same arguments before importing torch)."""
    return run(convert_parser().parse_args(argv))


def run(args) -> int:
    """Convert as the parsed `lazy-convert` arguments say; returns the exit status."""
    summary = None
    try:
        with terminations_as_interrupts():  # clean up on SIGTERM and SIGHUP as on Ctrl-C
            summary = convert(
                args.source,
                args.output,
                tau_init=args.tau_init,
                bias_window=args.bias_window,
                bias_init_std=args.bias_init_std,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                verify=args.verify,
                verify_tolerance=args.verify_tolerance,
                overwrite=args.overwrite,
                seed=args.seed,
                base_model=args.base_model,
                license=args.license,
                log=functools.partial(print, file=sys.stderr),  # progress on stderr; stdout is for results
            )
    except ConversionError as error:
        print(f"lazy-convert: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:
        if getattr(error, "published", summary is not None):
            print("lazy-convert: interrupted after the conversion was complete: OUT holds the new conversion.",
                  file=sys.stderr)
        else:
            print("lazy-convert: interrupted; OUT was left as it was and nothing was left behind.", file=sys.stderr)
        return 130
    if "max_abs_diff" in summary:
        print(f"max abs logit difference: {summary['max_abs_diff']:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
