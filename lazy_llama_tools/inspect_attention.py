"""`lazy-inspect`: what Lazy Attention does in a checkpoint, as a JSON report, PNG plots and a text summary.

    lazy-inspect MODEL [--text FILE] [--baseline MODEL | --baseline tau=0] [--out DIR]

Measured per layer and head on natural text (defined in docs/design.md;
`lazy_llama_tools.metrics.attention_statistics`):
sparsity, 64 x 64 tile density, first-token (sink) mass, surviving mass `sum_j a_ij`, and `tau`; the same on
a sequence of one repeated token. Plots (each side by side with the baseline when one is given):

    statistics.png      the four statistics per layer (mean over heads, each head as a dot)
    distance_bias.png   the learned distance-bias curves per layer and head (the paper's Figure 4)
    tau.png             the tau values of each layer's heads (Figure 5)
    attention_maps.png  attention maps on natural text and on repeated tokens (Figure 3)

The baseline is a vanilla Llama or another LazyLlama with the same tokenizer, or `tau=0`: the inspected model
itself with every tau set to 0 (distance bias kept). The JSON layout is `inspect_report.schema.json`.
"""

import json
import math
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from lazy_llama_tools.cli import TAU_ZERO, inspect_parser
from lazy_llama_tools.loading import check_same_vocabulary, load_causal_lm, load_tokenizer, one_line, read_token_ids
from lazy_llama_tools.metrics import TILE, attention_statistics, attention_weights
from modeling_lazy import lazy_attention_modules

SCHEMA_VERSION = 1
SCHEMA_FILE = Path(__file__).with_name("inspect_report.schema.json")
STATISTICS = ("sparsity", "tile_density", "sink", "surviving_mass", "tau")
PLOTS = {
    "statistics": "statistics.png",
    "distance_bias": "distance_bias.png",
    "tau": "tau.png",
    "attention_maps": "attention_maps.png",
}


# ------------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------------


@contextmanager
def tau_zero(model):
    """Temporarily set every `tau` of a LazyLlama to 0 (the `--baseline tau=0` view of the same weights)."""
    modules = lazy_attention_modules(model)
    saved = [m.tau.detach().clone() for m in modules]
    try:
        with torch.no_grad():
            for m in modules:
                m.tau.zero_()
        yield model
    finally:
        with torch.no_grad():
            for m, tau in zip(modules, saved):
                m.tau.copy_(tau)


def _describe(model, name: str) -> dict:
    config = model.config
    return {
        "name": name,
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "lazy_bias_window": getattr(config, "lazy_bias_window", None),
    }


@torch.no_grad()
def measure(model, name: str, text_ids: torch.Tensor, repeated_ids: torch.Tensor, map_tokens: int, tile: int = TILE,
            log=None):
    """Everything the report and the plots need about one model.

    text_ids `[windows, T]` and repeated_ids `[1, R]` int64 on the model's device. Returns `(entry, views)`:
    `entry` is the model's part of the JSON report; `views` holds the arrays for the plots (float32, CPU):
    `bias` (per layer `[H, W]`, or None for a vanilla Llama), `tau` `[L, H]`, `text_maps` and `repeated_maps`
    (per layer `[H, t, t]` for the first `map_tokens` tokens). `log`: a print-like function for progress lines.
    """
    log = log or (lambda *args: None)
    entry = _describe(model, name)
    log(f"{name}: statistics on {text_ids.shape[0]} x {text_ids.shape[1]} tokens of text ...")
    entry["text"] = attention_statistics(model, text_ids, tile=tile)
    log(f"{name}: statistics on {repeated_ids.shape[1]} repeated tokens ...")
    entry["repeated"] = attention_statistics(model, repeated_ids, tile=tile)
    log(f"{name}: attention maps of the first {map_tokens} tokens ...")
    modules = lazy_attention_modules(model)  # none for a vanilla Llama
    text_maps = attention_weights(model, text_ids[:1, :map_tokens])[0]
    repeated_maps = attention_weights(model, repeated_ids[:1, :map_tokens])[0]
    views = {
        "bias": [m.distance_bias.detach().float().cpu() for m in modules] if modules else None,
        "tau": torch.tensor([layer["tau"] for layer in entry["text"]["layers"]]),
        "text_maps": [w[0].cpu() for w in text_maps],
        "repeated_maps": [w[0].cpu() for w in repeated_maps],
    }
    for layer, stats in enumerate(entry["text"]["layers"]):
        stats["layer"] = layer
    for layer, stats in enumerate(entry["repeated"]["layers"]):
        stats["layer"] = layer
    return entry, views


