"""The five command-line tools feel like one: hyphenated options (old underscore spellings of `lazy-finetune`
accepted with a deprecation line), the model or folder first, `--dtype auto` by default, metavars that name what
a value is, and `--help` at once (arguments are parsed before torch and transformers are imported)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lazy_llama_tools import cli

ROOT = Path(__file__).resolve().parents[1]
TOOLS = {
    "lazy-convert": ("lazy_convert", cli.convert_parser),
    "lazy-inspect": ("lazy_inspect", cli.inspect_parser),
    "lazy-evaluate": ("lazy_evaluate", cli.evaluate_parser),
    "lazy-push": ("lazy_push", cli.push_parser),
    "lazy-finetune": ("lazy_finetune", cli.finetune_parser),
}
FIRST_POSITIONAL = {"lazy-convert": "SRC", "lazy-inspect": "MODEL", "lazy-evaluate": "MODEL", "lazy-push": "FOLDER",
                    "lazy-finetune": "MODEL"}


def _run_tool(function: str, *args: str) -> subprocess.CompletedProcess:
    """The console script's function in a fresh interpreter (what `lazy-...` runs), reporting whether torch or
    transformers got imported."""
    code = (f"import sys, atexit\nfrom lazy_llama_tools.cli import {function}\n"
            "atexit.register(lambda: print('heavy imports:', sorted({'torch', 'transformers'} & set(sys.modules)), "
            "file=sys.stderr))\n"
            f"sys.exit({function}())")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tool", list(TOOLS))
def test_help_answers_within_a_second_without_importing_torch(tool):
    function, _ = TOOLS[tool]
    _run_tool(function, "--help")  # warm the file cache once
    start = time.perf_counter()
    result = _run_tool(function, "--help")
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {tool} ") and "heavy imports: []" in result.stderr, result.stderr
    assert seconds < 1.0, f"{tool} --help took {seconds:.2f} s"


@pytest.mark.parametrize("tool", list(TOOLS))
def test_one_option_convention(tool):
    _, build = TOOLS[tool]
    parser = build()
    positionals = [action for action in parser._actions if not action.option_strings]
    assert positionals[0].metavar == FIRST_POSITIONAL[tool]
    for action in parser._actions:
        for option in action.option_strings:
            assert "_" not in option, (tool, option)
        takes_value = action.option_strings and action.nargs != 0 and action.help != "==SUPPRESS=="
        if takes_value:  # a metavar of its own (FILE, DIR, N, ...) or its choices, never argparse's DEST_NAME
            assert action.metavar or action.choices, (tool, action.option_strings)
        if "--dtype" in action.option_strings:
            assert action.default == "auto" and action.choices == cli.DTYPE_CHOICES, tool
    # the tools that load weights for inference or conversion take --dtype (lazy-finetune keeps float32 master
    # weights and trains in mixed precision with --bf16; lazy-push uploads files as they are)
    has_dtype = any("--dtype" in action.option_strings for action in parser._actions)
    assert has_dtype == (tool in ("lazy-convert", "lazy-inspect", "lazy-evaluate")), tool


def test_finetune_takes_the_old_spellings_with_one_deprecation_line(capsys):
    args, rest = cli.parse_finetune(["--model_name_or_path", "some/model", "--train_file", "a.txt", "b.txt",
                                     "--tau_init=-0.5", "--lora_train_lazy", "false", "--output_dir", "out",
                                     "--max_steps", "3", "--bf16"])
    assert args.model == "some/model" and args.train_file == ["a.txt", "b.txt"] and args.tau_init == -0.5
    assert args.lora_train_lazy is False
    assert rest == ["--output-dir", "out", "--max-steps", "3", "--bf16"]  # for TrainingArguments, hyphenated
    lines = capsys.readouterr().err.splitlines()
    assert lines == [  # the old model option points to MODEL, not to another deprecated spelling
        "lazy-finetune: deprecated option spelling --train_file, --tau_init, --lora_train_lazy, --output_dir, "
        "--max_steps: use --train-file, --tau-init, --lora-train-lazy, --output-dir, --max-steps",
        "lazy-finetune: --model-name-or-path is deprecated: give the model as the first argument",
    ]
    new, rest = cli.parse_finetune(["some/model", "--train-file", "a.txt", "--output-dir", "out"])
    assert new.model == "some/model" and rest == ["--output-dir", "out"] and capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, message", [
    (["--train-file", "a.txt"], "the following arguments are required: MODEL"),
    (["m"], "the following arguments are required: --train-file"),
    (["m", "--model-name-or-path", "n", "--train-file", "a"], "give the model once"),
    (["--output-dir", "out", "m", "--train-file", "a"], "MODEL must be the first argument"),
    (["m", "--train-file", "a", "--lora-train-lazy", "maybe"], "expected true or false, got 'maybe'"),
    (["m", "--train-file", "a", "--tau-init", "nan"], "argument --tau-init: must be a finite number, got nan"),
    (["m", "--train-file", "a", "--lazy-lr-multiplier", "nan"], "--lazy-lr-multiplier: must be a finite number"),
    (["m", "--train-file", "a", "--bias-init-std", "-5"], "--bias-init-std: must be at least 0.0, got -5"),
    (["m", "--train-file", "a", "--lora-dropout", "5"], "--lora-dropout: must be less than 1.0, got 5"),
    (["m", "--train-file", "a", "--stats-tokens", "1"], "--stats-tokens: must be at least 2, got 1"),
])
def test_finetune_refuses_bad_command_lines_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_finetune(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err  # one line: no usage block above it


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_bad_command_line_is_one_line(tool, capsys):
    """argparse's own errors (an unknown option, a bad value) come without its usage block: one line that names the
    tool, what was wrong, and where the options are listed; exit status 2."""
    _, build = TOOLS[tool]
    for argv in (["--no-such-option"], ["x", "y", "--dtype", "int3"]):
        with pytest.raises(SystemExit) as exit_info:
            build().parse_args(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"{tool}: error: ") and f"`{tool} --help` lists the options" in err, err


def test_a_bad_device_spelling_is_refused_before_torch_loads():
    result = _run_tool("lazy_evaluate", "m", "--text", "t.txt", "--device", "banana")
    assert result.returncode == 2 and "unknown device 'banana'" in result.stderr
    assert "heavy imports: []" in result.stderr


def test_finetune_training_options_reach_training_arguments(tmp_path):
    """The rest of the command line goes to TrainingArguments (hyphenated), and unknown options are refused."""
    from lazy_llama_tools.finetune import training_arguments

    args, rest = cli.parse_finetune(["m", "--train-file", "a", "--output_dir", str(tmp_path), "--max-steps", "7",
                                     "--learning-rate", "0.5", "--use-cpu", "true"])
    training = training_arguments(args, rest)
    assert (training.output_dir, training.max_steps, training.learning_rate) == (str(tmp_path), 7, 0.5)
    args, rest = cli.parse_finetune(["m", "--train-file", "a", "--output-dir", str(tmp_path), "--no-such-option"])
    with pytest.raises(SystemExit):
        training_arguments(args, rest)


@pytest.mark.parametrize("option, message", [
    (["--learning-rate", "nan"], "argument --learning-rate: must be a finite number, got nan"),
    (["--weight-decay", "inf"], "argument --weight-decay: must be a finite number, got inf"),
    (["--learning-rate", "-1"], "argument --learning-rate: must be at least 0"),
])
def test_finetune_training_options_are_checked_when_parsed(tmp_path, option, message, capsys):
    """TrainingArguments takes NaN learning rates (a NaN model) and raises tracebacks for bad combinations:
    both are one line, exit status 2, before anything loads."""
    from lazy_llama_tools.finetune import training_arguments

    args, rest = cli.parse_finetune(["m", "--train-file", "a", "--output-dir", str(tmp_path), *option])
    with pytest.raises(SystemExit) as exit_info:
        training_arguments(args, rest)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_finetune_bf16_without_support_is_one_line(tmp_path, capsys, monkeypatch):
    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: False)
    from lazy_llama_tools.finetune import training_arguments

    args, rest = cli.parse_finetune(["m", "--train-file", "a", "--output-dir", str(tmp_path), "--bf16", "true",
                                     "--use-cpu", "false"])
    with pytest.raises(SystemExit) as exit_info:
        training_arguments(args, rest)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lazy-finetune: error:") and "bf16" in last.lower()


@pytest.mark.parametrize("tool", ["lazy-convert", "lazy-finetune"])
def test_a_signal_while_the_tool_starts_is_one_line(tool, tmp_path):
    """SIGTERM while torch and transformers are imported (seconds, before the tool's own handlers exist): one line
    and exit status 130, as later in the run, not a traceback or a silent death."""
    import signal

    function, _ = TOOLS[tool]
    code = f"import sys\nfrom lazy_llama_tools.cli import {function}\nsys.exit({function}())"
    args = [str(tmp_path / "src"), str(tmp_path / "out")] if tool == "lazy-convert" else [
        str(tmp_path / "model"), "--train-file", str(tmp_path / "train.txt"), "--output-dir", str(tmp_path / "out")]
    process = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        maps = Path(f"/proc/{process.pid}/maps")
        while process.poll() is None and time.monotonic() < deadline and "libtorch" not in maps.read_text():
            time.sleep(0.01)  # torch is being imported: after the console script's handlers, before the tool runs
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert process.returncode == 130 and lines == [
        f"{tool}: interrupted before it began its work; nothing was written."], (process.returncode, err)
    assert list(tmp_path.iterdir()) == []  # no output, nothing hidden beside it
