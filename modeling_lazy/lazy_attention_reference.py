"""Lazy Attention, the math in one place: who sees whom (`LazyMetadata`) and the plain reference (`"eager"`).

Per query head h, query i, key j, for visible (i, j) (docs/design.md explains each choice):

    s_ij = scaling * <q_i, k_j> + beta_h(pos_i - pos_j)       beta_h(d) = distance_bias[h, d] if 0 <= d < W else 0
    p_ij = exp(s_ij - LSE_i)                                   LSE over the visible keys of row i, float32
    a_ij = max(0, p_ij + tau_h / n_i)                          n_i = pos_i + 1; a_ij = 0 for masked (i, j)
    o_i  = sum_j a_ij v_j                                      no renormalisation

A row whose visible scores are all `-inf` has no normaliser: its weights are all 0 and `o_i = 0`.

Visibility is described by per-token integer tensors rather than an L x L mask, so that every backend
(the reference here, the CPU path in `lazy_attention_torch`, the Triton kernels) reads the same compact
inputs, built once per forward by `lazy_attention_metadata` and carried in a `LazyMetadata`.
"""

import os
import warnings
from typing import NamedTuple

import torch

# Query rows per call up to which inference takes a decode path rather than a prefill (the Triton packed decode,
# the PyTorch few-row decode): `tl.dot` needs tiles of >= 16 rows.
DECODE_MAX_ROWS = 16
ENV_PREFIX = "LAZY_LLAMA_"
# Other names read for a variable: the Lazy Attention specification's name for the backend switch, read silently
# (scripts written against the specification set it; one line when both names are set to different values); names
# used before the single prefix, with one deprecation line each.
_SPEC_ENV_NAMES = {"LAZY_LLAMA_BACKEND": "LAZY_ATTENTION_BACKEND"}
_OLD_ENV_NAMES = {"LAZY_LLAMA_CPU_KERNEL": "LAZY_ATTENTION_CPU_KERNEL", "LAZY_LLAMA_CACHE": "LAZYLLAMA_CACHE"}
_WARNED_OLD_NAMES: set = set()


def environment_setting(name: str, default: str | None = None) -> str | None:
    """The environment variable `LAZY_LLAMA_<name>` (read at every call), else the specification's name for it,
    else its old name (warned once), else `default`. Every variable the project reads goes through here, so they all
    share one prefix."""
    full = ENV_PREFIX + name
    spec = _SPEC_ENV_NAMES.get(full)
    if full in os.environ:
        value = os.environ[full]
        if spec is not None and os.environ.get(spec, value).strip().lower() != value.strip().lower():
            conflict = (full, value, os.environ[spec])
            if conflict not in _WARNED_OLD_NAMES:  # once per pair of values
                _WARNED_OLD_NAMES.add(conflict)
                warnings.warn(f"{full}={value} and {spec}={os.environ[spec]} disagree: {full} is used (unset one "
                              "of them).", UserWarning, stacklevel=2)
        return value
    if spec is not None and spec in os.environ:
        return os.environ[spec]
    old = _OLD_ENV_NAMES.get(full)
    if old is not None and old in os.environ:
        if old not in _WARNED_OLD_NAMES:
            _WARNED_OLD_NAMES.add(old)
            warnings.warn(f"{old} is deprecated: set {full} instead (same values).", FutureWarning, stacklevel=2)
        return os.environ[old]
    return default


