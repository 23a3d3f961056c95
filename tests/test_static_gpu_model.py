"""Smoke test of the static GPU model (benchmarks/static_gpu_model.py): parser, counts, and its yardstick.

The full model compiles ~50 kernels (minutes); here: the SASS parser on a hand-written listing, one real
sm_90 build per kernel family whose counts must come out as the kernel's source says (the packed decode's two
passes against the FA2-style decode), and the FlashAttention-2-style reference kernels against PyTorch under the
Triton interpreter (so the yardstick computes attention, not something cheaper).
"""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("triton")

from benchmarks import static_gpu_model as model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0040*/              @P1 BRA `(.L_x_2) ;
        /*0050*/                   FFMA R5, R6, R7, R8 ;
        /*0060*/                   MUFU.EX2 R5, R5 ;
        /*0070*/                   LDG.E R9, desc[UR4][R10.64] ;
        /*0075*/                   IMAD.WIDE R10, R3, 0x4, R10 ;
.L_x_2:
        /*0080*/                   IADD3.X R3, R3, 0x1, RZ ;
        /*0090*/                   ISETP.GE.AND P0, PT, R3, R12, PT ;
        /*00a0*/              @!P0 BRA `(.L_x_1) ;
.L_x_0:
        /*00b0*/                   EXIT ;
