"""The study's control variants (lazy_llama_tools/replicate.py) do what their names say, and the pooled
attention figures (lazy_llama_tools.metrics.pooled_attention_statistics) agree with a direct count. Tiny random
models: seconds."""

import argparse
import math

import pytest
import torch

from lazy_llama_tools import replicate
from lazy_llama_tools.metrics import attention_weights, pooled_attention_statistics
from modeling_lazy.lazy_attention_reference import (
    LazyMetadata,
    lazy_attention_reference,
)


def tiny_args(**overrides):
    args = {"hidden_size": 32, "intermediate_size": 64, "layers": 2, "heads": 2, "context": 16, "seed": 0,
            "tau_init": -1.0,
            "bias_window": None, "gain_init": 1.0, "small_oinit": 0.02, "lr": 2e-3, "gain_lr": 5e-2,
            "weight_decay": 0.1}
    args.update(overrides)
    return argparse.Namespace(**args)


def ids(batch=2, length=16, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def o_proj_outputs(model, input_ids):
    """Per layer: (input, output) of o_proj, as the model computes them (hooks included)."""
    seen = []
    handles = [layer.self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
               for layer in replicate.attention_layers(model)]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    for handle in handles:
        handle.remove()
    return seen, logits


def test_every_variant_starts_from_the_same_llama_weights():
    args = tiny_args()
    reference = replicate.build_model("vanilla", args).state_dict()
    for variant in replicate.VARIANTS:
        state = replicate.build_model(variant, args).state_dict()
        for name, tensor in reference.items():
            if variant == "small_oinit" and name.endswith("o_proj.weight"):
                torch.testing.assert_close(state[name], tensor * 0.02, rtol=0, atol=0)
            else:
                assert torch.equal(state[name], tensor), (variant, name)


def test_scale_multiplies_the_attention_output_and_scale1_is_vanilla():
    x = ids()
    base_seen, base_logits = o_proj_outputs(replicate.build_model("vanilla", tiny_args()), x)
    _, one_logits = o_proj_outputs(replicate.build_model("scale1", tiny_args()), x)
    assert torch.equal(one_logits, base_logits)
    model = replicate.build_model("scale0.3", tiny_args())
    # Layer 0 sees the same input, so its attention output must be exactly 0.3 x vanilla's.
    seen, logits = o_proj_outputs(model, x)
    torch.testing.assert_close(seen[0][1], 0.3 * base_seen[0][1])
    attn_out = model.model.layers[0].self_attn.o_proj(seen[0][0])  # the hook applies to direct calls too
    weight = model.model.layers[0].self_attn.o_proj.weight
    torch.testing.assert_close(attn_out, 0.3 * torch.nn.functional.linear(seen[0][0], weight))
    assert not torch.allclose(logits, base_logits)


def test_gain_is_a_learnable_per_head_factor_on_each_heads_output():
    model = replicate.build_model("gain", tiny_args())
    attn = model.model.layers[0].self_attn
    assert attn.head_gain.shape == (2,) and attn.head_gain.requires_grad
    assert torch.equal(attn.head_gain, torch.ones(2))
    names = [n for n, _ in model.named_parameters() if n.endswith("head_gain")]
    assert len(names) == 2  # one per layer, seen by the optimizer
    x = ids()
    seen_before, _ = o_proj_outputs(model, x)
    with torch.no_grad():
        attn.head_gain.copy_(torch.tensor([0.5, 2.0]))
    captured = []
    handle = attn.o_proj.register_forward_hook(lambda m, i, o: captured.append(i[0]))
    with torch.no_grad():
        model(input_ids=x)
    handle.remove()
    # The pre-hook scaled head 0's 16 channels by 0.5 and head 1's by 2 before the projection.
    raw = seen_before[0][0]  # o_proj input with gains 1 (= the heads' outputs)
    expected = torch.cat([raw[..., :16] * 0.5, raw[..., 16:] * 2.0], dim=-1)
    out = attn.o_proj(raw)
    torch.testing.assert_close(out, torch.nn.functional.linear(expected, attn.o_proj.weight))
    assert captured  # the forward ran through the hook
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    assert attn.head_gain.grad is not None and attn.head_gain.grad.abs().sum() > 0


def test_norelu_has_no_exact_zeros_and_equals_p_plus_tau_over_n():
    args = tiny_args()
    norelu = replicate.build_model("norelu", args)
    lazy = replicate.build_model("lazy", args)
    lazy.load_state_dict(norelu.state_dict())
    x = ids()
    weights, visible, _, _ = attention_weights(norelu, x)
    lazy_weights, *_ = attention_weights(lazy, x)
    for layer, (w, lw) in enumerate(zip(weights, lazy_weights)):
        # No exact zeros among visible pairs, except where the formula itself gives 0: query 0 has one key
        # (p = 1, n = 1), so its weight is 1 + tau = 0 at tau = -1.
        assert ((w == 0) & visible)[:, :, 1:].sum() == 0
        assert (w[~visible.expand_as(w)] == 0).all()
        assert ((lw == 0) & visible).sum() > 0  # while the ReLU version has some (tau = -1)
        if layer == 0:  # same input: ReLU of no-ReLU = Lazy Attention (later layers see different inputs)
            torch.testing.assert_close(torch.relu(w), lw)
        tau = norelu.model.layers[layer].self_attn.tau
        torch.testing.assert_close(w.sum(-1), (1 + tau[None, :, None]).expand(2, -1, 16))  # rows sum to 1 + tau
    # and the weights are softmax + tau/n: compare with the reference at tau = 0 (plain softmax with the bias)
    attn = norelu.model.layers[0].self_attn
    q, k, v = (torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(s)) for s in (2, 3, 4))
    meta = LazyMetadata.from_mask(query_length=16, batch_size=1, device=q.device)
    out, w = replicate.norelu_attention(attn, q, k, v, None, 0.25, lazy_metadata=meta)
    _, p = lazy_attention_reference(q, k, v, torch.zeros(2), attn.distance_bias, meta, 0.25)
    n = torch.arange(1, 17.0)[None, None, :, None]
    expected = (p + attn.tau[None, :, None, None] / n) * torch.ones(16, 16).tril()
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(out, (expected @ v).transpose(1, 2))


