"""The five command-line tools' arguments, parsed before anything heavy is imported.

`lazy-convert`, `lazy-inspect`, `lazy-evaluate`, `lazy-push` and `lazy-finetune` share one convention:

- the model or folder they work on is the first positional argument (`lazy-push FOLDER REPO_ID`, `lazy-convert
  SRC OUT`, `lazy-finetune MODEL ...`); every option is spelled with hyphens (`--tau-init`); the
  underscore spellings `lazy-finetune` used to take (`--tau_init`, `--output_dir`, ...) still work and print one
  deprecation line;
- `--dtype` takes `auto` (the default: the dtype the checkpoint stores) or a dtype name, in every tool that loads
  weights for inference or conversion (`lazy-finetune` keeps float32 master weights: `--bf16` trains in mixed
  precision);
- metavars name what a value is (`DIR`, `FILE`, `N`, ...).

This module imports only the standard library: `--help` and argument errors answer at once, and torch and
transformers are imported by the tool's own module after the arguments are parsed (each tool's `run(args)`).
"""

import argparse
import importlib
import math
import re
import signal
import sys
import threading

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float64")
DTYPE_HELP = "weights dtype: auto (the checkpoint's own), float32, bfloat16, float16 or float64 (default: auto)"
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|(cuda|xpu|npu|hpu)(:\d+)?)$")

# Defaults the tools' modules read from here (one place for the value the help text shows)
VERIFY_TOLERANCE = 1e-4  # lazy-convert --verify: max abs logit difference
DEFAULT_BIAS_WINDOW = 1024
PUSH_TIMEOUT = 60.0  # seconds without an answer before a request gives up
PUSH_RETRIES = 2
PUSH_COMMIT_MESSAGE = "Upload LazyLlama checkpoint (lazy-push)"
TAU_ZERO = "tau=0"  # lazy-inspect --baseline: MODEL with every tau set to 0
SEED_LIMIT = 2**64  # lazy-convert --seed: torch.Generator.manual_seed takes 0 .. 2**64 - 1
SIZE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


# ------------------------------------------------------------------------------------------------ types


def at_least(minimum: float, kind: type = int, *, strictly: bool = False, below: float | None = None):
    """An `argparse` type: a finite `kind` (int or float) >= `minimum` (> with `strictly`) and < `below` (if
    given), checked when parsed."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):  # (an int is finite, however long)
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < minimum or strictly and value == minimum:
            raise argparse.ArgumentTypeError(f"must be {'more than' if strictly else 'at least'} {minimum}, got {text}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"must be less than {below}, got {text}")
        return value

    parse.__name__ = kind.__name__  # what argparse names in "invalid ... value"
    return parse


positive_int = at_least(1)
finite_float = at_least(-math.inf, float)


def parse_size(size: str | int) -> int:
    """Bytes in "5GB", "500MB", "64KiB" or a plain number of bytes; ValueError unless it is at least one byte."""
    text, factor = str(size).strip().upper(), 1
    for unit, unit_bytes in SIZE_UNITS.items():
        if text.endswith(unit):
            text, factor = text[: -len(unit)], unit_bytes
            break
    try:
        value = float(text) * factor
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"expected a positive size such as 2GB, 500MB or a number of bytes, got {size!r}")
    return int(value)


def byte_size(text: str) -> int:
    """`argparse` type: a size in bytes, spelled as `parse_size` reads it."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def device_name(text: str) -> str:
    """`argparse` type: the spelling of a device (auto, cpu, cuda, cuda:1, ...). Whether this machine has it is
    checked after parsing, once torch is imported (`lazy_llama_tools.loading.resolve_device`)."""
    if not DEVICE_PATTERN.match(text):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use auto, cpu, cuda or cuda:N")
    return text