class LazyMetadata(NamedTuple):
    """Positions and visibility of one forward call, shared by every layer and every backend.

    q_pos `[B, Tq]`, k_pos `[B, Tk]` int64: positions (restart at 0 per packed document); `n_i = q_pos[i] + 1`.
    q_seg `[B, Tq]`, k_seg `[B, Tk]` int32: query i sees key j  <=>  `q_seg[i] == k_seg[j]` and
        `j <= i + key_offset`. Padding keys carry -1, padded query rows -2 (they see nothing).
    key_offset: key index of query row 0, i.e. the number of cached keys before this call. A Python int
        (then `Tk - Tq`), except for a static cache under torch.compile: there it is a 0-d int64 tensor (the
        cache's written length, which changes every step without changing any shape), `Tk` is the cache's
        whole buffer and its unwritten slots carry k_seg -1.
    causal: the plain causal layout (no padding, one document per row, positions = index + a per-row
        constant): query i sees exactly keys `0 .. i + key_offset` at distance `i + key_offset - j`.
        Backends may use a faster path then; `False` is always safe.
    q_pos32, k_pos32: int32 copies of the positions (what the Triton kernels read).
    """

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q_seg: torch.Tensor
    k_seg: torch.Tensor
    key_offset: int | torch.Tensor
    causal: bool
    q_pos32: torch.Tensor
    k_pos32: torch.Tensor

    @property
    def key_length(self) -> int:
        """Keys this call attends over (a static cache may hand backends a longer, partly unwritten buffer)."""
        return self.k_pos.shape[1]

    @property
    def static_buffer(self) -> bool:
        """True when the keys are a static cache's whole buffer and `key_offset` is a tensor (torch.compile)."""
        return isinstance(self.key_offset, torch.Tensor)

    # Keyword constructors: the model, the vLLM backend, the tools and the tests build metadata only through these.

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, *,
                  query_length: int, batch_size: int | None = None, past_length: int | torch.Tensor = 0,
                  key_length: int | None = None, device: torch.device | None = None,
                  cu_seq_lens: torch.Tensor | None = None) -> "LazyMetadata":
        """What a transformers forward has: a 2-D padding mask `[B, past + Tq]` and/or `position_ids` (restarting
        positions mark packed documents), after `past_length` cached keys (`lazy_attention_metadata` documents
        each argument). `batch_size` and `device` default to the mask's or the positions'."""
        like = attention_mask if attention_mask is not None else position_ids
        if batch_size is None:
            batch_size = like.shape[0] if like is not None else 1
        if device is None:
            device = like.device if like is not None else torch.device("cpu")
        return lazy_attention_metadata(attention_mask, position_ids, past_length, query_length, batch_size, device,
                                       cu_seq_lens, key_length=key_length)

    @classmethod
    def from_cu_seq_lens(cls, cu_seq_lens: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                         device: torch.device | None = None) -> "LazyMetadata":
        """One row of packed documents (`cu_seq_lens` `[docs + 1]`, cumulative lengths from 0, as flash-attention's
        varlen kernels and TRL's padding-free collator give them); positions restart at 0 in each document unless
        `position_ids` `[1, total]` are given."""
        cu_seq_lens = cu_seq_lens.reshape(-1).long()
        device = cu_seq_lens.device if device is None else device
        return lazy_attention_metadata(None, position_ids, 0, int(cu_seq_lens[-1]), 1, device, cu_seq_lens)

    @classmethod
    def from_seq_lens(cls, seq_lens: torch.Tensor, *, query_length: int = 1, key_length: int | None = None,
                      position_offsets: torch.Tensor | None = None) -> "LazyMetadata":
        """B requests as a serving engine holds them: request b has `seq_lens[b]` tokens in its cache, its queries are
        the last `query_length` of them, its keys indices `0 .. seq_lens[b] - 1` of a right-padded `[B, key_length]`
        (default: the longest); padding keys are seen by nothing. Positions are key indices, plus
        `position_offsets[b]` when given. Several query rows need requests of one length (each row's i-th query
        sits at the same key index)."""
        seq_lens = seq_lens.reshape(-1).long()
        batch, device = seq_lens.numel(), seq_lens.device
        longest = int(seq_lens.max())
        key_length = longest if key_length is None else key_length
        if key_length < longest or int(seq_lens.min()) < query_length:
            raise ValueError(f"LazyMetadata.from_seq_lens: every request needs >= query_length ({query_length}) tokens "
                             f"and <= key_length ({key_length}); got seq_lens {seq_lens.tolist()}.")
        if query_length > 1 and int(seq_lens.min()) != longest:
            raise ValueError("LazyMetadata.from_seq_lens: several query rows need requests of one length; group the "
                             f"requests by length (got seq_lens {seq_lens.tolist()}).")
        index = torch.arange(key_length, device=device).expand(batch, key_length)
        k_pos = index if position_offsets is None else index + position_offsets.reshape(-1, 1).long().to(device)
        k_seg = torch.where(index < seq_lens[:, None], 0, -1).to(torch.int32)
        q_pos = (seq_lens - query_length)[:, None] + torch.arange(query_length, device=device)
        if position_offsets is not None:
            q_pos = q_pos + position_offsets.reshape(-1, 1).long().to(device)
        q_seg = torch.zeros(batch, query_length, dtype=torch.int32, device=device)
        causal = longest == key_length and int(seq_lens.min()) == key_length and (
            position_offsets is None or not bool(position_offsets.any()))
        return cls.from_tensors(q_pos, k_pos, q_seg, k_seg, key_offset=key_length - query_length, causal=causal)

    @classmethod
    def from_tensors(cls, q_pos: torch.Tensor, k_pos: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor, *,
                     key_offset: int | torch.Tensor | None = None, causal: bool = False,
                     positions32: tuple[torch.Tensor, torch.Tensor] | None = None) -> "LazyMetadata":
        """From the per-token tensors themselves (field meanings in the class docstring); `key_offset` defaults to
        `Tk - Tq`. `causal=True` is the caller's promise of the plain causal layout (it unlocks the fast paths).
        `positions32`: the int32 copies when the caller has them (made here otherwise)."""
        if key_offset is None:
            key_offset = k_pos.shape[1] - q_pos.shape[1]
        q_pos, k_pos = q_pos.long().contiguous(), k_pos.long().contiguous()
        if positions32 is None:
            positions32 = (q_pos.to(torch.int32), k_pos.to(torch.int32))
        return cls(q_pos, k_pos, q_seg.to(torch.int32).contiguous(), k_seg.to(torch.int32).contiguous(), key_offset,
                   causal, *positions32)


