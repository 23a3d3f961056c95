"""Pool a study grid (`python -m lazy_llama_tools.replicate --grid ...`) into tables of means with 95% intervals and
paired differences.

    python -m lazy_llama_tools.study_summary docs/replication/controls --reference vanilla --lazy lazy

Reads `DIR/CELL/seedS/results.json` (finished runs only), writes `DIR/summary.json` (strict JSON: a NaN or infinite
figure is null there, nan / inf in the tables) and `DIR/summary.md`.
Per cell and seed: perplexity (per byte) at 1x/2x/4x, the mean training loss over the last 5% of steps, and the
attention figures at the training length after training and at step 0. Paired differences use the same seed
(same init, same data order): `d ppl = ppl_cell / ppl_reference - 1`, the share of lazy's gain a control
recovers, `(ppl_reference - ppl_cell) / (ppl_reference - ppl_lazy)`, and `d rise = rise_cell - rise_reference`
(how much more the perplexity grows from 1x to 2x/4x).

Intervals (95%): over seeds, `mean +- t(0.975, n-1) * std / sqrt(n)` (`t_interval`); a difference whose interval
contains 0 is "not resolved". A single seed has no seed interval; where its `results.json` holds per-document
losses (`doc_nll@Fx`, `doc_tokens@Fx`), it gets an *evaluation* interval instead: a bootstrap over the held-out
documents (`bootstrap_interval`), paired when two runs are compared (the same resampled documents for both). It
says how much the number depends on which documents were scored, not how much it depends on the seed.
"""

import argparse
import functools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from lazy_llama_tools.cli import one_line_errors
from lazy_llama_tools.folders import write_text_whole
from lazy_llama_tools.loading import one_line, read_json_object

PAIRED_FIGURES = ("sink", "sink_share", "sink@4x", "sink_share@4x")  # differences `cell - reference`, same seed
FIGURES = ("sparsity", "sparsity_pooled", "surviving_mass", "removed_mass", "sink", "sink_share", "tile_density")


CONFIDENCE = 0.95
BOOTSTRAP_SAMPLES = 10_000


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (p in (0.5, 1)): bisection on the CDF, the
    density integrated with Simpson's rule (the density is smooth; 4,096 intervals give about 1e-10)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x):
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))

    def upper_half_mass(x, intervals=4096):  # P(0 < T < x)
        h = x / intervals
        inner = sum((4 if k % 2 else 2) * density(k * h) for k in range(1, intervals))
        return h / 3 * (density(0.0) + inner + density(x))

    low, high = 0.0, 1.0
    while upper_half_mass(high) < p - 0.5:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if upper_half_mass(mid) < p - 0.5 else (low, mid)
    return (low + high) / 2


