"""Lazification with controls: SmolLM2-135M converted at tau = 0 (exactly the Llama), then the same small
fine-tuning budget spent on different parameter sets, and a no-training tau sweep as the baseline.

    python -m lazy_llama_tools.lazify_controls --out docs/replication/lazify --steps 24

Arms (each starts from the same converted model, sees the same Brown-train blocks in the same order, same steps):

- `lazy_only`:    tau and distance_bias trained (both from 0), everything else frozen (the demo's mode);
- `bias_only`:    distance_bias trained, tau frozen at 0 (plain softmax: no exact zeros);
- `tau_only`:     tau trained, distance_bias frozen at 0;
- `vanilla_norms`: tau = distance_bias = 0 frozen (the model *is* the Llama), the RMSNorm weights trained instead
  (30 x 2 x 576 + 576 = 35k parameters; the lazy arms train 30 x 9 x (1 + W) of which 30 x 9 x 257 = 69k receive
  gradients at block length 256): a vanilla fine-tune of comparable size;
- `lazy_norms`:   tau, distance_bias and the RMSNorm weights together (what lazification costs on top of that
  vanilla fine-tune: the same norms, the same steps, plus exact zeros).

Baseline without training: the converted model with one uniform tau for every head (`--tau-sweep`).

Evaluation (every arm and every tau): all 50 Brown-test documents, the first `--eval-tokens` tokens of each,
scored with `lazy_llama_tools.metrics.perplexity` (context 512, so each document is one window; every token after
the first is scored); perplexity pooled over documents. Attention statistics (`attention_statistics` and the
pooled figures) on the first `--stats-tokens` tokens of the first `--stats-docs` documents.
Writes `results.json` (after every evaluation) and `log.txt` under `--out`; at the end (or alone, with
`--summary-only`) `summary.md` (the table and the Pareto front of sparsity against perplexity change) and
`pareto.png`.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from lazy_llama_tools.cli import at_least, finite_float, one_line_errors, positive_int
from lazy_llama_tools.data import brown_documents, pack_token_blocks, smollm2_llama_dir
from lazy_llama_tools.finetune import load_model
from lazy_llama_tools.folders import write_text_whole
from lazy_llama_tools.loading import one_line, read_json_object
from lazy_llama_tools.metrics import (
    attention_statistics,
    perplexity,
    pooled_attention_statistics,
)
from lazy_llama_tools.replicate import code_version
from modeling_lazy import lazy_attention_modules

ARMS = ("lazy_only", "vanilla_norms", "bias_only", "tau_only", "lazy_norms")
CONTROLS = ("bias_only", "vanilla_norms")  # fine-tunes that cannot make exact zeros (tau stays 0)


def trainable(model, arm: str) -> list[torch.nn.Parameter]:
    """Freeze everything, then unfreeze what the arm trains; returns those parameters."""
    return [p for group in trainable_groups(model, arm) for p in group]


def trainable_groups(model, arm: str) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Freeze everything, then unfreeze what the arm trains: `(lazy parameters, RMSNorm weights)`."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")
    model.requires_grad_(False)
    lazy = []
    for attn in lazy_attention_modules(model):
        if arm in ("lazy_only", "tau_only", "lazy_norms"):
            lazy.append(attn.tau)
        if arm in ("lazy_only", "bias_only", "lazy_norms"):
            lazy.append(attn.distance_bias)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")] \
        if arm in ("vanilla_norms", "lazy_norms") else []
    for param in lazy + norms:
        param.requires_grad_(True)
    return lazy, norms


def train_blocks(tokenizer, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Brown-train documents tokenised with EOS, packed one document at a time into `--block-size` blocks."""
    ids, pos = [], []
    for doc in brown_documents("train"):
        tokens = tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]
        if len(tokens) >= args.block_size:
            block_ids, block_pos = pack_token_blocks([tokens], args.block_size)
            ids.append(block_ids)
            pos.append(block_pos)
    return torch.cat(ids), torch.cat(pos)


