"""Compile every Lazy Attention Triton kernel ahead of time for sm_80 and sm_90 (no GPU needed).

    python benchmarks/aot_compile_table.py                # bf16 builds: registers, shared, spill bytes, wgmma
    python benchmarks/aot_compile_table.py --all-dtypes   # also fp16 and fp32

Each row is one kernel at one shipped block configuration: the build list `AOT_BUILDS`, the pointer types
`AOT_KERNELS` and the block table `_CONFIGS` of modeling_lazy/lazy_attention_triton_common.py.
`cuobjdump --dump-resource-usage` (shipped in the triton wheel) gives registers and LOCAL bytes (spills); the PTX
of the sm_90 build shows whether `wgmma.mma_async` (Hopper tensor cores) is used. tests/test_triton_aot.py asserts
the same facts.
"""

import argparse
import concurrent.futures
import functools
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# The packages that hold kernel files (flat modules that import each other), loaded afresh by `load_kernels`.
KERNEL_PACKAGES = {"modeling_lazy": ROOT / "modeling_lazy", "lazy_llama_vllm": ROOT / "lazy_llama_vllm"}
COMMON_MODULE = "modeling_lazy.lazy_attention_triton_common"
ARCHS = (80, 90)
HEAD_DIMS = (64, 128)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class KernelFiles:
    """The kernel files of one `load_kernels` call: a name is looked up in the common module (`_config`,
    `_DOT_PRECISION`, `AOT_BUILDS`, ...), then, for a kernel, in the file `AOT_KERNELS` names for it."""

    def __init__(self, modules: dict):
        self.modules = modules
        self.common = modules[COMMON_MODULE]

    def __getattr__(self, name):
        if hasattr(self.common, name):
            return getattr(self.common, name)
        if name in self.common.AOT_KERNELS:
            return getattr(self.modules[self.common.AOT_KERNELS[name][0]], name)
        raise AttributeError(name)


@functools.cache
def load_kernels() -> KernelFiles:
    """Fresh, compiled-mode copies of the kernel files (works even if TRITON_INTERPRET=1 is set, or this process
    imported them under the interpreter): each file of `AOT_KERNELS` and the common one, imported as submodules of
    bare packages named like the real ones (their relative and absolute imports resolve to these copies; the
    packages' `__init__` files, which import transformers and register operators, do not run). The process's own
    modules are put back afterwards; the copies stay usable (Triton compiles from their functions' globals)."""
    saved_env = os.environ.pop("TRITON_INTERPRET", None)
    ours = lambda name: name.split(".")[0] in KERNEL_PACKAGES  # noqa: E731
    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    try:
        for name in saved:
            del sys.modules[name]
        for name, path in KERNEL_PACKAGES.items():
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
        common = importlib.import_module(COMMON_MODULE)
        files = {COMMON_MODULE} | {module for module, _ in common.AOT_KERNELS.values()}
        return KernelFiles({name: importlib.import_module(name) for name in sorted(files)})
    finally:
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
        if saved_env is not None:
            os.environ["TRITON_INTERPRET"] = saved_env


@dataclass(frozen=True)
class Build:
    kernel: str  # kernel function name (an `AOT_KERNELS` key)
    kind: str  # a `_CONFIGS` key: fwd | causal_fwd | decode | delta | dq | dkdv | causal_dq ... (blocks, warps)
    dtype: torch.dtype
    head_dim: int
    arch: int
    matmul: bool = True  # uses tl.dot (so sm_90 with 16-bit inputs must use wgmma)
    page_size: int = 0  # PAGE_SIZE of the packed decode / paged prefill (> 0: K/V through a block table)
    documents: bool = False  # DOCUMENTS: the causal fast path per document
    key_start: bool = False  # KEY_START: the packed decode from per-row first keys
    key_mask: bool = False  # KEY_MASK: the packed decode of any layout (segments and positions per key)

    @property
    def label(self) -> str:
        extra = (f", paged {self.page_size}" if self.page_size else "") + (", documents" if self.documents else "")
        extra += (", key starts" if self.key_start else "") + (", key mask" if self.key_mask else "")
        return f"{self.kernel} ({self.kind}{extra})"


def shipped_builds(dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> list[Build]:
    """`AOT_BUILDS` (the common module's build list) for every arch, dtype and head dim."""
    return [Build(build.kernel, build.kind, dtype, dim, arch, build.matmul, build.page_size, build.documents,
                  build.key_start, build.key_mask)
            for arch in ARCHS for dtype in dtypes for dim in HEAD_DIMS for build in load_kernels().AOT_BUILDS]


def _family(build: Build) -> str:
    return "sm90" if build.arch >= 90 else "sm80"


def _constexprs(module, build: Build) -> dict:
    block_m, block_n, _, _ = module._config(build.kind, max(16, build.head_dim), _family(build))
    block_n1 = module._pass1_block_n(build.kind, max(16, build.head_dim), _family(build))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_N1=block_n1, BLOCK_D=max(16, build.head_dim), D=build.head_dim,
                UPCAST=False, PRECISION=module._DOT_PRECISION[build.dtype],
                PAGE_SIZE=build.page_size, STORE_U=build.kind in ("causal_fwd_u", "causal_fwd_u1"),
                PASSES={"causal_fwd_u1": 1, "causal_fwd_u": 2}.get(build.kind, 0), DOCUMENTS=build.documents,
                KEY_START=build.key_start, KEY_MASK=build.key_mask)