def _is_causal_layout(q_pos, k_pos, q_seg, k_seg, key_offset: int) -> bool:
    """True when query i sees exactly keys `j <= i + key_offset` and `pos_i - pos_j = i + key_offset - j`."""
    seg = k_seg[:, :1]
    index = torch.arange(k_pos.shape[1], device=k_pos.device)
    base = k_pos[:, :1] - index[:1]
    return bool(
        (seg >= 0).all() & (k_seg == seg).all() & (q_seg == seg).all()
        & (k_pos == base + index).all() & (q_pos == base + index[key_offset:]).all()
    )


def _given_position_shift(q_pos: torch.Tensor, q_mask_pos: torch.Tensor, q_valid: torch.Tensor | None) -> torch.Tensor:
    """`[B, 1]`: what the given positions of this call's queries add to the mask's (`cumsum - 1`), at each row's first
    real query (0 for a row without one). A cache keeps keys, not their positions: the cached real keys are taken to
    run up to that query's position, so an offset the caller gave every call (`arange + c`, or `arange` over a
    left-padded row, padding counted) reaches the cached keys' distances as a cache-free call of all the tokens
    sees them."""
    offset = q_pos - q_mask_pos
    if q_valid is None:
        return offset[:, :1]
    first = q_valid.to(torch.int8).argmax(-1, keepdim=True)  # 0 when no query of the row is real
    return offset.gather(1, first) * q_valid.any(-1, keepdim=True)


