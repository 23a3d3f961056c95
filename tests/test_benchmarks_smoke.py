"""The benchmark scripts run at smoke size and print finite ratios for every table (so they never rot): the CPU
benchmark, and the GPU benchmark's decode rows under the Triton interpreter."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_benchmarks_smoke():
    out = subprocess.run([sys.executable, "-m", "benchmarks.cpu_benchmarks", "--smoke"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for heading in ("Attention op", "Peak extra RSS", "Model:", "Workloads:", "the attention calls' share"):
        assert heading in text, heading
    ratios = [float(x) for x in re.findall(r"\| ([0-9.]+)x \(", text)]
    assert len(ratios) >= 4 + 8 and all(math.isfinite(r) and r > 0 for r in ratios)
    for measure in ("prefill", "generate", "train step", "padded SFT batch", "TRL padding-free", "static cache"):
        assert measure in text
    shares = [float(x) for x in re.findall(r"\| (?:lazy|llama) \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+)% \|", text)]
    assert len(shares) == 2 and all(0 < share < 100 for share in shares), text


def test_gpu_benchmark_decode_rows_smoke():
    """The GPU benchmark's decode rows (plain, left-padded, a static cache's buffer) run under the Triton interpreter
    at tiny sizes, pass their gate against the float32 reference and print every row: a lent GPU's minutes are not
    spent on a script that crashes."""
    import os

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "benchmarks/gpu_benchmark.py", "--smoke", "--decode-only"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| B 8,")]
    assert len(rows) == 2 * 4, out.stdout
    errors = [float(line.rstrip(" |").split("|")[-1]) for line in rows if "lazy" in line]
    assert len(errors) == 6 and max(errors) < 4e-2, rows


def test_in_place_benchmark_cache_equals_the_dynamic_cache(rng_seed):
    """The decode benchmark's `in-place` cache (LazyLlama's `InPlaceDynamicLayer`: spare capacity instead of a
    concatenation per token) gives both models the same logits as `DynamicCache`, through crops."""
    import torch
    import transformers

    from benchmarks.cpu_benchmarks import _cache
    from tests.conftest import tiny_model

    lazy = tiny_model(seed=rng_seed, attn_implementation="lazy")
    llama = transformers.LlamaForCausalLM._from_config(
        transformers.LlamaConfig(**{k: v for k, v in lazy.config.to_dict().items() if not k.startswith("lazy_")}),
        attn_implementation="sdpa").eval()
    ids = torch.randint(3, 97, (1, 40))
    for model in (lazy, llama):
        caches = {kind: _cache(kind) for kind in ("dynamic", "in-place")}
        with torch.no_grad():
            for step in range(70):  # 40 + 70 keys, crops on the way: each write reuses the buffer
                tokens = ids if step == 0 else ids[:, step % 40 : step % 40 + 1]
                logits = {}
                for kind, cache in caches.items():
                    out = model(tokens, cache=cache, use_cache=True)
                    logits[kind] = out.logits
                    if step % 7 == 3:
                        cache.crop(-2)  # drop two keys: the next write reuses their slots
                torch.testing.assert_close(logits["in-place"], logits["dynamic"], atol=1e-5, rtol=1e-5,
                                           msg=f"{type(model).__name__} step {step}, seed {rng_seed}")
        assert type(caches["in-place"].layers[0]).__name__ == "InPlaceDynamicLayer"