def test_bias_only_and_tau_only_freeze_what_they_say_and_tau_init_is_used():
    bias_only = replicate.build_model("bias_only", tiny_args())
    tau_only = replicate.build_model("tau_only", tiny_args(tau_init=-0.25))
    for layer in bias_only.model.layers:
        assert not layer.self_attn.tau.requires_grad and (layer.self_attn.tau == 0).all()
    for layer in tau_only.model.layers:
        assert not layer.self_attn.distance_bias.requires_grad and (layer.self_attn.distance_bias == 0).all()
        assert (layer.self_attn.tau == -0.25).all()
    wide = replicate.build_model("lazy", tiny_args(bias_window=64))
    assert wide.model.layers[0].self_attn.distance_bias.shape == (2, 64)


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        replicate.build_model("lazzy", tiny_args())


def test_pooled_statistics_match_a_direct_count():
    model = replicate.build_model("lazy", tiny_args())
    x = ids(batch=3)
    stats = pooled_attention_statistics(model, x)
    weights, *_ = attention_weights(model, x)
    for layer, w in enumerate(weights):
        for head in range(2):
            zeros = pairs = 0
            removed, shares, sink_sum, mass_sum = [], [], 0.0, 0.0
            for b in range(3):
                for i in range(16):
                    row = [float(w[b, head, i, j]) for j in range(i + 1)]
                    zeros += sum(1 for a in row if a == 0.0)
                    pairs += len(row)
                    removed.append(1 - sum(row))
                    if i > 0 and sum(row) > 0:
                        shares.append(row[0] / sum(row))
                    if i > 0:
                        sink_sum += row[0]
                        mass_sum += sum(row)
            got = {k: v[head] for k, v in stats["layers"][layer].items()}
            assert got["sparsity_pooled"] == pytest.approx(zeros / pairs)
            assert got["removed_mass"] == pytest.approx(sum(removed) / len(removed), abs=1e-6)
            assert got["sink_share"] == pytest.approx(sum(shares) / len(shares), abs=1e-6)
            assert got["sink_share_pooled"] == pytest.approx(sink_sum / mass_sum, abs=1e-6)
    assert 0 < stats["mean"]["sparsity_pooled"] < 1
    vanilla = pooled_attention_statistics(replicate.build_model("vanilla", tiny_args()), x)["mean"]
    assert vanilla["sparsity_pooled"] == 0 and abs(vanilla["removed_mass"]) < 1e-5