def _checked_cu_seq_lens(cu_seq_lens: torch.Tensor, batch_size: int, key_length: int, device) -> torch.Tensor:
    """`cu_seq_lens` as int64 on `device`, refused with one line unless it describes the row's tokens: one packed row
    (a batch of 1, as padding-free collators give), from 0 to its `key_length` tokens, never decreasing."""
    cu_seq_lens = cu_seq_lens.reshape(-1).to(device=device, dtype=torch.long)
    if torch.compiler.is_compiling():
        return cu_seq_lens  # no host sync in a graph; eager calls of the same layout were checked
    problem = None
    if batch_size != 1:
        problem = f"they describe one packed row, but the batch has {batch_size} rows"
    elif cu_seq_lens.numel() < 2 or int(cu_seq_lens[0]) != 0 or bool((cu_seq_lens.diff() < 0).any()):
        problem = "they must start at 0 and never decrease"
    elif int(cu_seq_lens[-1]) != key_length:
        problem = f"they end at {int(cu_seq_lens[-1])}, but the row has {key_length} tokens"
    if problem is not None:
        shown = cu_seq_lens.tolist() if cu_seq_lens.numel() <= 8 else f"{cu_seq_lens[:8].tolist()[:-1]} ..."
        raise ValueError(f"Invalid cu_seq_lens {shown}: {problem}. Pass the cumulative document lengths of the "
                         "packed row (as DataCollatorWithFlattening gives them), or position_ids that restart at 0.")
    return cu_seq_lens


