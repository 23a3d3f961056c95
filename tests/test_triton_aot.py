"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 at its shipped blocks, without spills, within
the shared memory one block may use.

No GPU is needed: the triton wheel ships ptxas and cuobjdump (BENCHMARKS.md). The default run compiles the
bfloat16 builds (14 kernels, 17 block kinds, the packed decode and the paged prefill also paged, the causal fast path
also per document (7 builds), the packed decode also from per-row key starts (2) and for any layout (2), x head dims
64/128 x 2 GPU families = 120 compiles, ~9 min on 2 cores).
With LAZY_LLAMA_AOT_ALL_DTYPES=1 the float16 builds (same lowering, also spill-free) and the float32 builds
(IEEE float32 dots: the exact path for checks, not tuned, so they spill: not checked for spills) run
too (~7 min more). `python benchmarks/aot_compile_table.py` prints the same facts as a table; every test checks
that table's registers and spill bytes against its own measurements. The kernels also compile as Inductor
re-emits them under `torch.compile`, with its signature's float64 float arguments (each sm_90 build at D 64, ~1.5
min).
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.aot_compile_table import ARCHS, HEAD_DIMS, compile_all, markdown_table, shipped_builds  # noqa: E402
from benchmarks.static_gpu_model import MAX_SHARED_BYTES  # noqa: E402

DECODE_KERNELS = ("decode", "packed_decode")  # 16-row tiles: below wgmma's 64-row minimum, and bandwidth-bound anyway


def _check(rows):
    assert rows, "no builds"
    problems = []
    for build, usage, _ in rows:
        name = f"{build.kernel} ({build.kind}, {build.dtype}, D={build.head_dim}, sm_{build.arch})"
        if usage["spill"]:
            problems.append(f"{name}: {usage['spill']} bytes of local/stack memory (register spills)")
        if usage["shared"] > MAX_SHARED_BYTES[build.arch]:
            problems.append(f"{name}: {usage['shared']} B of shared memory, over the per-block limit (cannot launch)")
        needs_wgmma = (build.matmul and build.arch >= 90 and build.dtype != torch.float32
                       and build.kind not in DECODE_KERNELS)
        if needs_wgmma and not usage["wgmma"]:
            problems.append(f"{name}: sm_90 build does not use wgmma.mma_async")
    assert not problems, "\n".join(problems)
    _check_table(rows)


def _check_table(rows):
    """`markdown_table` (what benchmarks/aot_compile_table.py prints) has one line per build, in order, with the
    registers and spill bytes measured here."""
    lines = markdown_table(rows).splitlines()[2:]  # after the header and separator lines
    assert len(lines) == len(rows)
    for (build, usage, _), line in zip(rows, lines):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[0] == build.label and cells[5] == f"sm_{build.arch}", line
        assert (int(cells[6]), int(cells[8])) == (usage["registers"], usage["spill"]), line


def test_every_kernel_compiles_for_sm80_and_sm90_without_spills():
    rows = compile_all(shipped_builds((torch.bfloat16,)), workers=min(4, os.cpu_count() or 1))
    assert len({b.kernel for b, _, _ in rows}) == 14  # the forward kernel ships prefill and decode blocks
    assert len({(b.kernel, b.kind) for b, _, _ in rows if not b.documents}) == 17
    # the left-padded packed decode's two kernels, and the per-document forward after a cache (left padding)
    assert len([b for b, _, _ in rows if b.key_start]) == 3 * 2 * 2
    assert len([b for b, _, _ in rows if b.key_mask]) == 2 * 2 * 2  # the packed decode of any layout
    # forward (+ U: the heads of one pass and of two), the running sums of V, Delta, dq, dk/dv
    assert len({(b.kernel, b.kind) for b, _, _ in rows if b.documents}) == 7
    assert {b.arch for b, _, _ in rows} == set(ARCHS)
    assert {b.head_dim for b, _, _ in rows} == set(HEAD_DIMS)
    _check(rows)


