"""lazy_llama_tools.study_summary pools a grid correctly (synthetic results, no training) and
lazy_llama_tools.lazify_controls' arms train exactly the parameters they name (a tiny LazyLlama)."""

import json
import math
import random
import statistics

import pytest
import torch

from lazy_llama_tools import lazify_controls, study_summary
from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM


def write_run(folder, cell, seed, ppl1, sparsity=0.0, finished=True, docs=None):
    """A finished run's results.json; `docs`: per factor, (summed nats, scored bytes) per document, from which the
    perplexities are then computed."""
    out = folder / cell / f"seed{seed}"
    out.mkdir(parents=True)
    ev = {"ppl@1x": ppl1, "ppl@2x": ppl1 + 1, "ppl@4x": ppl1 + 2,
          "attention": {"mean": {"sparsity": sparsity, "surviving_mass": 1 - sparsity}}}
    for factor, (nll, tokens) in (docs or {}).items():
        ev[f"doc_nll@{factor}"], ev[f"doc_tokens@{factor}"] = nll, tokens
        ev[f"ppl@{factor}"] = math.exp(sum(nll) / sum(tokens))
    run = {"losses": [3.0] * 19 + [2.0], "train_seconds": 1.0, "eval": ev,
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


def test_left_out_runs_and_unknown_cells_are_named(tmp_path, capsys):
    """A summary with fewer seeds than the grid ran says which runs it left out (unfinished), and a --reference or
    --lazy that names no cell says so (its paired columns are empty) instead of leaving the reader to guess."""
    for seed in (0, 1):
        write_run(tmp_path, "vanilla", seed, 10.0 + seed)
        write_run(tmp_path, "lazy", seed, 8.0 + seed)
    write_run(tmp_path, "lazy", 2, 1.0, finished=False)
    study_summary.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert "left out 1 unfinished run(s): lazy/seed2" in err and "no cell named" not in err, err
    summary = study_summary.main([str(tmp_path), "--reference", "vanila"])
    err = capsys.readouterr().err
    assert "no cell named vanila (--reference)" in err and "cells: lazy, vanilla" in err, err
    assert "d_ppl@1x" not in summary["lazy"]["paired"]
    study_summary.main([str(tmp_path), "--by-prefix"])  # cells without a prefix pair: named as the prefix asks
    assert "no cell named lazy-vanilla/vanilla-vanilla (--reference)" in capsys.readouterr().err


def test_values_that_round_to_zero_print_without_a_minus_sign():
    assert study_summary.fmt({"mean": -0.0004, "n": 2, "ci95": [-0.0001, 0.3]}) == "0.000 [0.000, 0.300] (n=2)"
    assert study_summary.fmt({"mean": -4e-5, "n": 2, "ci95": [-0.0001, 0.3]}, test=True) == \
        "+0.000 [+0.000, +0.300] (n=2) not resolved"
    assert study_summary.fmt({"mean": -0.0006, "n": 1}) == "-0.001 (n=1) no interval"


def test_a_nan_figure_stays_nan_in_the_summary(tmp_path):
    """A figure with nothing to average is NaN in a run's results (e.g. the sink share of a cell whose rows all sum
    to 0); pooling it over seeds gives NaN without an interval, and the summary is written, not a traceback."""
    for seed in (0, 1):
        write_run(tmp_path, "vanilla", seed, 10.0 + seed, sparsity=float("nan"))
        write_run(tmp_path, "lazy", seed, 8.0 + seed, sparsity=0.7)
    summary = study_summary.main([str(tmp_path)])
    sparsity = summary["vanilla"]["figures"]["sparsity"]
    assert math.isnan(sparsity["mean"]) and math.isnan(sparsity["std"]) and sparsity["ci95"] is None

    def refuse(constant):
        raise ValueError(f"summary.json holds {constant}, which strict JSON parsers refuse")

    written = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)  # null, not NaN
    assert written["vanilla"]["figures"]["sparsity"]["mean"] is None
    assert written["lazy"]["figures"]["sparsity"]["mean"] == pytest.approx(0.7)
    assert "| nan" in (tmp_path / "summary.md").read_text()  # the table still says what the figure is
    assert summary["lazy"]["figures"]["sparsity"]["mean"] == pytest.approx(0.7)
    assert "nan" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("content, message", [
    ('{"runs": {', "cannot be read"), ("", "cannot be read"), ("[1, 2]", "holds a JSON list"),
    ('{"finished": "now"}', "is not the results of one finished grid cell"),
    ('{"finished": "now", "runs": {"a": {}, "b": {}}}', "it holds 2 runs, a grid cell one"),
])
def test_a_bad_results_file_is_named_in_one_line(tmp_path, content, message):
    write_run(tmp_path, "vanilla", 0, 10.0)
    bad = tmp_path / "lazy" / "seed0"
    bad.mkdir(parents=True)
    (bad / "results.json").write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        study_summary.main([str(tmp_path)])
    text = str(exit_info.value.code)
    assert text.startswith("study_summary: error: ") and message in text and "lazy/seed0" in text, text
    assert "\n" not in text