def lazy_attention_metadata(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_length: int | torch.Tensor,
    query_length: int,
    batch_size: int,
    device: torch.device,
    cu_seq_lens: torch.Tensor | None = None,
    key_length: int | None = None,
) -> LazyMetadata:
    """Positions and segment ids of queries and keys for one forward call.

    Args:
        attention_mask: `[B, key_length]` (1 = token, 0 = padding) or None.
        position_ids: `[B or 1, query_length]` or None. When None they come from the mask (`cumsum - 1`),
            so a left-padded row gets the positions its prompt gets alone, or are `past_length + arange`.
        past_length: number of cached keys before this call's tokens: an int, or a 0-d tensor for a static
            cache under torch.compile (no host sync; then `key_length` is the cache's buffer length and the
            slots from `past_length + query_length` on are invisible).
        cu_seq_lens: optional `[num_docs + 1]` cumulative document lengths of a packed batch of one row.
        key_length: keys the backends attend over; default (and required for an int `past_length`)
            `past_length + query_length`.
    """
    static_buffer = isinstance(past_length, torch.Tensor)
    if static_buffer:
        if key_length is None:
            raise ValueError("lazy_attention_metadata: a tensor past_length needs key_length "
                             "(the cache buffer length).")
        past_length = past_length.to(device=device, dtype=torch.long)
    elif key_length is None:
        key_length = past_length + query_length
    elif key_length != past_length + query_length:
        raise ValueError(f"key_length ({key_length}) must be past_length + query_length for an int past_length.")
    key_index = torch.arange(key_length, device=device)
    if cu_seq_lens is not None:
        cu_seq_lens = _checked_cu_seq_lens(cu_seq_lens, batch_size, key_length, device)
        if position_ids is None and not static_buffer and past_length == 0:
            # positions restart in each document, as `from_cu_seq_lens` gives them: n_i counts the document's keys
            position_ids = (key_index - torch.repeat_interleave(cu_seq_lens[:-1], cu_seq_lens.diff()))[None]
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] != key_length:
            raise ValueError(
                f"LazyLlama expects a 2-D padding mask of shape [batch, past + new tokens] = "
                f"[{batch_size}, {key_length}], got {tuple(attention_mask.shape)}. 4-D masks cannot express "
                "Elastic-Softmax's per-row key count; pass the tokenizer's attention_mask instead."
            )
        if not static_buffer and not torch.compiler.is_compiling() and bool(attention_mask.all()):
            attention_mask = None  # all ones (generate() without padding): the same layout as no mask
    key_valid = None
    if attention_mask is not None:
        key_valid = attention_mask.to(device=device, dtype=torch.bool)
        mask_pos = key_valid.long().cumsum(-1) - 1
        mask_pos = mask_pos.masked_fill(~key_valid, 1)  # what generate() gives padding positions
    else:
        mask_pos = key_index.expand(batch_size, key_length)

    if static_buffer:  # slots not written yet (this call's tokens included) are invisible
        query_index = past_length + torch.arange(query_length, device=device)  # key index of every query
        written = (key_index < past_length + query_length).expand(batch_size, key_length)
        key_valid = written if key_valid is None else key_valid & written
        q_mask_pos = mask_pos.index_select(1, query_index)
        if position_ids is None:
            q_pos = q_mask_pos
        else:
            q_pos = position_ids.to(device=device, dtype=torch.long).expand(batch_size, query_length)
            mask_pos = mask_pos + _given_position_shift(q_pos, q_mask_pos, key_valid.index_select(1, query_index))
        k_pos = mask_pos.index_copy(1, query_index, q_pos)
    else:
        if position_ids is None:
            q_pos = mask_pos[:, past_length:]
        else:
            q_pos = position_ids.to(device=device, dtype=torch.long).expand(batch_size, query_length)
            if past_length > 0:
                mask_pos = mask_pos + _given_position_shift(
                    q_pos, mask_pos[:, past_length:], None if key_valid is None else key_valid[:, past_length:])
        k_pos = torch.cat([mask_pos[:, :past_length], q_pos], dim=1)

    # Segments: packed documents are only meaningful without a cache (training / scoring).
    if cu_seq_lens is not None:
        lengths = cu_seq_lens.diff()
        seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        seg = seg[:key_length].expand(batch_size, key_length)
    elif not static_buffer and past_length == 0 and position_ids is not None:
        # a document starts at a real key whose position does not continue the previous real key's: padding keys
        # (left, right, or holes inside a row, whose positions are fill values) neither start nor end one
        valid = key_valid if key_valid is not None else torch.ones_like(k_pos, dtype=torch.bool)
        last = torch.where(valid, key_index, -1).cummax(-1).values  # the last real key at or before each key
        before = torch.cat([last.new_full((last.shape[0], 1), -1), last[:, :-1]], dim=1)  # ... strictly before
        starts = valid & ((before < 0) | (k_pos != k_pos.gather(1, before.clamp(min=0)) + 1))
        seg = starts.long().cumsum(-1)
    else:
        seg = torch.zeros(batch_size, key_length, dtype=torch.int32, device=device)
    seg = seg.to(torch.int32)
    if static_buffer:
        k_seg = seg.masked_fill(~key_valid, -1).contiguous()
        q_seg = seg.index_select(1, query_index).masked_fill(~key_valid.index_select(1, query_index), -2)
        q_seg = q_seg.contiguous()
    elif key_valid is None:
        k_seg, q_seg = seg.contiguous(), seg[:, past_length:].contiguous()
    else:
        k_seg = seg.masked_fill(~key_valid, -1).contiguous()
        q_seg = seg[:, past_length:].masked_fill(~key_valid[:, past_length:], -2).contiguous()
    q_pos, k_pos = q_pos.contiguous(), k_pos.contiguous()

    if static_buffer:
        causal = False  # the buffer holds unwritten slots: the general path masks them
    elif attention_mask is None and position_ids is None and cu_seq_lens is None:
        causal = True  # known without looking at the data (and without a host sync under torch.compile)
    elif torch.compiler.is_compiling():
        causal = False  # a data-dependent check would break the graph; the general path is exact
    elif key_valid is not None:
        causal = False  # the mask holds a zero (an all-ones mask was dropped above): a padding key no row sees
    elif attention_mask is None and cu_seq_lens is None and past_length > 0:
        # one segment, cached keys at positions 0 .. past - 1: causal iff the new tokens continue them
        causal = bool((q_pos == torch.arange(past_length, key_length, device=device)).all())
    else:
        causal = _is_causal_layout(q_pos, k_pos, q_seg, k_seg, past_length)
    return LazyMetadata.from_tensors(q_pos, k_pos, q_seg, k_seg, key_offset=past_length, causal=causal)