def repeated_token_ids(text_ids: torch.Tensor, length: int, bos_token_id: int | None) -> torch.Tensor:
    """`[1, length]`: the most frequent token of the text repeated (after the BOS token if the model has one)."""
    values, counts = torch.unique(text_ids.flatten(), return_counts=True)
    if bos_token_id is not None:
        counts = torch.where(values == bos_token_id, torch.zeros_like(counts), counts)
    token = int(values[counts.argmax()])
    ids = torch.full((1, length), token, dtype=torch.long, device=text_ids.device)
    if bos_token_id is not None and text_ids.numel() > 0 and int(text_ids.flatten()[0]) == bos_token_id:
        ids[0, 0] = bos_token_id
    return ids


def _pick_map_heads(entry: dict, layers: list[int]) -> list[tuple[int, int]]:
    """(layer, head) pairs to draw: in each chosen layer the head the inspected model makes sparsest."""
    pairs = []
    for layer in layers:
        sparsity = entry["text"]["layers"][layer]["sparsity"]
        pairs.append((layer, max(range(len(sparsity)), key=sparsity.__getitem__)))
    return pairs


# ------------------------------------------------------------------------------------------------------
# Plotting (matplotlib, Agg backend)
# ------------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, columns: int, size: tuple[float, float], titles: list[str]):
    """A figure with one sub-figure per model (inspected, then baseline), side by side."""
    fig = plt.figure(figsize=(size[0] * columns, size[1]), layout="constrained")
    subfigs = fig.subfigures(1, columns, squeeze=False)[0]
    for subfig, title in zip(subfigs, titles):
        subfig.suptitle(title, fontsize=11)
    return fig, subfigs


def _grid(n: int, max_columns: int = 6) -> tuple[int, int]:
    columns = min(n, max_columns)
    return math.ceil(n / columns), columns


def plot_statistics(entries: list[dict], path: Path):
    """Four panels (sparsity, tile density, sink, surviving mass) against layer; one line per model."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), layout="constrained")
    styles = [{"color": "C0", "marker": "o"}, {"color": "C3", "marker": "s", "linestyle": "--"}]
    for entry, style in zip(entries, styles):
        layers = entry["text"]["layers"]
        for ax, key in zip(axes, STATISTICS[:4]):
            per_head = [layer[key] for layer in layers]
            xs = range(len(per_head))
            ax.plot(xs, [sum(h) / len(h) for h in per_head], label=entry["name"], **style)
            for x, heads in zip(xs, per_head):
                ax.scatter([x] * len(heads), heads, s=6, alpha=0.3, color=style["color"])
    for ax, key in zip(axes, STATISTICS[:4]):
        ax.set_title(key.replace("_", " ") + " (text)")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_distance_bias(entries: list[dict], views: list[dict], path: Path):
    """Per layer, the curve `distance_bias[h, d]` of every head against the distance d (paper Figure 4)."""
    plt = _pyplot()
    layers = max(entry["num_layers"] for entry in entries)
    rows, columns = _grid(layers)
    fig, subfigs = _panels(plt, len(entries), (1.9 * columns, 1.5 * rows + 0.6), [e["name"] for e in entries])
    for subfig, entry, view in zip(subfigs, entries, views):
        axes = subfig.subplots(rows, columns, squeeze=False, sharex=True, sharey=True)
        for index, ax in enumerate(axes.flat):
            if index >= entry["num_layers"]:
                ax.axis("off")
                continue
            if view["bias"] is None:  # vanilla Llama: no distance bias
                ax.axhline(0.0, color="gray", linewidth=0.8)
                ax.text(0.5, 0.5, "no bias", transform=ax.transAxes, ha="center", fontsize=7, color="gray")
            else:
                for head, curve in enumerate(view["bias"][index]):
                    ax.plot(curve.numpy(), linewidth=0.7, color=f"C{head % 10}")
            ax.set_title(f"layer {index}", fontsize=8)
            ax.tick_params(labelsize=6)
        subfig.supxlabel("distance i - j", fontsize=8)
        subfig.supylabel("bias", fontsize=8)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_tau(entries: list[dict], views: list[dict], path: Path):
    """The tau of every head, per layer, with the layer mean (paper Figure 5)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(entries), figsize=(6 * len(entries), 3.6), squeeze=False,
                             sharey=True, layout="constrained")
    for ax, entry, view in zip(axes[0], entries, views):
        tau = view["tau"]
        for layer, heads in enumerate(tau):
            ax.scatter([layer] * len(heads), heads.numpy(), s=10, alpha=0.6, color="C0")
        ax.plot(range(len(tau)), tau.mean(dim=1).numpy(), color="C3", label="layer mean")
        ax.set_title(f"tau per head: {entry['name']}", fontsize=10)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("tau")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_attention_maps(entries: list[dict], views: list[dict], pairs: list[tuple[int, int]], path: Path):
    """Attention maps `a_ij` of chosen (layer, head) pairs on natural text (top) and repeated tokens (bottom);
    exact zeros (and the masked upper triangle) are white (paper Figure 3)."""
    plt = _pyplot()
    import numpy as np
    from matplotlib.colors import PowerNorm

    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    fig, subfigs = _panels(plt, len(entries), (2.2 * len(pairs) + 0.8, 5.0), [e["name"] for e in entries])
    for subfig, view in zip(subfigs, views):
        axes = subfig.subplots(2, len(pairs), squeeze=False)
        for row, (key, label) in enumerate((("text_maps", "text"), ("repeated_maps", "repeated token"))):
            for column, (layer, head) in enumerate(pairs):
                ax = axes[row][column]
                weights = view[key][layer][head].numpy()
                image = ax.imshow(np.where(weights == 0, np.nan, weights), cmap=cmap,
                                  norm=PowerNorm(0.4, vmin=0.0, vmax=1.0), interpolation="nearest")
                zeros = float((weights == 0).sum() - weights.shape[0] * (weights.shape[0] - 1) / 2)
                visible = weights.shape[0] * (weights.shape[0] + 1) / 2
                ax.set_title(f"L{layer} H{head} {label}\n{zeros / visible:.0%} zero", fontsize=8)
                ax.set_xticks([])
                ax.set_yticks([])
        subfig.colorbar(image, ax=axes, shrink=0.6, label="a_ij")
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------