def test_a_folder_that_is_no_seed_is_left_out(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path, "vanilla", seed, 10.0 + seed)
    (tmp_path / "vanilla" / "seed1").rename(tmp_path / "vanilla" / "seed1-old")
    assert study_summary.main([str(tmp_path)])["vanilla"]["seeds"] == [0]


def test_bias_tail_counts_entries_beyond_the_threshold(tmp_path):
    bias = [[[0.0] * 10 + [0.06, -0.2, 0.01]]]  # one layer, one head, 13 distances
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"runs": {"lazy": {"learned": {"distance_bias": bias}}, "vanilla": {"learned": {}}}}))
    report = study_summary.bias_tail(path, 10, 13)
    assert report == {"lazy": {"distances": [10, 12], "entries": 3, "beyond_threshold": 2, "threshold": 0.05,
                               "positive_beyond": 1, "min": -0.2, "max": 0.06}}
    with pytest.raises(SystemExit) as exit_info:  # beyond the window: said, not a traceback
        study_summary.bias_tail(path, 20, 30)
    assert "bias window holds distances 0..12" in str(exit_info.value.code)
    with pytest.raises(SystemExit) as exit_info:
        study_summary.main([str(path), "--bias-tail", "5", "0"])
    assert exit_info.value.code == 2


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
        "code": "abc", "command": "python -m lazy_llama_tools.lazify_controls", "torch": "x",
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


def t_closed_form(p, df):
    """Student's t quantiles with closed forms: df 1 (Cauchy) and df 2."""
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    assert df == 2
    return (2 * p - 1) / math.sqrt(2 * p * (1 - p))


@pytest.mark.parametrize("p", [0.9, 0.975, 0.995])
def test_t_quantile_matches_closed_forms_and_the_normal_limit(p):
    for df in (1, 2):
        assert study_summary.t_quantile(p, df) == pytest.approx(t_closed_form(p, df), rel=1e-7)
    assert study_summary.t_quantile(p, 100_000) == pytest.approx(statistics.NormalDist().inv_cdf(p), rel=1e-4)
    # more degrees of freedom: thinner tails, smaller quantiles
    assert study_summary.t_quantile(p, 2) > study_summary.t_quantile(p, 3) > study_summary.t_quantile(p, 30)
    with pytest.raises(ValueError):
        study_summary.t_quantile(0.4, 2)


def test_t_interval_is_the_textbook_one_and_covers_95_percent():
    seed = random.randrange(2**31)
    print("seed", seed)
    rng = random.Random(seed)
    values = [rng.gauss(0, 1) for _ in range(3)]
    half = t_closed_form(0.975, 2) * statistics.stdev(values) / math.sqrt(3)
    assert study_summary.t_interval(values) == pytest.approx([statistics.fmean(values) - half,
                                                              statistics.fmean(values) + half])
    assert study_summary.t_interval([1.0]) is None
    trials = 4000
    covered = sum(lo <= 5.0 <= hi for lo, hi in
                  (study_summary.t_interval([rng.gauss(5.0, 2.0) for _ in range(3)]) for _ in range(trials)))
    assert abs(covered / trials - 0.95) < 0.015  # 3.5 binomial standard deviations
    # the normal quantile in place of t would cover far less with n = 3 (about 83%)
    assert study_summary.t_quantile(0.975, 2) > 2 * statistics.NormalDist().inv_cdf(0.975)


