"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 at its shipped blocks, without spills, within
the shared memory one block may use.

No GPU is needed: the triton wheel ships ptxas and cuobjdump (BENCHMARKS.md). The default run compiles the
bfloat16 builds (14 kernels, 17 block kinds, the packed decode and the paged prefill also paged, the causal fast path
also per document (7 builds), the packed decode also from per-row key starts (2) and for any layout (2), x head dims
64/128 x 2 GPU families = 120 compiles, ~9 min on 2 cores).
With LAZY_AOT_ALL_DTYPES=1 the float16 builds (same lowering, also spill-free) and the float32 builds
(IEEE float32 dots: the exact path for checks, not tuned, so they spill: not checked for spills) run
too (~7 min more). `python benchmarks/aot_compile_table.py` prints the same facts as a table; every test checks
that table's registers and spill bytes against its own measurements.
"""

import os
import shutil

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
    assert len([b for b, _, _ in rows if b.key_start]) == 2 * 2 * 2  # the left-padded packed decode's two kernels
    assert len([b for b, _, _ in rows if b.key_mask]) == 2 * 2 * 2  # the packed decode of any layout
    # forward (+ U: the heads of one pass and of two), the running sums of V, Delta, dq, dk/dv
    assert len({(b.kernel, b.kind) for b, _, _ in rows if b.documents}) == 7
    assert {b.arch for b, _, _ in rows} == set(ARCHS)
    assert {b.head_dim for b, _, _ in rows} == set(HEAD_DIMS)
    _check(rows)


ALL_DTYPES = pytest.mark.skipif(os.environ.get("LAZY_AOT_ALL_DTYPES") != "1",
                                reason="set LAZY_AOT_ALL_DTYPES=1 for the float16/float32 builds (~7 min)")


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