ALL_DTYPES = pytest.mark.skipif(os.environ.get("LAZY_LLAMA_AOT_ALL_DTYPES") != "1",
                                reason="set LAZY_LLAMA_AOT_ALL_DTYPES=1 for the float16/float32 builds (~7 min)")


@ALL_DTYPES
def test_float16_builds_compile_without_spills():
    _check(compile_all(shipped_builds((torch.float16,)), workers=min(4, os.cpu_count() or 1)))


@ALL_DTYPES
def test_float32_builds_compile():
    """float32 is the exact path (IEEE dots, for checks); it compiles everywhere but is not tuned: it spills."""
    _check_table(compile_all(shipped_builds((torch.float32,)), workers=min(4, os.cpu_count() or 1)))


def test_cuobjdump_is_shipped_with_triton():
    from benchmarks.aot_compile_table import _cuobjdump

    assert shutil.which(_cuobjdump()) or os.path.exists(_cuobjdump())


def test_kernels_compile_as_inductor_re_emits_them():
    """Under `torch.compile` with the Inductor backend a user-defined Triton kernel is not run from its module: Inductor
    re-emits its source and that of every `@triton.jit` helper it reaches (by the names the kernel's globals bind) into
    a module of its own, with its own imports, and Triton compiles that with Inductor's signature, which types a
    Python float argument as float64 where the JIT types it float32. A helper bound under another name, a global
    Inductor does not carry (a plain float), a name its imports shadow, or a float argument that makes a loop's
    running values float64 compiles here and fails there (or runs in float64: the kernels convert each float
    argument to float32 first). Every sm_90 bfloat16 build at D 64 is re-emitted with Inductor's own function and
    imports, compiled with Inductor's float type, and its PTX may hold no float64 instruction but that conversion."""
    import importlib.util
    import re

    from torch._inductor import config as inductor_config
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    from benchmarks.aot_compile_table import _DTYPE_NAMES, _constexprs, _family, aot_compile, load_kernels

    float_type = "fp64" if getattr(inductor_config, "_use_fp64_for_unbacked_floats", False) else "fp32"
    module = load_kernels()
    builds = [build for build in shipped_builds((torch.bfloat16,)) if build.arch == 90 and build.head_dim == 64]
    assert len({build.kernel for build in builds}) == 14
    directory = Path(tempfile.mkdtemp())
    emitted = {}
    problems = []
    try:
        for build in builds:
            name = build.kernel
            if name not in emitted:
                renamed = f"{name}_0"  # Inductor names each kernel it defines uniquely
                source = user_defined_triton_kernel_transitive_closure_source_code(getattr(module, name))
                text = (TritonKernel.gen_common_triton_imports() + "\n@triton.jit\n"
                        + source.replace(f"def {name}(", f"def {renamed}("))
                path = directory / f"inductor_{name}.py"
                path.write_text(text)
                spec = importlib.util.spec_from_file_location(f"inductor_{name}", path)
                loaded = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(loaded)
                emitted[name] = getattr(loaded, renamed)
            pointers = {arg: _DTYPE_NAMES[build.dtype] if kind == "input" else kind
                        for arg, kind in module.AOT_KERNELS[name][1].items()}
            constexprs = _constexprs(module, build)
            _, _, num_warps, num_stages = module._config(build.kind, constexprs["BLOCK_D"], _family(build))
            try:
                compiled = aot_compile(emitted[name], pointers, constexprs, 90, num_warps, num_stages, float_type)
            except Exception as error:  # noqa: BLE001 - every build's failure is reported
                while error.__cause__ is not None:  # Triton's message of the innermost call
                    error = error.__cause__
                problems.append(f"{build.label}: {type(error).__name__}: {str(error)[-600:]}")
                continue
            float64 = set(re.findall(r"\b[a-z]+(?:\.[a-z0-9]+)*\.f64\b", compiled.asm["ptx"])) - {"cvt.rn.f32.f64"}
            if float64:
                problems.append(f"{build.label}: float64 arithmetic under Inductor's signature: {sorted(float64)}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert not problems, "\n".join(problems)
