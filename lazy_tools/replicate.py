"""Replication study (REPLICATION.md; the paper's claims: docs/design.md): train vanilla Llama, Lazy Attention
and two ablations from scratch on Brown-train with one shared loop, then evaluate all four on Brown-test.

    python -m lazy_tools.replicate --out runs/replicate            # the real run (see REPLICATION.md)
    python -m lazy_tools.replicate --steps 8 --hidden-size 32 ...  # a smoke run (tests/test_replicate_smoke.py)

Variants (identical Llama weights at step 0, same data order, steps, optimizer and learning rate):

- `vanilla`:   `LlamaForCausalLM`, `attn_implementation="sdpa"`.
- `lazy`:      `LazyLlamaForCausalLM`, the paper's init: tau = -1, distance_bias ~ N(0, 1e-3), both learned.
- `bias_only`: tau = 0 and frozen (plain softmax), distance_bias learned.
- `tau_only`:  distance_bias = 0 and frozen (plain RoPE scores), tau learned from -1.

Data choices (why):
- Tokens are UTF-8 bytes (vocabulary 256, tied embeddings). SmolLM2's 49152-token vocabulary would make the
  embedding 4x the rest of a small model and its output layer the dominant cost on these CPUs.
- Training blocks are cut *within* documents (`pack_token_blocks` on one document at a time, the tail of each
  document dropped), so every block is one contiguous text with positions 0..T-1. Vanilla Llama with sdpa does
  not separate packed documents while LazyLlama does; blocks that never straddle a document boundary make the
  two see exactly the same attention context.
- Evaluation: from each Brown-test document its first `4 x context` bytes; perplexity (non-overlapping windows,
  `lazy_tools.metrics.perplexity`) at windows of 1x, 2x and 4x the training length, pooled over documents, so
  the three lengths score the same text. Attention statistics (`lazy_tools.metrics.attention_statistics`) on
  the first training-length block of test documents.

Writes under `--out`: `results.json` (config, losses, evaluation, per-layer statistics), `table.md`, `plots/`
(loss curves, distance-bias curves, tau per head, attention maps, per-layer sink and sparsity) and
`log.txt`.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lazy_tools.data import brown_documents, pack_token_blocks
from lazy_tools.metrics import attention_statistics, attention_weights, perplexity
from modeling_lazy import (
    LAZY_PARAMETER_NAMES,
    LazyLlamaConfig,
    LazyLlamaForCausalLM,
    is_lazy_parameter,
    lazy_attention_modules,
)

VARIANTS = ("vanilla", "lazy", "bias_only", "tau_only")
VOCAB = 256  # UTF-8 bytes
EXTRAPOLATION = (1, 2, 4)  # evaluation windows, in multiples of the training length


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def document_blocks(documents: list[str], block_size: int) -> torch.Tensor:
    """`[N, block_size]` int64: each document cut into whole blocks (no block crosses a document boundary)."""
    blocks = [pack_token_blocks([byte_tokens(doc)], block_size)[0] for doc in documents if len(doc) >= block_size]
    return torch.cat(blocks)


def llama_kwargs(args) -> dict:
    """The Llama fields shared by all four variants."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(EXTRAPOLATION) * args.context,  # the model refuses longer inputs otherwise
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(variant: str, args):
    """The model of one variant. All four start from the same Llama weights (same seed), the lazy ones add
    `tau` and `distance_bias` initialised and frozen as the variant says."""
    torch.manual_seed(args.seed)
    vanilla = LlamaForCausalLM(LlamaConfig(**llama_kwargs(args), attn_implementation="sdpa"))
    if variant == "vanilla":
        return vanilla
    config = LazyLlamaConfig(**llama_kwargs(args), lazy_bias_window=args.context)
    torch.manual_seed(args.seed + 1)  # tau / distance_bias init, identical for the three lazy variants
    model = LazyLlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(vanilla.state_dict(), strict=False)
    if unexpected or not all(is_lazy_parameter(k) for k in missing):
        raise RuntimeError(f"Llama -> LazyLlama weight copy mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for attn in lazy_attention_modules(model):
            if variant == "bias_only":
                attn.tau.zero_()
                attn.tau.requires_grad_(False)
            elif variant == "tau_only":
                attn.distance_bias.zero_()
                attn.distance_bias.requires_grad_(False)
            elif variant != "lazy":
                raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    return model


def optimizer(model, args) -> torch.optim.AdamW:
    """AdamW; weight decay on weight matrices only, never on norms, tau or distance_bias (docs/design.md)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and not is_lazy_parameter(name) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def learning_rate(step: int, args) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_order(num_blocks: int, args) -> torch.Tensor:
    """`[steps, batch]` block indices: seeded epochs of shuffled blocks, the same for every variant."""
    generator = torch.Generator().manual_seed(args.seed)
    needed = args.steps * args.batch_size
    order = torch.cat([torch.randperm(num_blocks, generator=generator)
                       for _ in range(math.ceil(needed / num_blocks))])
    return order[:needed].view(args.steps, args.batch_size)


def train(model, blocks: torch.Tensor, args, log) -> dict:
    """The shared training loop. Returns losses per step and the wall-clock time."""
    model.train()
    opt = optimizer(model, args)
    order = batch_order(blocks.shape[0], args)
    positions = torch.arange(args.context).expand(args.batch_size, -1)  # one document per block: 0..T-1
    losses, start = [], time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)
        input_ids = blocks[order[step]]
        loss = model(input_ids=input_ids, position_ids=positions, labels=input_ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"non-finite loss {losses[-1]} at step {step}")
        if step % args.log_every == 0 or step == args.steps - 1:
            log(f"  step {step:5d}/{args.steps}  loss {losses[-1]:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                f"{time.time() - start:7.1f}s")
    return {"losses": losses, "train_seconds": time.time() - start}


@torch.no_grad()
def evaluate(model, test_documents: list[str], args) -> dict:
    """Perplexity at 1x, 2x, 4x the training length on the same text, and attention statistics."""
    model.eval()
    span = max(EXTRAPOLATION) * args.context
    segments = [torch.tensor(byte_tokens(doc)[:span]) for doc in test_documents if len(doc.encode()) >= span]
    result = {"eval_documents": len(segments)}
    for factor in EXTRAPOLATION:
        nll, tokens = 0.0, 0
        for segment in segments:
            scored = perplexity(model, segment, context=factor * args.context)
            nll += scored["nll"] * scored["tokens"]
            tokens += scored["tokens"]
        result[f"ppl@{factor}x"] = math.exp(nll / tokens)
        result[f"bits_per_byte@{factor}x"] = nll / tokens / math.log(2)
        result[f"tokens@{factor}x"] = tokens
    stats_blocks = torch.stack([segment[: args.context] for segment in segments[: args.stats_blocks]])
    result["attention"] = attention_statistics(model, stats_blocks)
    return result


def lazy_parameters(model) -> dict:
    """Learned `tau [layers][heads]` and `distance_bias [layers][heads][W]` (empty for vanilla)."""
    modules = lazy_attention_modules(model)
    if not modules:
        return {}
    return {name: [getattr(m, name).detach().tolist() for m in modules] for name in LAZY_PARAMETER_NAMES}


def results_table(results: dict) -> str:
    """The Markdown comparison table (means over layers and heads for the attention figures)."""
    head = ("| variant | params | final train loss | ppl @1x | ppl @2x | ppl @4x | sparsity | tile density "
            "| sink | surviving mass | tau (mean) | train time |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, run in results["runs"].items():
        ev, mean = run["eval"], run["eval"]["attention"]["mean"]
        tail = run["losses"][-max(1, len(run["losses"]) // 20):]  # last 5% of steps, to smooth batch noise
        lines.append(
            f"| {name} | {run['parameters']:,} | {sum(tail) / len(tail):.4f} | {ev['ppl@1x']:.3f} | "
            f"{ev['ppl@2x']:.3f} | {ev['ppl@4x']:.3f} | {mean['sparsity']:.2%} | {mean['tile_density']:.2%} | "
            f"{mean['sink']:.4f} | {mean['surviving_mass']:.4f} | {mean['tau']:+.3f} | {run['train_seconds'] / 60:.1f} min |"
        )
    return "\n".join(lines) + "\n"


def per_layer_table(results: dict) -> str:
    """Per layer: sparsity / sink / surviving mass / mean tau of each variant."""
    lines = ["| variant | layer | sparsity | tile density | sink | surviving mass | tau per head |", "|---|---|---|---|---|---|---|"]
    for name, run in results["runs"].items():
        for index, layer in enumerate(run["eval"]["attention"]["layers"]):
            avg = {k: sum(v) / len(v) for k, v in layer.items()}
            taus = ", ".join(f"{t:+.2f}" for t in layer["tau"])
            lines.append(f"| {name} | {index} | {avg['sparsity']:.2%} | {avg['tile_density']:.2%} | {avg['sink']:.4f} "
                         f"| {avg['surviving_mass']:.4f} | {taus} |")
    return "\n".join(lines) + "\n"


def make_plots(results: dict, models: dict, test_documents: list[str], args, out: Path):
    """Small PNGs: loss curves, distance-bias curves, tau per head, attention maps, per-layer sink/sparsity.
    (Made here with matplotlib; `lazy_tools.inspect_attention` was not available when this was written.)"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    runs = results["runs"]

    fig, ax = plt.subplots(figsize=(6, 3.5))
    window = max(1, args.steps // 50)
    for name, run in runs.items():
        losses = torch.tensor(run["losses"])
        smooth = losses.unfold(0, window, 1).mean(-1) if losses.numel() >= window else losses
        ax.plot(range(window - 1, window - 1 + smooth.numel()), smooth, label=name, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss (nats/byte, {window}-step mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=80)
    plt.close(fig)

    biased = [n for n in runs if "distance_bias" in runs[n]["learned"] and n != "tau_only"]
    if biased:
        fig, axes = plt.subplots(len(biased), args.layers, figsize=(2.4 * args.layers, 2.2 * len(biased)),
                                 squeeze=False, sharey=True)
        for row, name in enumerate(biased):
            for layer, bias in enumerate(runs[name]["learned"]["distance_bias"]):
                ax = axes[row][layer]
                for head in bias:
                    ax.plot(head, lw=0.8)
                ax.set_title(f"{name} L{layer}", fontsize=8)
                ax.set_xlabel("distance", fontsize=7)
                ax.tick_params(labelsize=6)
        fig.tight_layout()
        fig.savefig(out / "distance_bias.png", dpi=80)
        plt.close(fig)

    taued = [n for n in runs if "tau" in runs[n]["learned"] and n != "bias_only"]
    if taued:
        fig, ax = plt.subplots(figsize=(6, 3))
        for offset, name in enumerate(taued):
            for layer, taus in enumerate(runs[name]["learned"]["tau"]):
                x = [layer + 0.3 * offset - 0.15] * len(taus)
                ax.scatter(x, taus, s=12, label=name if layer == 0 else None, color=f"C{offset}")
        ax.axhline(-1, color="grey", lw=0.5, ls="--")
        ax.set_xlabel("layer")
        ax.set_ylabel("learned tau per head")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "tau.png", dpi=80)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for name, run in runs.items():
        layers = run["eval"]["attention"]["layers"]
        axes[0].plot([sum(l["sink"]) / len(l["sink"]) for l in layers], marker="o", label=name)
        axes[1].plot([sum(l["sparsity"]) / len(l["sparsity"]) for l in layers], marker="o", label=name)
    axes[0].set_title("sink: mean weight on key 0")
    axes[1].set_title("sparsity: fraction of exact zeros")
    for ax in axes:
        ax.set_xlabel("layer")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sink_sparsity.png", dpi=80)
    plt.close(fig)

    block = torch.tensor(byte_tokens(test_documents[0])[: args.context])[None]
    fig, axes = plt.subplots(len(models), args.layers, figsize=(2.2 * args.layers, 2.3 * len(models)), squeeze=False)
    for row, (name, model) in enumerate(models.items()):
        weights, *_ = attention_weights(model, block)
        for layer, w in enumerate(weights):
            ax = axes[row][layer]
            ax.imshow(w[0].mean(0).clamp(min=0) ** 0.5, cmap="viridis", interpolation="nearest")
            ax.set_title(f"{name} L{layer}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle("attention (head mean, sqrt scale), first test block", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "attention_maps.png", dpi=80)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/replicate"), help="output folder")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=350, help="optimizer steps per variant")
    parser.add_argument("--batch-size", type=int, default=16, help="blocks per step")
    parser.add_argument("--context", type=int, default=128, help="training length T (bytes); eval at T, 2T, 4T")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate, the same for every variant")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-docs", type=int, default=None, help="use only the first N Brown-train documents")
    parser.add_argument("--eval-docs", type=int, default=None, help="use only the first N Brown-test documents")
    parser.add_argument("--stats-blocks", type=int, default=16, help="test blocks for the attention statistics")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (1: on a shared 2-core machine 2 threads ran 7x slower)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--no-plots", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "log.txt", "a", encoding="utf-8")

    def log(message: str):
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    train_documents = brown_documents("train")[: args.train_docs]
    test_documents = brown_documents("test")[: args.eval_docs]
    blocks = document_blocks(train_documents, args.context)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {"config": config, "train_blocks": blocks.shape[0],
               "train_tokens_per_variant": args.steps * args.batch_size * args.context,
               "torch": torch.__version__, "runs": {}}
    log(f"{blocks.shape[0]} training blocks of {args.context} bytes; {args.steps} steps x {args.batch_size} blocks "
        f"= {results['train_tokens_per_variant']:,} tokens per variant ({results['train_tokens_per_variant'] / blocks.numel():.2f} epochs)")
    models = {}
    for variant in args.variants:
        model = build_model(variant, args)
        parameters = sum(p.numel() for p in model.parameters())
        log(f"{variant}: {type(model).__name__}, {parameters:,} parameters, attn={model.config._attn_implementation}")
        run = {"parameters": parameters, **train(model, blocks, args, log)}
        start = time.time()
        run["eval"] = evaluate(model, test_documents, args)
        run["eval_seconds"] = time.time() - start
        run["learned"] = lazy_parameters(model)
        ev = run["eval"]
        log(f"{variant}: ppl {ev['ppl@1x']:.3f} / {ev['ppl@2x']:.3f} / {ev['ppl@4x']:.3f} at 1x/2x/4x; "
            f"sparsity {ev['attention']['mean']['sparsity']:.2%}, sink {ev['attention']['mean']['sink']:.4f}; "
            f"train {run['train_seconds']:.0f}s, eval {run['eval_seconds']:.0f}s")
        results["runs"][variant] = run
        models[variant] = model
        (args.out / "results.json").write_text(json.dumps(results, indent=1))  # after each variant: partial results survive
    table = results_table(results) + "\n" + per_layer_table(results)
    (args.out / "table.md").write_text(table)
    log("\n" + table)
    if not args.no_plots:
        make_plots(results, models, test_documents, args, args.out / "plots")
        log(f"plots in {args.out / 'plots'}")
    log_file.close()
    return results


if __name__ == "__main__":
    main()
