"""The one independent float64 implementation of the math in docs/design.md that every test compares against.

It shares no code with the project: positions, documents and visibility are rebuilt here from the raw
inputs (padding mask, position_ids) with explicit Python loops, the attention (`lazy_attention64`, and
`decode64` for one query row per sequence) is written from the formulas, and the whole LazyLlama forward
(embeddings, RMSNorm, RoPE, MLP) is recomputed in float64 from a model's weights (`lazy_llama_logits64`).
"""

import math

import torch


def positions_and_documents(attention_mask, position_ids, batch, length):
    """Per row: positions (list), document id per token (list), valid flag per token (list)."""
    rows = []
    for b in range(batch):
        valid = [True] * length if attention_mask is None else [bool(x) for x in attention_mask[b].tolist()]
        if position_ids is not None:
            pos = position_ids[min(b, position_ids.shape[0] - 1)].tolist()
        elif attention_mask is not None:
            count, pos = 0, []
            for ok in valid:
                pos.append(count if ok else 0)
                count += ok
        else:
            pos = list(range(length))
        doc, docs, previous = 0, [], None  # a real token whose position does not continue the last real one's
        for t in range(length):  # starts a document; padding tokens (any fill position) start none
            if valid[t]:
                if previous is not None and pos[t] != previous + 1:
                    doc += 1
                previous = pos[t]
            docs.append(doc)
        rows.append((pos, docs, valid))
    return rows


def token_layout(attention_mask, position_ids, batch, length, query_length=None):
    """`(q_pos, k_pos, q_seg, k_seg)` int64 tensors of `length` keys whose last `query_length` (default all) are the
    queries, from a padding mask and/or positions: tokens of one document share a segment id; padding keys get -1
    and padded queries -2, so nothing sees them and they see nothing."""
    query_length = length if query_length is None else query_length
    rows = positions_and_documents(attention_mask, position_ids, batch, length)
    k_pos = torch.tensor([pos for pos, _, _ in rows], dtype=torch.long)
    docs = torch.tensor([doc for _, doc, _ in rows], dtype=torch.long)
    valid = torch.tensor([ok for _, _, ok in rows], dtype=torch.bool)
    k_seg = docs.masked_fill(~valid, -1)
    q_seg = docs.masked_fill(~valid, -2)[:, length - query_length:]
    return k_pos[:, length - query_length:], k_pos, q_seg, k_seg


def lazy_attention64(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling=None):
    """The float64 Lazy Attention oracle of every test (dense; differentiable in the five float inputs).

    query `[B, Hq, Tq, D]`, key/value `[B, Hkv, Tk, D]`, tau `[Hq]`, distance_bias `[Hq, W]`; per-token int
    tensors: positions q_pos `[B, Tq]`, k_pos `[B, Tk]` and segments q_seg, k_seg (query i sees key j when
    `q_seg[i] == k_seg[j]` and `j <= i + Tk - Tq`). `scaling` defaults to `1 / sqrt(D)`.
    Returns `(out [B, Hq, Tq, D], weights [B, Hq, Tq, Tk])`. A row with no finite visible score has weights 0; a
    NaN score makes its row NaN.
    """
    bsz, num_heads, q_len, dim = query.shape
    groups = num_heads // key.shape[1]
    k_len = key.shape[2]
    scaling = dim ** -0.5 if scaling is None else scaling
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    q_pos, k_pos = q_pos.long(), k_pos.long()
    scores = scaling * query.double() @ k.transpose(-1, -2)  # [B, H, Tq, Tk]
    dist = q_pos[:, :, None] - k_pos[:, None, :]  # [B, Tq, Tk]
    window = distance_bias.shape[1]
    in_window = (dist >= 0) & (dist < window)
    bias = distance_bias.double()[:, dist.clamp(0, window - 1)].permute(1, 0, 2, 3)  # [B, H, Tq, Tk]
    scores = scores + torch.where(in_window[:, None], bias, torch.zeros((), dtype=torch.float64))
    q_index = torch.arange(q_len)[:, None] + (k_len - q_len)
    visible = (q_seg[:, :, None].long() == k_seg[:, None, :].long()) & (torch.arange(k_len)[None, :] <= q_index)
    visible = visible[:, None]  # [B, 1, Tq, Tk]
    scores = scores.masked_fill(~visible, -math.inf)
    # a row with a finite (or NaN: it flows on) score has a normaliser; the others take it over zeros, so that
    # logsumexp's backward (exp(s - lse) of -inf - -inf) puts no NaN into their gradients
    alive = (~torch.isneginf(scores)).any(-1, keepdim=True)
    lse = torch.logsumexp(torch.where(alive, scores, torch.zeros((), dtype=torch.float64)), -1, keepdim=True)
    probs = torch.exp(scores - lse)
    n = (q_pos + 1).double()[:, None, :, None]
    weights = torch.where(visible & alive, torch.relu(probs + tau.double()[None, :, None, None] / n), 0.0)
    return weights @ v, weights


def decode64(query, keys, values, tau, distance_bias, positions, scaling=None):
    """One query row per sequence over its own keys: query `[B, Hq, D]`, keys[b] / values[b] `[Hkv, n_b, D]`, the
    query at position `positions[b]` and key t at `positions[b] - (n_b - 1 - t)`. Returns `[B, Hq, D]` float64."""
    outs = []
    for b in range(query.shape[0]):
        n = keys[b].shape[1]
        k_pos = (int(positions[b]) - (n - 1) + torch.arange(n))[None]
        seg = torch.zeros(1, n, dtype=torch.long)
        out, _ = lazy_attention64(query[b:b + 1, :, None], keys[b][None], values[b][None], tau, distance_bias,
                                  k_pos[:, -1:], k_pos, seg[:, -1:], seg, scaling)
        outs.append(out[:, :, 0])
    return torch.cat(outs)


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.tensor(pos, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    half = dim // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


@torch.no_grad()
def lazy_llama_logits64(model, input_ids, attention_mask=None, position_ids=None):
    """Logits [B, T, V] of a LazyLlamaForCausalLM (default RoPE only) recomputed in float64 from its weights."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    bsz, length = input_ids.shape
    rows = positions_and_documents(attention_mask, position_ids, bsz, length)
    layout = token_layout(attention_mask, position_ids, bsz, length)
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    h = sd["model.embed_tokens.weight"][input_ids]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        x = _rms(h, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(bsz, length, heads, dim).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(bsz, length, kv_heads, dim).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(bsz, length, kv_heads, dim).transpose(1, 2)
        q = torch.stack([_rope(q[b], rows[b][0], theta) for b in range(bsz)])
        k = torch.stack([_rope(k[b], rows[b][0], theta) for b in range(bsz)])
        o, _ = lazy_attention64(q, k, v, sd[p + "self_attn.tau"], sd[p + "self_attn.distance_bias"], *layout)
        h = h + o.transpose(1, 2).reshape(bsz, length, heads * dim) @ sd[p + "self_attn.o_proj.weight"].T
        x = _rms(h, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = x @ sd[p + "mlp.gate_proj.weight"].T
        up = x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    h = _rms(h, sd["model.norm.weight"], cfg.rms_norm_eps)
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return h @ head.T