.L_x_3:
        /*00c0*/                   BRA `(.L_x_3);
"""


def test_parser_finds_the_loop_and_its_dense_path():
    blocks = model.basic_blocks(LISTING)
    loops, outside = model.tensor_loops(blocks)
    assert len(loops) == 1  # the trailing self-branch has no tensor instruction: not a key-tile loop
    cost = model.count(loops[0].dense_path, 90)
    assert cost.instructions == 10  # the `if` body (FFMA, MUFU, LDG, IMAD.WIDE) is on the dense path
    assert cost.counts == {"async_copy": 1, "tensor": 1, "other": 2, "fp32": 1, "mufu": 1, "ldg": 1, "addr64": 2,
                           "isetp/sel": 1}
    assert cost.tensor_flop == {"HGMMA": 2 * 64 * 64 * 16 // 4}  # a warpgroup instruction, per warp
    assert cost.pipes == {"lsu": 2, "fma": 1 + 2, "mufu": 1, "alu": 2}
    assert [i.base for i in outside] == ["MOV", "BRA", "EXIT", "BRA"]
    cycles = cost.cycles(90, num_warps=8)
    assert cycles["bound"] == "issue" and cycles["issue"] == 10 * 8 / 4 and cycles["mufu"] == 16
    assert cycles["tensor"] == 8 * 32768 / 4096 and cycles["serial"] == cycles["tensor"] + 20


def test_causal_forward_passes_are_told_apart_by_their_exponentials():
    """Pass 1 (q k^T alone: one exp2 per score and one product) is found by its exponentials per tensor-core FLOP,
    not by its FLOP per iteration, which ties with the other passes' when its key tiles are wider (pass 1 at 128
    keys and pass 2 at 64 do the same products an iteration); the one pass then by its float32 rescaling."""
    def loop(flop, mufu, fp32):
        return model.Cost({"fp32": fp32}, 10 + fp32, {"HGMMA": flop}, {"mufu": mufu, "fma": fp32})

    # address order: the one pass, pass 2, pass 1 (64 exp2 a thread per 128 x 128 pass 1 tile, 32 per 128 x 64)
    loops = [loop(2, 33, 40)] * 3 + [loop(2, 32, 20)] * 3 + [loop(2, 64, 30)] * 3
    code = model.KernelCode("synthetic", 90, 8, 200, 0, loops, model.Cost({}, 0, {}, {}))
    assert model.causal_forward_passes(code, (128, 64)) == {"pass 1": [6, 7, 8], "one pass": [0, 1, 2],
                                                            "pass 2": [3, 4, 5]}


def test_every_yardstick_build_would_launch_without_spills():
    """The FA2-style kernels at their configurations, both GPU families and head dims: no register spills, and
    shared memory within what one block may use (a yardstick that could not launch would flatter nothing)."""
    from benchmarks.aot_compile_table import resource_usage

    problems = []
    for spec in model.FA2.values():
        for arch in (90, 80):
            for dim in (64, 128):
                usage = resource_usage(model.compile_spec(spec, arch, dim))
                if usage["spill"] or usage["shared"] > model.MAX_SHARED_BYTES[arch]:
                    problems.append((spec.label, arch, dim, usage))
    assert not problems, problems


def test_fa2_style_forward_counts_match_its_source():
    """The yardstick's sm_90 loop: QK^T and PV on wgmma, one exp2 per score, pipelined loads, no spills."""
    spec = model.FA2["fwd"]
    block_m, block_n, _, _ = model.blocks_of(spec, 90, 64)
    code = model.analyse(spec.label, model.compile_spec(spec, 90, 64), 90)
    assert code.spill == 0 and len(code.loops) == 1
    loop = code.loops[0]
    assert loop.tensor_flop["HGMMA"] * code.num_warps == 2 * (2 * block_m * block_n * 64)
    assert loop.counts.get("async_copy", 0) > 0 and loop.counts.get("ldg", 0) == 0
    per = model.per_element(code, 0, (block_m, block_n))
    assert 0.9 <= per["mufu"] <= 1.3, per  # one exp2 per score (+ the row rescale)
    assert 4 <= per["total"] <= 14, per
    problem = model.prefill_problem(4096, 64)
    work = spec.work(problem, (block_m, block_n), model.MACHINES[90].sms)
    seconds = model.kernel_time(code, work, 90)["seconds"]
    tflops = 2 * problem.batch * problem.heads * problem.length**2 * problem.dim / seconds / 1e12
    assert 250 < tflops < 800, tflops  # FlashAttention-class on an H100, below the 989 TFLOP/s peak


def test_causal_fast_path_forward_stays_near_the_yardstick():
    """The causal fast-path forward at sm_90, D 64: every loop pipelines its loads, the loops beyond the bias
    window read nothing per key, no spills; the model tells its three passes apart (pass 1 with the least
    tensor-core work, the one pass with its accumulator's rescale); the two passes (tau < 0) model within 2.2x the
    FA2-style forward, the one pass (tau = 0) within 1.25x and below 0.7 of the two passes."""
    fast, fa2 = model.LAZY_FAST["fwd"], model.FA2["fwd"]
    code = model.analyse(fast.label, model.compile_spec(fast, 90, 64), 90)
    assert code.spill == 0 and len(code.loops) == 9  # (pass 1, pass 2, one pass) x (beyond window, inside, limit)
    assert all(loop.counts.get("async_copy", 0) > 0 for loop in code.loops)
    block_m, block_n, _, _ = model.blocks_of(fast, 90, 64)
    passes = model.causal_forward_passes(code, (block_m, block_n))
    assert sorted(i for group in passes.values() for i in group) == list(range(9)), passes
    flop = {name: sum(code.loops[group[0]].tensor_flop.values()) for name, group in passes.items()}
    assert 2 * flop["pass 1"] == flop["pass 2"] == flop["one pass"], flop  # q k^T; q k^T and a @ V
    assert all(code.loops[passes[name][0]].counts.get("ldg", 0) == 0 for name in passes)
    fa2_code = model.analyse(fa2.label, model.compile_spec(fa2, 90, 64), 90)
    times = {}
    for tau in (-1.0, 0.0):
        problem = replace(model.prefill_problem(4096, 64), tau=tau)
        fa2_blocks = model.blocks_of(fa2, 90, 64)[:2]
        times[tau] = [model.kernel_time(kernel, spec.work(problem, blocks, 132), 90)["seconds"]
                      for spec, kernel, blocks in ((fast, code, (block_m, block_n)), (fa2, fa2_code, fa2_blocks))]
    assert times[-1.0][0] < 2.2 * times[-1.0][1], times
    assert times[0.0][0] < 1.25 * times[0.0][1] and times[0.0][0] < 0.7 * times[-1.0][0], times


def test_packed_decode_stays_near_the_yardstick():
    """The packed decode's two passes at sm_90, D 64 (where the kept scores weigh most against K): every loop
    pipelines its loads, no spills, and the modelled decode at 32k keys is within 1.2x the FA2-style one."""
    codes = {}
    for spec in (model.LAZY_FAST["decode_lse"], model.LAZY_FAST["decode_out"], model.FA2["decode"]):
        codes[(spec, 90, 64)] = model.analyse(spec.label, model.compile_spec(spec, 90, 64), 90)
    lazy = [codes[(model.LAZY_FAST[key], 90, 64)] for key in ("decode_lse", "decode_out")]
    assert [code.spill for code in lazy] == [0, 0] and [len(code.loops) for code in lazy] == [2, 1]
    assert all(loop.counts.get("async_copy", 0) > 0 for code in lazy for loop in code.loops)
    assert lazy[0].loops[0].counts.get("ldg", 0) == 0  # beyond the bias window nothing is read per key
    problem = model.decode_problem(32768, 64)
    ratio = (model.scenario_time("lazy (causal fast path)", "decode", codes, problem, 90)
             / model.scenario_time("FA2-style", "decode", codes, problem, 90))
    assert ratio <= 1.2, ratio


def test_causal_fast_path_training_stays_near_the_yardstick():
    """The causal fast path's training kernels at sm_90, D 64: the forward's two builds that also store U (the heads
    of two passes, with the U product in pass 2; the heads of one pass, with U from the running sums of V: no third
    product) and the dq and dk/dv kernels pipeline their loads in every loop (dq, dk/dv: beyond the window, inside
    it, at the causal limit), the Delta kernel reads U (no loop over the keys), no spills, the bias gradient's
    atomics (dq kernel, bias loops only) far below the general dk/dv kernel's one per score element, and the
    modelled forward + backward is within 2.5x the FA2-style one at tau = -1 and within 1.9x at tau = 0."""
    problem = model.prefill_problem(4096, 64)
    codes = {}
    for impl, keys in (("lazy (causal fast path)", ("fwd_u1", "fwd_u", "delta", "dq", "dkdv")),
                       ("FA2-style", ("fwd", "preprocess", "bwd"))):
        for key in keys:
            spec = model.IMPLEMENTATIONS[impl][key]
            codes[(spec, 90, 64)] = model.analyse(spec.label, model.compile_spec(spec, 90, 64), 90)
    for key, loops in (("fwd_u1", 3), ("fwd_u", 6), ("delta", 0), ("dq", 3), ("dkdv", 3)):
        spec = model.LAZY_FAST[key]
        code = codes[(spec, 90, 64)]
        work = spec.work(problem, model.work_blocks(spec, 90, 64), 132)
        assert code.spill == 0 and len(code.loops) == loops, key
        assert len(work.iterations) == (3 if key.startswith("fwd_u") else loops), key  # the forward's: per pass
        assert all(loop.counts.get("async_copy", 0) > 0 for loop in code.loops), key
        if key in ("dq", "dkdv"):
            # the ReLU mask m as a float32 1 / 0 (one FSET a score; dS = p (m dP - Delta) an FFMA and a multiply):
            # 9.5 / 13.6 thread-instructions per score beyond the window, 10.5 / 14.6 with a boolean m
            far = model.per_element(code, loops - 1 if key == "dkdv" else 0, work.tile)["total"]
            assert far <= {"dq": 10.0, "dkdv": 14.0}[key], (key, far)
        atomics = [model.per_element(code, i, work.tile)["atomic"] for i in range(loops)]
        limit = 0.1 if key == "dq" else 0  # none in loop 0 (no bias there, or the causal limit of dk/dv)
        assert atomics[:1] == [0] * min(loops, 1) and max(atomics, default=0) <= limit, (key, atomics)
    ratio = (model.scenario_time("lazy (causal fast path)", "training", codes, problem, 90)
             / model.scenario_time("FA2-style", "training", codes, problem, 90))
    assert ratio <= 2.5, ratio
    code_u1, code_u = (codes[(model.LAZY_FAST[key], 90, 64)] for key in ("fwd_u1", "fwd_u"))
    block_u1, block_u = (model.blocks_of(model.LAZY_FAST[key], 90, 64)[:2] for key in ("fwd_u1", "fwd_u"))
    pass_2 = model.causal_forward_passes(code_u, block_u)["pass 2"][0]
    flop = [sum(code_u1.loops[0].tensor_flop.values()), sum(code_u.loops[pass_2].tensor_flop.values())]
    # per score: the one pass q k^T and p @ V, pass 2 of the two passes also m @ V
    assert 3 * flop[0] / (block_u1[0] * block_u1[1]) == 2 * flop[1] / (block_u[0] * block_u[1]), flop
    # pass 1 of the two passes (q k^T alone) runs on the inference forward's wider key tiles, which the work counts
    block_n1 = model.work_blocks(model.LAZY_FAST["fwd_u"], 90, 64)[2]
    assert block_n1 == model.blocks_of(model.LAZY_FAST["fwd"], 90, 64)[1] > block_u[1]
    pass_1 = model.causal_forward_passes(code_u, block_u)["pass 1"][0]
    assert 3 * sum(code_u.loops[pass_1].tensor_flop.values()) / (block_u[0] * block_n1) == flop[1] / (
        block_u[0] * block_u[1])
    iterations = model.LAZY_FAST["fwd_u"].work(problem, model.work_blocks(model.LAZY_FAST["fwd_u"], 90, 64),
                                                132).iterations
    assert sum(iterations["pass 1"]) * block_n1 == sum(iterations["pass 2"]) * block_u[1]  # the same keys
    floors = {}
    for tau in (-1.0, 0.0):
        problem = replace(problem, tau=tau)
        for impl in ("lazy (causal fast path)", "FA2-style"):
            # each kernel's floor (its loops' tensor-core + MUFU cycles alone) is below its modelled time
            seconds = model.kernel_seconds(impl, "training", codes, problem, 90)
            floor = model.kernel_seconds(impl, "training", codes, problem, 90, "floor_s")
            assert all(0 <= floor[key] <= seconds[key] for key in seconds), (impl, tau, floor, seconds)
            # at D 64 every product of both runs on wgmma: nothing to re-rate
            assert model.kernel_seconds(impl, "training", codes, problem, 90, "all_wgmma_s") == seconds
            floors[(impl, tau)] = model.scenario_floor(impl, "training", codes, problem, 90)
    # tau < 0: four passes of exp2 over the scores (two forward, dq, dk/dv) and 11 products against the
    # yardstick's two and 7; tau = 0: three and 9
    assert floors[("FA2-style", -1.0)] == floors[("FA2-style", 0.0)]
    assert floors[("lazy (causal fast path)", -1.0)] > 1.2 * floors[("lazy (causal fast path)", 0.0)], floors
    assert floors[("lazy (causal fast path)", 0.0)] > 1.2 * floors[("FA2-style", 0.0)], floors
    problem = replace(problem, tau=0.0)
    ratio = (model.scenario_time("lazy (causal fast path)", "training", codes, problem, 90)
             / model.scenario_time("FA2-style", "training", codes, problem, 90))
    assert ratio <= 1.9, ratio


def test_fa2_reference_kernels_compute_attention():
    """Forward, backward and split-K decode against PyTorch, run by the Triton interpreter in a child process."""
    code = """
import torch, torch.nn.functional as F
from benchmarks import fa2_reference_kernels as R
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 256, 64, requires_grad=True) for _ in range(3))
out, lse = R.fa2_forward(q.detach(), k.detach(), v.detach())
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
grad = torch.randn_like(ref)
ref.backward(grad)
grads = R.fa2_backward(q.detach(), k.detach(), v.detach(), out, lse, grad)
errors = [(out - ref).abs().max()] + [(a - b.grad).abs().max() for a, b in zip(grads, (q, k, v))]
qd, kd, vd = torch.randn(2, 8, 1, 64), torch.randn(2, 2, 300, 64), torch.randn(2, 2, 300, 64)
ref = F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
errors.append((R.flash_decode(qd, kd, vd, num_splits=3) - ref).abs().max())
assert max(errors) < 1e-4, errors
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0 and "ok" in child.stdout, child.stderr[-3000:]