def aot_compile(fn, pointer_types: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int,
                float_type: str = "fp32"):
    """`triton.compile` a `@triton.jit` kernel for `sm_<arch>` without a GPU.

    `pointer_types` maps each pointer argument to its element type ("bf16", "fp32", ...); every other
    non-constexpr argument is an int32 except `scal*` arguments (Python floats: `float_type`, "fp32" as the JIT
    types them, "fp64" as Inductor does). Pointers and `stride*` arguments
    get the 16-divisibility the JIT sees for aligned tensors. Returns the compiled kernel (`.asm['ptx']`,
    `.asm['cubin']`, `.metadata`).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in pointer_types:
            signature[name] = "*" + pointer_types[name]
        elif name.startswith("scal"):
            signature[name] = float_type
        else:
            signature[name] = "i32"
        if signature[name].startswith("*") or name.startswith("stride"):
            attrs[(index,)] = [["tt.divisibility", 16]]  # what the JIT sees for aligned tensors / D-multiple strides
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_build(module, build: Build):
    """`aot_compile` one build of the project's kernels with the launchers' blocks and warps and the pointer types
    `AOT_KERNELS` declares ("input": the build's dtype)."""
    fn = getattr(module, build.kernel)
    pointer_types = {name: _DTYPE_NAMES[build.dtype] if kind == "input" else kind
                     for name, kind in module.AOT_KERNELS[build.kernel][1].items()}
    constexprs = _constexprs(module, build)
    _, _, num_warps, num_stages = module._config(build.kind, constexprs["BLOCK_D"], _family(build))
    return aot_compile(fn, pointer_types, constexprs, build.arch, num_warps, num_stages)


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def resource_usage(compiled) -> dict:
    """Registers, LOCAL (spill) bytes and static shared bytes from cuobjdump; dynamic shared from Triton."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([_cuobjdump(), "--dump-resource-usage", str(path)], check=True,
                              capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if "REG" not in fields:
        raise RuntimeError(f"cannot parse cuobjdump output:\n{text}")
    # Spilled registers show up as a stack frame (STACK) and/or LOCAL bytes; both must be zero.
    return {"registers": int(fields["REG"]), "spill": int(fields["LOCAL"]) + int(fields.get("STACK", 0)),
            "shared": int(fields.get("SHARED", 0)) + int(compiled.metadata.shared),
            "wgmma": "wgmma.mma_async" in compiled.asm["ptx"]}


def _compile_row(build: Build) -> tuple[Build, dict, float]:
    module = load_kernels()
    start = time.perf_counter()
    usage = resource_usage(compile_build(module, build))
    return build, usage, time.perf_counter() - start


def compile_all(builds=None, workers: int | None = None) -> list[tuple[Build, dict, float]]:
    """Compile builds in worker processes (compilation is single-threaded per kernel)."""
    builds = shipped_builds() if builds is None else builds
    workers = workers or max(1, min(len(builds), os.cpu_count() or 1))
    if workers == 1:
        return [_compile_row(b) for b in builds]
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_compile_row, builds))


def markdown_table(rows) -> str:
    module = load_kernels()
    lines = ["| kernel | blocks (M x N) | warps | dtype | D | arch | registers | shared (B) "
             "| local+stack (spill, B) | wgmma |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for build, usage, _ in rows:
        c = _constexprs(module, build)
        warps = module._config(build.kind, c["BLOCK_D"], _family(build))[2]
        wgmma = ("yes" if usage["wgmma"] else "no") if build.arch >= 90 and build.matmul else "n/a"
        blocks = f"{c['BLOCK_M']} x {c['BLOCK_N']}" if c["BLOCK_N"] else f"{c['BLOCK_M']} rows"  # no key tiles
        if c["BLOCK_N1"] != c["BLOCK_N"] and build.kernel == "_lazy_causal_fwd_kernel":
            blocks += f" (pass 1: x {c['BLOCK_N1']})"
        lines.append(f"| {build.label} | {blocks} | {warps} | "
                     f"{_DTYPE_NAMES[build.dtype]} | {build.head_dim} | sm_{build.arch} | {usage['registers']} | "
                     f"{usage['shared']} | {usage['spill']} | {wgmma} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--all-dtypes", action="store_true", help="also float16 and float32 (3x the builds)")
    args = parser.parse_args()
    import triton

    start = time.perf_counter()
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if args.all_dtypes else (torch.bfloat16,)
    rows = compile_all(shipped_builds(dtypes), workers=args.workers)
    print(f"triton {triton.__version__}, torch {torch.__version__}, {len(rows)} builds in "
          f"{time.perf_counter() - start:.0f} s on {os.cpu_count()} CPU cores\n")
    print(markdown_table(rows))
    spills = [r for r in rows if r[1]["spill"]]
    print(f"\nbuilds with spills: {len(spills)}")


if __name__ == "__main__":
    sys.exit(main())