def boolean(text: str) -> bool:
    """`argparse` type for `--flag true|false` (what transformers' options take)."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def hyphenated(argv: list[str], prog: str) -> list[str]:
    """`argv` with every `--some_option` spelled `--some-option`; one deprecation line on stderr names them."""
    old, out = [], []
    for token in argv:
        if token == "--":
            out += argv[len(out):]
            break
        name, sep, value = token.partition("=")
        if name.startswith("--") and "_" in name:
            old.append(name)
            token = name.replace("_", "-") + sep + value
        out.append(token)
    if old:
        new = [name.replace("_", "-") for name in old]
        print(f"{prog}: deprecated option spelling {', '.join(old)}: use {', '.join(new)}", file=sys.stderr)
    return out


def _args(argv):
    return list(sys.argv[1:] if argv is None else argv)


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser`, answering a bad command line in one line (`PROG: error: WHAT (PROG --help lists the options)`,
    exit status 2) instead of argparse's usage block above it; a message that names a --help option keeps its own
    hint."""

    def error(message: str):
        hint = "" if "--help" in message else f" (`{parser.prog} --help` lists the options)"
        parser.exit(2, f"{parser.prog}: error: {message}{hint}\n")

    parser.error = error
    return parser


# ------------------------------------------------------------------------------------------------ parsers


def convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazy-convert",
        description="Convert a Llama checkpoint (HF folder or GGUF file) into a LazyLlama checkpoint.",
    )
    parser.add_argument("source", metavar="SRC", help="Hugging Face Llama folder or Llama .gguf file")
    parser.add_argument("output", metavar="OUT", help="folder to create")
    parser.add_argument("--tau-init", type=finite_float, default=0.0, metavar="TAU",
                        help="Elastic-Softmax tau of every head, a finite number (default: 0, exact)")
    parser.add_argument("--bias-window", type=positive_int, metavar="W",
                        help=f"distances with a learnable bias, at most max_position_embeddings "
                             f"(default: {DEFAULT_BIAS_WINDOW}, or max_position_embeddings if smaller)")
    parser.add_argument("--bias-init-std", type=at_least(0.0, float), default=0.0, metavar="STD",
                        help="std of the initial distance bias, a finite number >= 0 (default: 0, exact)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, metavar="DTYPE",
                        help=DTYPE_HELP.replace("checkpoint's own", "source's: its config.json, else its tensors; "
                                                                    "GGUF: float32"))
    parser.add_argument("--max-shard-size", type=byte_size, default="2GB", metavar="SIZE",
                        help="largest output shard, e.g. 2GB, 500MB (default: %(default)s)")
    parser.add_argument("--verify", action="store_true", help="compare logits with the source; fail above tolerance")
    parser.add_argument("--verify-tolerance", type=at_least(0.0, float), default=VERIFY_TOLERANCE, metavar="DIFF",
                        help="max abs logit difference, a finite number >= 0 (default: %(default)g)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT that holds a model")
    parser.add_argument("--seed", type=at_least(0, below=SEED_LIMIT), default=0, metavar="N",
                        help="seed of the distance-bias initialisation, 0 .. 2**64 - 1 (default: %(default)s)")
    parser.add_argument("--base-model", metavar="REPO_ID", help="Hub id of the source, for the model card")
    parser.add_argument("--license", metavar="NAME", help="license of the weights, for the model card")
    return one_line_errors(parser)


def inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazy-inspect",
        description="Attention statistics and plots (sparsity, tile density, sink, surviving mass, tau, distance "
        "bias, attention maps) of a LazyLlama checkpoint, optionally side by side with a baseline.",
    )
    parser.add_argument("model", metavar="MODEL", help="LazyLlama folder or Hub id (converted or trained)")
    parser.add_argument("--text", metavar="FILE",
                        help="UTF-8 text file to measure on (default: the Brown Corpus test split)")
    parser.add_argument("--baseline", metavar="MODEL", help="vanilla Llama or LazyLlama folder with the same "
                        f"tokenizer, or '{TAU_ZERO}' for MODEL with every tau set to 0")
    parser.add_argument("--out", default="inspect-out", metavar="DIR", help="output folder (default: %(default)s)")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: MODEL's)")
    parser.add_argument("--tokens", type=at_least(2), default=512, metavar="N",
                        help="tokens per window, at least 2: the sink is measured on queries after the first "
                             "(default: %(default)s)")
    parser.add_argument("--windows", type=positive_int, default=1, metavar="N",
                        help="consecutive windows to average over (default: %(default)s; memory grows with layers x "
                             "heads x windows x tokens^2)")
    parser.add_argument("--repeated-length", type=at_least(2), default=128, metavar="N",
                        help="length of the repeated-token sequence, at least 2 (default: %(default)s)")
    parser.add_argument("--map-tokens", type=positive_int, default=64, metavar="N",
                        help="tokens shown in attention maps (default: %(default)s)")
    parser.add_argument("--map-layers", metavar="L,L,...",
                        help="comma-separated layers for the attention maps (default: first, middle, last)")
    parser.add_argument("--device", default="auto", type=device_name, metavar="DEVICE",
                        help="auto (CUDA if available), cpu, cuda, cuda:1, ... (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, metavar="DTYPE", help=DTYPE_HELP)
    return one_line_errors(parser)


def evaluate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazy-evaluate",
                                     description="Sliding-window perplexity of a LazyLlama checkpoint on a text file.")
    parser.add_argument("model", metavar="MODEL", help="LazyLlama folder or Hub id (converted or trained)")
    parser.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file to score")
    parser.add_argument("--context", type=at_least(2), default=512, metavar="N",
                        help="tokens per window, at least 2: a token and its history (default: %(default)s)")
    parser.add_argument("--stride", type=positive_int, metavar="N",
                        help="tokens between window starts, 1..context; capped at context - 1 so that windows overlap "
                             "by a token (default: context - 1)")
    parser.add_argument("--max-tokens", type=positive_int, metavar="N",
                        help="score only the first N tokens of the text")
    parser.add_argument("--baseline", metavar="MODEL",
                        help="also score a vanilla Llama or LazyLlama with the same tokenizer")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: MODEL's)")
    parser.add_argument("--json", metavar="FILE", help="also write the results to this JSON file")
    parser.add_argument("--device", default="auto", type=device_name, metavar="DEVICE",
                        help="auto (CUDA if available), cpu, cuda, cuda:1, ... (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, metavar="DTYPE", help=DTYPE_HELP)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return one_line_errors(parser)


def push_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazy-push",
        description="Publish a LazyLlama folder to the Hugging Face Hub in one commit, "
                    "with its code files and a model card.",
    )
    parser.add_argument("folder", metavar="FOLDER", help="folder written by the converter or by save_pretrained")
    parser.add_argument("repo_id", metavar="REPO_ID", help="target repository, 'namespace/name' (created if missing)")
    parser.add_argument("--private", action="store_true",
                        help="create the repository private (an existing one keeps its visibility)")
    parser.add_argument("--revision", metavar="BRANCH",
                        help="branch to commit to (created from main if missing); default main")
    parser.add_argument("--commit-message", metavar="TEXT", help=f"default: {PUSH_COMMIT_MESSAGE!r}")
    parser.add_argument("--create-pr", action="store_true",
                        help="open a pull request instead of committing to the branch")
    parser.add_argument("--token", metavar="TOKEN", help="Hub token; default: HF_TOKEN, then the `hf auth login` cache")
    parser.add_argument("--stats", metavar="FILE", help="JSON file of measured attention statistics for the model card "
                                                        "(default: FOLDER/attention_stats.json if present)")
    parser.add_argument("--include", action="append", default=[], metavar="PATTERN",
                        help="also upload the files matching this glob pattern, relative to FOLDER (repeatable); by "
                             "default only the model's files are uploaded")
    parser.add_argument("--timeout", type=at_least(0.0, float, strictly=True), default=PUSH_TIMEOUT, metavar="SECONDS",
                        help="seconds without an answer before a request gives up (default: %(default)g)")
    parser.add_argument("--retries", type=at_least(0), default=PUSH_RETRIES, metavar="N",
                        help="retries after a time-out, a lost connection, 429 or 502/503/504 (default: %(default)s)")
    return one_line_errors(parser)


