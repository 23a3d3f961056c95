"""Demonstration of `lazy-finetune`: SmolLM2-135M converted at tau = 0, then `lazy-only` fine-tuning on Brown-train.

Evaluates Brown-test perplexity (`lazy_llama_tools.metrics.perplexity`, context 512) and attention statistics
(`attention_statistics`) on a fixed slice of Brown-test (the first `--eval_rows x --eval_context` tokens of
`brown_text_file("test")`) before and after, prints a table and writes `summary.json` into the output folder.

    python -m demos.finetune_demo --output_dir .cache/finetune-demo --max_steps 24 --eval_rows 4

Options after `--` go to `lazy-finetune` unchanged (they override the defaults below).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lazy_llama_tools.cli import one_line_errors
from lazy_llama_tools.data import brown_text_file, smollm2_llama_dir
from lazy_llama_tools.finetune import load_model
from lazy_llama_tools.finetune import main as finetune_main
from lazy_llama_tools.metrics import attention_statistics, perplexity


def evaluate(model, tokens: torch.Tensor, rows: int, context: int, stats_rows_per_call: int = 2) -> dict:
    """Perplexity of `tokens[: rows * context]` (windows of `context`) and attention statistics of the same tokens
    as `rows` rows, computed `stats_rows_per_call` rows at a time (equal-length rows: the mean of the means)."""
    tokens = tokens[: rows * context]
    model.eval()
    ppl = perplexity(model, tokens, context=context)
    grid = tokens.view(rows, context)
    parts = [attention_statistics(model, grid[i : i + stats_rows_per_call])
             for i in range(0, rows, stats_rows_per_call)]
    mean = {key: sum(p["mean"][key] for p in parts) / len(parts) for key in parts[0]["mean"]}
    layers = len(parts[0]["layers"])
    per_layer = {
        key: [sum(sum(p["layers"][layer][key]) / len(p["layers"][layer][key]) for p in parts) / len(parts)
              for layer in range(layers)]
        for key in ("sparsity", "sink", "tau")
    }
    return {"perplexity": ppl["perplexity"], "tokens": ppl["tokens"], "mean": mean, "per_layer": per_layer}


def main(argv=None) -> None:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__,
                                                     formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--output_dir", default=".cache/finetune-demo")
    parser.add_argument("--max_steps", type=int, default=24)
    parser.add_argument("--eval_rows", type=int, default=4)
    parser.add_argument("--eval_context", type=int, default=512)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]

    torch.manual_seed(0)
    llama_dir = smollm2_llama_dir()
    train_file, test_file = brown_text_file("train"), brown_text_file("test")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    model, tokenizer = load_model(str(llama_dir), tau_init=0.0, bias_init_std=0.0)  # the exact tau = 0 conversion
    test_tokens = torch.tensor(tokenizer(test_file.read_text(encoding="utf-8"))["input_ids"], dtype=torch.long)
    start = time.time()
    saved = out / f"before-{args.eval_rows}x{args.eval_context}.json"  # the converted model never changes
    if saved.is_file():
        before = json.loads(saved.read_text())
    else:
        before = evaluate(model, test_tokens, args.eval_rows, args.eval_context)
        saved.write_text(json.dumps(before, indent=1))
    print(f"before: ppl {before['perplexity']:.3f}, sparsity {before['mean']['sparsity']:.4f} "
          f"({time.time() - start:.0f} s)", flush=True)
    del model

    command = [
        str(llama_dir), "--train-file", str(train_file), "--output-dir", str(out / "run"),
        "--mode", "lazy-only", "--block-size", "256", "--per-device-train-batch-size", "2",
        "--max-steps", str(args.max_steps), "--learning-rate", "1e-3", "--lazy-lr-multiplier", "20",
        "--lr-scheduler-type", "constant_with_warmup", "--warmup-steps", "5", "--weight-decay", "0.1",
        "--logging-steps", "5", "--stats-every-n-logs", "4", "--stats-tokens", "128", "--save-strategy", "no",
        "--report-to", "none",
        "--seed", "0", "--disable-tqdm", "true", "--dataloader-num-workers", "0",
    ] + extra
    print("lazy-finetune " + " ".join(command), flush=True)
    start = time.time()
    finetune_main(command)
    train_seconds = time.time() - start

    tuned, _ = load_model(str(out / "run"))
    after = evaluate(tuned, test_tokens, args.eval_rows, args.eval_context)
    summary = {"command": "lazy-finetune " + " ".join(command), "train_seconds": train_seconds,
               "before": before, "after": after}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\ntraining wall time {train_seconds:.0f} s")
    print(f"{'':10} {'ppl':>9} {'sparsity':>9} {'sink':>7} {'tau':>8} {'surv.mass':>9} {'tile dens':>9}")
    for name, res in (("before", before), ("after", after)):
        m = res["mean"]
        print(f"{name:10} {res['perplexity']:9.3f} {m['sparsity']:9.4f} {m['sink']:7.4f} {m['tau']:8.4f} "
              f"{m['surviving_mass']:9.4f} {m['tile_density']:9.4f}")
    print(f"perplexity change {100 * (after['perplexity'] / before['perplexity'] - 1):+.2f}%")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except FileNotFoundError as error:  # missing weights or npm: the message says what to install
        sys.exit(f"error: {error}")