def test_grid_cells_run_seed_by_seed():
    args = argparse.Namespace(grid="controls", seeds=[0, 1])
    cells = replicate.grid_cells(args)
    assert len(cells) == 2 * len(replicate.GRIDS["controls"])
    assert [c[1] for c in cells[: len(replicate.GRIDS["controls"])]] == [0] * len(replicate.GRIDS["controls"])
    assert all(set(c[2][1:2]) <= set(replicate.VARIANTS) for c in cells)
    by_cell = replicate.grid_cells(argparse.Namespace(grid="controls", seeds=[0, 1], order="cell"))
    assert [c[:2] for c in by_cell[:3]] == [("vanilla", 0), ("vanilla", 1), ("lazy", 0)]


def test_shift_only_is_softmax_plus_tau_over_n_without_bias_or_relu():
    args = tiny_args()
    model = replicate.build_model("shift_only", args)
    vanilla = replicate.build_model("vanilla", args)
    for layer in model.model.layers:
        attn = layer.self_attn
        assert not attn.distance_bias.requires_grad and (attn.distance_bias == 0).all()
        assert attn.tau.requires_grad and (attn.tau == -1).all()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.tau.copy_(-1 - torch.rand(2, generator=torch.Generator().manual_seed(5)))
    seed = torch.seed() % 2**31
    print("seed", seed)
    x = ids(seed=seed)
    weights, visible, _, _ = attention_weights(model, x)
    plain, *_ = attention_weights(vanilla, x)  # same Llama weights: layer 0 sees the same input
    tau = model.model.layers[0].self_attn.tau.detach().double()
    n = torch.arange(1, 17, dtype=torch.float64)[None, None, :, None]
    expected = (plain[0].double() - tau.abs()[None, :, None, None] / n) * visible
    torch.testing.assert_close(weights[0].double(), expected, rtol=1e-5, atol=1e-6)
    assert (weights[0][visible.expand_as(weights[0])] < 0).any()  # no ReLU: negative weights survive
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    assert all(layer.self_attn.tau.grad.abs().sum() > 0 for layer in model.model.layers)


def test_scale075_multiplies_the_attention_output_by_075():
    x = ids()
    base_seen, _ = o_proj_outputs(replicate.build_model("vanilla", tiny_args()), x)
    seen, _ = o_proj_outputs(replicate.build_model("scale0.75", tiny_args()), x)
    torch.testing.assert_close(seen[0][1], 0.75 * base_seen[0][1])


def test_loggain_is_exp_of_a_parameter_with_its_own_learning_rate():
    args = tiny_args(lr=2e-3, gain_lr=5e-2, weight_decay=0.1, gain_init=1.0)
    model = replicate.build_model("loggain", args)
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "head_gain") and torch.equal(attn.head_log_gain, torch.zeros(2))
    x = ids()
    raw, _ = o_proj_outputs(model, x)
    with torch.no_grad():
        attn.head_log_gain.copy_(torch.tensor([-1.0, 0.5]))
    expected = torch.cat([raw[0][0][..., :16] * math.exp(-1.0), raw[0][0][..., 16:] * math.exp(0.5)], dim=-1)
    torch.testing.assert_close(attn.o_proj(raw[0][0]), torch.nn.functional.linear(expected, attn.o_proj.weight))
    assert replicate.output_figures(model)["head_gain"][0] == pytest.approx([math.exp(-1.0), math.exp(0.5)])
    # the optimizer gives the log gains their own peak rate; Adam's first step moves each by about that rate
    opt = replicate.optimizer(model, args)
    (group,) = [g for g in opt.param_groups if "lr_scale" in g]
    assert group["lr_scale"] == pytest.approx(25.0) and group["weight_decay"] == 0.0
    assert {id(p) for p in group["params"]} == {id(layer.self_attn.head_log_gain) for layer in model.model.layers}
    before = attn.head_log_gain.detach().clone()
    for g in opt.param_groups:
        g["lr"] = 2e-3 * g.get("lr_scale", 1.0)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    moved = (attn.head_log_gain.detach() - before).abs()
    assert ((moved > 0.03) & (moved < 0.06)).all(), moved
    with pytest.raises(ValueError, match="gain-init"):
        replicate.build_model("loggain", tiny_args(gain_init=0.0))


