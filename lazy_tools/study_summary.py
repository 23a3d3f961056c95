"""Pool a study grid (`python -m lazy_tools.replicate --grid ...`) into mean +- std tables and paired differences.

    python -m lazy_tools.study_summary docs/replication/controls --reference vanilla --lazy lazy

Reads `DIR/CELL/seedS/results.json` (finished runs only), writes `DIR/summary.json` and `DIR/summary.md`.
Per cell and seed: perplexity (per byte) at 1x/2x/4x, the mean training loss over the last 5% of steps, and the
attention figures at the training length after training and at step 0. Paired differences use the same seed
(same init, same data order): `d ppl = ppl_cell / ppl_reference - 1`, and the share of lazy's gain a control
recovers, `(ppl_reference - ppl_cell) / (ppl_reference - ppl_lazy)`.
"""

import argparse
import json
import statistics
from pathlib import Path

FIGURES = ("sparsity", "sparsity_pooled", "surviving_mass", "removed_mass", "sink", "sink_share", "tile_density")


def load_grid(folder: Path) -> dict:
    """`{cell: {seed: record}}` of every finished run under `folder`."""
    cells = {}
    for path in sorted(folder.glob("*/seed*/results.json")):
        data = json.loads(path.read_text())
        if not data.get("finished"):
            continue
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
        cells.setdefault(path.parent.parent.name, {})[int(path.parent.name.removeprefix("seed"))] = record
    return cells


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values), "values": values}


def summarise(cells: dict, reference: str, lazy: str) -> dict:
    out = {}
    for cell, seeds in cells.items():
        keys = sorted({k for record in seeds.values() for k, v in record.items() if isinstance(v, (int, float))
                       and not isinstance(v, bool)})
        figures = {k: mean_std([seeds[s][k] for s in sorted(seeds) if k in seeds[s]]) for k in keys}
        entry = {"seeds": sorted(seeds), "figures": figures}
        paired = {}
        for factor in ("1x", "2x", "4x"):
            key = f"ppl@{factor}"
            common = [s for s in sorted(seeds) if s in cells.get(reference, {})]
            if common and cell != reference:
                paired[f"d_ppl@{factor}"] = mean_std([seeds[s][key] / cells[reference][s][key] - 1 for s in common])
            both = [s for s in common if s in cells.get(lazy, {})]
            gaps = {s: cells[reference][s][key] - cells[lazy][s][key] for s in both}
            if both and cell not in (reference, lazy) and all(abs(g) > 1e-9 for g in gaps.values()):
                paired[f"share_of_lazy_gain@{factor}"] = mean_std(
                    [(cells[reference][s][key] - seeds[s][key]) / gaps[s] for s in both])
            common_lazy = [s for s in sorted(seeds) if s in cells.get(lazy, {})]
            if common_lazy and cell != lazy:
                paired[f"d_ppl_vs_lazy@{factor}"] = mean_std(
                    [seeds[s][key] / cells[lazy][s][key] - 1 for s in common_lazy])
        entry["paired"] = paired
        entry["commits"] = sorted({str(r["commit"]) + ("+dirty" if r["dirty"] else "") for r in seeds.values()})
        out[cell] = entry
    return out


def fmt(stat: dict | None, scale: float = 1.0, digits: int = 3, percent: bool = False) -> str:
    if not stat:
        return "-"
    unit = "%" if percent else ""
    mult = 100 if percent else scale
    text = f"{stat['mean'] * mult:+.{digits}f}{unit}" if percent else f"{stat['mean'] * mult:.{digits}f}"
    if stat["std"] is not None:
        text += f" +- {stat['std'] * mult:.{digits}f}{unit}"
    return text + f" (n={stat['n']})"


def markdown(summary: dict, reference: str, lazy: str) -> str:
    lines = [(f"Mean +- sample std over seeds (n = seeds). d ppl: paired (same seed) relative change vs "
             f"`{reference}`; share: (ppl_{reference} - ppl_cell) / (ppl_{reference} - ppl_{lazy}), same seed."), ""]
    head = ("| cell | seeds | ppl @1x | ppl @2x | ppl @4x | d ppl @1x | d ppl @4x | share of lazy gain @1x "
            "| d vs lazy @1x |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for cell, entry in summary.items():
        f, p = entry["figures"], entry["paired"]
        lines.append(f"| {cell} | {','.join(map(str, entry['seeds']))} | {fmt(f.get('ppl@1x'))} "
                     f"| {fmt(f.get('ppl@2x'))} | {fmt(f.get('ppl@4x'))} "
                     f"| {fmt(p.get('d_ppl@1x'), percent=True, digits=2)} "
                     f"| {fmt(p.get('d_ppl@4x'), percent=True, digits=2)} "
                     f"| {fmt(p.get('share_of_lazy_gain@1x'), digits=2)} "
                     f"| {fmt(p.get('d_ppl_vs_lazy@1x'), percent=True, digits=2)} |")
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


def bias_tail(results_file: Path, start: int, stop: int, threshold: float = 0.05) -> dict:
    """Per run of a `results.json`: how many learned distance-bias entries at distances `start..stop-1` (all
    layers and heads) exceed `threshold` in magnitude, and their extremes."""
    data = json.loads(Path(results_file).read_text())
    out = {}
    for name, run in data["runs"].items():
        bias = run.get("learned", {}).get("distance_bias")
        if not bias:
            continue
        values = [x for layer in bias for head in layer for x in head[start:stop]]
        out[name] = {"distances": [start, stop - 1], "entries": len(values),
                     "beyond_threshold": sum(abs(x) > threshold for x in values), "threshold": threshold,
                     "positive_beyond": sum(x > threshold for x in values), "min": min(values), "max": max(values)}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a grid folder, or with --bias-tail a results.json")
    parser.add_argument("--bias-tail", type=int, nargs=2, metavar=("START", "STOP"), default=None,
                        help="report learned distance-bias entries at distances START..STOP-1 of a results.json")
    parser.add_argument("--reference", default="vanilla")
    parser.add_argument("--lazy", default="lazy")
    args = parser.parse_args(argv)
    if args.bias_tail:
        report = bias_tail(args.folder, *args.bias_tail)
        print(json.dumps(report, indent=1))
        return report
    summary = summarise(load_grid(args.folder), args.reference, args.lazy)
    (args.folder / "summary.json").write_text(json.dumps(summary, indent=1))
    table = markdown(summary, args.reference, args.lazy)
    (args.folder / "summary.md").write_text(table)
    print(table)
    return summary


if __name__ == "__main__":
    main()
