"""Attention statistics and perplexity, shared by the demo, `inspect`, training callbacks
and the replication study.

Definitions, for visible (query i, key j) pairs only:
- sparsity: fraction of exactly-zero weights `a_ij` among the keys query i sees, averaged over queries
  (then heads, then layers);
- tile density: fraction of 64 x 64 (query, key) tiles holding a visible pair that keep a non-zero weight;
- sink: mean weight on the first key (position 0) over queries at position > 0;
- surviving mass: mean over queries of `sum_j a_ij` (Elastic-Softmax does not renormalise).

A figure with nothing to average over is NaN, not 0: the sink of an input whose queries are all at position 0 (a
1-token text), or any figure of an input that is all padding.

Packed documents are measured with their `position_ids` (restarting at 0 for each document): pairs across
documents are not visible, and `n_i` counts from each document's start. The weights of a model without Lazy
Attention (a vanilla Llama baseline) are its softmax in float32 whatever the model's dtype: Llama's eager attention
rounds them to the model's dtype, and in float16 that turns small weights into exact zeros this would count as cut.
"""

import math
from contextlib import contextmanager

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from modeling_lazy import lazy_attention_modules
from modeling_lazy.lazy_attention_reference import LazyMetadata, lazy_visibility

TILE = 64
SOFTMAX_FLOAT32_WEIGHTS = "lazy_llama_softmax_float32_weights"


