"""The CPU benchmark script runs at smoke size and prints finite ratios for every table (so it never rots)."""

import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_benchmarks_smoke():
    out = subprocess.run([sys.executable, "-m", "benchmarks.cpu_benchmarks", "--smoke"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for heading in ("Attention op", "Peak extra RSS", "Model:"):
        assert heading in text, heading
    ratios = [float(x) for x in re.findall(r"\| ([0-9.]+)x \(", text)]
    assert len(ratios) >= 4 + 8 and all(math.isfinite(r) and r > 0 for r in ratios)
    for measure in ("prefill", "generate", "train step"):
        assert measure in text