FINETUNE_MODES = ("full", "lazy-only", "lora")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def finetune_parser() -> argparse.ArgumentParser:
    """`lazy-finetune`'s own options; the rest of the command line goes to `transformers.TrainingArguments`."""
    parser = argparse.ArgumentParser(
        prog="lazy-finetune",
        usage="lazy-finetune MODEL --train-file FILE [FILE ...] --output-dir DIR [options] [TrainingArguments options]",
        description="Fine-tune a LazyLlama (or a Llama, converted on load) with transformers.Trainer.",
        epilog="Every transformers.TrainingArguments option is accepted too, hyphenated (--output-dir DIR is "
               "required; --max-steps N, --learning-rate LR, --bf16 true, --eval-strategy steps, "
               "--gradient-checkpointing true, --resume-from-checkpoint last, ...): `lazy-finetune --help-training` "
               "lists them.",
    )
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="LazyLlama or Llama folder (a Llama converts on load at --tau-init, --bias-init-std)")
    parser.add_argument("--help-training", action="store_true",
                        help="list the transformers.TrainingArguments options and exit (imports transformers)")
    parser.add_argument("--train-file", nargs="+", default=[], metavar="FILE", help="text or JSON-lines files")
    parser.add_argument("--eval-file", nargs="+", default=[], metavar="FILE", help="text or JSON-lines files")
    parser.add_argument("--text-column", default="text", metavar="NAME",
                        help="document field of JSON-lines records (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=512, metavar="N",
                        help="tokens per packed block (default: %(default)s)")
    parser.add_argument("--max-train-blocks", type=positive_int, metavar="N",
                        help="keep only the first N training blocks")
    parser.add_argument("--max-eval-blocks", type=positive_int, metavar="N",
                        help="keep only the first N evaluation blocks")
    parser.add_argument("--mode", default="full", choices=FINETUNE_MODES, help="what trains (default: %(default)s)")
    parser.add_argument("--lazy-lr-multiplier", type=at_least(0.0, float), default=1.0, metavar="FACTOR",
                        help="learning-rate factor for tau/distance_bias, a finite number >= 0 (default: %(default)g)")
    parser.add_argument("--tau-init", type=finite_float, default=0.0, metavar="TAU",
                        help="tau for a Llama input, a finite number (default: 0, exact conversion)")
    parser.add_argument("--bias-init-std", type=at_least(0.0, float), default=0.0, metavar="STD",
                        help="distance_bias std for a Llama input, a finite number >= 0 (default: 0)")
    parser.add_argument("--lora-r", type=positive_int, default=8, metavar="R", help="LoRA rank (mode lora; default 8)")
    parser.add_argument("--lora-alpha", type=positive_int, default=16, metavar="ALPHA",
                        help="LoRA alpha (mode lora; default 16)")
    parser.add_argument("--lora-dropout", type=at_least(0.0, float, below=1.0), default=0.0, metavar="P",
                        help="LoRA dropout probability, 0 <= P < 1 (mode lora; default 0)")
    parser.add_argument("--lora-target-modules", nargs="+", default=list(DEFAULT_LORA_TARGETS), metavar="NAME",
                        help="modules that get LoRA adapters (mode lora; default: %(default)s)")
    parser.add_argument("--lora-train-lazy", type=boolean, default=True, metavar="true|false",
                        help="train tau/distance_bias beside the LoRA adapters and save them in the adapter file "
                             "(mode lora; default: true)")
    parser.add_argument("--stats-tokens", type=at_least(2), default=256, metavar="N",
                        help="probe length of the attention-statistics callback, at least 2 (default: %(default)s)")
    parser.add_argument("--stats-every-n-logs", type=positive_int, default=1, metavar="N",
                        help="attention statistics every N training logs (default: %(default)s)")
    parser.add_argument("--auto-bf16", type=boolean, default=True, metavar="true|false",
                        help="train in bf16 mixed precision on CUDA GPUs that support it (default: true)")
    parser.add_argument("--fsdp-size", type=positive_int, default=1, metavar="N",
                        help="FSDP2: shard the model over N processes (torchrun --nproc_per_node N); 1 = replicated "
                             "(DDP under torchrun)")
    return one_line_errors(parser)


