"""Static GPU time model of the Lazy Attention Triton kernels against FlashAttention-2-style kernels (no GPU).

    python -m benchmarks.static_gpu_model                          # full table, sm_90 and sm_80, D 64/128
    python -m benchmarks.static_gpu_model --json out.json          # also the raw counts and model inputs
    python -m benchmarks.static_gpu_model --arch 90 --dims 64      # a subset

Every kernel is compiled ahead of time (`benchmarks/aot_compile_table.py`: Triton's own ptxas) for sm_90 /
sm_80 in bf16 at the launchers' blocks; the cubin is disassembled with the `nvdisasm` shipped in the triton
wheel and split into basic blocks. In each kernel the innermost loops that contain tensor-core instructions
(HGMMA / HMMA) are the key-tile (or query-tile) loops; each is costed on its *dense path* (the heaviest
acyclic path from loop head to back branch: a visible tile whose weights are not all zero, so every `if`
inside the loop is taken) and everything outside those loops once per program.

Model (per SM per clock, warp-instructions; H100/H200 for sm_90, A100 for sm_80):

    tensor    HGMMA 4096 dense bf16 FLOP (mma.sync HMMA 2048 on sm_90; 2048 on sm_80)
    issue     4       every SASS instruction takes an issue slot
    fma       4 (2)   FFMA/FMUL/FADD; IMAD at half rate                      (sm_80: 2, IMAD 1)
    alu       2       integer, compare/select, min/max, logic, 32/64-bit address arithmetic, packing
    mufu      0.5     MUFU.EX2/LG2/RCP and int<->float conversions
    lsu       1       global/shared loads and stores, cp.async, atomics, shuffles

    cycles per loop iteration  = tensor + max(issue, fma, alu, mufu, lsu)     ("serial": no overlap of the
                                 tensor cores with the CUDA cores; an upper bound of what warp scheduling hides)
    kernel time                = max(sum over programs and iterations / (SMs x clock), DRAM bytes / bandwidth)
    scenario time              = its kernels' times + 2.5 us per launch (`launches`)

DRAM bytes are counted per kernel from the tensors it reads and writes; a tensor is read once per kernel
(programs running at the same time share it through L2) except where a later pass re-reads it after a
working set far larger than L2 (the Lazy decode passes). Not modelled: latency and occupancy (a loop
without pipelined loads waits on every load: the `pipelined loads` column says which loops can hide it),
wave quantisation, L2 bandwidth and atomic throughput (listed per loop), clock changes.

The yardsticks are FlashAttention-2-style kernels written for this model (`benchmarks/fa2_reference_kernels.py`):
a causal forward, a 5-matmul backward with float32 atomic dq, and a split-K decode with the GQA group packed
as rows (what FlashAttention's decode does); they are compiled the same way. Packed and padded training
(`documents_problem`) charge the Lazy kernels' DOCUMENTS builds each document's causal work plus their work lists'
spare programs, and the yardstick the same kernels' work per document on the useful tokens (a varlen FA2 runs
the same loops per document; its work-list prologue is not charged).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.aot_compile_table import aot_compile, load_kernels  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    name: str
    sms: int
    clock_hz: float
    dram_bytes_per_s: float
    tensor_flop: dict  # per SM per clock, by tensor instruction (HGMMA / HMMA)
    pipes: dict  # warp-instructions per SM per clock


MACHINES = {
    90: Machine("H100/H200 (sm_90)", 132, 1.83e9, 4.8e12, {"HGMMA": 4096, "HMMA": 2048},
                {"issue": 4, "fma": 4, "alu": 2, "mufu": 0.5, "lsu": 1}),
    80: Machine("A100 (sm_80)", 108, 1.41e9, 2.0e12, {"HMMA": 2048},
                {"issue": 4, "fma": 2, "alu": 2, "mufu": 0.5, "lsu": 1}),
}
IMAD_COST = {90: 2, 80: 2}  # fma-pipe slots per IMAD (half rate)
# Shared memory one block may use (opt-in maximum): 227 KiB on H100/H200, 163 KiB on A100. A build above it cannot
# launch; the project's kernels and the yardstick's stay within it (tests/test_triton_aot.py, test_static_gpu_model.py).
MAX_SHARED_BYTES = {90: 232_448, 80: 166_912}

# ---------------------------------------------------------------------------------------------------
# SASS: parse, basic blocks, loops, dense path
# ---------------------------------------------------------------------------------------------------

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Instr:
    address: int
    opcode: str  # mnemonic with modifiers, e.g. "HGMMA.64x64x16.F32.BF16"
    predicated: bool
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


@dataclass
class Block:
    label: str | None
    instrs: list = field(default_factory=list)


def _nvdisasm() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm")


def disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([_nvdisasm(), "-c", str(path)], check=True, capture_output=True, text=True).stdout


def basic_blocks(sass: str) -> list[Block]:
    """Split the disassembly at labels and after every branch or exit."""
    blocks = [Block(None)]
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            blocks.append(Block(label.group(1)))
            continue
        match = _LINE.match(line)
        if not match:
            continue
        instr = Instr(int(match.group(1), 16), match.group(3), match.group(2) is not None, match.group(4))
        if blocks[-1].instrs and blocks[-1].instrs[-1].base in ("BRA", "EXIT", "JMP", "RET"):
            blocks.append(Block(None))
        blocks[-1].instrs.append(instr)
    return [b for b in blocks if b.instrs]


@dataclass
class Loop:
    head: int  # block indices (address order); the loop is blocks[head : latch + 1]
    latch: int
    dense_path: list  # instructions on the heaviest path head -> back branch

    def contains(self, other: "Loop") -> bool:
        return self is not other and self.head <= other.head and other.latch <= self.latch


def _successors(blocks, index, labels) -> list[int]:
    last = blocks[index].instrs[-1]
    succ = []
    if last.base in ("BRA", "JMP"):
        target = _TARGET.search(last.operands)
        if target and target.group(1) in labels:
            succ.append(labels[target.group(1)])
        if last.predicated or ".DIV" in last.opcode:
            succ.append(index + 1)
    elif not (last.base in ("EXIT", "RET") and not last.predicated):
        succ.append(index + 1)
    return [s for s in succ if s < len(blocks)]


def find_loops(blocks: list[Block]) -> list[Loop]:
    """Natural loops from backward branches; the dense path is the longest forward path through the body."""
    labels = {b.label: i for i, b in enumerate(blocks) if b.label}
    loops = []
    for latch, block in enumerate(blocks):
        last = block.instrs[-1]
        target = _TARGET.search(last.operands) if last.base == "BRA" else None
        if not target or labels.get(target.group(1), latch + 1) > latch:
            continue
        head = labels[target.group(1)]
        best = {head: (len(blocks[head].instrs), [head])}  # longest path (instruction count) to each block
        for i in range(head, latch + 1):
            if i not in best:
                continue
            for j in _successors(blocks, i, labels):
                if i < j <= latch:
                    weight = best[i][0] + len(blocks[j].instrs)
                    if j not in best or weight > best[j][0]:
                        best[j] = (weight, best[i][1] + [j])
        if latch in best:
            loops.append(Loop(head, latch, [ins for i in best[latch][1] for ins in blocks[i].instrs]))
    return loops


def tensor_loops(blocks: list[Block]) -> tuple[list[Loop], list[Instr]]:
    """Innermost loops holding tensor-core instructions (address order), and the instructions outside them."""
    loops = [lp for lp in find_loops(blocks) if any(i.base in ("HGMMA", "HMMA") for i in lp.dense_path)]
    innermost = [lp for lp in loops if not any(lp.contains(other) for other in loops)]
    inside = {i for lp in innermost for i in range(lp.head, lp.latch + 1)}
    outside = [ins for i, b in enumerate(blocks) if i not in inside for ins in b.instrs]
    return sorted(innermost, key=lambda lp: lp.head), outside


# ---------------------------------------------------------------------------------------------------
# Instruction classes and the cost model
# ---------------------------------------------------------------------------------------------------

CLASSES = ("tensor", "mufu", "fp32", "fcmp", "isetp/sel", "int", "addr64", "ldg", "async_copy", "stg",
           "atomic", "shared", "shfl", "bar/sync", "other")
_FP32 = {"FFMA", "FMUL", "FADD", "FFMA2", "FMUL2", "FADD2", "HFMA2", "HMUL2", "HADD2", "FSWZADD"}
_FCMP = {"FMNMX", "FSETP", "FSEL", "FSET", "FMNMX3"}
_ISETP = {"ISETP", "SEL", "PLOP3", "P2R", "R2P", "ICMP", "UISETP"}
_INT_ALU = {"IADD3", "LOP3", "SHF", "LEA", "IABS", "IMNMX", "VIADD", "VIMNMX", "PRMT", "FLO", "POPC", "BREV",
            "SGXT", "BMSK", "IADD", "VIADDMNMX", "F2FP", "I2IP", "HMNMX2", "LOP"}
_CONVERT = {"F2I", "I2F", "F2F", "FRND", "I2FP", "F2IP"}
_ASYNC = {"LDGSTS", "UTMALDG", "UBLKCP", "UTMAPF"}
_STORE = {"STG", "ST", "LD", "LDL", "STL"}
_ATOMIC = {"ATOM", "ATOMG", "RED", "REDG"}
_SHARED = {"LDS", "STS", "LDSM", "STSM", "ATOMS"}
_SHFL = {"SHFL", "REDUX", "MATCH"}
_SYNC = {"BAR", "SYNCS", "WARPGROUP", "DEPBAR", "LDGDEPBAR", "MEMBAR", "FENCE", "ARRIVES", "WARPSYNC", "BSSY", "BSYNC",
         "ERRBAR", "CCTL", "UCGABAR_ARV", "UCGABAR_WAIT"}


def classify(instr: Instr) -> tuple[str, str | None, int]:
    """`(class, pipe or None for issue-only, pipe slots)` of one SASS instruction."""
    base, op = instr.base, instr.opcode
    wide = "X" in op.split(".")[1:] or op.startswith("IMAD.WIDE") or op.startswith("LEA.HI")  # 64-bit pairs
    if base in ("HGMMA", "HMMA"):
        return "tensor", None, 0
    if base == "MUFU" or base in _CONVERT:
        return "mufu", "mufu", 1
    if base in _FP32:
        return "fp32", "fma", 1
    if base in _FCMP:
        return "fcmp", "alu", 1
    if base in _ISETP:
        return "isetp/sel", "alu", 1
    if base == "IMAD":
        return ("addr64" if wide else "int"), "fma", "IMAD"
    if base in _INT_ALU:
        return ("addr64" if wide else "int"), "alu", 1
    if base == "LDG":
        return "ldg", "lsu", 1
    if base in _ASYNC:
        return "async_copy", "lsu", 1
    if base in _STORE:
        return "stg", "lsu", 1
    if base in _ATOMIC:
        return "atomic", "lsu", 1
    if base in _SHARED:
        return "shared", "lsu", 1
    if base in _SHFL:
        return "shfl", "lsu", 1
    if base in _SYNC:
        return "bar/sync", None, 0
    return "other", None, 0  # moves, uniform datapath, special registers, branches, nops: issue only


_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)")
_HMMA = re.compile(r"^HMMA\.168(\d+)")  # HMMA.16816 (m16 n8 k16), HMMA.1688 (m16 n8 k8)


def tensor_flop_per_warp(instr: Instr) -> int:
    """FLOP one warp contributes: HGMMA.MxNxK is a warpgroup (4 warps) instruction; HMMA.168K one warp's."""
    match = _HGMMA.match(instr.opcode)
    if match:
        m, n, k = (int(g) for g in match.groups())
        return 2 * m * n * k // 4
    match = _HMMA.match(instr.opcode)
    if match:
        return 2 * 16 * 8 * int(match.group(1))
    raise ValueError(f"unknown tensor instruction shape: {instr.opcode}")


