"""LazyLlama's native CPU ops (`torch.ops.lazy_llama.cpu_*`), when the project was installed with them.

PyTorch computes a decode row of Lazy Attention in five or more ops (scores, bias, softmax, `+ tau / n` and the
ReLU, the value product), each a dispatch and a full pass over the row; SDPA does softmax attention in one. The
native decode op does the whole row in one call per (sequence, key/value head) task: scores of the G query heads
of a GQA group (each key row read once), the distance bias on the last W keys, `a = max(0, softmax + tau / n)`,
and `o = sum_t a_t v_t` over only the value rows some head weights (exactly the dense sum; with tau < 0 a fraction
of V). It reads the model's contiguous cache `[B, Hkv, T, D]` and vLLM's paged cache (through a block table) in
place, in float32, bfloat16 or float16 (converted on load, accumulated in float32). Two smaller ops share the
module: the causal prefill's Elastic-Softmax row pass (float32 scores, in place) and vLLM's paged-cache write.

The C++ source is `csrc/lazy_attention_cpu.cpp`, built when the project is installed (`make setup`,
`pip install --no-build-isolation .`) into the module `lazy_llama_cpu`; this file only imports it, so loading a
checkpoint with `trust_remote_code` never compiles anything. Where the module is absent (no compiler at install
time, or a checkpoint's code used without the project), `available()` warns once and returns False and the callers
keep their PyTorch paths; `LAZY_LLAMA_CPU_KERNEL=0` switches the ops off. The callers ask `decode_supported` /
`cache_write_supported` (CPU tensors of a supported dtype and unit last stride) before calling an op; the ops check
the same again (a clear error, never a foreign pointer).

NaN and Inf behave as in the PyTorch reference: a NaN query or key makes that head's output NaN, with the ops on
and off. A value row that no head of its group weights is not read (as the PyTorch path's sparse value product):
a NaN there reaches the output only when some head weights it.
"""

import warnings

import torch

from .lazy_attention_reference import environment_setting

try:
    import lazy_llama_cpu  # noqa: F401  (registers torch.ops.lazy_llama.cpu_*)
except (ImportError, OSError) as error:  # not installed, or built against another torch
    _MISSING = f"{type(error).__name__}: {error}"
else:
    _MISSING = None

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WARNED: list = []


def available() -> bool:
    """True when the native ops are installed and not switched off (`LAZY_LLAMA_CPU_KERNEL=0`); warns once when
    they are not installed."""
    if environment_setting("CPU_KERNEL", "1") == "0":
        return False
    if _MISSING is not None and not _WARNED:
        _WARNED.append(True)
        warnings.warn(f"LazyLlama's native CPU op (lazy_llama_cpu) is not installed ({_MISSING}); using the PyTorch "
                      "path. Install the project with `pip install --no-build-isolation .` (needs a C++ compiler) "
                      "or set LAZY_LLAMA_CPU_KERNEL=0 to silence this.", stacklevel=3)
    return _MISSING is None


def decode_supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """True when `lazy_decode_cpu` takes these: the ops are available, all three on the CPU in one dtype of
    `DTYPES`, key and value with unit last strides."""
    return (query.is_cpu and key.is_cpu and value.is_cpu  # (`is_cpu`: no device object per call)
            and query.dtype == key.dtype == value.dtype and query.dtype in DTYPES
            and key.stride(-1) == 1 and value.stride(-1) == 1 and available())


