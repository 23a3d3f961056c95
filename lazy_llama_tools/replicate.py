"""Replication study: train vanilla Llama, Lazy Attention, ablations and controls from scratch on
Brown-train with one shared loop, then evaluate all four on Brown-test.

    python -m lazy_llama_tools.replicate --out runs/replicate            # the real run (see REPLICATION.md)
    python -m lazy_llama_tools.replicate --steps 8 --hidden-size 32 ...  # a smoke run (tests/test_replicate_smoke.py)

Variants (identical Llama weights at step 0, same data order, steps, optimizer and learning rate): see
`VARIANTS` below. The controls change the attention only through wrappers and hooks defined here
(`modeling_lazy` is untouched); `tests/test_study_variants.py` checks that each does what its name says.

A grid (`--grid NAME`, one of `GRIDS`; `--seeds`, `--jobs`) runs many configurations as separate processes, one
folder each under `--out`, skipping those already finished; `lazy_llama_tools.study_summary` then pools them into means
with 95% intervals and paired differences.

Data choices (why):
- Tokens are UTF-8 bytes (vocabulary 256, tied embeddings). SmolLM2's 49152-token vocabulary would make the
  embedding 4x the rest of a small model and its output layer the dominant cost on these CPUs.
- Training blocks are cut *within* documents (`pack_token_blocks` on one document at a time, the tail of each
  document dropped), so every block is one contiguous text with positions 0..T-1. Vanilla Llama with sdpa does
  not separate packed documents while LazyLlama does; blocks that never straddle a document boundary make the
  two see exactly the same attention context.
- Evaluation: from each Brown-test document its first `4 x context` bytes; perplexity (non-overlapping windows,
  `lazy_llama_tools.metrics.perplexity`) at windows of 1x, 2x and 4x the training length, pooled over documents, so
  the three lengths score the same text. Attention statistics (`lazy_llama_tools.metrics.attention_statistics`) on
  the first training-length block of test documents.

Writes under `--out`: `results.json` (config, losses, evaluation, per-layer statistics), `table.md`, `plots/`
(loss curves, distance-bias curves, tau per head, attention maps, per-layer sink and sparsity) and
`log.txt`.
"""

import argparse
import functools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import AttentionInterface

from lazy_llama_tools.cli import at_least, finite_float, one_line_errors, positive_int
from lazy_llama_tools.data import brown_documents, pack_token_blocks
from lazy_llama_tools.folders import write_text_whole
from lazy_llama_tools.metrics import (
    attention_statistics,
    attention_weights,
    perplexity,
    pooled_attention_statistics,
)
from modeling_lazy import (
    LAZY_PARAMETER_NAMES,
    LazyLlamaConfig,
    LazyLlamaForCausalLM,
    is_lazy_parameter,
    lazy_attention_modules,
)
from modeling_lazy.lazy_attention_reference import (
    compute_dtype,
    distance_bias_scores,
    lazy_visibility,
)

VARIANTS = {
    "vanilla": "LlamaForCausalLM, sdpa attention",
    "lazy": "LazyLlama, the paper's init: tau = --tau-init (-1), distance_bias ~ N(0, 1e-3), both learned",
    "bias_only": "LazyLlama with tau = 0 frozen (plain softmax); distance_bias learned",
    "tau_only": "LazyLlama with distance_bias = 0 frozen; tau learned from --tau-init",
    "norelu": "Elastic-Softmax without the ReLU: a = p + tau/n (no exact zeros); tau, distance_bias as lazy",
    "shift_only": "the tau/n shift alone: a = p + tau/n = p - |tau|/n while tau < 0 (no ReLU, no distance bias: "
                  "frozen at 0); tau learned from --tau-init",
    "scale0.1": "vanilla whose attention output (after o_proj) is multiplied by a fixed 0.1",
    "scale0.3": "vanilla whose attention output (after o_proj) is multiplied by a fixed 0.3",
    "scale0.75": "vanilla whose attention output (after o_proj) is multiplied by a fixed 0.75",
    "scale1": "vanilla through the same scaling hook with 1.0 (identical to vanilla; a check of the hook)",
    "gain": "vanilla with a learnable per-head gain on each head's output (before o_proj), init --gain-init",
    "loggain": "vanilla with a learnable per-head gain exp(g) (g init log --gain-init) trained at its own peak "
               "learning rate --gain-lr, so that it can move far within the run",
    "small_oinit": "vanilla with o_proj initialised x0.02 (the attention output starts near zero)",
}
LAZY_VARIANTS = ("lazy", "bias_only", "tau_only", "norelu", "shift_only")
NORELU_VARIANTS = ("norelu", "shift_only")  # routed to `norelu_attention`
PAPER_VARIANTS = ("vanilla", "lazy", "bias_only", "tau_only")  # the default set of one plain run

