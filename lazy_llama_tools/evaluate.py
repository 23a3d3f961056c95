"""`lazy-evaluate`: sliding-window perplexity of a LazyLlama on a text file.

    lazy-evaluate MODEL --text FILE [--context 512] [--stride 256] [--baseline MODEL]

Each window of `--context` tokens scores only the tokens the previous window did not (all of them for the
first), so every token after the first is scored exactly once with up to `context - 1` tokens of history
(`lazy_llama_tools.metrics.perplexity`). With `--baseline` (a vanilla Llama or another LazyLlama with the same
tokenizer) the same tokens are scored by both. Benchmarks: see the README (lm-evaluation-harness `HFLM`).
"""

import json
from pathlib import Path

from tqdm.auto import tqdm

from lazy_llama_tools.cli import parse_evaluate
from lazy_llama_tools.folders import write_text_whole
from lazy_llama_tools.loading import (
    check_output_file,
    check_same_vocabulary,
    load_causal_lm,
    load_tokenizer,
    one_line,
    read_token_ids,
)
from lazy_llama_tools.metrics import perplexity


def evaluate_perplexity(model, token_ids, context: int, stride: int | None, name: str, show_progress: bool = True):
    """`metrics.perplexity` with a progress bar; returns its dict (with the stride used) plus `model`."""
    with tqdm(desc=f"perplexity {name}", unit="window", disable=not show_progress) as bar:
        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        result = perplexity(model, token_ids, context=context, stride=stride, progress=progress)
    return {"model": name, **result}


def main(argv: list[str] | None = None) -> int:
    """`python -m lazy_llama_tools.evaluate`: the `lazy-evaluate` command (`lazy_llama_tools.cli.lazy_evaluate` parses
    the same
    arguments before importing torch)."""
    return run(parse_evaluate(argv))


def run(args) -> int:
    """Evaluate as the parsed `lazy-evaluate` arguments say; returns the exit status."""
    try:
        if args.json:
            check_output_file(args.json, "--json")
        models = [(args.model, load_causal_lm(args.model, role="model", device=args.device, dtype=args.dtype))]
        if args.baseline:
            models.append((args.baseline, load_causal_lm(args.baseline, role="baseline", device=args.device,
                                                         dtype=args.dtype)))
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        if args.baseline:
            check_same_vocabulary(tokenizer, models[0][1], models[1][1], args.baseline)
        ids = read_token_ids(args.text, tokenizer, args.max_tokens)
        results = []
        for name, model in models:
            if int(ids.max()) >= model.config.vocab_size:
                raise ValueError(f"token id {int(ids.max())} is outside {name}'s vocabulary "
                                 f"({model.config.vocab_size}): the models must share the tokenizer")
            results.append(evaluate_perplexity(model, ids, args.context, args.stride, name, not args.no_progress))
        if args.json:
            write_text_whole(Path(args.json), json.dumps({"text_file": args.text, "results": results}, indent=1) + "\n")
    except (ValueError, OSError) as error:  # NotALazyLlama, ModelNotFound and UnusableModel are ValueErrors
        raise SystemExit(f"lazy-evaluate: error: {one_line(error, 1000)}") from None
    for result in results:
        print(f"{result['model']}: perplexity {result['perplexity']:.4f} (mean NLL {result['nll']:.4f} nats over "
              f"{result['tokens']} tokens of {args.text}; context {result['context']}, stride {result['stride']})")
    if len(results) == 2:
        print(f"ratio model / baseline: {results[0]['perplexity'] / results[1]['perplexity']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