@dataclass
class Cost:
    """Counts per warp for one loop iteration (or one program's code outside the loops) and its cycles per SM."""
    counts: dict  # class -> warp-instructions
    instructions: int
    tensor_flop: dict  # HGMMA/HMMA -> FLOP per warp
    pipes: dict  # pipe -> warp-instruction slots per warp

    def cycles(self, arch: int, num_warps: int) -> dict:
        machine = MACHINES[arch]
        tensor = sum(flop * num_warps / machine.tensor_flop.get(kind, machine.tensor_flop["HMMA"])
                     for kind, flop in self.tensor_flop.items())
        pipe = {"issue": self.instructions * num_warps / machine.pipes["issue"]}
        for name in ("fma", "alu", "mufu", "lsu"):
            pipe[name] = self.pipes.get(name, 0) * num_warps / machine.pipes[name]
        bound = max(pipe, key=pipe.get)
        return {"tensor": tensor, **pipe, "bound": bound, "serial": tensor + pipe[bound],
                "overlapped": max(tensor, pipe[bound])}


def count(instrs: list[Instr], arch: int) -> Cost:
    counts, pipes, flop = Counter(), Counter(), Counter()
    for instr in instrs:
        cls, pipe, slots = classify(instr)
        counts[cls] += 1
        if pipe:
            pipes[pipe] += IMAD_COST[arch] if slots == "IMAD" else slots
        if cls == "tensor":
            flop[instr.base] += tensor_flop_per_warp(instr)
    return Cost(dict(counts), len(instrs), dict(flop), dict(pipes))


@dataclass
class KernelCode:
    """One compiled kernel: its tensor-core loops (address order) and the code outside them."""
    name: str
    arch: int
    num_warps: int
    registers: int
    spill: int
    loops: list  # Cost per loop
    outside: Cost


def analyse(name: str, compiled, arch: int) -> KernelCode:
    from benchmarks.aot_compile_table import resource_usage

    blocks = basic_blocks(disassemble(compiled.asm["cubin"]))
    loops, outside = tensor_loops(blocks)
    usage = resource_usage(compiled)
    return KernelCode(name, arch, compiled.metadata.num_warps, usage["registers"], usage["spill"],
                      [count(lp.dense_path, arch) for lp in loops], count(outside, arch))


# ---------------------------------------------------------------------------------------------------
# Kernels to compile and their work for a given problem
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """Causal self-attention (prefill / training) or one-token decode against a cache of `length` keys.
    `documents`: the rows (`batch` x `length` tokens) hold these documents (packed, or one per padded row), each a
    causal layout of its own; the rest is padding."""
    batch: int
    heads: int
    kv_heads: int
    length: int
    dim: int
    window: int = 1024
    documents: tuple = ()
    tau: float = -1.0  # every head's (the causal forward's branch: `_lazy_causal_fwd_work`)

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