def cache_write_supported(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor) -> bool:
    """True when `lazy_cache_write` takes these: CPU tensors of one dtype, unit last strides, ops available."""
    return (key.device.type == value.device.type == cache.device.type == "cpu"
            and key.dtype == value.dtype == cache.dtype and key.stride(-1) == 1 and value.stride(-1) == 1
            and available())


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as contiguous float32 without autograd history (no call when it already is, or when only its
    `requires_grad` says otherwise while grad mode is off, as in generation: microseconds count)."""
    if (tensor.dtype != torch.float32 or not tensor.is_contiguous()
            or (tensor.requires_grad and torch.is_grad_enabled())):
        tensor = tensor.detach().to(torch.float32).contiguous()
    return tensor


def _require_cpu(op: str, **tensors) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device.type != "cpu":
            raise ValueError(f"{op}: {name} is on {tensor.device}, but LazyLlama's native op runs on CPU tensors "
                             "only; check decode_supported() first or use lazy_attention_torch.")


def lazy_decode_cpu(query, key, value, tau, distance_bias, scaling, *, seq_len=0, seq_lens=None, block_table=None,
                    positions=None, key_starts=None, num_splits=0) -> torch.Tensor:
    """One decode row per sequence: `out [B, Hq, Dv]` (the query dtype) = LazyAttention(query `[B, Hq, D]`,
    keys 0 .. n - 1).

    Without `block_table`, `key`/`value` are `[B, Hkv, T, D]` caches and every sequence has `seq_len` keys. With
    it (`[B, max_blocks]` int32), they are `[num_blocks, Hkv, block_size, D]` page views, key t of sequence b is
    row `t % block_size` of block `block_table[b, t // block_size]`, and sequence b has `seq_lens[b]` keys (int32
    `[B]`). Any strides with a unit last stride; query, key and value in one dtype of `DTYPES`. The query of a
    sequence with n keys sits at position n - 1 unless `positions [B]` (int64) says otherwise (`n = position + 1`
    divides tau; the distances stay `n_keys - 1 - t`). `key_starts [B]` (int32) skips each sequence's first keys (a
    left-padded batch): sequence b then sees keys `key_starts[b] .. n - 1`, as if they were all its keys (its
    default position is `n - key_starts[b] - 1`). `tau [Hq]`, `distance_bias [Hq, W]` (any float dtype).
    `num_splits`: slices of each sequence's keys computed as separate parallel items (split-K); 0 chooses (slices
    only when there are fewer (sequence, KV head) tasks than the threads can share evenly and the keys are many).
    """
    if not (query.is_cpu and key.is_cpu and value.is_cpu):
        _require_cpu("lazy_decode_cpu", query=query, key=key, value=value)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if positions is not None and (positions.dtype != torch.int64 or not positions.is_contiguous()):
        positions = positions.to(torch.int64).contiguous()
    if key_starts is not None and (key_starts.dtype != torch.int32 or not key_starts.is_contiguous()):
        key_starts = key_starts.to(torch.int32).contiguous()
    return torch.ops.lazy_llama.cpu_decode(query, key, value, _float32(tau), _float32(distance_bias), float(scaling),
                                           int(seq_len), seq_lens, block_table, positions, key_starts,
                                           int(num_splits))


def lazy_elastic_rows(scores, i0, tau, distance_bias, q_pos, row0) -> torch.Tensor:
    """`scores [B, H, rows, keys]` (contiguous float32, already scaled) become the chunk's Lazy Attention weights in
    place: row r is key index `i0 + r` and sees keys `0 .. i0 + r` (bias on distances below W, softmax, `+ tau / n`
    with `n = q_pos[b, row0 + r] + 1`, ReLU; keys past `i0 + r` get 0). `q_pos [B, >= row0 + rows]` int64 with a
    unit last stride, `tau [H]` and `distance_bias [H, W]` contiguous float32. Returns `scores`."""
    _require_cpu("lazy_elastic_rows", scores=scores, q_pos=q_pos)
    torch.ops.lazy_llama.cpu_elastic_rows_(scores, int(i0), tau, distance_bias, q_pos, int(row0))
    return scores


def lazy_cache_write(key, value, slots, key_cache, value_cache) -> None:
    """Write `key [T, Hkv, D]` and `value [T, Hkv, Dv]` to the slots `slots [T]` (int64; -1 skips a token) of a
    paged cache given as `[num_blocks, Hkv, block_size, D]` views: row `slot % block_size` of block
    `slot // block_size`. One dtype throughout, unit last strides."""
    _require_cpu("lazy_cache_write", key=key, value=value, slots=slots, key_cache=key_cache, value_cache=value_cache)
    torch.ops.lazy_llama.cpu_cache_write_(key, value, slots.to(torch.int64).contiguous(), key_cache, value_cache)


def _register_fakes() -> None:
    """Shapes for fake (meta) tensors, so that tracing and `torch.compile` see through the ops."""

    def decode(query, key, value, tau, distance_bias, scale, seq_len, seq_lens, block_table, positions,
               key_starts=None, num_splits=0):
        if not query.device == key.device == value.device:
            raise RuntimeError(f"lazy_llama::cpu_decode: query, key and value are on different devices "
                               f"({query.device}, {key.device}, {value.device})")
        return query.new_empty(query.shape[0], query.shape[1], value.shape[-1])

    def in_place(*args):
        return None

    for name, fake in (("cpu_decode", decode), ("cpu_elastic_rows_", in_place), ("cpu_cache_write_", in_place)):
        try:
            torch.library.register_fake(f"lazy_llama::{name}")(fake)
        except RuntimeError as error:  # this file imported twice (the package and a checkpoint's copy)
            if "already" not in str(error):
                raise


if _MISSING is None:
    _register_fakes()


__all__ = ["DTYPES", "available", "cache_write_supported", "decode_supported", "lazy_cache_write", "lazy_decode_cpu",
           "lazy_elastic_rows"]