# Grids: (cell name, extra arguments) run for every seed; the grid command's own arguments (--steps ...) come first,
# so a cell's arguments override them. Cells run in the order listed, seed by seed (seed 0 of every cell first).
CONTROL_CELLS = [(v, ["--variants", v]) for v in
                 ("vanilla", "lazy", "norelu", "scale0.3", "small_oinit", "gain", "scale0.1", "bias_only", "tau_only")]
SIZE_64 = ["--hidden-size", "64", "--intermediate-size", "192", "--layers", "2"]
SIZE_256 = ["--hidden-size", "256", "--intermediate-size", "768", "--layers", "4"]
GRIDS = {
    "controls": CONTROL_CELLS,
    "controls-core": CONTROL_CELLS[:5],  # the controls that decide what the zeros contribute, when CPU is short
    "sweeps": [
        ("size64-vanilla", ["--variants", "vanilla", *SIZE_64]),
        ("size64-lazy", ["--variants", "lazy", *SIZE_64]),
        ("tau0-lazy", ["--variants", "lazy", "--tau-init", "0"]),
        ("tau-0.25-lazy", ["--variants", "lazy", "--tau-init", "-0.25"]),
        ("tau-0.5-lazy", ["--variants", "lazy", "--tau-init", "-0.5"]),
        ("lr1e-3-vanilla", ["--variants", "vanilla", "--lr", "1e-3"]),
        ("lr1e-3-lazy", ["--variants", "lazy", "--lr", "1e-3"]),
        ("lr4e-3-vanilla", ["--variants", "vanilla", "--lr", "4e-3"]),
        ("lr4e-3-lazy", ["--variants", "lazy", "--lr", "4e-3"]),
        ("size256-vanilla", ["--variants", "vanilla", *SIZE_256]),
        ("size256-lazy", ["--variants", "lazy", *SIZE_256]),
        ("long-vanilla", ["--variants", "vanilla", "--steps-factor", "7"]),  # 1,050 steps at --steps 150
        ("long-lazy", ["--variants", "lazy", "--steps-factor", "7"]),
    ],
    # more seeds of the size sweep (where does the sign flip?); the middle size is the controls grid's vanilla/lazy
    # the mechanism arms: the shift alone, a modest fixed shrink, a gain that can move (150-step protocol)
    "mechanism": [(v, ["--variants", v]) for v in ("shift_only", "scale0.75", "loggain")],
    # equal token budgets: 150 steps x (16 x 128 / T) blocks of T bytes = 307,200 bytes at every length T; one
    # bias window (1,024) that covers 4x every training length
    "budget": [
        (f"ctx{ctx}-{variant}", ["--variants", variant, "--context", str(ctx), "--batch-size", str(16 * 128 // ctx),
                                 "--eval-span", "8", "--eval-docs", "25", *extra])
        for ctx in (64, 128, 256)
        for variant, extra in (("vanilla", []), ("lazy", ["--bias-window", "1024"]),
                               ("norelu", ["--bias-window", "1024"]))
    ],
    "extrapolation": [
        (f"ctx{ctx}-{name}", ["--variants", variant, "--context", str(ctx), "--eval-span", "8", "--sliding", "2",
                              "--eval-docs", "25", *extra])
        for ctx in (128, 64, 256)
        for name, variant, extra in (("vanilla", "vanilla", []), ("lazy-w512", "lazy", ["--bias-window", "512"]),
                                     ("bias_only-w512", "bias_only", ["--bias-window", "512"]))
    ],
}
# more seeds of the size sweep (where does the sign flip?); the middle size is the controls grid's vanilla/lazy
GRIDS["sizes"] = [cell for cell in GRIDS["sweeps"] if cell[0].startswith("size")]
# the tau-init cells with 3 seeds, in the controls' folder so that they pair with its vanilla and lazy
GRIDS["tauinit"] = [cell for cell in GRIDS["sweeps"] if cell[0].startswith("tau")]
GRIDS["long"] = [cell for cell in GRIDS["sweeps"] if cell[0].startswith("long")]  # more seeds of the 7x runs
GRIDS["budget128"] = [cell for cell in GRIDS["budget"] if cell[0].startswith("ctx128-")]  # more seeds at 128
VOCAB = 256  # UTF-8 bytes
EXTRAPOLATION = (1, 2, 4)  # evaluation windows, in multiples of the training length


@functools.cache
def corpus(split: str) -> tuple[str, ...]:
    """The Brown documents of a split, read once per process (a grid worker runs many cells)."""
    return tuple(brown_documents(split))


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def document_blocks(documents: list[str], block_size: int) -> torch.Tensor:
    """`[N, block_size]` int64: each document cut into whole blocks (no block crosses a document boundary)."""
    blocks = [pack_token_blocks([byte_tokens(doc)], block_size)[0] for doc in documents if len(doc) >= block_size]
    return torch.cat(blocks)


def llama_kwargs(args) -> dict:
    """The Llama fields shared by all four variants."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "max_position_embeddings": max(EXTRAPOLATION) * args.context,  # the model refuses longer inputs otherwise
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


NORELU_IMPLEMENTATION = "study_lazy_norelu"


def norelu_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Elastic-Softmax *without* the ReLU: `a_ij = p_ij + tau_h / n_i` on visible pairs (0 elsewhere), the same
    scores and distance bias as Lazy Attention. Always returns the weights (the study's models are small)."""
    metadata = kwargs["lazy_metadata"]
    groups = query.shape[1] // key.shape[1]
    dtype = compute_dtype(query)
    k_len = metadata.key_length
    k = key[:, :, :k_len].to(dtype).repeat_interleave(groups, dim=1)
    v = value[:, :, :k_len].to(dtype).repeat_interleave(groups, dim=1)
    visible = lazy_visibility(metadata)
    scores = torch.matmul(query.to(dtype), k.transpose(2, 3)) * scaling
    scores = scores + distance_bias_scores(module.distance_bias, metadata.q_pos, metadata.k_pos, dtype)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    n = (metadata.q_pos + 1).to(dtype)[:, None, :, None]
    weights = (probs + module.tau.to(dtype)[None, :, None, None] / n) * visible
    out = torch.matmul(weights, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register(NORELU_IMPLEMENTATION, norelu_attention)


class RoutedConfig:
    """A view of a model config that names another attention implementation: given to one attention module
    (`module.config`), it routes that module to `implementation` whatever the model is switched to (the
    statistics switch models to "eager" to read weights; the no-ReLU weights must still be the no-ReLU ones)."""

    def __init__(self, config, implementation: str):
        self._config = config
        self._attn_implementation = implementation

    def __getattr__(self, name):
        return getattr(self._config, name)


def attention_layers(model):
    return getattr(model, "model", model).layers


def add_output_scale(model, scale: float):
    """Multiply every attention block's output (the o_proj output, before the residual add) by `scale`."""
    for layer in attention_layers(model):
        layer.self_attn.o_proj.register_forward_hook(lambda module, inputs, output: output * scale)


def add_head_gain(model, init: float, log_scale: bool = False):
    """A learnable gain per head multiplying each head's output before o_proj: `self_attn.head_gain [H]` itself,
    or with `log_scale` `exp(self_attn.head_log_gain [H])` (initialised at `log(init)`)."""
    if log_scale and init <= 0:
        raise ValueError(f"--gain-init must be > 0 for a log-scale gain, got {init}")
    for layer in attention_layers(model):
        attn = layer.self_attn
        heads = attn.config.num_attention_heads
        if log_scale:
            attn.head_log_gain = torch.nn.Parameter(torch.full((heads,), math.log(init)))
        else:
            attn.head_gain = torch.nn.Parameter(torch.full((heads,), float(init)))

        def scale_heads(module, inputs, attn=attn):
            (x,) = inputs
            gain = attn.head_log_gain.exp() if log_scale else attn.head_gain
            shaped = x.view(*x.shape[:-1], gain.numel(), -1) * gain.to(x.dtype)[:, None]
            return (shaped.view_as(x),)

        attn.o_proj.register_forward_pre_hook(scale_heads)


def build_model(variant: str, args):
    """The model of one variant. All start from the same Llama weights (same seed); the lazy ones add
    `tau` and `distance_bias` initialised and frozen as the variant says, the vanilla controls add a hook."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {list(VARIANTS)}")
    torch.manual_seed(args.seed)
    vanilla = LlamaForCausalLM(LlamaConfig(**llama_kwargs(args), attn_implementation="sdpa"))
    if variant not in LAZY_VARIANTS:
        if variant.startswith("scale"):
            add_output_scale(vanilla, float(variant.removeprefix("scale")))
        elif variant == "gain":
            add_head_gain(vanilla, args.gain_init)
        elif variant == "loggain":
            add_head_gain(vanilla, args.gain_init, log_scale=True)
        elif variant == "small_oinit":
            with torch.no_grad():
                for layer in attention_layers(vanilla):
                    layer.self_attn.o_proj.weight.mul_(args.small_oinit)
        return vanilla
    config = LazyLlamaConfig(**llama_kwargs(args), lazy_bias_window=args.bias_window or args.context,
                             lazy_tau_init=args.tau_init)
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
            elif variant in ("tau_only", "shift_only"):
                attn.distance_bias.zero_()
                attn.distance_bias.requires_grad_(False)
            if variant in NORELU_VARIANTS:
                attn.config = RoutedConfig(model.config, NORELU_IMPLEMENTATION)
    return model


def optimizer(model, args) -> torch.optim.AdamW:
    """AdamW; weight decay on weight matrices only, never on norms, tau, distance_bias or head gains. Log-scale
    head gains get their own group whose learning rate is `--gain-lr` (its `lr_scale` times the schedule)."""
    decay, no_decay, log_gains = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith("self_attn.head_log_gain"):
            log_gains.append(param)
            continue
        lazy_extra = is_lazy_parameter(name) or name.endswith("self_attn.head_gain")
        (decay if param.dim() >= 2 and not lazy_extra else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if log_gains:
        groups.append({"params": log_gains, "weight_decay": 0.0, "lr_scale": args.gain_lr / args.lr})
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
            group["lr"] = learning_rate(step, args) * group.get("lr_scale", 1.0)
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


def eval_segments(test_documents: list[str], args) -> list[torch.Tensor]:
    span = args.eval_span * args.context
    return [torch.tensor(byte_tokens(doc)[:span]) for doc in test_documents if len(doc.encode()) >= span]


@torch.no_grad()
def attention_figures(model, blocks: torch.Tensor) -> dict:
    """`attention_statistics` plus the pooled figures (`pooled_attention_statistics`) of the same blocks."""
    stats = attention_statistics(model, blocks)
    pooled = pooled_attention_statistics(model, blocks)
    for layer, extra in zip(stats["layers"], pooled["layers"]):
        layer.update(extra)
    stats["mean"].update(pooled["mean"])
    return stats


@torch.no_grad()
def evaluate(model, test_documents: list[str], args) -> dict:
    """Perplexity at 1x, 2x, 4x the training length on the same text (non-overlapping windows, and with
    `--sliding k` also windows every 1/k window), and attention statistics at 1x (and, with
    `--stats-factors`, at longer lengths on fewer blocks)."""
    model.eval()
    segments = eval_segments(test_documents, args)
    result = {"eval_documents": len(segments)}
    strides = {"": None}
    if args.sliding:
        strides["sliding_"] = args.sliding
    for prefix, divisor in strides.items():
        for factor in EXTRAPOLATION:
            window = factor * args.context
            doc_nll, doc_tokens = [], []  # per document: summed nats and scored bytes (for a bootstrap)
            for segment in segments:
                scored = perplexity(model, segment, context=window, stride=window // divisor if divisor else None)
                doc_nll.append(scored["nll"] * scored["tokens"])
                doc_tokens.append(scored["tokens"])
            nll, tokens = sum(doc_nll), sum(doc_tokens)
            result[f"{prefix}ppl@{factor}x"] = math.exp(nll / tokens)
            result[f"{prefix}bits_per_byte@{factor}x"] = nll / tokens / math.log(2)
            result[f"{prefix}tokens@{factor}x"] = tokens
            result[f"{prefix}doc_nll@{factor}x"] = doc_nll
            result[f"{prefix}doc_tokens@{factor}x"] = doc_tokens
    for factor in args.stats_factors:
        count = max(1, args.stats_blocks // factor)
        blocks = torch.stack([segment[: factor * args.context] for segment in segments[:count]])
        result["attention" if factor == 1 else f"attention@{factor}x"] = attention_figures(model, blocks)
    return result


def code_version() -> dict:
    """The git commit of this checkout and whether the study code differs from it."""
    root = Path(__file__).resolve().parents[1]

    def git(*cmd):
        try:
            done = subprocess.run(["git", *cmd], check=False, cwd=root, capture_output=True, text=True, timeout=30)
            return done.stdout.rstrip()  # (porcelain lines start with a space: keep it)
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = git("status", "--porcelain", "--", "lazy_llama_tools", "modeling_lazy", "configuration_lazy")
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(dirty),
            "dirty_files": [line[3:] for line in dirty.splitlines()]}


# The code this process runs: a grid worker imports this module once and trains many cells with it, while the
# checkout may move on (commits, edits) in the meantime; each run also records the checkout at its own start.
LOADED_CODE = code_version()


def output_figures(model) -> dict:
    """Per layer: the Frobenius norm of `o_proj.weight` and of each head's column block of it, and the head gains
    of the gain controls (`exp(head_log_gain)` for the log-scale one): how large the attention output can be."""
    figures = {"o_proj_norm": [], "o_proj_head_norm": []}
    for layer in attention_layers(model):
        attn = layer.self_attn
        weight = attn.o_proj.weight.detach().float()
        heads = attn.config.num_attention_heads
        figures["o_proj_norm"].append(weight.norm().item())
        figures["o_proj_head_norm"].append([block.norm().item() for block in weight.chunk(heads, dim=1)])
        if hasattr(attn, "head_log_gain"):
            figures.setdefault("head_gain", []).append(attn.head_log_gain.detach().exp().tolist())
        elif hasattr(attn, "head_gain"):
            figures.setdefault("head_gain", []).append(attn.head_gain.detach().tolist())
    return figures


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
            f"{mean['sink']:.4f} | {mean['surviving_mass']:.4f} | {mean['tau']:+.3f} | "
            f"{run['train_seconds'] / 60:.1f} min |"
        )
    return "\n".join(lines) + "\n"


def per_layer_table(results: dict) -> str:
    """Per layer: sparsity / sink / surviving mass / mean tau of each variant."""
    lines = ["| variant | layer | sparsity | tile density | sink | surviving mass | tau per head |",
             "|---|---|---|---|---|---|---|"]
    for name, run in results["runs"].items():
        for index, layer in enumerate(run["eval"]["attention"]["layers"]):
            avg = {k: sum(v) / len(v) for k, v in layer.items()}
            taus = ", ".join(f"{t:+.2f}" for t in layer["tau"])
            lines.append(f"| {name} | {index} | {avg['sparsity']:.2%} | {avg['tile_density']:.2%} | {avg['sink']:.4f} "
                         f"| {avg['surviving_mass']:.4f} | {taus} |")
    return "\n".join(lines) + "\n"


def make_plots(results: dict, models: dict, test_documents: list[str], args, out: Path):
    """Small PNGs: loss curves, distance-bias curves, tau per head, attention maps, per-layer sink/sparsity.
    (Made here with matplotlib; `lazy_llama_tools.inspect_attention` was not available when this was written.)"""
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
        axes[0].plot([sum(layer["sink"]) / len(layer["sink"]) for layer in layers], marker="o", label=name)
        axes[1].plot([sum(layer["sparsity"]) / len(layer["sparsity"]) for layer in layers], marker="o", label=name)
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
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    parser.add_argument("--out", type=Path, default=Path("runs/replicate"), help="output folder")
    parser.add_argument("--variants", nargs="+", default=list(PAPER_VARIANTS), choices=list(VARIANTS),
                        help="; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    parser.add_argument("--steps", type=positive_int, default=350, help="optimizer steps per variant")
    parser.add_argument("--steps-factor", type=positive_int, default=1,
                        help="multiply --steps (for a grid's longer cells)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="blocks per step")
    parser.add_argument("--context", type=at_least(2), default=128,
                        help="training length T (bytes); eval at T, 2T, 4T")
    parser.add_argument("--hidden-size", type=positive_int, default=128)
    parser.add_argument("--intermediate-size", type=positive_int, default=384)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--lr", type=at_least(0.0, float, strictly=True), default=2e-3,
                        help="peak learning rate, the same for every variant")
    parser.add_argument("--weight-decay", type=at_least(0.0, float), default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tau-init", type=finite_float, default=-1.0, help="initial tau of lazy, tau_only, norelu")
    parser.add_argument("--bias-window", type=positive_int, default=None,
                        help="distance-bias window W (default: --context)")
    parser.add_argument("--gain-init", type=float, default=1.0,
                        help="initial head gain of the `gain` and `loggain` variants")
    parser.add_argument("--gain-lr", type=float, default=5e-2,
                        help="peak learning rate of `loggain`'s log gains (same schedule as --lr)")
    parser.add_argument("--small-oinit", type=float, default=0.02, help="o_proj init factor of `small_oinit`")
    parser.add_argument("--eval-span", type=at_least(max(EXTRAPOLATION)), default=max(EXTRAPOLATION),
                        help="bytes of each test document evaluated, in multiples of --context")
    parser.add_argument("--sliding", type=at_least(0), default=0,
                        help="also evaluate with windows every 1/k window (0: only non-overlapping windows)")
    parser.add_argument("--stats-factors", type=positive_int, nargs="+", default=list(EXTRAPOLATION),
                        help="lengths (multiples of --context) at which attention statistics are measured")
    parser.add_argument("--train-docs", type=positive_int, default=None,
                        help="use only the first N Brown-train documents")
    parser.add_argument("--eval-docs", type=positive_int, default=None,
                        help="use only the first N Brown-test documents")
    parser.add_argument("--stats-blocks", type=positive_int, default=16,
                        help="test blocks for the attention statistics")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch.set_num_threads (1: on a shared 2-core machine 2 threads ran 7x slower)")
    parser.add_argument("--log-every", type=positive_int, default=25)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--grid", choices=list(GRIDS), default=None,
                        help="run a grid of configurations (one process each, results under --out/CELL/seedS)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of a --grid")
    parser.add_argument("--jobs", type=positive_int, default=1, help="grid cells run at once")
    parser.add_argument("--order", choices=("seed", "cell"), default="seed",
                        help="grid order: all cells of one seed first, or all seeds of one cell first")
    parser.add_argument("--nice", type=int, default=19, help="niceness of a grid's processes")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # set by the grid itself
    args = parser.parse_args(argv)
    if args.hidden_size % args.heads or (args.hidden_size // args.heads) % 2:
        parser.error(f"--hidden-size ({args.hidden_size}) must split into --heads ({args.heads}) heads of an even "
                     "size (rotary embeddings rotate pairs of channels)")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: give a folder (it is created if missing)")
    if max(args.stats_factors) > args.eval_span:
        parser.error(f"--stats-factors {max(args.stats_factors)} is longer than --eval-span ({args.eval_span}): the "
                     "test segments hold eval-span x context bytes")
    if "loggain" in args.variants and args.gain_init <= 0:
        parser.error(f"--gain-init must be > 0 for `loggain` (its gain is exp(g), g = log of it); got {args.gain_init}")
    args.steps *= args.steps_factor
    return args


def grid_cells(args) -> list[tuple[str, int, list[str]]]:
    """`(cell, seed, extra arguments)` in run order: `--order seed` runs every cell of seed 0, then of seed 1, ...;
    `--order cell` runs every seed of the first cell, then of the second, ... (when time may run out, the first
    cells then have all their seeds)."""
    if getattr(args, "order", "seed") == "cell":
        return [(cell, seed, extra) for cell, extra in GRIDS[args.grid] for seed in args.seeds]
    return [(cell, seed, extra) for seed in args.seeds for cell, extra in GRIDS[args.grid]]


def run_grid(args, argv: list[str]) -> list[str]:
    """Run every (cell, seed) of `--grid` under `--out/CELL/seedS`, skipping those whose `results.json` says
    `finished`. `--jobs` worker processes (niced) each run every `jobs`-th cell one after another in-process
    (one interpreter start and one corpus load per worker, not per cell); their output goes to
    `--out/worker-K.txt`."""
    passed = cell_arguments(args, argv)
    cells = grid_cells(args)
    if args.worker is not None:
        done = []
        for cell, seed, extra in cells[args.worker :: args.jobs]:
            out = args.out / cell / f"seed{seed}"
            if not finished_run(out / "results.json"):
                print(f"[{time.strftime('%H:%M:%S')}] {cell} seed {seed}: start", flush=True)
                main([*passed, "--no-plots", "--seed", str(seed), "--out", str(out), *extra])
            done.append(str(out))
        return done
    for cell, seed, extra in cells:  # every cell's own options, checked before any cell trains
        parse_args([*passed, "--seed", str(seed), "--out", str(args.out / cell / f"seed{seed}"), *extra])
    make_out_folder(args.out)
    workers = []
    for worker in range(args.jobs):
        command = ["nice", "-n", str(args.nice), sys.executable, "-m", "lazy_llama_tools.replicate", *passed,
                   "--grid", args.grid, "--seeds", *map(str, args.seeds), "--jobs", str(args.jobs),
                   "--out", str(args.out), "--worker", str(worker), "--order", args.order]
        handle = open(args.out / f"worker-{worker}.txt", "a", encoding="utf-8")  # noqa: SIM115 (closed below)
        workers.append((subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT), handle))
    failed = []
    for worker, (process, handle) in enumerate(workers):
        process.wait()
        handle.close()
        print(f"[{time.strftime('%H:%M:%S')}] worker exit {process.returncode}", flush=True)
        if process.returncode:
            failed.append(f"worker {worker} exited with {process.returncode}: see {args.out / f'worker-{worker}.txt'}")
    if failed:
        raise SystemExit(f"replicate: error: {'; '.join(failed)} (finished cells are kept: the same command "
                         "resumes the grid)")
    return [str(args.out / cell / f"seed{seed}") for cell, seed, _ in cells]


def cell_arguments(args, argv: list[str]) -> list[str]:
    """`argv` without the grid's own options (`--grid`, `--seeds`, `--out`, ...), in either spelling (`--grid NAME`
    or `--grid=NAME`): what every cell of the grid runs with (a cell handed `--grid` would start a grid itself)."""
    drop = {"--grid": 1, "--seeds": len(args.seeds), "--jobs": 1, "--out": 1, "--nice": 1, "--worker": 1,
            "--order": 1}
    passed, skip = [], 0
    for item in argv:
        if skip:
            skip -= 1
        elif item in drop:
            skip = drop[item]
        elif item.split("=", 1)[0] not in drop:
            passed.append(item)
    return passed


def finished_run(path: Path) -> bool:
    """Whether `path` is a results.json that says `finished`; an unreadable one (a run killed while writing it)
    counts as unfinished, so that the cell runs again."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("finished"))


def make_out_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"replicate: error: cannot create --out {out}: {error.strerror or error}") from None


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.grid:
        return {"grid": args.grid, "runs": run_grid(args, argv)}
    torch.set_num_threads(args.threads)
    make_out_folder(args.out)
    log_file = open(args.out / "log.txt", "a", encoding="utf-8")  # noqa: SIM115 (closed at the end of main)

    def log(message: str):
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    train_documents = corpus("train")[: args.train_docs]
    test_documents = corpus("test")[: args.eval_docs]
    if not any(len(doc) >= args.context for doc in train_documents):
        raise SystemExit(f"replicate: error: no training document holds a block of --context {args.context} bytes: "
                         "lower --context or raise --train-docs")
    if not eval_segments(test_documents, args):
        raise SystemExit(f"replicate: error: no test document holds --eval-span x --context = "
                         f"{args.eval_span * args.context} bytes: lower --context or raise --eval-docs")
    blocks = document_blocks(train_documents, args.context)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {"config": config, "train_blocks": blocks.shape[0],
               "train_tokens_per_variant": args.steps * args.batch_size * args.context,
               "torch": torch.__version__, "code": LOADED_CODE,
               "code_at_start": code_version(), "command": "python -m lazy_llama_tools.replicate "
               + " ".join(argv), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": {}}
    log(f"code {LOADED_CODE['commit']}" + (f" + uncommitted {LOADED_CODE['dirty_files']}" if LOADED_CODE["dirty"]
                                              else ""))
    log(f"{blocks.shape[0]} training blocks of {args.context} bytes; {args.steps} steps x {args.batch_size} blocks "
        f"= {results['train_tokens_per_variant']:,} tokens per variant "
        f"({results['train_tokens_per_variant'] / blocks.numel():.2f} epochs)")
    models = {}
    for variant in args.variants:
        model = build_model(variant, args)
        parameters = sum(p.numel() for p in model.parameters())
        log(f"{variant}: {type(model).__name__}, {parameters:,} parameters, attn={model.config._attn_implementation}")
        segments = eval_segments(test_documents, args)[: args.stats_blocks]
        init_blocks = torch.stack([segment[: args.context] for segment in segments])
        init_attention = attention_figures(model, init_blocks)  # step 0: what the init imposes
        init_output = output_figures(model)
        run = {"parameters": parameters, "init_attention": init_attention, "init_output": init_output,
               **train(model, blocks, args, log)}
        start = time.time()
        run["eval"] = evaluate(model, test_documents, args)
        run["eval_seconds"] = time.time() - start
        run["learned"] = lazy_parameters(model)
        run["output"] = output_figures(model)
        ev = run["eval"]
        log(f"{variant}: ppl {ev['ppl@1x']:.3f} / {ev['ppl@2x']:.3f} / {ev['ppl@4x']:.3f} at 1x/2x/4x; "
            f"sparsity {ev['attention']['mean']['sparsity']:.2%}, sink {ev['attention']['mean']['sink']:.4f}; "
            f"train {run['train_seconds']:.0f}s, eval {run['eval_seconds']:.0f}s")
        results["runs"][variant] = run
        models[variant] = model
        # after each variant, so that partial results survive
        write_text_whole(args.out / "results.json", json.dumps(results, indent=1))
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_text_whole(args.out / "results.json", json.dumps(results, indent=1))
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