@dataclass
class Work:
    programs: int
    iterations: list  # per tensor-core loop (address order), summed over programs; or per pass of the causal forward
    dram_bytes: float
    tile: tuple  # (rows, cols) of the score tile of one loop iteration
    pass_tiles: dict | None = None  # the causal forward's: a pass whose tile is not `tile` (pass 1's wider keys)


@dataclass(frozen=True)
class KernelSpec:
    """How to compile one kernel (module, function, blocks) and what work it does for a problem."""
    label: str
    source: str  # "lazy" (the lazy_attention_triton_*.py kernel files) or "fa2" (benchmarks/fa2_reference_kernels.py)
    function: str
    kind: str  # block-table key
    work: object  # (problem, blocks, num_sms) -> Work
    documents: bool = False  # the DOCUMENTS build (work lists of document tiles)


def _cdiv(a, b):
    return -(-a // b)


def _bytes(*tensors_elements, elem=2):
    return sum(tensors_elements) * elem


def _lazy_fwd_work(p: Problem, blocks, sms):
    bm, bn = blocks
    tiles = [_cdiv(min(p.length, (m + 1) * bm), bn) for m in range(_cdiv(p.length, bm))]
    bh = p.batch * p.heads
    qkvo = _bytes(2 * bh * p.length * p.dim, 2 * p.batch * p.kv_heads * p.length * p.dim)
    return Work(bh * len(tiles), [bh * sum(tiles)] * 2, qkvo + 4 * bh * p.length, (bm, bn))


def _causal_ranges(p: Problem, m0: int, bm: int, bn: int) -> tuple[int, int, int]:
    """Key tiles of the causal fast path's three loops for query rows [m0, m0 + BM) (its `_causal_key_ranges`)."""
    hi = min(p.length, m0 + bm)
    full = (m0 + 1) // bn * bn
    far = max(m0 - p.window + 1, 0) // bn * bn
    return far // bn, (full - far) // bn, _cdiv(max(hi - full, 0), bn)


def _lazy_causal_fwd_work(p: Problem, blocks, sms, store_u: bool = False, passes: int = 0):
    """Three loops per pass (beyond the window, inside it, at the causal limit): pass 1 and pass 2 (tau < 0), or the
    one pass (tau = 0, or with `store_u` tau >= 0): `p.tau` picks the branch every program takes; the iterations
    are given per pass (`causal_forward_passes` finds each pass's loops). `store_u` (training): U written too (bf16,
    as O), in the one pass from the running sums of V (float32, read once per row of key heads). `passes` 1 or 2:
    the training build that runs only the heads of one pass or of two; the other build's programs return after
    their prologue (charged as whole programs without loops: an upper bound). `blocks` (BM, BN) or (BM, BN, pass 1's
    BN) (`work_blocks`)."""
    bm, bn = blocks[:2]
    bn1 = blocks[2] if len(blocks) > 2 else bn
    bh = p.batch * p.heads

    def per_loop(key_tile: int) -> list:
        ranges = [_causal_ranges(p, m * bm, bm, key_tile) for m in range(_cdiv(p.length, bm))]
        return [bh * sum(r[i] for r in ranges) for i in range(3)] if runs else [0] * 3

    one_pass = p.tau == 0 or (store_u and p.tau > 0)
    runs = passes == 0 or one_pass == (passes == 1)
    none = [0] * 3
    iterations = {"pass 1": none if one_pass else per_loop(bn1), "pass 2": none if one_pass else per_loop(bn),
                  "one pass": per_loop(bn) if one_pass else none}
    qkvo = _bytes(2 * bh * p.length * p.dim, 2 * p.batch * p.kv_heads * p.length * p.dim)
    u = 2 * bh * p.length * p.dim if store_u else 0
    vsum = 4 * p.batch * p.kv_heads * p.length * p.dim if store_u and one_pass else 0  # the running sums of V
    return Work(bh * _cdiv(p.length, bm), iterations, (qkvo + u + vsum + 4 * bh * p.length) if runs else 4 * bh,
                (bm, bn), {"pass 1": (bm, bn1)} if bn1 != bn else None)


def _lazy_causal_delta_work(p: Problem, blocks, sms):
    """Causal Delta from U: one query tile per program, no key loop; reads O, dO and U (bf16) of every row, or with
    `documents` of the rows in a document (QSEG, read for every token, says which), and the LSE; writes Delta, the
    threshold and a copy of the LSE, and with documents the padding's zero dq, dk and dv (bf16; MHA). Without
    documents the threshold and LSE rows run one dk/dv query tile past the end (one more program per row of heads
    at the shipped blocks, whose Delta tiles are at least as tall)."""
    bm, _ = blocks
    rows = p.batch * p.length
    useful = sum(p.documents) if p.documents else rows
    per_token = 4 * (2 if p.documents else 1)  # QPOS (and QSEG)
    zeros = 3 * 2 * (rows - useful) * p.dim
    programs = p.batch * p.heads * (_cdiv(p.length, bm) + (0 if p.documents else 1))
    return Work(programs, [],
                p.heads * ((2 + 2 + 2) * useful * p.dim + (4 + 4 + 4 + 4) * rows + zeros) + per_token * rows,
                (bm, p.dim))


def _lazy_causal_bwd_query_work(p: Problem, blocks, sms, writes_dq: bool):
    """Causal Delta / dq kernels: one query tile per program, the forward's three key ranges."""
    bm, bn = blocks
    ranges = [_causal_ranges(p, m * bm, bm, bn) for m in range(_cdiv(p.length, bm))]
    bh = p.batch * p.heads
    elements = bh * p.length * p.dim * (3 if writes_dq else 2) + 2 * p.batch * p.kv_heads * p.length * p.dim
    return Work(bh * len(ranges), [bh * sum(r[i] for r in ranges) for i in range(3)], _bytes(elements), (bm, bn))


def _lazy_causal_dkdv_work(p: Problem, blocks, sms):
    """Causal dk/dv: one key tile of one query head per program; query tiles at the causal limit, inside the bias
    window, beyond it (`_lazy_causal_bwd_dkdv_kernel`'s bounds)."""
    bm, bn = blocks
    loops = [0, 0, 0]
    for n in range(_cdiv(p.length, bn)):
        n0 = n * bn
        start = n0 // bm * bm
        near = max(start, _cdiv(n0 + bn - 1, bm) * bm)
        far = max(near, _cdiv(n0 + bn - 1 + p.window, bm) * bm)
        bounds = (start, min(near, p.length), near, min(far, p.length), far, p.length)
        for i in range(3):
            loops[i] += max(0, _cdiv(bounds[2 * i + 1] - bounds[2 * i], bm))
    bh = p.batch * p.heads
    elements = 2 * bh * p.length * p.dim + 4 * p.batch * p.kv_heads * p.length * p.dim
    return Work(bh * _cdiv(p.length, bn), [bh * n for n in loops], _bytes(elements), (bn, bm))


def _lazy_decode_work(p: Problem, blocks, sms):
    """`_lazy_fwd_kernel` with the decode blocks - pass 1 reads K, pass 2 re-reads K and V.

    The launcher runs it (one split) when the query heads alone fill the GPU; fewer would take the split-K
    kernels, which this model does not cost."""
    bm, bn = blocks
    bh = p.batch * p.heads
    if bh < sms:
        raise ValueError(f"{bh} query heads do not fill {sms} SMs: the launcher would split K (not modelled)")
    tiles = _cdiv(p.length, bn)
    kv = p.batch * p.kv_heads * p.length * p.dim
    return Work(bh, [bh * tiles] * 2, _bytes(3 * kv), (bm, bn))



def _packed_decode_plan(p: Problem, blocks, sms):
    """`(programs, splits, keys per split)` of the packed decode (its launcher, `_packed_decode`, one query row)."""
    bm, bn = blocks
    programs = p.batch * p.kv_heads * _cdiv(p.groups, bm)
    splits = 1 if programs >= sms else max(1, min(_cdiv(2 * sms, programs), p.length // 256))
    keys_per_split = _cdiv(_cdiv(p.length, splits), bn) * bn
    return programs, _cdiv(p.length, keys_per_split), keys_per_split


def _packed_decode_loops(p: Problem, bn: int, splits: int, keys_per_split: int, far: int) -> list:
    """Key tiles of the two loops (below `far`, from `far` on), summed over the splits of one program row."""
    below = sum(len(range(s * keys_per_split, min((s + 1) * keys_per_split, p.length, far), bn))
                for s in range(splits))
    return [below, _cdiv(p.length, bn) - below]


def _lazy_decode_lse_work(p: Problem, blocks, sms):
    """Packed decode pass 1: reads K once per KV head, writes the float32 scores of the G real rows per key."""
    _, bn = blocks
    programs, splits, keys_per_split = _packed_decode_plan(p, blocks, sms)
    far = max(p.length - p.window, 0) // bn * bn  # keys >= W behind the row: no bias
    loops = _packed_decode_loops(p, bn, splits, keys_per_split, far)
    kv = p.batch * p.kv_heads * p.length * p.dim
    scores = 4 * p.batch * p.heads * p.length
    return Work(programs * splits, [programs * n for n in loops], _bytes(kv) + scores + 4 * 2 * splits * p.batch
                * p.heads, blocks)


def _lazy_decode_out_work(p: Problem, blocks, sms):
    """Packed decode pass 2: reads the kept scores and V (all tiles live: the dense worst case), writes float32
    partial outputs that the combine reads back."""
    _, bn = blocks
    programs, splits, _ = _packed_decode_plan(p, blocks, sms)
    kv = p.batch * p.kv_heads * p.length * p.dim
    scores = 4 * p.batch * p.heads * p.length
    partials = 4 * 2 * splits * p.batch * p.heads * p.dim
    return Work(programs * splits, [programs * _cdiv(p.length, bn)], _bytes(kv) + scores + partials, blocks)

def _lazy_bwd_query_work(p: Problem, blocks, sms, writes_dq: bool):
    """Delta / dq kernels: one query tile per program over the causally needed key tiles."""
    bm, bn = blocks
    tiles = [_cdiv(min(p.length, (m + 1) * bm), bn) for m in range(_cdiv(p.length, bm))]
    bh = p.batch * p.heads
    elements = bh * p.length * p.dim * (3 if writes_dq else 2) + 2 * p.batch * p.kv_heads * p.length * p.dim
    return Work(bh * len(tiles), [bh * sum(tiles)], _bytes(elements), (bm, bn))


def _lazy_dkdv_work(p: Problem, blocks, sms):
    bm, bn = blocks
    rows = [_cdiv(p.length - (n * bn // bm) * bm, bm) for n in range(_cdiv(p.length, bn))]
    bkv = p.batch * p.kv_heads
    elements = 2 * p.batch * p.heads * p.length * p.dim + 4 * bkv * p.length * p.dim
    return Work(bkv * len(rows), [bkv * p.groups * sum(rows)], _bytes(elements), (bm, bn))


def _fa2_fwd_work(p: Problem, blocks, sms):
    bm, bn = blocks
    m_tiles = p.length // bm
    bh = p.batch * p.heads
    # the diagonal loop runs BM / BN times: with BM == BN the compiler emits it as straight-line code (per program)
    diagonal = [bh * m_tiles * bm // bn] if bm > bn else []
    return Work(bh * m_tiles, [bh * sum(m * bm // bn for m in range(m_tiles))] + diagonal,
                _bytes(4 * bh * p.length * p.dim), (bm, bn))


def _fa2_preprocess_work(p: Problem, blocks, sms):
    bm, _ = blocks
    bh = p.batch * p.heads
    return Work(bh * p.length // bm, [], _bytes(2 * bh * p.length * p.dim), (bm, p.dim))


def _fa2_bwd_work(p: Problem, blocks, sms):
    bm, bn = blocks
    n_tiles = p.length // bn
    bh = p.batch * p.heads
    below = sum((p.length - (n + 1) * bn) // bm for n in range(n_tiles))
    diagonal = [bh * n_tiles * bn // bm] if bn > bm else []  # straight-line code when it runs once (BN == BM)
    # q, k, v, dO read, dk, dv written (bf16); dq accumulated in float32 through L2 (read + write once)
    return Work(bh * n_tiles, diagonal + [bh * below],
                _bytes(6 * bh * p.length * p.dim) + 8 * bh * p.length * p.dim, (bn, bm))


def _fa2_decode_work(p: Problem, blocks, sms):
    _, bn = blocks
    programs = p.batch * p.kv_heads
    splits = 1 if programs >= sms else max(1, min(_cdiv(2 * sms, programs), p.length // 256))
    keys_per_split = _cdiv(_cdiv(p.length, splits), bn) * bn
    splits = _cdiv(p.length, keys_per_split)
    kv = p.batch * p.kv_heads * p.length * p.dim
    partials = 4 * 2 * splits * p.batch * p.heads * (p.dim + 2)  # float32 partials written, read by the combine
    return Work(programs * splits, [programs * splits * (keys_per_split // bn)], _bytes(2 * kv) + partials,
                (max(16, p.groups), bn))


LAZY_GENERAL = {
    "fwd": KernelSpec("lazy fwd (general)", "lazy", "_lazy_fwd_kernel", "fwd", _lazy_fwd_work),
    "decode": KernelSpec("lazy decode (general)", "lazy", "_lazy_fwd_kernel", "decode", _lazy_decode_work),
    "delta": KernelSpec("lazy bwd Delta", "lazy", "_lazy_bwd_delta_kernel", "delta",
                        partial(_lazy_bwd_query_work, writes_dq=False)),
    "dq": KernelSpec("lazy bwd dq", "lazy", "_lazy_bwd_dq_kernel", "dq", partial(_lazy_bwd_query_work, writes_dq=True)),
    "dkdv": KernelSpec("lazy bwd dk/dv", "lazy", "_lazy_bwd_dkdv_kernel", "dkdv", _lazy_dkdv_work),
}
LAZY_FAST = {
    **LAZY_GENERAL,
    "fwd": KernelSpec("lazy fwd (causal)", "lazy", "_lazy_causal_fwd_kernel", "causal_fwd", _lazy_causal_fwd_work),
    "decode_lse": KernelSpec("lazy packed decode pass 1", "lazy", "_lazy_decode_lse_kernel", "packed_decode",
                             _lazy_decode_lse_work),
    "decode_out": KernelSpec("lazy packed decode pass 2", "lazy", "_lazy_decode_out_kernel", "packed_decode",
                             _lazy_decode_out_work),
    "fwd_u": KernelSpec("lazy fwd + U, two passes (causal, training)", "lazy", "_lazy_causal_fwd_kernel",
                        "causal_fwd_u", partial(_lazy_causal_fwd_work, store_u=True, passes=2)),
    "fwd_u1": KernelSpec("lazy fwd + U, one pass (causal, training)", "lazy", "_lazy_causal_fwd_kernel",
                         "causal_fwd_u1", partial(_lazy_causal_fwd_work, store_u=True, passes=1)),
    "delta": KernelSpec("lazy bwd Delta from U (causal)", "lazy", "_lazy_causal_bwd_delta_kernel", "causal_delta",
                        _lazy_causal_delta_work),
    "dq": KernelSpec("lazy bwd dq (causal)", "lazy", "_lazy_causal_bwd_dq_kernel", "causal_dq",
                     partial(_lazy_causal_bwd_query_work, writes_dq=True)),
    "dkdv": KernelSpec("lazy bwd dk/dv (causal)", "lazy", "_lazy_causal_bwd_dkdv_kernel", "causal_dkdv",
                       _lazy_causal_dkdv_work),
}
LAZY_DOCUMENTS = {  # the causal fast path per document: its kernels' DOCUMENTS builds
    "fwd_u": KernelSpec("lazy fwd + U, two passes (per document)", "lazy", "_lazy_causal_fwd_kernel",
                        "causal_fwd_u", partial(_lazy_causal_fwd_work, store_u=True, passes=2), documents=True),
    "fwd_u1": KernelSpec("lazy fwd + U, one pass (per document)", "lazy", "_lazy_causal_fwd_kernel",
                         "causal_fwd_u1", partial(_lazy_causal_fwd_work, store_u=True, passes=1), documents=True),
    "delta": KernelSpec("lazy bwd Delta from U (per document)", "lazy", "_lazy_causal_bwd_delta_kernel",
                        "causal_delta", _lazy_causal_delta_work, documents=True),
    "dq": KernelSpec("lazy bwd dq (per document)", "lazy", "_lazy_causal_bwd_dq_kernel", "causal_dq",
                     partial(_lazy_causal_bwd_query_work, writes_dq=True), documents=True),
    "dkdv": KernelSpec("lazy bwd dk/dv (per document)", "lazy", "_lazy_causal_bwd_dkdv_kernel",
                       "causal_dkdv_documents", _lazy_causal_dkdv_work, documents=True),
}
FA2 = {
    "fwd": KernelSpec("FA2-style fwd", "fa2", "_fa2_fwd_kernel", "fwd", _fa2_fwd_work),
    "preprocess": KernelSpec("FA2-style bwd Delta", "fa2", "_fa2_bwd_preprocess_kernel", "bwd", _fa2_preprocess_work),
    "bwd": KernelSpec("FA2-style bwd", "fa2", "_fa2_bwd_kernel", "bwd", _fa2_bwd_work),
    "decode": KernelSpec("FA2-style decode", "fa2", "_flash_decode_kernel", "decode", _fa2_decode_work),
}
# The plain scenarios give every head tau = -1 (the causal forward's two passes); these rows (causal fast path, L 4k)
# give every head tau = 0 (its one pass)
TAU_ROWS = ("forward, tau = 0", "training, tau >= 0")
# Scenario -> kernels run, for each implementation
SCENARIOS = {
    "lazy (general)": {"forward": ["fwd"], "training": ["fwd", "delta", "dq", "dkdv"], "decode": ["decode"]},
    "lazy (causal fast path)": {"forward": ["fwd"], "training": ["fwd_u1", "fwd_u", "delta", "dq", "dkdv"],
                                "decode": ["decode_lse", "decode_out"], "forward, tau = 0": ["fwd"],
                                "training, tau >= 0": ["fwd_u1", "fwd_u", "delta", "dq", "dkdv"]},
    "lazy (per document)": {"packed training": ["fwd_u1", "fwd_u", "delta", "dq", "dkdv"],
                            "padded training": ["fwd_u1", "fwd_u", "delta", "dq", "dkdv"]},
    "FA2-style": {"forward": ["fwd"], "training": ["fwd", "preprocess", "bwd"], "decode": ["decode"],
                  "packed training": ["fwd", "preprocess", "bwd"], "padded training": ["fwd", "preprocess", "bwd"],
                  "forward, tau = 0": ["fwd"], "training, tau >= 0": ["fwd", "preprocess", "bwd"]},
}
IMPLEMENTATIONS = {"lazy (general)": LAZY_GENERAL, "lazy (causal fast path)": LAZY_FAST,
                   "lazy (per document)": LAZY_DOCUMENTS, "FA2-style": FA2}


def _fa2_module():
    from benchmarks import fa2_reference_kernels

    return fa2_reference_kernels


def work_blocks(spec: KernelSpec, arch: int, dim: int) -> tuple:
    """The blocks a work function takes: (BLOCK_M, BLOCK_N), and pass 1's BLOCK_N after them where a causal forward
    build runs pass 1 on wider key tiles (`_pass1_block_n`)."""
    block_m, block_n = blocks_of(spec, arch, dim)[:2]
    if spec.source == "lazy" and spec.function == "_lazy_causal_fwd_kernel":
        block_n1 = load_kernels()._pass1_block_n(spec.kind, max(16, dim), "sm90" if arch >= 90 else "sm80")
        if block_n1 != block_n:
            return block_m, block_n, block_n1
    return block_m, block_n


def blocks_of(spec: KernelSpec, arch: int, dim: int) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) the launcher uses."""
    family = "sm90" if arch >= 90 else "sm80"
    if spec.source == "lazy":
        return load_kernels()._config(spec.kind, max(16, dim), family)
    return _fa2_module().CONFIGS[family][(spec.kind, dim)]


def compile_spec(spec: KernelSpec, arch: int, dim: int, groups: int = 4):
    """Compile one kernel in bf16 for `sm_<arch>` at head dim `dim` (GQA `groups` for the packed decode)."""
    block_m, block_n, warps, stages = blocks_of(spec, arch, dim)
    if spec.source == "lazy":
        from benchmarks.aot_compile_table import Build, compile_build

        return compile_build(load_kernels(), Build(spec.function, spec.kind, torch.bfloat16, dim, arch,
                                                   documents=spec.documents))
    fn = getattr(_fa2_module(), spec.function)
    pointers = {name: "bf16" for name in ("Q", "K", "V", "OUT", "DO", "DK", "DV")}
    pointers |= {name: "fp32" for name in ("DQ", "LSE", "DELTA", "O_PART", "M_PART", "L_PART")}
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=dim, GROUPS=groups, BLOCK_G=max(16, groups))
    return aot_compile(fn, pointers, constexprs, arch, warps, stages)


def _analyse_job(job):
    spec, arch, dim = job
    start = time.perf_counter()
    code = analyse(spec.label, compile_spec(spec, arch, dim), arch)
    return job, code, time.perf_counter() - start


def analyse_all(jobs, workers: int):
    """Compile and analyse `(KernelSpec, arch, dim)` jobs in worker processes."""
    if workers <= 1:
        return [_analyse_job(job) for job in jobs]
    import concurrent.futures

    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_analyse_job, jobs))


# ---------------------------------------------------------------------------------------------------
# Time of a kernel and of a scenario
# ---------------------------------------------------------------------------------------------------


def causal_forward_passes(code: KernelCode, tile: tuple) -> dict:
    """The causal forward's tensor-core loops (address order) by pass, three each (beyond the window, inside it, at
    the causal limit; in that order within a pass, while the compiler may lay out the passes in either order): "pass
    1" computes the most exponentials per tensor-core FLOP (one exp2 per score for q k^T alone, where the other
    passes also multiply by V; its key tiles may be wider than theirs, so its FLOP per iteration alone does not tell
    it apart), "one pass" (FlashAttention-2's online softmax rescales its accumulator: more float32 arithmetic per
    score), "pass 2" the rest. The training builds that run only the heads of two passes, or of one (`PASSES`), have
    those loops only (the others: [])."""
    if len(code.loops) not in (3, 6, 9):
        raise RuntimeError(f"{code.name}: the causal forward has {len(code.loops)} tensor-core loops, the model "
                           "expects 9, 6 where it has no one pass, 3 where it has only the one pass (did the kernel "
                           "change?)")
    groups = [list(range(i, i + 3)) for i in range(0, len(code.loops), 3)]
    if len(groups) == 1:  # the training build of the heads of one pass
        return {"pass 1": [], "pass 2": [], "one pass": groups[0]}
    exp_per_flop = [code.loops[g[0]].pipes.get("mufu", 0) / sum(code.loops[g[0]].tensor_flop.values())
                    for g in groups]
    passes = {"pass 1": groups.pop(exp_per_flop.index(max(exp_per_flop)))}
    if len(groups) == 1:
        return passes | {"pass 2": groups[0], "one pass": []}
    fp32 = [per_element(code, g[0], tile)["fp32"] for g in groups]  # the one pass also rescales its accumulator
    if fp32[0] == fp32[1]:
        raise RuntimeError(f"{code.name}: cannot tell the one pass from pass 2 ({fp32})")
    return passes | {"one pass": groups[fp32.index(max(fp32))], "pass 2": groups[fp32.index(min(fp32))]}


def kernel_time(code: KernelCode, work: Work, arch: int) -> dict:
    """Modelled seconds of one launch: SM cycles (serial model) over all SMs, or DRAM time if larger."""
    if isinstance(work.iterations, dict):  # per pass of the causal forward: in the loops' order
        iterations, passes = [0] * len(code.loops), causal_forward_passes(code, work.tile)
        for name, loops in passes.items():
            if not loops and any(work.iterations[name]):
                raise RuntimeError(f"{code.name}: the work has iterations of {name}, the build has no such loops")
            for index, n in zip(loops, work.iterations[name]):
                iterations[index] += n
        work = replace(work, iterations=iterations)
    if len(work.iterations) != len(code.loops):
        raise RuntimeError(f"{code.name} (sm_{arch}): the model expects {len(work.iterations)} tensor-core loops, "
                           f"the SASS has {len(code.loops)} (did the kernel change? update its Work function)")
    machine = MACHINES[arch]
    loops = [(n, lp.cycles(arch, code.num_warps)) for n, lp in zip(work.iterations, code.loops)]
    cycles = work.programs * code.outside.cycles(arch, code.num_warps)["serial"]
    cycles += sum(n * c["serial"] for n, c in loops)
    compute_s = cycles / machine.sms / machine.clock_hz
    dram_s = work.dram_bytes / machine.dram_bytes_per_s
    # the floor: the loops' tensor-core and MUFU (exp2) cycles alone, as if every other instruction were free
    floor_s = sum(n * (c["tensor"] + c["mufu"]) for n, c in loops) / machine.sms / machine.clock_hz
    # on sm_90, the time if the loops' mma.sync products (a tile too short for wgmma) ran at the wgmma rate
    rates = machine.tensor_flop
    slow = (1 / rates["HMMA"] - 1 / rates["HGMMA"]) if "HGMMA" in rates else 0
    hmma_s = sum(n * lp.tensor_flop.get("HMMA", 0) * code.num_warps * slow
                 for n, lp in zip(work.iterations, code.loops)) / machine.sms / machine.clock_hz
    return {"seconds": max(compute_s, dram_s), "compute_s": compute_s, "dram_s": dram_s,
            "floor_s": max(floor_s, dram_s), "all_wgmma_s": max(compute_s - hmma_s, dram_s),
            "bound": "dram" if dram_s > compute_s else "compute"}


def padding_runs(p: Problem) -> list:
    """Lengths of the runs of padding of `p`'s rows when its documents fill them in order (a document that does not
    fit in what is left of a row starts the next one); none without documents."""
    if not p.documents:
        return []
    runs, used, rows = [], 0, 1
    for n in p.documents:
        if used + n > p.length:
            runs += [p.length - used] if used < p.length else []
            used, rows = 0, rows + 1
        used += n
    runs += [p.length - used] if used < p.length else []
    return runs + [p.length] * (p.batch - rows)


def problem_work(spec: KernelSpec, problem: Problem, blocks: tuple, sms: int) -> Work:
    """`spec`'s work for `problem`. With documents: a DOCUMENTS build does each document's causal work, plus the
    spare programs of its upper-bound work list (`_varlen_tiles`: prologue only) over the document table (the
    documents, then the runs of padding); the forward's work list also holds the padding's tiles, which write its
    zeros (charged as spare programs plus their bytes); an FA2-style kernel does the same per-document work (what a
    varlen FlashAttention-2 does: the yardstick on the useful tokens); the Delta from U runs over every row,
    padding included (where it writes the padding's zero gradients)."""
    if not problem.documents or spec.kind == "causal_delta" or (spec.source == "lazy" and not spec.documents):
        return spec.work(problem, blocks, sms)
    works = [spec.work(replace(problem, batch=1, length=n, documents=()), blocks, sms) for n in problem.documents]
    programs = sum(w.programs for w in works)
    dram_bytes = sum(w.dram_bytes for w in works)
    if spec.documents:
        rows = blocks[1] if spec.kind.startswith("causal_dkdv") else blocks[0]  # the work list's tile height
        padding = padding_runs(problem)
        if spec.kind in ("causal_fwd", "causal_fwd_u"):  # out and U (bf16) 0, the dead-row LSE (float32)
            per_token = 2 * problem.dim * (2 if spec.kind == "causal_fwd_u" else 1) + 4
            dram_bytes += problem.heads * sum(padding) * per_token
        entries = len(problem.documents) + len(padding)
        upper = (problem.batch * problem.length + entries * (rows - 1)) // rows
        programs += problem.heads * (upper - sum(_cdiv(n, rows) for n in problem.documents))  # spares, padding
    if isinstance(works[0].iterations, dict):
        iterations = {k: [sum(w.iterations[k][i] for w in works) for i in range(3)] for k in works[0].iterations}
    else:
        iterations = [sum(w.iterations[i] for w in works) for i in range(len(works[0].iterations))]
    return replace(works[0], programs=programs, iterations=iterations, dram_bytes=dram_bytes)


LAUNCH_S = 2.5e-6  # charged per kernel launch (and per device op a launcher adds), so that launch-bound decode shows


# Small device ops (fills, sums, the bias band) each launcher runs beside its kernels in one attention call of a
# scenario, in a layer after the first of a step, each charged as a launch (`LAUNCH_S`). Lazy's: counted by
# tests/test_triton_kernels.py (`launcher_device_ops`: the launchers run under the interpreter, every aten op
# outside the kernels that is not a view or an allocation; MHA, float32 parameters as a model keeps them). The bias
# band (`BAND_OPS`) is kept with the value of distance_bias it was built from: a training step builds it once per
# layer (the optimizer changes the bias between steps) and its backward reads the forward's; inference builds it
# once per layer, at the first call, which the model does not charge. The first layer of a step with documents also
# builds their two work lists, `WORK_LIST_OPS` each, which the others reuse. The FA2-style backward's: its float32
# dq buffer's fill and the conversion to the input dtype (`fa2_backward`).
BAND_OPS = 6
WORK_LIST_OPS = 18
LAUNCHER_OPS = {
    ("lazy (causal fast path)", "forward"): 0, ("lazy (causal fast path)", "forward, tau = 0"): 0,
    # training: the band, the d distance_bias partials' fill and two sums of partials
    **{("lazy (causal fast path)", scenario): BAND_OPS + 3 for scenario in ("training", "training, tau >= 0")},
    **{("lazy (per document)", scenario): BAND_OPS + 3 for scenario in ("packed training", "padded training")},
    **{("FA2-style", scenario): 2 for scenario in ("training", "training, tau >= 0", "packed training",
                                                   "padded training")},
}


def launches(impl: str, scenario: str, problem: Problem, arch: int) -> int:
    """Launches of one scenario: its kernels, plus what their launchers add (`LAUNCHER_OPS`). The packed decode sums
    its split-K partials into the output (one reduction) when it splits; the FA2-style decode is FlashDecoding's
    split kernel plus its combine (1)."""
    count = len(SCENARIOS[impl][scenario]) + LAUNCHER_OPS.get((impl, scenario), 0)
    if scenario == "decode" and impl == "lazy (causal fast path)":
        spec = IMPLEMENTATIONS[impl]["decode_lse"]
        count += _packed_decode_plan(problem, blocks_of(spec, arch, problem.dim)[:2], MACHINES[arch].sms)[1] > 1
    elif scenario == "decode" and impl == "FA2-style":
        count += 1
    return count + ("vsum" in _vsum_seconds(impl, scenario, problem, arch))


def _vsum_seconds(impl: str, scenario: str, problem: Problem, arch: int) -> dict:
    """The causal fast path's training launcher first runs `_lazy_value_sums_kernel`, the running sums of V (float32)
    for the heads of one pass: one launch in every training scenario of the fast path, and where heads have tau >=
    0 the DRAM time to read V and write the sums (a scan without tensor-core work: its loop is not analysed)."""
    if "fwd_u" not in SCENARIOS[impl][scenario] or impl == "lazy (general)":
        return {}
    tokens = sum(problem.documents) if problem.documents else problem.batch * problem.length
    return {"vsum": (2 + 4) * tokens * problem.kv_heads * problem.dim / MACHINES[arch].dram_bytes_per_s
            if problem.tau >= 0 else 0.0}


def _launcher_op_seconds(impl: str, scenario: str, problem: Problem, arch: int) -> dict:
    """DRAM time of the launcher ops that move more than a few KB: the FA2-style backward's float32 dq buffer
    (filled with zeros, then read and written in the input dtype: 4 + 4 + 2 bytes per element); the Lazy causal
    backward's d distance_bias partials, one float32 row of W per (dq program, head), filled with zeros and summed
    (4 + 4 bytes each)."""
    if not scenario.startswith(("training", "packed", "padded")) or impl == "lazy (general)":
        return {}
    tokens = sum(problem.documents) if problem.documents else problem.batch * problem.length
    if impl == "FA2-style":
        moved = (4 + 4 + 2) * tokens * problem.heads * problem.dim
    else:
        block_m = blocks_of(IMPLEMENTATIONS[impl]["dq"], arch, problem.dim)[0]
        if problem.documents:  # the work list's upper bound of tiles (`_varlen_tiles`), rows of documents and padding
            runs = len(problem.documents) + len(padding_runs(problem))
            programs = (problem.batch * problem.length + runs * (block_m - 1)) // block_m
        else:
            programs = problem.batch * _cdiv(problem.length, block_m)
        moved = (4 + 4) * programs * problem.heads * problem.window
    return {"launcher ops": moved / MACHINES[arch].dram_bytes_per_s}


def kernel_seconds(impl: str, scenario: str, codes: dict, problem: Problem, arch: int,
                   measure: str = "seconds") -> dict:
    """Modelled seconds of each kernel of one scenario (its `SCENARIOS` keys), launches not charged; with
    `measure="floor_s"` each kernel's floor, with "all_wgmma_s" its time with every product at the wgmma rate
    (`kernel_time`)."""
    seconds = {}
    for key in SCENARIOS[impl][scenario]:
        spec = IMPLEMENTATIONS[impl][key]
        work = problem_work(spec, problem, work_blocks(spec, arch, problem.dim), MACHINES[arch].sms)
        seconds[key] = kernel_time(codes[(spec, arch, problem.dim)], work, arch)[measure]
    return seconds | _vsum_seconds(impl, scenario, problem, arch) | _launcher_op_seconds(impl, scenario, problem, arch)


def scenario_floor(impl: str, scenario: str, codes: dict, problem: Problem, arch: int) -> float:
    """The scenario's floor: each kernel's loops at their tensor-core and MUFU cycles alone (or its DRAM time if
    larger), no launches, no code outside the loops. A ratio of floors is what a design's own matrix products and
    exponentials allow against the yardstick's, however lean the rest of its code."""
    return sum(kernel_seconds(impl, scenario, codes, problem, arch, "floor_s").values())


def scenario_time(impl: str, scenario: str, codes: dict, problem: Problem, arch: int) -> float:
    """Modelled seconds of one scenario: its kernels plus `LAUNCH_S` per launch."""
    return (LAUNCH_S * launches(impl, scenario, problem, arch)
            + sum(kernel_seconds(impl, scenario, codes, problem, arch).values()))


def per_element(code: KernelCode, loop: int, tile: tuple) -> dict:
    """Thread-instructions per score element of one loop iteration, in total and by class."""
    cost = code.loops[loop]
    scale = code.num_warps * 32 / (tile[0] * tile[1])
    return {"total": cost.instructions * scale, **{c: cost.counts.get(c, 0) * scale for c in CLASSES}}


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------

PREFILL_LENGTHS = (1024, 4096, 16384)
DECODE_LENGTHS = (4096, 32768)


def prefill_problem(length: int, dim: int) -> Problem:
    """H * D = 2048, B * L = 16k (the GPU benchmark's prefill shapes), MHA (the FA2-style kernels have no GQA)."""
    heads = 2048 // dim
    return Problem(max(1, 16384 // length), heads, heads, length, dim)


PACKED_DOCUMENTS = (256, 4096, 512, 1024, 2048, 256, 3072, 1024, 512, 768, 2048, 768)  # 16k tokens in one row
PADDED_ROWS = (4096, 3072, 2560, 2560)  # 4 rows of 4096: 25% padding


def documents_problem(scenario: str, dim: int) -> Problem:
    """H * D = 2048 (MHA, as `prefill_problem`): "packed training" is one row of the mixed documents of
    `PACKED_DOCUMENTS` (the GPU benchmark's), "padded training" 4 rows of 4096 with `PADDED_ROWS` useful tokens."""
    heads = 2048 // dim
    if scenario == "packed training":
        return Problem(1, heads, heads, sum(PACKED_DOCUMENTS), dim, documents=PACKED_DOCUMENTS)
    return Problem(len(PADDED_ROWS), heads, heads, max(PADDED_ROWS), dim, documents=PADDED_ROWS)


def decode_problem(length: int, dim: int) -> Problem:
    """Batch 8 of one new token, 32 query heads over 8 KV heads (a Llama-style GQA of 4)."""
    return Problem(8, 32, 8, length, dim)


def build_report(archs, dims, workers) -> dict:
    specs = {}  # each kernel once, with the implementation and role it is listed under first
    for impl, kernels in IMPLEMENTATIONS.items():
        for key, spec in kernels.items():
            specs.setdefault(spec, (impl, key))
    jobs = [(spec, arch, dim) for spec in specs for arch in archs for dim in dims]
    start = time.perf_counter()
    results = analyse_all(jobs, workers)
    codes = {job: code for job, (_, code, _) in zip(jobs, results)}  # the jobs' own specs (results are copies)
    report = {"kernels": [], "ratios": [], "compile_seconds": round(time.perf_counter() - start, 1)}
    for (spec, arch, dim), code in codes.items():
        impl, key = specs[spec]
        warps, stages = blocks_of(spec, arch, dim)[2:]
        work = spec.work(prefill_problem(4096, dim) if not key.startswith("decode") else decode_problem(32768, dim),
                         work_blocks(spec, arch, dim), MACHINES[arch].sms)
        passes = ({i: name for name, group in causal_forward_passes(code, work.tile).items() for i in group}
                  if isinstance(work.iterations, dict) else {})
        loops = []
        for index, loop in enumerate(code.loops):
            cyc = loop.cycles(arch, code.num_warps)
            tile = (work.pass_tiles or {}).get(passes.get(index), work.tile)
            loops.append({"pass": passes.get(index), "tile": list(tile), "counts_per_warp": loop.counts,
                          "instructions_per_warp": loop.instructions,
                          "per_score_element": per_element(code, index, tile),
                          "cycles_per_iteration": cyc, "pipelined_loads": loop.counts.get("async_copy", 0),
                          "ldg": loop.counts.get("ldg", 0), "atomics": loop.counts.get("atomic", 0)})
        report["kernels"].append({
            "implementation": impl, "kernel": spec.label, "function": spec.function, "arch": arch, "dim": dim,
            "blocks": list(work_blocks(spec, arch, dim)), "warps": warps, "stages": stages, "tile": list(work.tile),
            "registers": code.registers, "spill_bytes": code.spill, "loops": loops,
            "outside_loops": {"instructions_per_warp": code.outside.instructions,
                              "cycles": code.outside.cycles(arch, code.num_warps)}})
    for arch in archs:
        for dim in dims:
            rows = [("forward", L, prefill_problem(L, dim)) for L in PREFILL_LENGTHS]
            rows += [("training", L, prefill_problem(L, dim)) for L in PREFILL_LENGTHS]
            rows += [(scenario, 4096, replace(prefill_problem(4096, dim), tau=0.0)) for scenario in TAU_ROWS]
            rows += [("decode", L, decode_problem(L, dim)) for L in DECODE_LENGTHS]
            rows += [(scenario, problem.batch * problem.length, problem)
                     for scenario in ("packed training", "padded training")
                     for problem in [documents_problem(scenario, dim)]]
            for scenario, length, problem in rows:
                base = scenario_time("FA2-style", scenario, codes, problem, arch)
                base_floor = scenario_floor("FA2-style", scenario, codes, problem, arch)
                base_wgmma = LAUNCH_S * launches("FA2-style", scenario, problem, arch) + sum(
                    kernel_seconds("FA2-style", scenario, codes, problem, arch, "all_wgmma_s").values())
                for impl in IMPLEMENTATIONS:
                    if impl == "FA2-style" or scenario not in SCENARIOS[impl]:
                        continue
                    t = scenario_time(impl, scenario, codes, problem, arch)
                    floor = scenario_floor(impl, scenario, codes, problem, arch)
                    report["ratios"].append({"arch": arch, "dim": dim, "scenario": scenario, "length": length,
                                             "problem": problem.__dict__, "implementation": impl,
                                             "seconds": t, "fa2_seconds": base, "ratio": t / base,
                                             "floor_seconds": floor, "fa2_floor_seconds": base_floor,
                                             "floor_ratio": floor / base_floor,
                                             "fa2_seconds_all_wgmma": base_wgmma,
                                             "ratio_to_all_wgmma_fa2": t / base_wgmma,
                                             "kernel_seconds": kernel_seconds(impl, scenario, codes, problem, arch),
                                             "fa2_kernel_seconds": kernel_seconds("FA2-style", scenario, codes,
                                                                                  problem, arch)})
    return report


def markdown(report: dict) -> str:
    lines = ["### Inner loops: thread-instructions per score element (dense path), by class", "",
             "| kernel | arch | D | tile | warps | loop | total | tensor | mufu | fp32 | fcmp | isetp/sel | int | "
             "addr64 | ldg | cp.async/TMA | atomic | shared | shfl | bound | regs | spill |",
             "|" + "---|" * 22]
    for k in report["kernels"]:
        for i, loop in enumerate(k["loops"]):
            e = loop["per_score_element"]
            lines.append(
                f"| {k['kernel']} | sm_{k['arch']} | {k['dim']} | {loop['tile'][0]}x{loop['tile'][1]} | "
                f"{k['warps']} | {i}"
                + (f" ({loop['pass']})" if loop.get("pass") else "") + " | "
                f"{e['total']:.1f} | " + " | ".join(f"{e[c]:.2f}" for c in
                                                    ("tensor", "mufu", "fp32", "fcmp", "isetp/sel", "int", "addr64",
                                                     "ldg", "async_copy", "atomic", "shared", "shfl"))
                + f" | {loop['cycles_per_iteration']['bound']} | {k['registers']} | {k['spill_bytes']} |")
    lines += ["", "### Modelled time, Lazy / FA2-style (serial model; < 1 is faster)", "",
              "Floor: the ratio of the two implementations' tensor-core + MUFU cycles in their loops alone (or DRAM "
              "time where larger), every other instruction free: what the design's own matrix products and "
              "exponentials allow.", "",
              "| arch | D | scenario | L | implementation | ratio | floor | lazy ms | FA2-style ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report["ratios"]:
        lines.append(f"| sm_{r['arch']} | {r['dim']} | {r['scenario']} | {r['length']} | {r['implementation']} | "
                     f"{r['ratio']:.2f}x | {r['floor_ratio']:.2f}x | {1e3 * r['seconds']:.3f} | "
                     f"{1e3 * r['fa2_seconds']:.3f} |")
    return "\n".join(lines)


def _code_version() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "modeling_lazy", "benchmarks/*.py"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("+uncommitted" if dirty else "")
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(MACHINES))
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="write the raw report here")
    args = parser.parse_args()
    import triton

    report = build_report(args.arch, args.dims, args.workers)
    report["versions"] = {"triton": triton.__version__, "torch": torch.__version__, "code": _code_version()}
    report["machines"] = {arch: MACHINES[arch].__dict__ for arch in args.arch}
    print(f"triton {triton.__version__}; {len(report['kernels'])} kernels compiled and analysed in "
          f"{report['compile_seconds']} s on {os.cpu_count()} cores; code {report['versions']['code']}\n")
    print(markdown(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