def softmax_attention_float32_weights(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Llama's eager attention, its weights returned in float32 (Llama's own rounds them to the query's dtype): what
    the statistics read from a model without Lazy Attention."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
    if attention_mask is not None:  # the additive mask eager attention gets (0 or the dtype's minimum)
        scores = scores + attention_mask.float()
    weights = torch.softmax(scores, dim=-1)
    out = torch.matmul(weights.to(value.dtype), value)
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register(SOFTMAX_FLOAT32_WEIGHTS, softmax_attention_float32_weights)
AttentionMaskInterface.register(SOFTMAX_FLOAT32_WEIGHTS, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # eager's masks


@contextmanager
def eager_attention(model, implementation: str = "eager"):
    """Temporarily switch a LazyLlama (or Llama) to an implementation that returns weights (`"eager"`)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def attention_weights(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None):
    """Per-layer attention weights `[B, H, T, T]` (float32; for LazyLlama after the ReLU) and the visibility
    mask `[B, 1, T, T]` bool of the same call, then the query and key positions. `position_ids` that restart
    mark packed documents."""
    implementation = "eager" if lazy_attention_modules(model) else SOFTMAX_FLOAT32_WEIGHTS
    with eager_attention(model, implementation):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    output_attentions=True, use_cache=False)
    metadata = LazyMetadata.from_mask(attention_mask, position_ids, query_length=input_ids.shape[1],
                                      batch_size=input_ids.shape[0], device=input_ids.device)
    return [w.float() for w in out.attentions], lazy_visibility(metadata), metadata.q_pos, metadata.k_pos


def _mean_over(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`[H]`: the mean of `values` `[B, H, T]` over the rows `rows` `[B, 1, T]` selects; NaN where it selects none."""
    return (values * rows).sum(dim=(0, 2)) / rows.float().sum(dim=(0, 2))


def _tile_density(weights: torch.Tensor, visible: torch.Tensor, tile: int) -> torch.Tensor:
    """`[H]`: fraction of tiles with a visible pair that keep a non-zero weight (pooled over the batch)."""
    bsz, heads, length, _ = weights.shape
    tiles = math.ceil(length / tile)
    pad = tiles * tile - length
    alive = torch.nn.functional.pad((weights > 0).float(), (0, pad, 0, pad))
    seen = torch.nn.functional.pad(visible.float(), (0, pad, 0, pad)).expand(bsz, heads, -1, -1)
    alive = alive.view(bsz, heads, tiles, tile, tiles, tile).amax(dim=(3, 5))
    seen = seen.reshape(bsz, heads, tiles, tile, tiles, tile).amax(dim=(3, 5))
    return alive.sum(dim=(0, 2, 3)) / seen.sum(dim=(0, 2, 3))  # NaN: no visible pair


@torch.no_grad()
def attention_statistics(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, tile: int = TILE,
                         position_ids: torch.Tensor | None = None):
    """Per layer and head: sparsity, tile density, sink, surviving mass, tau (definitions above).

    Returns a dict: `layers` (a list with, per layer, lists of `[H]` floats under `sparsity`, `tile_density`,
    `sink`, `surviving_mass`, `tau`) and `mean` (each figure averaged over layers and heads).
    """
    weights, visible, q_pos, k_pos = attention_weights(model, input_ids, attention_mask, position_ids)
    row_visible = visible.sum(-1).float()  # [B, 1, T]
    rows = row_visible > 0  # queries that see at least one key
    first_key = visible & (k_pos == 0)[:, None, None, :]  # [B, 1, T, T]
    sink_rows = rows & (q_pos > 0)[:, None, :]
    lazy = lazy_attention_modules(model)  # none for a vanilla Llama: tau 0
    layers = []
    for layer, w in enumerate(weights):
        zeros = ((w == 0) & visible).sum(-1).float()  # [B, H, T]
        sparsity = _mean_over(zeros / row_visible.clamp(min=1), rows)
        surviving = _mean_over((w * visible).sum(-1), rows)
        sink = _mean_over((w * first_key).sum(-1), sink_rows)
        tau = lazy[layer].tau.detach() if lazy else torch.zeros(w.shape[1])
        if hasattr(tau, "full_tensor"):  # a DTensor (FSDP2 or tensor parallelism): every rank gathers it
            tau = tau.full_tensor()
        tau = tau.float().cpu()
        layers.append({
            "sparsity": sparsity.cpu().tolist(),
            "tile_density": _tile_density(w, visible, tile).cpu().tolist(),
            "sink": sink.cpu().tolist(),
            "surviving_mass": surviving.cpu().tolist(),
            "tau": tau.tolist(),
        })
    keys = ("sparsity", "tile_density", "sink", "surviving_mass", "tau")
    mean = {k: sum(sum(layer[k]) / len(layer[k]) for layer in layers) / len(layers) for k in keys}
    return {"layers": layers, "mean": mean}


@torch.no_grad()
def perplexity(model, token_ids: torch.Tensor, context: int = 512, stride: int | None = None, progress=None):
    """Sliding-window perplexity of a 1-D token sequence: each window of `context` tokens scores only the tokens
    not scored by the previous window (all of them for the first), so every token after the first is scored
    exactly once with up to `context - 1` tokens of history.

    Windows start every `stride` tokens, with `stride` (default `context`) capped at `context - 1`: a window's
    first token has no history inside it, so consecutive windows must overlap by at least one token or that
    token would never be scored.

    Returns `{"perplexity", "nll", "tokens", "context", "stride"}` with `perplexity = exp(nll)`, `nll` the mean
    over scored tokens and `stride` the one used. `progress`, if given, is called with (windows done, total).
    """
    if context < 2:
        raise ValueError(f"context must be >= 2 (a token and its history), got {context}")
    stride = stride or context
    if token_ids.dim() != 1 or token_ids.numel() < 2:
        raise ValueError("perplexity needs a 1-D sequence of at least 2 tokens")
    if not 0 < stride <= context:
        raise ValueError(f"stride must be in 1..context ({context}), got {stride}")
    stride = min(stride, context - 1)
    device = next(model.parameters()).device
    total_nll, total_tokens, scored_until = 0.0, 0, 1  # token 0 is never scored (no history)
    windows = 1 + math.ceil(max(0, token_ids.numel() - context) / stride)  # the last one reaches the end
    starts = [k * stride for k in range(windows)]
    for done, begin in enumerate(starts, 1):
        end = min(begin + context, token_ids.numel())
        window = token_ids[begin:end].to(device)[None]
        logits = model(input_ids=window, use_cache=False).logits[0].float()
        targets = window[0, 1:]
        nll = torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="none")
        new = end - max(scored_until, begin + 1)  # tokens in this window not yet scored
        if new > 0:
            total_nll += nll[-new:].sum().item()
            total_tokens += new
            scored_until = end
        if progress is not None:
            progress(done, len(starts))
        if end == token_ids.numel():
            break
    mean = total_nll / total_tokens
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": total_tokens, "context": context, "stride": stride}


@torch.no_grad()
def pooled_attention_statistics(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                position_ids: torch.Tensor | None = None):
    """Figures that pool (query, key) pairs instead of averaging per-row fractions, per layer and head.

    - sparsity_pooled: exact zeros among *all* visible pairs / number of visible pairs (the per-row mean in
      `attention_statistics` weights a row of 2 keys like a row of 500; this one weights every pair alike);
    - removed_mass: mean over queries of `1 - sum_j a_ij` (what Elastic-Softmax takes away; 0 for softmax);
    - sink_share: mean over queries at position > 0 with a positive row sum of `a_i0 / sum_j a_ij` (the first
      key's share of the *surviving* mass; for softmax it equals the sink);
    - sink_share_pooled: `sum_i a_i0 / sum_i sum_j a_ij` over the same queries.

    Returns `{"layers": [{key: [H floats]}], "mean": {key: float}}` (mean over layers and heads).
    """
    weights, visible, q_pos, k_pos = attention_weights(model, input_ids, attention_mask, position_ids)
    rows = visible.sum(-1) > 0  # [B, 1, T]
    first_key = visible & (k_pos == 0)[:, None, None, :]
    sink_rows = rows & (q_pos > 0)[:, None, :]
    layers = []
    for w in weights:
        pairs = visible.expand_as(w)
        zeros = ((w == 0) & pairs).sum(dim=(0, 2, 3)).float()
        mass = (w * visible).sum(-1)  # [B, H, T]
        sink_w = (w * first_key).sum(-1)
        share_rows = sink_rows & (mass > 0)
        share = torch.where(share_rows, sink_w / mass.clamp(min=1e-30), torch.zeros_like(mass))
        sink_mass = (mass * sink_rows).sum(dim=(0, 2))
        layers.append({
            "sparsity_pooled": (zeros / pairs.sum(dim=(0, 2, 3))).tolist(),
            "removed_mass": _mean_over(1 - mass, rows).tolist(),
            "sink_share": _mean_over(share, share_rows).tolist(),
            "sink_share_pooled": torch.where(sink_mass > 0, (sink_w * sink_rows).sum(dim=(0, 2))
                                             / sink_mass.clamp(min=1e-30), math.nan).tolist(),
        })
    keys = ("sparsity_pooled", "removed_mass", "sink_share", "sink_share_pooled")
    mean = {k: sum(sum(layer[k]) / len(layer[k]) for layer in layers) / len(layers) for k in keys}
    return {"layers": layers, "mean": mean}
