"""The dtype `make serve` hands vLLM on this machine.

    python -m lazy_llama_vllm.serve_dtype        # prints float32 or bfloat16

vLLM's CPU build serves bfloat16 by default. Without native bfloat16 arithmetic in the CPU (x86:
`avx512_bf16` or `amx_bf16`; Arm: `bf16`) every bfloat16 matmul is emulated, and prefill runs about an
order of magnitude slower than in float32: a burst of requests then looks like a hung server. So
`make serve` serves float32 there and bfloat16 where the CPU computes it natively. `make serve
SERVE_DTYPE=...` overrides the choice. Standard library only: the Makefile runs it with any Python.
"""

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# CPU feature flags (as /proc/cpuinfo spells them) that mean native bfloat16 arithmetic
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str) -> set[str]:
    """Every feature flag of a /proc/cpuinfo text (x86 `flags` lines, Arm `Features` lines)."""
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def serve_dtype(cpuinfo: str | None = None) -> str:
    """`"bfloat16"` when the CPU has native bfloat16 arithmetic, else `"float32"`.

    `cpuinfo` is the text of /proc/cpuinfo (read when None); where it cannot be read (not Linux) the answer
    is float32, which is exact and never emulated.
    """
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return "float32"
    return "bfloat16" if cpu_flags(cpuinfo) & NATIVE_BF16_FLAGS else "float32"


if __name__ == "__main__":
    print(serve_dtype())
