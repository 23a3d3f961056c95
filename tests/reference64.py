"""An independent float64 implementation of the math in docs/design.md, written for the tests only.

It shares no code with the project: positions, documents and visibility are rebuilt here from the raw
inputs (padding mask, position_ids), with explicit Python loops where that is clearest, and the whole
LazyLlama forward (embeddings, RMSNorm, RoPE, MLP) is recomputed in float64 from a model's weights.
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
        doc, docs = 0, []
        for t in range(length):
            if t > 0 and pos[t] != pos[t - 1] + 1:
                doc += 1
            docs.append(doc)
        rows.append((pos, docs, valid))
    return rows


def lazy_attention64(q, k, v, tau, bias, rows, past=0):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] float64; rows from `positions_and_documents` over the Tk keys.

    Returns out [B, Hq, Tq, D] and weights [B, Hq, Tq, Tk].
    """
    bsz, heads, tq, dim = q.shape
    tk = k.shape[2]
    group = heads // k.shape[1]
    window = bias.shape[1]
    out = torch.zeros(bsz, heads, tq, dim, dtype=torch.float64)
    weights = torch.zeros(bsz, heads, tq, tk, dtype=torch.float64)
    for b in range(bsz):
        pos, docs, valid = rows[b]
        for i in range(tq):
            gi = past + i  # query index in key coordinates
            keys = [j for j in range(tk) if j <= gi and valid[j] and valid[gi] and docs[j] == docs[gi]]
            if not keys:
                continue
            idx = torch.tensor(keys)
            for h in range(heads):
                kh = k[b, h // group, idx]
                s = (kh @ q[b, h, i]) / math.sqrt(dim)
                for n_, j in enumerate(keys):
                    d = pos[gi] - pos[j]
                    if 0 <= d < window:
                        s[n_] = s[n_] + bias[h, d]
                p = torch.softmax(s, dim=0)
                a = torch.clamp(p + tau[h] / (pos[gi] + 1), min=0.0)
                weights[b, h, i, idx] = a
                out[b, h, i] = a @ v[b, h // group, idx]
    return out, weights


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
        o, _ = lazy_attention64(q, k, v, sd[p + "self_attn.tau"], sd[p + "self_attn.distance_bias"], rows)
        h = h + o.transpose(1, 2).reshape(bsz, length, heads * dim) @ sd[p + "self_attn.o_proj.weight"].T
        x = _rms(h, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = x @ sd[p + "mlp.gate_proj.weight"].T
        up = x @ sd[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    h = _rms(h, sd["model.norm.weight"], cfg.rms_norm_eps)
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return h @ head.T