def parse_finetune(argv=None):
    """`(args, training_argv)`: lazy-finetune's own options and the rest of the command line (hyphenated) for
    `transformers.TrainingArguments`. MODEL comes first (the old `--model-name-or-path MODEL` is moved there, with
    a deprecation line), so that no value of a TrainingArguments option can be taken for it. Exits with one line
    on bad input."""
    parser = finetune_parser()
    # the old --model_name_or_path gets the one line below (give MODEL first), not a second about its spelling
    argv = [token.replace("--model_name_or_path", "--model-name-or-path", 1)
            if token.partition("=")[0] == "--model_name_or_path" else token for token in _args(argv)]
    argv = hyphenated(argv, parser.prog)
    for index, token in enumerate(argv):
        name, sep, value = token.partition("=")
        if name == "--model-name-or-path":
            if not sep and index + 1 >= len(argv):
                parser.error("argument --model-name-or-path: expected one argument")
            if argv[0] != token and not argv[0].startswith("-"):
                parser.error("give the model once: as MODEL (the first argument), not also as --model-name-or-path")
            model = value if sep else argv[index + 1]
            argv = [model, *argv[:index], *argv[index + (1 if sep else 2):]]
            print("lazy-finetune: --model-name-or-path is deprecated: give the model as the first argument",
                  file=sys.stderr)
            break
    args, rest = parser.parse_known_args(argv)
    if not args.help_training:
        if args.model is None:
            parser.error("the following arguments are required: MODEL")
        if args.model != argv[0]:
            parser.error(f"MODEL must be the first argument (lazy-finetune MODEL --train-file FILE ...), got "
                         f"{args.model!r} after {argv[0]!r}")
        if not args.train_file:
            parser.error("the following arguments are required: --train-file")
    return args, rest


# ------------------------------------------------------------------------------------------------ console scripts


def _run_tool(prog: str, argv, module: str, *run_args) -> int:
    """`run(*run_args)` of the tool's `module`, imported here, with SIGTERM and SIGHUP raising `KeyboardInterrupt` as
    Ctrl-C does from the first moment: the imports take seconds (torch, transformers), and a signal there gave a
    traceback (Ctrl-C) or a silent death (SIGTERM). Each tool's own run handles the signals that reach it later.
    From the command line (`argv` None), signals after the tool has returned (while Python shuts down, about a
    second with torch loaded: the output is complete) are ignored, so the exit status is the tool's."""
    from lazy_llama_tools.folders import INTERRUPT_SIGNALS, terminations_as_interrupts

    code = 1
    try:
        with terminations_as_interrupts():
            code = importlib.import_module(module).run(*run_args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted before it began its work; nothing was written.", file=sys.stderr)
        code = 130
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else int(done.code is not None)
        raise
    finally:
        if argv is None and threading.current_thread() is threading.main_thread():
            sys.stdout.flush()
            sys.stderr.flush()
            for number in INTERRUPT_SIGNALS:  # (a Python handler would be reset to the default while it shuts down)
                signal.signal(number, signal.SIG_IGN)
    return code


def lazy_convert(argv=None) -> int:
    args = convert_parser().parse_args(_args(argv))
    return _run_tool("lazy-convert", argv, "conversion.convert_llama_to_lazy", args)


def lazy_inspect(argv=None) -> int:
    args = inspect_parser().parse_args(_args(argv))
    return _run_tool("lazy-inspect", argv, "lazy_llama_tools.inspect_attention", args)


def parse_evaluate(argv=None) -> argparse.Namespace:
    """`lazy-evaluate`'s arguments; a `--stride` longer than `--context` is refused here (exit status 2)."""
    parser = evaluate_parser()
    args = parser.parse_args(_args(argv))
    if args.stride is not None and args.stride > args.context:
        parser.error(f"argument --stride: must be at most --context ({args.context}), got {args.stride}")
    return args


def lazy_evaluate(argv=None) -> int:
    args = parse_evaluate(argv)
    return _run_tool("lazy-evaluate", argv, "lazy_llama_tools.evaluate", args)


def lazy_push(argv=None) -> int:
    args = push_parser().parse_args(_args(argv))
    return _run_tool("lazy-push", argv, "conversion.push_to_hub", args)


def lazy_finetune(argv=None) -> int:
    args, training_argv = parse_finetune(argv)
    return _run_tool("lazy-finetune", argv, "lazy_llama_tools.finetune", args, training_argv)