def t_interval(values: list[float], confidence: float = CONFIDENCE) -> list[float] | None:
    """`[low, high]` of the mean of `values` (independent draws, e.g. one per seed), t with n-1 degrees of freedom;
    None for fewer than two values."""
    if len(values) < 2 or not all(math.isfinite(value) for value in values):
        return None
    half = t_quantile(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    mean = statistics.fmean(values)
    return [mean - half, mean + half]


def bootstrap_interval(statistic, documents: int, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0,
                       confidence: float = CONFIDENCE) -> list[float]:
    """Percentile interval of `statistic(index)` over `samples` resamples of `documents` documents with
    replacement. `statistic` gets a `[samples, documents]` int64 index tensor and returns `[samples]` values."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(documents, (samples, documents), generator=generator)
    values = statistic(index).double()
    tail = (1 - confidence) / 2
    low, high = torch.quantile(values, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return [low, high]


def pooled_ppl(nll: torch.Tensor, tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Perplexity of each resample: `exp(sum nll / sum tokens)` over the resampled documents."""
    return torch.exp(nll[index].sum(-1) / tokens[index].sum(-1))


def document_losses(record: dict, factor: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    docs = record.get("docs", {}).get(factor)
    if docs is None:
        return None
    return torch.tensor(docs[0], dtype=torch.float64), torch.tensor(docs[1], dtype=torch.float64)


def eval_interval_ratio(cell: dict, reference: dict, factor: str, ref_factor: str | None = None,
                        cell_factor_base: str | None = None) -> list[float] | None:
    """Paired bootstrap over documents of `ppl_cell@factor / ppl_reference@ref_factor - 1` (the same documents
    for both; same-run comparisons such as the 1x -> 4x rise pass the same record twice). With
    `cell_factor_base`, the statistic is the difference of two such ratios: `(cell@factor / cell@base) -
    (reference@ref_factor / reference@base)`, the extra rise of the cell over the reference. None when a run
    lacks per-document losses or the two scored different document lists."""
    ref_factor = ref_factor or factor
    a, b = document_losses(cell, factor), document_losses(reference, ref_factor)
    if a is None or b is None or a[0].numel() != b[0].numel():
        return None
    if cell_factor_base is None:
        return bootstrap_interval(lambda i: pooled_ppl(*a, i) / pooled_ppl(*b, i) - 1, a[0].numel())
    a0, b0 = document_losses(cell, cell_factor_base), document_losses(reference, cell_factor_base)
    if a0 is None or b0 is None or a0[0].numel() != a[0].numel():
        return None
    return bootstrap_interval(lambda i: (pooled_ppl(*a, i) / pooled_ppl(*a0, i))
                              - (pooled_ppl(*b, i) / pooled_ppl(*b0, i)), a[0].numel())


def load_grid(folder: Path) -> dict:
    """`{cell: {seed: record}}` of every finished run under `folder`; one line on stderr names the runs left out
    because they have not finished (a table with fewer seeds than the grid ran says why)."""
    cells, unfinished = {}, []
    for path in sorted(folder.glob("*/seed*/results.json")):
        seed = path.parent.name.removeprefix("seed")
        if not seed.lstrip("-").isdigit():  # e.g. a `seed0-old` copy: not a seed of the grid
            continue
        data = read_json_object(path, "study_summary", ": delete it to rerun that cell (the grid's own command "
                                "reruns unfinished cells)")
        if not data.get("finished"):
            unfinished.append(f"{path.parent.parent.name}/{path.parent.name}")
            continue
        try:
            cells.setdefault(path.parent.parent.name, {})[int(seed)] = grid_record(data)
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as error:
            raise SystemExit(f"study_summary: error: {path} is not the results of one finished grid cell "
                             f"({one_line(error, 200)}): move it away or rerun that cell") from None
    if unfinished:
        print(f"study_summary: left out {len(unfinished)} unfinished run(s): {', '.join(unfinished)} (the grid's "
              "own command finishes them)", file=sys.stderr)
    return cells


def grid_record(data: dict) -> dict:
    """The figures of one grid cell's finished run (its results.json holds exactly one run)."""
    if len(data["runs"]) != 1:
        raise ValueError(f"it holds {len(data['runs'])} runs, a grid cell one")
    (run,) = data["runs"].values()
    ev = run["eval"]
    tail = run["losses"][-max(1, len(run["losses"]) // 20):]
    record = {
        "commit": data.get("code", {}).get("commit"), "dirty": data.get("code", {}).get("dirty"),
        "command": data.get("command"), "steps": data["config"]["steps"],
        "train_loss_tail": sum(tail) / len(tail), "train_seconds": run["train_seconds"],
    }
    for key, value in ev.items():
        if key.startswith(("ppl@", "sliding_ppl@")):
            record[key] = value
    record["docs"] = {key.removeprefix("doc_nll@"): (ev[key], ev[key.replace("nll", "tokens")])
                      for key in ev if key.startswith("doc_nll@")}
    for factor in ("2x", "4x"):  # how much worse the same text gets with longer windows
        if f"ppl@{factor}" in ev:
            record[f"rise@{factor}"] = ev[f"ppl@{factor}"] / ev["ppl@1x"] - 1
    for factor_key in [k for k in ev if k.startswith("attention")]:
        suffix = factor_key.removeprefix("attention")
        for fig in FIGURES:
            if fig in ev[factor_key]["mean"]:
                record[fig + suffix] = ev[factor_key]["mean"][fig]
    for fig in FIGURES:
        if fig in run.get("init_attention", {}).get("mean", {}):
            record["init_" + fig] = run["init_attention"]["mean"][fig]
    taus = [t for layer in run.get("learned", {}).get("tau", []) for t in layer]
    if taus:
        record["tau_mean"] = sum(taus) / len(taus)
    gains = [g for layer in run.get("output", {}).get("head_gain", []) for g in layer]
    if gains:
        record["head_gain_mean"] = sum(gains) / len(gains)
        record["head_gain_min"], record["head_gain_max"] = min(gains), max(gains)
    for when, key in (("init_", "init_output"), ("", "output")):
        norms = run.get(key, {}).get("o_proj_norm")
        if norms:
            record[when + "o_proj_norm_mean"] = sum(norms) / len(norms)
    return record


def mean_std(values: list[float], eval_ci95: list[float] | None = None) -> dict:
    """Mean, sample std and the 95% t interval over seeds (`ci95`); `eval_ci95`: the evaluation interval of a
    single seed (bootstrap over documents), kept apart because it measures something else."""
    finite = all(math.isfinite(value) for value in values)  # a NaN figure (nothing to average) stays NaN
    std = (statistics.stdev(values) if finite else math.nan) if len(values) > 1 else None
    out = {"mean": statistics.fmean(values), "std": std, "n": len(values), "values": values,
           "ci95": t_interval(values)}
    if eval_ci95 is not None and len(values) == 1:
        out["eval_ci95"] = eval_ci95
    return out


def resolved(stat: dict | None) -> bool | None:
    """Whether a difference's interval (over seeds, else over documents) excludes 0; None without one."""
    interval = (stat or {}).get("ci95") or (stat or {}).get("eval_ci95")
    if interval is None:
        return None
    return not interval[0] <= 0 <= interval[1]


def summarise(cells: dict, reference: str, lazy: str, by_prefix: bool = False) -> dict:
    """Per cell: figures over seeds and paired differences against `reference` and `lazy`. With `by_prefix`, a
    cell `P-NAME` is paired with `P-{reference}` and `P-{lazy}` (e.g. each training length with its own vanilla)."""
    out = {}
    base_reference, base_lazy = reference, lazy
    for cell, seeds in cells.items():
        if by_prefix:
            prefix = cell.split("-", 1)[0]
            reference, lazy = f"{prefix}-{base_reference}", f"{prefix}-{base_lazy}"
        keys = sorted({k for record in seeds.values() for k, v in record.items() if isinstance(v, (int, float))
                       and not isinstance(v, bool)})
        figures = {k: mean_std([seeds[s][k] for s in sorted(seeds) if k in seeds[s]]) for k in keys}
        if len(seeds) == 1:  # a single seed's perplexities: an evaluation interval
            (only,) = seeds.values()
            for factor in ("1x", "2x", "4x"):
                losses = document_losses(only, factor)
                if losses is not None and f"ppl@{factor}" in figures:
                    figures[f"ppl@{factor}"]["eval_ci95"] = bootstrap_interval(
                        lambda i, losses=losses: pooled_ppl(*losses, i), losses[0].numel())
        for factor in ("2x", "4x"):  # a single seed's rise: an evaluation interval (same documents at 1x and Fx)
            rise = figures.get(f"rise@{factor}")
            if rise and rise["n"] == 1:
                (only,) = seeds.values()
                rise["eval_ci95"] = eval_interval_ratio(only, only, f"{factor}", ref_factor="1x")
        entry = {"seeds": sorted(seeds), "figures": figures}
        paired = {}
        for factor in ("1x", "2x", "4x"):
            key = f"ppl@{factor}"
            common = [s for s in sorted(seeds) if s in cells.get(reference, {})]
            if common and cell != reference:
                boot = eval_interval_ratio(seeds[common[0]], cells[reference][common[0]], factor) \
                    if len(common) == 1 else None
                paired[f"d_ppl@{factor}"] = mean_std([seeds[s][key] / cells[reference][s][key] - 1 for s in common],
                                                     boot)
                if factor != "1x" and all(f"rise@{factor}" in seeds[s] for s in common):
                    boot = eval_interval_ratio(seeds[common[0]], cells[reference][common[0]], factor,
                                               cell_factor_base="1x") if len(common) == 1 else None
                    paired[f"d_rise@{factor}"] = mean_std(
                        [seeds[s][f"rise@{factor}"] - cells[reference][s][f"rise@{factor}"] for s in common], boot)
            both = [s for s in common if s in cells.get(lazy, {})]
            gaps = {s: cells[reference][s][key] - cells[lazy][s][key] for s in both}
            if both and cell not in (reference, lazy) and all(abs(g) > 1e-9 for g in gaps.values()):
                paired[f"share_of_lazy_gain@{factor}"] = mean_std(
                    [(cells[reference][s][key] - seeds[s][key]) / gaps[s] for s in both])
            common_lazy = [s for s in sorted(seeds) if s in cells.get(lazy, {})]
            if common_lazy and cell != lazy:
                boot = eval_interval_ratio(seeds[common_lazy[0]], cells[lazy][common_lazy[0]], factor) \
                    if len(common_lazy) == 1 else None
                paired[f"d_ppl_vs_lazy@{factor}"] = mean_std(
                    [seeds[s][key] / cells[lazy][s][key] - 1 for s in common_lazy], boot)
        common = [s for s in sorted(seeds) if s in cells.get(reference, {})]
        for fig in PAIRED_FIGURES:  # attention figures against the reference, same seed
            both = [s for s in common if fig in seeds[s] and fig in cells[reference][s]]
            if both and cell != reference:
                paired[f"d_{fig}"] = mean_std([seeds[s][fig] - cells[reference][s][fig] for s in both])
        for stat in paired.values():
            stat["resolved"] = resolved(stat)
        entry["paired"] = paired
        entry["commits"] = sorted({str(r["commit"]) + ("+dirty" if r["dirty"] else "") for r in seeds.values()})
        out[cell] = entry
    return out


def fmt(stat: dict | None, scale: float = 1.0, digits: int = 3, percent: bool = False, test: bool = False) -> str:
    """`mean [low, high] (n=N)`: the 95% interval over seeds; for a single seed the evaluation interval marked
    `eval`, or `no interval`. With `test` (a difference), `not resolved` where the interval contains 0."""
    if not stat:
        return "-"
    unit = "%" if percent else ""
    mult = 100 if percent else scale
    sign = "+" if percent or test else ""
    def number(x: float) -> str:  # + 0.0 turns a -0.0 (what a small negative value rounds to) into 0.0
        return f"{round(x, digits) + 0.0:{sign}.{digits}f}"

    text = f"{number(stat['mean'] * mult)}{unit}"
    interval = stat.get("ci95") or stat.get("eval_ci95")
    if interval is not None:
        low, high = (x * mult for x in interval)
        text += f" [{number(low)}, {number(high)}]"
    text += f" (n={stat['n']}{', eval' if stat.get('ci95') is None and interval else ''})"
    if interval is None and stat["n"] == 1:
        text += " no interval"
    elif test and interval is not None and interval[0] <= 0 <= interval[1]:
        text += " not resolved"
    return text


def markdown(summary: dict, reference: str, lazy: str) -> str:
    lines = [(f"Mean [95% interval] (n = seeds): over seeds, t with n-1 degrees of freedom; `eval`: a single seed's "
              f"interval from a bootstrap over the evaluated documents (seed noise not included); `no interval`: a "
              f"single seed without per-document losses. `not resolved`: the difference's interval contains 0. "
              f"d ppl: paired (same seed) relative change vs `{reference}`; share: (ppl_{reference} - ppl_cell) / "
              f"(ppl_{reference} - ppl_{lazy}), same seed; rise: ppl@4x / ppl@1x - 1 (same text); d rise: the "
              f"cell's rise minus `{reference}`'s (same seed), in points."), ""]
    head = ("| cell | seeds | ppl @1x | ppl @4x | d ppl @1x | d ppl @4x | share of lazy gain @1x "
            "| d vs lazy @1x | d vs lazy @4x | rise @4x | d rise @4x |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for cell, entry in summary.items():
        f, p = entry["figures"], entry["paired"]
        lines.append(f"| {cell} | {','.join(map(str, entry['seeds']))} | {fmt(f.get('ppl@1x'))} "
                     f"| {fmt(f.get('ppl@4x'))} "
                     f"| {fmt(p.get('d_ppl@1x'), percent=True, digits=2, test=True)} "
                     f"| {fmt(p.get('d_ppl@4x'), percent=True, digits=2, test=True)} "
                     f"| {fmt(p.get('share_of_lazy_gain@1x'), digits=2, test=True)} "
                     f"| {fmt(p.get('d_ppl_vs_lazy@1x'), percent=True, digits=2, test=True)} "
                     f"| {fmt(p.get('d_ppl_vs_lazy@4x'), percent=True, digits=2, test=True)} "
                     f"| {fmt(f.get('rise@4x'), percent=True, digits=2, test=True)} "
                     f"| {fmt(p.get('d_rise@4x'), percent=True, digits=2, test=True)} |")
    gains = [c for c, e in summary.items() if "o_proj_norm_mean" in e["figures"]]
    if gains:
        lines += ["", "Attention output size: mean Frobenius norm of `o_proj.weight` over layers at step 0 and after "
                  "training; learned head gains (mean, min, max over layers and heads):", ""]
        head = "| cell | o_proj norm, step 0 | o_proj norm, trained | head gain mean | head gain min | head gain max |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for cell in gains:
            f = summary[cell]["figures"]
            lines.append(f"| {cell} | {fmt(f.get('init_o_proj_norm_mean'))} | {fmt(f.get('o_proj_norm_mean'))} "
                         f"| {fmt(f.get('head_gain_mean'))} | {fmt(f.get('head_gain_min'))} "
                         f"| {fmt(f.get('head_gain_max'))} |")
    lines += ["", "Attention at the training length (after training; step 0 in the last columns):", ""]
    head = ("| cell | sparsity (row mean) | sparsity (pooled) | surviving mass | removed mass | sink | sink share "
            "| step-0 sparsity | step-0 surviving mass | mean tau |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for cell, entry in summary.items():
        f = entry["figures"]
        lines.append(f"| {cell} | {fmt(f.get('sparsity'))} | {fmt(f.get('sparsity_pooled'))} "
                     f"| {fmt(f.get('surviving_mass'))} | {fmt(f.get('removed_mass'))} "
                     f"| {fmt(f.get('sink'), digits=4)} | {fmt(f.get('sink_share'), digits=4)} "
                     f"| {fmt(f.get('init_sparsity'))} "
                     f"| {fmt(f.get('init_surviving_mass'))} | {fmt(f.get('tau_mean'))} |")
    sinks = [c for c, e in summary.items() if "d_sink_share" in e["paired"]]
    if sinks:
        lines += ["", f"Sink against `{reference}` (cell minus reference, same seed):", ""]
        head = "| cell | d sink @1x | d sink share @1x | d sink @4x | d sink share @4x |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for cell in sinks:
            p = summary[cell]["paired"]
            lines.append("| " + cell + " | " + " | ".join(fmt(p.get(f"d_{fig}"), digits=4, test=True)
                                                          for fig in PAIRED_FIGURES) + " |")
    extra = [c for c, e in summary.items() if "sparsity@4x" in e["figures"]]
    if extra:
        lines += ["", "Attention at 2x / 4x the training length (fewer blocks):", ""]
        head = ("| cell | sparsity @2x | sparsity @4x | pooled @4x | surviving mass @2x | surviving mass @4x "
                "| sink share @4x |")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for cell in extra:
            f = summary[cell]["figures"]
            lines.append(f"| {cell} | {fmt(f.get('sparsity@2x'))} | {fmt(f.get('sparsity@4x'))} "
                         f"| {fmt(f.get('sparsity_pooled@4x'))} | {fmt(f.get('surviving_mass@2x'))} "
                         f"| {fmt(f.get('surviving_mass@4x'))} | {fmt(f.get('sink_share@4x'), digits=4)} |")
    sliding = [c for c, e in summary.items() if "sliding_ppl@1x" in e["figures"]]
    if sliding:
        lines += ["", "Sliding-window perplexity (windows every half window) next to non-overlapping windows:", ""]
        head = "| cell | ppl @1x | sliding @1x | ppl @2x | sliding @2x | ppl @4x | sliding @4x |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for cell in sliding:
            f = summary[cell]["figures"]
            cells_text = [fmt(f.get(f"{p}ppl@{x}")) for x in ("1x", "2x", "4x") for p in ("", "sliding_")]
            lines.append("| " + cell + " | " + " | ".join(cells_text) + " |")
    commits = sorted({c for e in summary.values() for c in e["commits"]})
    lines += ["", "Code: " + ", ".join(commits)]
    return "\n".join(lines) + "\n"


def strict_json(value):
    """`value` with every NaN or infinite float replaced by None, so that summary.json is JSON every parser reads
    (Python writes them as bare NaN / Infinity, which strict parsers refuse); the tables print them as nan / inf."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def bias_tail(results_file: Path, start: int, stop: int, threshold: float = 0.05) -> dict:
    """Per run of a `results.json`: how many learned distance-bias entries at distances `start..stop-1` (all
    layers and heads) exceed `threshold` in magnitude, and their extremes."""
    data = read_json_object(results_file, "study_summary")
    out = {}
    for name, run in data.get("runs", {}).items():
        bias = run.get("learned", {}).get("distance_bias")
        if not bias:
            continue
        values = [x for layer in bias for head in layer for x in head[start:stop]]
        if not values:
            raise SystemExit(f"study_summary: error: --bias-tail {start} {stop}: {name}'s bias window holds "
                             f"distances 0..{len(bias[0][0]) - 1}")
        out[name] = {"distances": [start, stop - 1], "entries": len(values),
                     "beyond_threshold": sum(abs(x) > threshold for x in values), "threshold": threshold,
                     "positive_beyond": sum(x > threshold for x in values), "min": min(values), "max": max(values)}
    return out


def main(argv=None) -> dict:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("folder", type=Path, help="a grid folder, or with --bias-tail a results.json")
    parser.add_argument("--bias-tail", type=int, nargs=2, metavar=("START", "STOP"), default=None,
                        help="report learned distance-bias entries at distances START..STOP-1 of a results.json")
    parser.add_argument("--reference", default="vanilla")
    parser.add_argument("--lazy", default="lazy")
    parser.add_argument("--by-prefix", action="store_true",
                        help="pair each cell PREFIX-NAME with PREFIX-REFERENCE and PREFIX-LAZY (e.g. ctx64-vanilla)")
    args = parser.parse_args(argv)
    if args.bias_tail:
        if not args.folder.is_file():
            raise SystemExit(f"study_summary: error: {args.folder}: no such results.json file")
        if not 0 <= args.bias_tail[0] < args.bias_tail[1]:
            parser.error(f"--bias-tail START STOP needs 0 <= START < STOP, got {args.bias_tail[0]} {args.bias_tail[1]}")
        report = bias_tail(args.folder, *args.bias_tail)
        print(json.dumps(report, indent=1))
        return report
    if not args.folder.is_dir():
        raise SystemExit(f"study_summary: error: {args.folder}: no such folder (give the --grid folder of "
                         "lazy_llama_tools.replicate)")
    cells = load_grid(args.folder)
    if not cells:
        raise SystemExit(f"study_summary: error: {args.folder} holds no finished run (CELL/seedS/results.json "
                         "with \"finished\": true): nothing to summarise")
    for role, name in (("--reference", args.reference), ("--lazy", args.lazy)):
        wanted = {f"{cell.split('-', 1)[0]}-{name}" for cell in cells} if args.by_prefix else {name}
        if not wanted & cells.keys():
            print(f"study_summary: no cell named {'/'.join(sorted(wanted))} ({role}): the columns paired with it stay "
                  f"empty (cells: {', '.join(sorted(cells))})", file=sys.stderr)
    summary = summarise(cells, args.reference, args.lazy, args.by_prefix)
    write_text_whole(args.folder / "summary.json", json.dumps(strict_json(summary), indent=1, allow_nan=False))
    table = markdown(summary, args.reference, args.lazy)
    if args.by_prefix:
        table = f"Cells are paired within their prefix (`P-{args.reference}`, `P-{args.lazy}`).\n\n" + table
    write_text_whole(args.folder / "summary.md", table)
    print(table)
    return summary


if __name__ == "__main__":
    main()