def test_bootstrap_interval_of_a_mean_approaches_the_normal_interval():
    seed = random.randrange(2**31)
    print("seed", seed)
    values = torch.randn(400, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3 + 1
    low, high = study_summary.bootstrap_interval(lambda i: values[i].mean(-1), 400, seed=seed)
    half = 1.959964 * values.std().item() / math.sqrt(400)
    assert low == pytest.approx(values.mean().item() - half, abs=0.1 * half)
    assert high == pytest.approx(values.mean().item() + half, abs=0.1 * half)


def test_pooled_ppl_and_paired_document_intervals():
    seed = random.randrange(2**31)
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(50, 200, (30,), generator=gen).double()
    nll = tokens * (2 + torch.rand(30, generator=gen, dtype=torch.float64))
    index = torch.randint(30, (5, 30), generator=gen)
    expected = [math.exp(sum(nll[j].item() for j in row) / sum(tokens[j].item() for j in row)) for row in index]
    assert study_summary.pooled_ppl(nll, tokens, index).tolist() == pytest.approx(expected, rel=1e-12)
    record = {"docs": {"1x": (nll.tolist(), tokens.tolist()), "4x": ((nll * 1.1).tolist(), tokens.tolist())}}
    other = {"docs": {"1x": ((nll * 0.9).tolist(), tokens.tolist()), "4x": ((nll * 0.9).tolist(), tokens.tolist())}}
    # same run, same documents: the difference is exactly 0 in every resample
    assert study_summary.eval_interval_ratio(record, record, "1x") == [0.0, 0.0]
    # the 1x -> 4x rise: every document's loss x1.1, so the pooled ppl@4x / ppl@1x lies within [e^0.2, e^0.3] - 1
    low, high = study_summary.eval_interval_ratio(record, record, "4x", ref_factor="1x")
    mean_nll = (nll.sum() / tokens.sum()).item()
    assert low <= math.exp(0.1 * mean_nll) - 1 <= high and high - low < 0.05
    # the extra rise over a run that does not rise is the rise itself
    extra = study_summary.eval_interval_ratio(record, other, "4x", cell_factor_base="1x")
    assert extra == pytest.approx([low, high], abs=0.02)
    assert study_summary.eval_interval_ratio(record, {"docs": {}}, "1x") is None


def test_summary_intervals_verdicts_and_single_seed_document_intervals(tmp_path):
    seed = random.randrange(2**31)
    print("seed", seed)
    rng = random.Random(seed)
    for s in range(3):
        v = 10 + rng.random()
        write_run(tmp_path, "vanilla", s, v)
        write_run(tmp_path, "lazy", s, v * 0.8)  # -20% on every seed: resolved
        write_run(tmp_path, "noise", s, v * (1 + (-0.01, 0.0, 0.012)[s]))  # straddles 0: not resolved
    summary = study_summary.main([str(tmp_path)])
    d = summary["lazy"]["paired"]["d_ppl@1x"]
    assert d["ci95"] == pytest.approx([-0.2, -0.2]) and d["resolved"] is True
    noise = summary["noise"]["paired"]["d_ppl@1x"]
    half = t_closed_form(0.975, 2) * statistics.stdev([-0.01, 0.0, 0.012]) / math.sqrt(3)
    assert noise["ci95"] == pytest.approx([0.002 / 3 - half, 0.002 / 3 + half]) and noise["resolved"] is False
    table = (tmp_path / "summary.md").read_text()
    assert "not resolved" in table.split("| noise |")[1].split("\n")[0]
    assert "not resolved" not in table.split("| lazy |")[1].split("\n")[0]


def test_single_seed_cells_get_a_document_interval_or_say_there_is_none(tmp_path):
    seed = random.randrange(2**31)
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(100, 300, (25,), generator=gen).double()

    def docs(level):
        nll = tokens * (level + 0.3 * torch.rand(25, generator=gen, dtype=torch.float64))
        return {"1x": (nll.tolist(), tokens.tolist()), "2x": ((nll * 1.02).tolist(), tokens.tolist()),
                "4x": ((nll * 1.05).tolist(), tokens.tolist())}

    write_run(tmp_path, "vanilla", 0, 0.0, docs=docs(2.3))
    write_run(tmp_path, "lazy", 0, 0.0, docs=docs(2.1))
    write_run(tmp_path, "old", 0, 9.0)  # no per-document losses
    summary = study_summary.main([str(tmp_path)])
    lazy = summary["lazy"]
    interval = lazy["paired"]["d_ppl@1x"]["eval_ci95"]
    assert lazy["paired"]["d_ppl@1x"]["ci95"] is None and interval[0] < lazy["paired"]["d_ppl@1x"]["mean"] < interval[1]
    assert lazy["paired"]["d_ppl@1x"]["resolved"] is True  # 0.2 nats per byte apart: far outside document noise
    ppl = lazy["figures"]["ppl@1x"]
    assert ppl["eval_ci95"][0] < ppl["mean"] < ppl["eval_ci95"][1]
    assert "eval_ci95" in lazy["figures"]["rise@4x"] and "eval_ci95" in lazy["paired"]["d_rise@4x"]
    old = summary["old"]
    assert old["paired"]["d_ppl@1x"].get("eval_ci95") is None and old["paired"]["d_ppl@1x"]["resolved"] is None
    table = (tmp_path / "summary.md").read_text()
    assert "(n=1) no interval" in table.split("| old |")[1].split("\n")[0]
    assert "(n=1, eval)" in table.split("| lazy |")[1].split("\n")[0]


def test_by_prefix_pairs_each_length_with_its_own_reference(tmp_path):
    for ctx, v in ((64, 11.0), (128, 10.0)):
        write_run(tmp_path, f"ctx{ctx}-vanilla", 0, v)
        write_run(tmp_path, f"ctx{ctx}-lazy", 0, v * 0.9)
        write_run(tmp_path, f"ctx{ctx}-norelu", 0, v * 0.85)
    summary = study_summary.main([str(tmp_path), "--by-prefix"])
    for ctx in (64, 128):
        assert summary[f"ctx{ctx}-lazy"]["paired"]["d_ppl@1x"]["mean"] == pytest.approx(-0.1)
        assert summary[f"ctx{ctx}-norelu"]["paired"]["share_of_lazy_gain@1x"]["mean"] == pytest.approx(1.5)
        assert summary[f"ctx{ctx}-norelu"]["paired"]["d_ppl_vs_lazy@1x"]["mean"] == pytest.approx(0.85 / 0.9 - 1)


def test_attention_figures_are_paired_by_seed(tmp_path):
    for s, (v, lz) in enumerate([(0.2, 0.5), (0.4, 0.6), (0.3, 0.7)]):
        write_run(tmp_path, "vanilla", s, 10.0, sparsity=v)
        write_run(tmp_path, "lazy", s, 9.0, sparsity=lz)
    for s in range(3):  # put a sink share into every run: lazy's is 0.01 above vanilla's on every seed
        for cell, extra in (("vanilla", 0.0), ("lazy", 0.01)):
            path = tmp_path / cell / f"seed{s}" / "results.json"
            data = json.loads(path.read_text())
            data["runs"][cell]["eval"]["attention"]["mean"]["sink_share"] = 0.02 * s + extra
            path.write_text(json.dumps(data))
    summary = study_summary.main([str(tmp_path)])
    d = summary["lazy"]["paired"]["d_sink_share"]
    assert d["values"] == pytest.approx([0.01] * 3) and d["ci95"] == pytest.approx([0.01, 0.01])


def test_a_missing_or_empty_grid_is_one_line_and_writes_nothing(tmp_path):
    for folder, message in ((tmp_path / "nowhere", "no such folder"), (tmp_path, "holds no finished run")):
        with pytest.raises(SystemExit) as exit_info:
            study_summary.main([str(folder)])
        text = str(exit_info.value.code)
        assert text.startswith("study_summary: error:") and message in text and "\n" not in text, text
    write_run(tmp_path, "lazy", 0, 10.0, finished=False)  # an unfinished run is not a result either
    with pytest.raises(SystemExit, match="holds no finished run"):
        study_summary.main([str(tmp_path)])
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "summary.md").exists()
    with pytest.raises(SystemExit, match="no such results.json file"):
        study_summary.main([str(tmp_path / "results.json"), "--bias-tail", "0", "4"])


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read"), ("{", "cannot be read"), ("{}", "is not this study's results"),
])
def test_lazify_summary_of_a_missing_or_bad_results_file_is_one_line(tmp_path, content, message):
    if content is not None:
        (tmp_path / "results.json").write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        lazify_controls.main(["--summary-only", "--out", str(tmp_path)])
    text = str(exit_info.value.code)
    assert text.startswith("lazify_controls: error: ") and message in text and "\n" not in text, text


@pytest.mark.parametrize("arguments, message", [
    (["--steps", "-1"], "argument --steps: must be at least 1"), (["--eval-context", "0"], "must be at least 1"),
    (["--tau-sweep", "nan"], "must be a finite number"), (["--out", "README.md"], "is a file: give a folder"),
])
def test_lazify_bad_arguments_are_refused_before_the_model_loads(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lazify_controls.parse_args(arguments)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
