"""`make serve` picks the dtype the CPU serves best (float32 without native bfloat16), and it can be overridden."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lazy_llama_vllm.serve_dtype import cpu_flags, serve_dtype

ROOT = Path(__file__).resolve().parents[1]

# Excerpts of real /proc/cpuinfo texts (two processors each where the format repeats)
X86_NO_BF16 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu vme sse sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni
bogomips\t: 4400.00

processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni
"""
X86_AVX512_BF16 = X86_NO_BF16.replace("avx512_vnni", "avx512_vnni avx512_bf16")
X86_AMX = X86_NO_BF16.replace("avx512_vnni", "avx512_vnni amx_bf16 amx_tile amx_int8")
ARM_BF16 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm bf16 i8mm
CPU implementer\t: 0x41
"""
ARM_NO_BF16 = ARM_BF16.replace(" bf16", "")


@pytest.mark.parametrize("text, want", [
    (X86_NO_BF16, "float32"), (X86_AVX512_BF16, "bfloat16"), (X86_AMX, "bfloat16"),
    (ARM_BF16, "bfloat16"), (ARM_NO_BF16, "float32"), ("", "float32"),
    # a flag name that merely contains "bf16" is not the flag, and other lines do not count
    ("flags\t: avx512_bf16x\nmodel name\t: avx512_bf16 in the name\n", "float32"),
])
def test_serve_dtype_follows_native_bf16_flags(text, want):
    assert serve_dtype(text) == want


def test_cpu_flags_reads_flags_and_features_lines():
    assert {"avx512f", "avx512_bf16"} <= cpu_flags(X86_AVX512_BF16) and "GenuineIntel" not in cpu_flags(X86_NO_BF16)
    assert {"asimd", "bf16"} <= cpu_flags(ARM_BF16)


def test_unreadable_cpuinfo_serves_float32(monkeypatch, tmp_path):
    monkeypatch.setattr("lazy_llama_vllm.serve_dtype.CPUINFO", tmp_path / "missing")
    assert serve_dtype() == "float32"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_serve_passes_the_chosen_dtype_and_takes_an_override(tmp_path):
    """`make -n serve` (prints, runs nothing) hands vLLM this machine's choice, or `SERVE_DTYPE` when given."""
    base = ["make", "-n", "serve", f"PYTHON={sys.executable}", f"SERVE_VENV={tmp_path / 'venv'}"]
    chosen = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f"--dtype {serve_dtype()} " in chosen
    for override in ("bfloat16", "float32"):
        forced = subprocess.run([*base, f"SERVE_DTYPE={override}"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout
        assert f"--dtype {override} " in forced
