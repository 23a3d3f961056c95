"""lazy_tools.study_summary pools a grid correctly (synthetic results, no training) and
lazy_tools.lazify_controls' arms train exactly the parameters they name (a tiny LazyLlama)."""

import json

import pytest

from lazy_tools import lazify_controls, study_summary
from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM


def write_run(folder, cell, seed, ppl1, sparsity=0.0, finished=True):
    out = folder / cell / f"seed{seed}"
    out.mkdir(parents=True)
    run = {"losses": [3.0] * 19 + [2.0], "train_seconds": 1.0,
           "eval": {"ppl@1x": ppl1, "ppl@2x": ppl1 + 1, "ppl@4x": ppl1 + 2,
                    "attention": {"mean": {"sparsity": sparsity, "surviving_mass": 1 - sparsity}}},
           "init_attention": {"mean": {"sparsity": 0.5}}}
    data = {"config": {"steps": 20}, "code": {"commit": "abc", "dirty": False}, "command": "x", "runs": {cell: run}}
    if finished:
        data["finished"] = "now"
    (out / "results.json").write_text(json.dumps(data))


def test_summary_means_stds_and_paired_shares(tmp_path):
    for seed, (v, lz, c) in enumerate([(10.0, 8.0, 9.0), (12.0, 9.0, 12.0)]):
        write_run(tmp_path, "vanilla", seed, v)
        write_run(tmp_path, "lazy", seed, lz, sparsity=0.7)
        write_run(tmp_path, "control", seed, c)
    write_run(tmp_path, "control", 2, 1.0, finished=False)  # unfinished runs are ignored
    summary = study_summary.main([str(tmp_path)])
    assert summary["control"]["seeds"] == [0, 1]
    assert summary["vanilla"]["figures"]["ppl@1x"]["mean"] == pytest.approx(11.0)
    assert summary["vanilla"]["figures"]["ppl@1x"]["std"] == pytest.approx(2 ** 0.5)
    assert summary["lazy"]["paired"]["d_ppl@1x"]["values"] == pytest.approx([-0.2, -0.25])
    # control recovers half of lazy's gain on seed 0 ((10 - 9) / (10 - 8)) and none on seed 1
    assert summary["control"]["paired"]["share_of_lazy_gain@1x"]["values"] == pytest.approx([0.5, 0.0])
    assert summary["control"]["figures"]["train_loss_tail"]["mean"] == pytest.approx(2.0)
    assert summary["lazy"]["figures"]["init_sparsity"]["mean"] == 0.5
    assert "| control | 0,1 |" in (tmp_path / "summary.md").read_text()


def test_bias_tail_counts_entries_beyond_the_threshold(tmp_path):
    bias = [[[0.0] * 10 + [0.06, -0.2, 0.01]]]  # one layer, one head, 13 distances
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"runs": {"lazy": {"learned": {"distance_bias": bias}}, "vanilla": {"learned": {}}}}))
    report = study_summary.bias_tail(path, 10, 13)
    assert report == {"lazy": {"distances": [10, 12], "entries": 3, "beyond_threshold": 2, "threshold": 0.05,
                               "positive_beyond": 1, "min": -0.2, "max": 0.06}}


@pytest.mark.parametrize("arm, expected", [
    ("lazy_only", {"self_attn.tau", "self_attn.distance_bias"}), ("bias_only", {"self_attn.distance_bias"}),
    ("tau_only", {"self_attn.tau"}),
    ("vanilla_norms", {"input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight"}),
    ("lazy_norms", {"self_attn.tau", "self_attn.distance_bias", "input_layernorm.weight",
                    "post_attention_layernorm.weight", "model.norm.weight"}),
])
def test_lazify_arms_train_what_they_name(arm, expected):
    config = LazyLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, lazy_bias_window=16)
    model = LazyLlamaForCausalLM(config)
    params = lazify_controls.trainable(model, arm)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    # "model.layers.3.self_attn.tau" -> "self_attn.tau"; names outside the layers stay whole
    assert {n.split(".layers.")[-1].split(".", 1)[-1] if ".layers." in n else n for n in names} == expected
    assert sum(p.numel() for p in params) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError):
        lazify_controls.trainable(model, "everything")


def _evaluation(ppl, pooled, row_mean=None):
    return {"perplexity": ppl, "tokens": 1000, "attention": {"sparsity": pooled if row_mean is None else row_mean,
                                                           "sparsity_pooled": pooled, "removed_mass": pooled / 2,
                                                           "sink_share": 0.1}}


def test_lazify_summary_deltas_against_converted_and_best_control_and_pareto(tmp_path):
    results = {
        "config": {"eval_tokens": 20, "eval_context": 512, "stats_tokens": 8, "stats_docs": 1, "steps": 3,
                   "batch_size": 2, "block_size": 16, "seed": 0},
        "code": "abc", "command": "python -m lazy_tools.lazify_controls", "torch": "x",
        "tau_sweep": {"0": {"tau": 0.0, **_evaluation(40.0, 0.0)},
                      "-0.1": {"tau": -0.1, **_evaluation(44.0, 0.6)}},
        "arms": {arm: {"eval": _evaluation(ppl, pooled), "trained_parameters": 7, "losses": [1.0] * 3}
                 for arm, ppl, pooled in (("lazy_only", 37.0, 0.5), ("bias_only", 38.0, 0.0),
                                          ("vanilla_norms", 39.0, 0.0), ("tau_only", 45.0, 0.55))},
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    rows = {row["name"]: row for row in lazify_controls.summary_points(results)}
    assert rows["lazy_only"]["d_converted"] == pytest.approx(37 / 40 - 1)
    assert rows["lazy_only"]["d_best_control"] == pytest.approx(37 / 38 - 1)  # bias_only is the better control
    assert rows["no training, tau = -0.1"]["d_best_control"] == pytest.approx(44 / 38 - 1)
    # lazy_only (0.5, 37) beats bias_only, vanilla_norms and tau = 0; tau_only (0.55, 45) is beaten by tau -0.1
    assert {name for name, row in rows.items() if row["pareto"]} == {"lazy_only", "no training, tau = -0.1"}
    text = lazify_controls.write_summary(tmp_path)
    assert "| lazy_only | 7 | 37.000 | -7.50% | -2.63% |" in text
    assert (tmp_path / "pareto.png").stat().st_size > 0


def test_lazify_finetune_moves_only_the_arms_parameters_each_at_its_rate(rng_seed):
    import argparse

    import torch

    torch.manual_seed(rng_seed)
    config = LazyLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, lazy_bias_window=16)
    model = LazyLlamaForCausalLM(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = argparse.Namespace(steps=2, batch_size=2, warmup=1, seed=rng_seed, lazy_lr=1e-2, norm_lr=1e-3)
    blocks = (torch.randint(0, 64, (6, 12)), torch.arange(12).expand(6, 12).contiguous())
    run = lazify_controls.finetune(model, "lazy_norms", blocks, args, log=lambda message: None)
    assert run["lr"] == [1e-2, 1e-3] and len(run["losses"]) == 2
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {n for n in before if n.endswith(("tau", "distance_bias", "norm.weight"))}
    # Adam's first steps move each parameter by about its own learning rate
    tau_step = max((p - before[n]).abs().max().item() for n, p in model.named_parameters() if n.endswith("tau"))
    norm_step = max((p - before[n]).abs().max().item() for n, p in model.named_parameters()
                    if n.endswith("norm.weight"))
    assert 5e-3 < tau_step <= 2.1e-2 and 5e-4 < norm_step <= 2.1e-3