def lazy_visibility(metadata: LazyMetadata) -> torch.Tensor:
    """`[B, 1, Tq, Tk]` bool: query i sees key j (same segment and `j <= i + key_offset`)."""
    q_len, k_len = metadata.q_pos.shape[1], metadata.key_length
    device = metadata.q_pos.device
    query_key_index = torch.arange(q_len, device=device)[:, None] + metadata.key_offset
    causal = torch.arange(k_len, device=device)[None, :] <= query_key_index
    return ((metadata.q_seg[:, :, None] == metadata.k_seg[:, None, :]) & causal)[:, None]


def distance_bias_scores(distance_bias: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype) -> torch.Tensor:
    """`[B, H, Tq, Tk]`: `distance_bias[h, pos_i - pos_j]` inside the window, 0 outside it."""
    window = distance_bias.shape[-1]
    dist = q_pos[:, :, None] - k_pos[:, None, :]
    in_window = (dist >= 0) & (dist < window)
    bias = distance_bias.to(dtype)[:, dist.clamp(0, window - 1)]  # [H, B, Tq, Tk]
    return torch.where(in_window, bias, torch.zeros((), dtype=dtype, device=bias.device)).permute(1, 0, 2, 3)


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """float64 inputs are computed in float64 (for gradcheck); everything else in float32."""
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def lazy_attention_reference(query, key, value, tau, distance_bias, metadata: LazyMetadata, scaling: float,
                             dropout: float = 0.0):
    """Plain Lazy Attention that materialises the weights (the `"eager"` implementation).

    Args:
        query: `[B, Hq, Tq, D]`; key, value: `[B, Hkv, >= Tk, D]` (any float dtype; math in float32, or
            float64 for float64 inputs). Only the first `metadata.key_length` keys are read.
        tau: `[Hq]`; distance_bias: `[Hq, W]`; metadata: from `lazy_attention_metadata`.
        dropout: probability of dropping a weight `a_ij` before `a @ V` (the survivors are scaled by
            `1 / (1 - dropout)`, as Llama's eager attention does with softmax weights); 0 in evaluation.
    Returns:
        `(out [B, Tq, Hq, D] in the query dtype, weights [B, Hq, Tq, key.shape[2]] after the ReLU and
        dropout)`: over every key handed in, as Llama's eager attention returns them, so a static cache's
        weights span its whole buffer (`max_cache_len`), 0 on the slots past `metadata.key_length`.
    """
    groups = query.shape[1] // key.shape[1]
    dtype = compute_dtype(query)
    k_len = metadata.key_length
    k = key[:, :, :k_len].to(dtype).repeat_interleave(groups, dim=1)  # [B, Hq, Tk, D]
    v = value[:, :, :k_len].to(dtype).repeat_interleave(groups, dim=1)
    visible = lazy_visibility(metadata)  # [B, 1, Tq, Tk]
    scores = torch.matmul(query.to(dtype), k.transpose(2, 3)) * scaling
    scores = scores + distance_bias_scores(distance_bias, metadata.q_pos, metadata.k_pos, dtype)
    scores = scores.masked_fill(~visible, float("-inf"))
    alive = scores.amax(-1, keepdim=True) > float("-inf")  # [B, Hq, Tq, 1]: the row has a normaliser
    lse = torch.logsumexp(scores.masked_fill(~alive, 0.0), dim=-1, keepdim=True)  # finite values and gradients
    probs = torch.exp(scores - lse)
    n = (metadata.q_pos + 1).to(dtype)[:, None, :, None]
    weights = torch.relu(probs + tau.to(dtype)[None, :, None, None] / n) * (visible & alive)
    if dropout > 0:
        weights = torch.nn.functional.dropout(weights, p=dropout, training=True)
    out = torch.matmul(weights, v).to(query.dtype)
    weights = torch.nn.functional.pad(weights, (0, key.shape[2] - k_len))  # unwritten cache slots: weight 0
    return out.transpose(1, 2).contiguous(), weights


__all__ = ["LazyMetadata", "lazy_attention_metadata", "lazy_attention_reference", "lazy_visibility"]