def check_map_layers(map_layers: list[int] | None, models) -> None:
    """Refuse (ValueError) attention-map layers that some of `models` does not have, before any measuring."""
    counts = [model.config.num_hidden_layers for model in models]
    bad = [layer for layer in map_layers or () if not 0 <= layer < min(counts)]
    if bad:
        raise ValueError(f"map layers {bad} out of range (models have {counts} layers): give layers from 0 to "
                         f"{min(counts) - 1}")


def inspect_models(model, text_ids: torch.Tensor, out_dir: str | Path, *, name: str = "model", baseline=None,
                   baseline_name: str | None = None, text_file: str | None = None, map_tokens: int = 64,
                   map_layers: list[int] | None = None, repeated_length: int = 128, tile: int = TILE,
                   log=None) -> dict:
    """Measure `model` (and `baseline`: a model, `TAU_ZERO`, or None) on `text_ids` `[windows, T]`, write
    `report.json` and the plots into `out_dir`, and return the report (see `inspect_report.schema.json`).
    `log`: a print-like function for progress lines (None: silent)."""
    out_dir = Path(out_dir)
    check_map_layers(map_layers, [model] if baseline is None or isinstance(baseline, str) else [model, baseline])
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    text_ids = text_ids.to(device)
    repeated_ids = repeated_token_ids(text_ids, repeated_length, model.config.bos_token_id)
    map_tokens = min(map_tokens, text_ids.shape[1], repeated_length)
    entry, view = measure(model, name, text_ids, repeated_ids, map_tokens, tile, log=log)
    entries, views = [entry], [view]
    if baseline is not None:
        if isinstance(baseline, str) and baseline == TAU_ZERO:
            reference, context, baseline_name = model, tau_zero(model), f"{name} at tau=0"
        else:
            reference, context, baseline_name = baseline, nullcontext(), baseline_name or "baseline"
            largest = int(max(text_ids.max(), repeated_ids.max()))
            if largest >= reference.config.vocab_size:
                raise ValueError(f"token id {largest} is outside the baseline's vocabulary "
                                 f"({reference.config.vocab_size}): the baseline must share MODEL's tokenizer")
        ref_device = next(reference.parameters()).device
        with context:
            base_entry, base_view = measure(reference, baseline_name, text_ids.to(ref_device),
                                            repeated_ids.to(ref_device), map_tokens, tile, log=log)
        entries.append(base_entry)
        views.append(base_view)

    layers = entry["num_layers"]
    map_layers = sorted({0, layers // 2, layers - 1}) if map_layers is None else map_layers
    pairs = _pick_map_heads(entry, map_layers)
    if log is not None:
        log(f"writing the plots and report.json to {out_dir} ...")
    plot_statistics(entries, out_dir / PLOTS["statistics"])
    plot_distance_bias(entries, views, out_dir / PLOTS["distance_bias"])
    plot_tau(entries, views, out_dir / PLOTS["tau"])
    plot_attention_maps(entries, views, pairs, out_dir / PLOTS["attention_maps"])

    report = {
        "schema_version": SCHEMA_VERSION,
        "input": {
            "text_file": None if text_file is None else str(text_file),
            "windows": int(text_ids.shape[0]),
            "tokens_per_window": int(text_ids.shape[1]),
            "repeated_token_id": int(repeated_ids[0, -1]),
            "repeated_length": int(repeated_ids.shape[1]),
            "tile_size": tile,
            "map_tokens": map_tokens,
            "map_heads": [{"layer": layer, "head": head} for layer, head in pairs],
        },
        "model": entries[0],
        "baseline": entries[1] if len(entries) > 1 else None,
        "plots": dict(PLOTS),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


def summary(report: dict, out_dir: str | Path) -> str:
    """A short plain-text summary of a report (what `lazy-inspect` prints)."""
    entries = [report["model"]] + ([report["baseline"]] if report["baseline"] else [])
    width = max(14, *(len(e["name"]) + 2 for e in entries))
    inp = report["input"]
    source = inp["text_file"] or "token ids"
    lines = [
        f"{entries[0]['name']}: {entries[0]['num_layers']} layers x {entries[0]['num_heads']} heads; "
        f"{inp['windows']} x {inp['tokens_per_window']} tokens of {source}",
        f"{'':28s}" + "".join(f"{e['name']:>{width}s}" for e in entries),
    ]
    rows = [
        ("sparsity (exact zeros)", "text", "sparsity", True),
        (f"tile density ({inp['tile_size']}x{inp['tile_size']})", "text", "tile_density", True),
        ("sink (mass on 1st token)", "text", "sink", False),
        ("surviving mass sum_j a_ij", "text", "surviving_mass", False),
        ("tau (mean)", "text", "tau", False),
        ("sink, repeated token", "repeated", "sink", False),
        ("sparsity, repeated token", "repeated", "sparsity", True),
    ]
    for label, part, key, percent in rows:
        cells = [e[part]["mean"][key] for e in entries]
        lines.append(f"{label:28s}" + "".join(
            f"{(f'{v:.1%}' if percent else f'{v:.4f}'):>{width}s}" for v in cells))
    layer_sparsity = [sum(layer["sparsity"]) / len(layer["sparsity"]) for layer in entries[0]["text"]["layers"]]
    top = max(range(len(layer_sparsity)), key=layer_sparsity.__getitem__)
    low = min(range(len(layer_sparsity)), key=layer_sparsity.__getitem__)
    lines.append(f"sparsest layer {top} ({layer_sparsity[top]:.1%}), densest layer {low} ({layer_sparsity[low]:.1%})")
    lines.append(f"report: {Path(out_dir) / 'report.json'}; plots: " + ", ".join(report["plots"].values()))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`python -m lazy_llama_tools.inspect_attention`: the `lazy-inspect` command (`lazy_llama_tools.cli.lazy_inspect`
    parses
    the same arguments before importing torch)."""
    return run(inspect_parser().parse_args(argv))


def parse_map_layers(text: str | None) -> list[int] | None:
    """`--map-layers 0,15,29` as a list of ints (None when not given); ValueError for anything else."""
    if not text:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--map-layers takes comma-separated layer numbers (e.g. 0,15,29), got {text!r}") from None


def run(args) -> int:
    """Inspect as the parsed `lazy-inspect` arguments say; returns the exit status."""
    def log(message: str) -> None:  # progress on stderr: stdout carries the summary
        print(f"lazy-inspect: {message}", file=sys.stderr, flush=True)

    try:
        map_layers = parse_map_layers(args.map_layers)
        log(f"loading {args.model} ...")
        model = load_causal_lm(args.model, role="model", device=args.device, dtype=args.dtype)
        baseline = None
        if args.baseline == TAU_ZERO:
            baseline = TAU_ZERO
        elif args.baseline:
            log(f"loading the baseline {args.baseline} ...")
            baseline = load_causal_lm(args.baseline, role="baseline", device=args.device, dtype=args.dtype)
        check_map_layers(map_layers, [model] if baseline is None or isinstance(baseline, str) else [model, baseline])
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        if baseline is not None and not isinstance(baseline, str):
            check_same_vocabulary(tokenizer, model, baseline, args.baseline)
        if args.text is None:
            from lazy_llama_tools.data import brown_text_file

            args.text = str(brown_text_file("test"))
        needed = args.tokens * args.windows
        ids = read_token_ids(args.text, tokenizer, needed)
        if ids.numel() < needed:
            raise ValueError(f"{args.text} gives {ids.numel()} tokens; --tokens {args.tokens} x --windows "
                             f"{args.windows} needs {needed}: lower them or give a longer text")
        report = inspect_models(
            model, ids.view(args.windows, args.tokens), args.out, name=args.model, baseline=baseline,
            baseline_name=args.baseline, text_file=args.text, map_tokens=args.map_tokens, map_layers=map_layers,
            repeated_length=args.repeated_length, log=log,
        )
    except (ValueError, OSError) as error:  # NotALazyLlama, ModelNotFound and UnusableModel are ValueErrors
        raise SystemExit(f"lazy-inspect: error: {one_line(error, 1000)}") from None
    print(summary(report, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