def finetune(model, arm: str, blocks, args, log) -> dict:
    lazy, norms = trainable_groups(model, arm)
    groups = [{"params": ps, "lr": lr, "base_lr": lr} for ps, lr in ((lazy, args.lazy_lr), (norms, args.norm_lr)) if ps]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)
    ids, pos = blocks
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(args.seed))
    order = order[: args.steps * args.batch_size].view(args.steps, args.batch_size)
    model.train()
    losses, start = [], time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * min(1.0, (step + 1) / args.warmup)
        input_ids, position_ids = ids[order[step]], pos[order[step]]
        labels = input_ids.masked_fill(position_ids == 0, -100)
        loss = model(input_ids=input_ids, position_ids=position_ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        log(f"  {arm} step {step + 1}/{args.steps} loss {losses[-1]:.4f} ({time.time() - start:.0f}s)")
    model.eval()
    model.requires_grad_(False)
    return {"losses": losses, "lr": [group["base_lr"] for group in groups],
            "trained_parameters": sum(p.numel() for p in lazy + norms),
            "train_seconds": time.time() - start}


@torch.no_grad()
def evaluate(model, documents: list[torch.Tensor], args) -> dict:
    model.eval()
    nll, tokens = 0.0, 0
    for doc in documents:
        scored = perplexity(model, doc, context=args.eval_context)
        nll += scored["nll"] * scored["tokens"]
        tokens += scored["tokens"]
    stats_ids = torch.stack([doc[: args.stats_tokens] for doc in documents[: args.stats_docs]])
    stats = attention_statistics(model, stats_ids)
    pooled = pooled_attention_statistics(model, stats_ids)
    mean = {**stats["mean"], **pooled["mean"]}
    per_layer = {key: [sum(layer[key]) / len(layer[key]) for layer in part["layers"]]
                 for part, keys in ((stats, stats["mean"]), (pooled, pooled["mean"])) for key in keys}
    return {"perplexity": math.exp(nll / tokens), "nll": nll / tokens, "tokens": tokens, "documents": len(documents),
            "attention": mean, "per_layer": per_layer}


def lazy_state(model) -> dict:
    """Learned tau [layers][heads] and distance-bias summaries (the full bias is 30 x 9 x W)."""
    modules = lazy_attention_modules(model)
    return {"tau": [m.tau.tolist() for m in modules],
            "distance_bias_first16": [m.distance_bias[:, :16].tolist() for m in modules]}


def summary_points(results: dict) -> list[dict]:
    """One row per evaluated model: the no-training tau sweep, then the fine-tuned arms. Perplexity changes are
    relative to the converted model (tau = 0, no training) and to the best control arm (the lower perplexity of
    `CONTROLS`, when one has run); `pareto` marks rows no other row beats on both sparsity and perplexity."""
    base = results["tau_sweep"].get("0")
    controls = [results["arms"][a]["eval"]["perplexity"] for a in CONTROLS if a in results["arms"]]
    best_control = min(controls) if controls else None
    rows = []
    for key, res in sorted(results["tau_sweep"].items(), key=lambda kv: -kv[1]["tau"]):
        rows.append({"name": f"no training, tau = {res['tau']:g}", "kind": "sweep", **_row(res)})
    for arm in ARMS:
        if arm in results["arms"]:
            run = results["arms"][arm]
            rows.append({"name": arm, "kind": "control" if arm in CONTROLS else "lazy", **_row(run["eval"]),
                         "trained_parameters": run["trained_parameters"], "steps": len(run["losses"])})
    for row in rows:
        row["d_converted"] = row["perplexity"] / base["perplexity"] - 1 if base else None
        row["d_best_control"] = row["perplexity"] / best_control - 1 if best_control else None
    for row in rows:
        row["pareto"] = not any(other["sparsity_pooled"] >= row["sparsity_pooled"]
                                and other["perplexity"] <= row["perplexity"]
                                and (other["sparsity_pooled"], other["perplexity"])
                                != (row["sparsity_pooled"], row["perplexity"]) for other in rows)
    return rows


def _row(evaluation: dict) -> dict:
    att = evaluation["attention"]
    return {"perplexity": evaluation["perplexity"], "tokens": evaluation["tokens"], "sparsity": att["sparsity"],
            "sparsity_pooled": att["sparsity_pooled"], "removed_mass": att["removed_mass"],
            "sink_share": att["sink_share"]}


def summary_markdown(results: dict) -> str:
    def pct(value, signed=True):
        return "-" if value is None else (f"{100 * value:+.2f}%" if signed else f"{100 * value:.1f}%")

    rows = summary_points(results)
    cfg = results["config"]
    lines = [
        "Commands: " + "; ".join(f"`{c}`" for c in results.get("commands", [results["command"]]))
        + f". Code {results['code']}; torch {results['torch']}.",
        f"Scored: {rows[0]['tokens']:,} tokens ({cfg['eval_tokens']} per Brown-test document, context "
        f"{cfg['eval_context']}); attention figures on the first {cfg['stats_tokens']} tokens of "
        f"{cfg['stats_docs']} documents. Fine-tunes: {cfg['steps']} steps x {cfg['batch_size']} blocks of "
        f"{cfg['block_size']} Brown-train tokens, same blocks and order for every arm (seed {cfg['seed']}).",
        "d ppl: relative to the converted model (tau = 0, no training) and to the best control "
        f"({' / '.join(CONTROLS)}: fine-tunes without exact zeros). Sparsity: per-row mean / pooled (zeros over "
        "all visible pairs). Sink share: weight on the first token as a share of each row's surviving mass. "
        "Pareto: no other row has both more (pooled) sparsity and lower perplexity.",
        "",
        "| model | trained params | ppl | d ppl vs converted | d ppl vs best control | sparsity (row mean) "
        "| sparsity (pooled) | removed mass | sink share | Pareto |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        trained = f"{row['trained_parameters']:,}" if "trained_parameters" in row else "0"
        lines.append(f"| {row['name']} | {trained} | {row['perplexity']:.3f} | {pct(row['d_converted'])} "
                     f"| {pct(row['d_best_control'])} | {pct(row['sparsity'], False)} "
                     f"| {pct(row['sparsity_pooled'], False)} | {row['removed_mass']:.3f} "
                     f"| {row['sink_share']:.4f} | {'yes' if row['pareto'] else ''} |")
    return "\n".join(lines) + "\n"


def pareto_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary_points(results)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sweep = [r for r in rows if r["kind"] == "sweep"]
    ax.plot([100 * r["sparsity_pooled"] for r in sweep], [100 * r["d_converted"] for r in sweep], "o-",
            color="grey", label="no training, uniform tau")
    for r in sweep:
        ax.annotate(r["name"].split("= ")[-1], (100 * r["sparsity_pooled"], 100 * r["d_converted"]), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))
    for r in rows:
        if r["kind"] != "sweep":
            ax.plot(100 * r["sparsity_pooled"], 100 * r["d_converted"], "s" if r["kind"] == "control" else "D",
                    label=f"{r['name']} ({r['steps']} steps)")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("attention sparsity, pooled (%)")
    ax.set_ylabel("perplexity change vs converted model (%)")
    ax.set_title("SmolLM2-135M lazification on Brown: sparsity against perplexity")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_summary(out: Path) -> str:
    results = read_json_object(out / "results.json", "lazify_controls")
    try:
        text = summary_markdown(results)
    except (KeyError, TypeError, ValueError) as error:
        raise SystemExit(f"lazify_controls: error: {out / 'results.json'} is not this study's results "
                         f"({one_line(error, 200)})") from None
    (out / "summary.md").write_text(text)
    pareto_plot(results, out / "pareto.png")
    return text


def parse_args(argv=None):
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    parser.add_argument("--out", type=Path, default=Path("runs/lazify"))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--tau-sweep", type=finite_float, nargs="*", default=[0.0, -0.05, -0.1, -0.025])
    parser.add_argument("--steps", type=positive_int, default=24)
    parser.add_argument("--batch-size", type=positive_int, default=2)
    parser.add_argument("--block-size", type=positive_int, default=256)
    parser.add_argument("--lazy-lr", type=at_least(0.0, float), default=2e-2,
                        help="tau / distance_bias (the demo: 1e-3 x 20)")
    parser.add_argument("--norm-lr", type=at_least(0.0, float), default=1e-3,
                        help="RMSNorm weights of vanilla_norms")
    parser.add_argument("--warmup", type=at_least(0), default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tokens", type=positive_int, default=420,
                        help="first N tokens of each Brown-test document")
    parser.add_argument("--eval-context", type=positive_int, default=512)
    parser.add_argument("--stats-docs", type=positive_int, default=4)
    parser.add_argument("--stats-tokens", type=positive_int, default=256)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--summary-only", action="store_true", help="rewrite summary.md / pareto.png and exit")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: give a folder (it is created if missing)")
    return args


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.summary_only:
        print(write_summary(args.out))
        return read_json_object(args.out / "results.json", "lazify_controls")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    results = read_json_object(saved, "lazify_controls") if saved.is_file() else {}
    previous = results.get("commands") or ([results["command"]] if "command" in results else [])
    for entry in [*results.get("tau_sweep", {}).values(), *results.get("arms", {}).values()]:
        entry.setdefault("code", results["code"])  # entries written before the code was kept per entry
    results.update({"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "code": code_version(), "command": "python -m lazy_llama_tools.lazify_controls " + " ".join(argv),
                    "torch": torch.__version__})
    # a resumed or extended run (e.g. `--arms lazy_norms` added later) keeps every command that wrote into `--out`
    results["commands"] = [c for c in previous if c != results["command"]] + [results["command"]]
    results.setdefault("tau_sweep", {})
    results.setdefault("arms", {})

    with open(args.out / "log.txt", "a", encoding="utf-8") as log_file:
        def log(message: str):
            line = f"[{time.strftime('%H:%M:%S')}] {message}"
            print(line, flush=True)
            log_file.write(line + "\n")
            log_file.flush()

        def save():
            write_text_whole(saved, json.dumps(results, indent=1))

        model, tokenizer = load_model(str(smollm2_llama_dir()), tau_init=0.0, bias_init_std=0.0)
        model.eval()
        pristine = {k: v.clone() for k, v in model.state_dict().items() if "norm" in k or "tau" in k
                    or "distance_bias" in k}
        documents = [torch.tensor(tokenizer(doc)["input_ids"][: args.eval_tokens]) for doc in brown_documents("test")]
        log(f"{len(documents)} test documents, {sum(d.numel() for d in documents):,} tokens")

        def sweep(taus):
            for tau in taus:
                key = f"{tau:g}"
                if key in results["tau_sweep"]:
                    continue
                model.load_state_dict(pristine, strict=False)
                with torch.no_grad():
                    for attn in lazy_attention_modules(model):
                        attn.tau.fill_(tau)
                start = time.time()
                results["tau_sweep"][key] = {"tau": tau, **evaluate(model, documents, args),
                                             "eval_seconds": time.time() - start, "code": results["code"]}
                res = results["tau_sweep"][key]
                log(f"tau {tau:+.3f} (no training): ppl {res['perplexity']:.4f}, "
                    f"sparsity {res['attention']['sparsity']:.4f} (pooled {res['attention']['sparsity_pooled']:.4f})"
                    f", {res['eval_seconds']:.0f}s")
                save()

        sweep([tau for tau in args.tau_sweep if tau == 0])  # the converted model itself: every arm's baseline
        model.load_state_dict(pristine, strict=False)

        blocks = train_blocks(tokenizer, args)
        results["train_blocks"] = blocks[0].shape[0]
        for arm in args.arms:
            if arm in results["arms"]:
                continue
            model.load_state_dict(pristine, strict=False)
            run = finetune(model, arm, blocks, args, log)
            start = time.time()
            run["eval"] = evaluate(model, documents, args)
            run["eval_seconds"] = time.time() - start
            run["learned"] = lazy_state(model)
            run["code"] = results["code"]
            results["arms"][arm] = run
            ev = run["eval"]
            log(f"{arm}: ppl {ev['perplexity']:.4f}, sparsity {ev['attention']['sparsity']:.4f} "
                f"(pooled {ev['attention']['sparsity_pooled']:.4f}), train {run['train_seconds']:.0f}s")
            save()
        sweep([tau for tau in args.tau_sweep if tau != 0])  # after the arms (they are the comparison asked for)
        results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        save()
    print(write_summary(args.out))
    return results


if __name__ == "__main__":
    main()