def test_output_figures_are_the_o_proj_norms():
    model = replicate.build_model("gain", tiny_args())
    figures = replicate.output_figures(model)
    for layer, norm, heads in zip(model.model.layers, figures["o_proj_norm"], figures["o_proj_head_norm"]):
        weight = layer.self_attn.o_proj.weight.detach().double()
        assert norm == pytest.approx(weight.norm().item(), rel=1e-6)
        assert heads == pytest.approx([weight[:, :16].norm().item(), weight[:, 16:].norm().item()], rel=1e-6)
        assert (sum(h * h for h in heads)) ** 0.5 == pytest.approx(norm, rel=1e-6)
    assert figures["head_gain"] == [[1.0, 1.0], [1.0, 1.0]]
    assert "head_gain" not in replicate.output_figures(replicate.build_model("vanilla", tiny_args()))


def test_budget_grid_trains_the_same_bytes_at_every_length():
    budgets = {}
    for cell, extra in replicate.GRIDS["budget"]:
        args = replicate.parse_args(["--steps", "150", *extra])
        budgets[cell] = args.steps * args.batch_size * args.context
        if args.variants != ["vanilla"]:
            assert args.bias_window >= 4 * args.context  # the window covers the longest evaluation
    assert len(budgets) == 9 and set(budgets.values()) == {150 * 16 * 128}
    assert [c for c, _ in replicate.GRIDS["budget128"]] == ["ctx128-vanilla", "ctx128-lazy", "ctx128-norelu"]
    assert [c for c, _ in replicate.GRIDS["mechanism"]] == ["shift_only", "scale0.75", "loggain"]


def test_per_document_losses_add_up_to_the_pooled_perplexity():
    args = replicate.parse_args(["--context", "16", "--eval-span", "4", "--stats-factors", "1", "--stats-blocks",
                                 "2", "--hidden-size", "32", "--intermediate-size", "64", "--layers", "2",
                                 "--heads", "2"])
    model = replicate.build_model("lazy", args)
    documents = ["".join(chr(97 + (i * k) % 26) for i in range(70 + k)) for k in range(1, 4)]
    result = replicate.evaluate(model, documents, args)
    for factor in ("1x", "2x", "4x"):
        nll, tokens = result[f"doc_nll@{factor}"], result[f"doc_tokens@{factor}"]
        assert len(nll) == len(tokens) == 3
        assert math.exp(sum(nll) / sum(tokens)) == pytest.approx(result[f"ppl@{factor}"], rel=1e-12)
        for doc, doc_nll, doc_tokens in zip(documents, nll, tokens):  # each document scored on its own
            scored = replicate.perplexity(model, torch.tensor(replicate.byte_tokens(doc)[:64]),
                                          context=16 * int(factor[0]))
            assert doc_nll == pytest.approx(scored["nll"] * scored["tokens"]) and doc_tokens == scored["tokens"]


def test_tauinit_grid_is_the_sweeps_tau_cells():
    assert [c for c, _ in replicate.GRIDS["tauinit"]] == ["tau0-lazy", "tau-0.25-lazy", "tau-0.5-lazy"]
    assert [c for c, _ in replicate.GRIDS["long"]] == ["long-vanilla", "long-lazy"]
    assert replicate.parse_args(["--steps", "150", *replicate.GRIDS["long"][1][1]]).steps == 1050
    args = replicate.parse_args(["--steps", "150", *replicate.GRIDS["tauinit"][1][1]])
    assert args.variants == ["lazy"] and args.tau_init == -0.25 and args.steps == 150


def test_loggain_with_a_non_positive_init_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        replicate.parse_args(["--variants", "loggain", "--gain-init", "0"])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err  # one line
    assert "--gain-init must be > 0 for `loggain` (its gain is exp(g), g = log of it); got 0.0" in err
