"""The Triton kernels, run on CPU under TRITON_INTERPRET=1, against an independent float64 reference.

Triton decides interpreter or compiled mode when `triton` and the `@triton.jit` functions are imported, so
TRITON_INTERPRET=1 and LAZY_LLAMA_BACKEND=triton must be set before *any* import of triton. Inside a
pytest session another test module may already have imported `modeling_lazy` (and with it triton, in
compiled mode), and setting the variables here at import time would switch every other test module to
the interpreter. So the checks run in one child process (this file run as a script, with the variables
set before its first import); each check is reported as its own pytest test from the child's results.

Tolerances (max |kernel - reference| / max |reference|, per tensor):
  float32  2e-4: the interpreter's dots and all accumulations are float32 (relative error ~1e-6 per sum
               of a few hundred terms); the margin covers exp/log and the float32 threshold test.
  float16  1e-2 and bfloat16 4e-2: inputs are already in that dtype (the reference gets the same rounded
               values), but the kernels round the weights a_ij and dS_ij to the input dtype before the
               tensor-core products (2^-11 / 2^-8 relative per term) and store outputs and q/k/v gradients in
               it (another half ulp); over tens of terms of both signs that is a few ulps of the largest entry.
The tau and distance_bias gradients come from float32 sums of dS and are held to the same per-dtype bound.
"""

import json
import math
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from reference64 import lazy_attention64

ROOT = Path(__file__).resolve().parents[1]
ENVIRONMENT = {"TRITON_INTERPRET": "1", "LAZY_LLAMA_BACKEND": "triton"}
CHILD_TIMEOUT_S = 1200
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


# The float64 oracle (tests/reference64.py: written from the math in docs/design.md, shares no code with the project)
# ---------------------------------------------------------------------------------------------------


def reference(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling):
    """The oracle's output as the kernels lay it out, `[B, Tq, Hq, D]`. Differentiable in the five float inputs."""
    out, _ = lazy_attention64(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling)
    return out.transpose(1, 2)


def metadata(bsz, q_len, k_len, pad=None, docs=None):
    """Per-token metadata as the model builds it: `pad[b]` left-padding keys, `docs` document lengths (B=1)."""
    k_pos = torch.arange(k_len).repeat(bsz, 1)
    k_seg = torch.zeros(bsz, k_len, dtype=torch.int32)
    if pad is not None:
        for b, p in enumerate(pad):
            k_pos[b] = (torch.arange(k_len) - p).clamp(min=0)
            k_pos[b, :p] = 1
            k_seg[b, :p] = -1
    if docs is not None:
        starts = torch.tensor([0] + list(docs[:-1])).cumsum(0)
        seg = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
        k_pos = (torch.arange(k_len) - starts[seg])[None].repeat(bsz, 1)
        k_seg = seg.to(torch.int32)[None].repeat(bsz, 1)
    q_pos = k_pos[:, k_len - q_len:].clone()
    q_seg = k_seg[:, k_len - q_len:].clone()
    q_seg[q_seg == -1] = -2
    return q_pos, k_pos, q_seg, k_seg


def as_metadata(q_pos, k_pos, q_seg, k_seg, causal=False):
    """The project's `LazyMetadata` for the tensors above (`causal`: the caller vouches for the plain causal layout,
    which lets the kernels take their causal fast path)."""
    from modeling_lazy.lazy_attention_reference import LazyMetadata

    return LazyMetadata.from_tensors(q_pos, k_pos, q_seg, k_seg, causal=causal)


def int32(meta):
    return tuple(x.to(torch.int32).contiguous() for x in meta)


def make_inputs(bsz, heads, kv_heads, q_len, k_len, dim, window, dtype, tau, q_scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = (q_scale * torch.randn(bsz, heads, q_len, dim, generator=gen)).to(dtype)
    key = torch.randn(bsz, kv_heads, k_len, dim, generator=gen).to(dtype)
    value = torch.randn(bsz, kv_heads, k_len, dim, generator=gen).to(dtype)
    tau = torch.as_tensor(tau, dtype=torch.float32).expand(heads).contiguous()
    distance_bias = 0.5 * torch.randn(heads, window, generator=gen)
    grad = torch.randn(bsz, q_len, heads, dim, generator=gen)
    return query, key, value, tau, distance_bias, grad


def relative_error(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def check(kernels, inputs, meta, dtype, key_view=False, causal=False):
    """Output and the five gradients of `lazy_attention_triton` against the float64 reference."""
    query, key, value, tau, distance_bias, grad = inputs
    scaling = query.shape[-1] ** -0.5
    leaves = [x.clone().requires_grad_() for x in (query, key, value, tau, distance_bias)]
    ref_leaves = [x.detach().double().requires_grad_() for x in (query, key, value, tau, distance_bias)]
    k_in, v_in = leaves[1], leaves[2]
    if key_view:  # non-contiguous key/value, as a cache slice would give
        k_in = torch.cat([leaves[1], leaves[1]], dim=2)[:, :, : key.shape[2]]
        v_in = leaves[2].transpose(1, 2).contiguous().transpose(1, 2)
    out = kernels.lazy_attention_triton(leaves[0], k_in, v_in, *leaves[3:], as_metadata(*meta, causal), scaling)
    expected = reference(*ref_leaves, *meta, scaling)
    assert out.dtype == dtype and out.shape == expected.shape
    out.backward(grad.to(dtype))
    expected.backward(grad.double())
    tol = TOLERANCE[dtype]
    errors = {"out": relative_error(out.detach(), expected.detach())}
    for name, leaf, ref in zip(("dq", "dk", "dv", "dtau", "dbias"), leaves, ref_leaves):
        assert leaf.grad.dtype == leaf.dtype
        errors[name] = relative_error(leaf.grad, ref.grad)
    assert all(torch.isfinite(torch.tensor(list(errors.values())))), errors
    assert max(errors.values()) < tol, errors
    return errors


TAU_MIXED = [-1.0, 0.4, -0.3, -2.0, 0.0, -1.0]  # both signs; -1 with near-uniform rows is at the threshold


class ReferenceCase(NamedTuple):
    """One comparison with the float64 reference (shapes as in `make_inputs`, metadata as in `metadata`)."""

    dtype: torch.dtype
    batch: int
    heads: int  # query heads
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    window: int  # distance_bias window
    tau: list[float]  # per query head
    q_scale: float = 1.0  # query magnitude (small: near-uniform rows)
    pad: list[int] | None = None  # left-padding keys per batch row
    docs: list[int] | None = None  # packed document lengths (batch 1)


REFERENCE_CASES = {  # the names are the pytest ids; "decode" and "prefill" cases pass non-contiguous key/value views
    # (the first rows of a longer buffer, as a cache that appends in place holds them)
    "gqa2-window-short-odd-fp32": ReferenceCase(
        torch.float32, batch=2, heads=4, kv_heads=2, q_len=77, k_len=77, head_dim=64, window=16, tau=TAU_MIXED[:4]),
    "gqa3-d128-window-long-fp32": ReferenceCase(
        torch.float32, batch=1, heads=3, kv_heads=1, q_len=50, k_len=50, head_dim=128, window=128, tau=TAU_MIXED[:3]),
    "near-threshold-fp32": ReferenceCase(
        torch.float32, batch=1, heads=2, kv_heads=1, q_len=70, k_len=70, head_dim=64, window=32, tau=[-1.0, -1.0],
        q_scale=0.2),
    "left-padding-bf16": ReferenceCase(
        torch.bfloat16, batch=2, heads=2, kv_heads=2, q_len=45, k_len=45, head_dim=64, window=24, tau=TAU_MIXED[:2],
        pad=[0, 7]),
    "packed-docs-gqa2-d128-fp16": ReferenceCase(
        torch.float16, batch=1, heads=4, kv_heads=2, q_len=90, k_len=90, head_dim=128, window=40, tau=TAU_MIXED[:4],
        docs=[30, 17, 43]),
    "chunked-prefill-gqa3-bf16": ReferenceCase(
        torch.bfloat16, batch=2, heads=6, kv_heads=2, q_len=21, k_len=70, head_dim=64, window=64, tau=TAU_MIXED,
        pad=[0, 5]),
    "decode-cache-gqa3-d128-fp32": ReferenceCase(
        torch.float32, batch=2, heads=3, kv_heads=1, q_len=1, k_len=83, head_dim=128, window=50, tau=TAU_MIXED[:3],
        pad=[4, 0]),
    "decode-cache-gqa2-bf16": ReferenceCase(
        torch.bfloat16, batch=2, heads=4, kv_heads=2, q_len=1, k_len=66, head_dim=64, window=100, tau=TAU_MIXED[:4],
        pad=[0, 9]),
}


def reference_case(name):
    def run(kernels):
        case = REFERENCE_CASES[name]
        inputs = make_inputs(case.batch, case.heads, case.kv_heads, case.q_len, case.k_len, case.head_dim,
                             case.window, case.dtype, case.tau, case.q_scale)
        meta = metadata(case.batch, case.q_len, case.k_len, case.pad, case.docs)
        return check(kernels, inputs, meta, case.dtype, key_view="decode" in name or "prefill" in name)
    return run


def ampere_blocks(kernels):
    """The sm80 block table (smaller tiles) on two reference cases: D 64 and D 128, GQA, padding, offsets."""
    import modeling_lazy.lazy_attention_triton_common as common  # every launcher asks it for the GPU family

    family = common._gpu_family
    common._gpu_family = lambda device: "sm80"
    try:
        return {name: reference_case(name)(kernels)
                for name in ("chunked-prefill-gqa3-bf16", "decode-cache-gqa3-d128-fp32", "gqa3-d128-window-long-fp32")}
    finally:
        common._gpu_family = family


def split_k_decode_matches(kernels):
    """The split-K decode kernels (several key slices per query tile, combined after) compute the reference."""
    query, key, value, tau, bias, grad = make_inputs(2, 4, 2, 1, 300, 64, 64, torch.float32, [-1.0, 0.3, -3.0, 0])
    meta = int32(metadata(2, 1, 300, pad=[0, 37]))
    scaling = 0.125
    expected = reference(query, key, value, tau, bias, *[m.long() for m in meta], scaling)
    errors = {}
    for splits in (1, 3, 5):
        out = kernels._forward(query, key, value, tau, bias, *meta, scaling, num_splits=splits).out
        errors[f"splits={splits}"] = relative_error(out, expected)
    assert max(errors.values()) < TOLERANCE[torch.float32], errors
    return errors


def general_kernels_skip_dead_value_tiles(kernels):
    """Block skipping in the general kernels, through their entry points: a chunk of 128 queries after 256 cached
    keys, a sharp local bias and tau = -1, so every weight of the first 192 keys is 0 for every row (whole key tiles
    of every kernel's blocks). Their values are NaN here: the forward (one pass; split-K for a decode row) must never
    read them (a read tile would put NaN in the output), and output and gradients (the backward's Delta, dq and dk/dv
    kernels take their skipping branch on those tiles) must be the float64 reference's, computed with the real values
    (those weights are exactly 0): a skipped tile that carried weight would show as a wrong result."""
    q_len, k_len, dead, scaling, seed = 128, 384, 192, 0.125, fresh_seed()
    query, key, value, tau, bias, grad = make_inputs(1, 2, 1, q_len, k_len, 64, 8, torch.float32, [-1.0, -1.0], 0.1,
                                                     seed)
    bias[:, :2] = 8.0  # distances 0 and 1 carry the weight, the rest of the window none
    bias[:, 2:] = -30.0
    meta = metadata(1, q_len, k_len)
    for kind in ("fwd", "delta", "dq", "dkdv", "decode"):
        assert dead % kernels._config(kind, 64)[1] == 0, kind  # whole key tiles
    ref_leaves = [x.detach().double().requires_grad_() for x in (query, key, value, tau, bias)]
    expected = reference(*ref_leaves, *meta, scaling)
    expected.backward(grad.double())
    poisoned = value.clone()
    poisoned[:, :, :dead] = float("nan")
    leaves = [x.clone().requires_grad_() for x in (query, key, poisoned, tau, bias)]
    out = kernels.lazy_attention_triton(*leaves, as_metadata(*meta), scaling)  # not causal: the general kernels
    out.backward(grad)
    errors = {"out": relative_error(out.detach(), expected.detach())}
    for name, leaf, ref in zip(("dq", "dk", "dv", "dtau", "dbias"), leaves, ref_leaves):
        errors[name] = relative_error(leaf.grad, ref.grad)
    row = int32(metadata(1, 1, k_len))
    expected_row = reference(query[:, :, -1:], key, value, tau, bias, *[m.long() for m in row], scaling)
    for splits in (1, 3):
        out = kernels._forward(query[:, :, -1:], key, poisoned, tau, bias, *row, scaling, num_splits=splits).out
        errors[f"decode splits={splits}"] = relative_error(out, expected_row)
    assert all(math.isfinite(e) for e in errors.values()), (seed, errors)
    assert max(errors.values()) < TOLERANCE[torch.float32], (seed, errors)
    return {"seed": seed, **errors}


def lone_key_rows_at_tau_minus_one(kernels):
    """A row that sees one key (a first token, a one-token document) has p = 1 exactly, so at tau = -1 its weight
    max(0, p - 1) is 0 and it adds nothing to d tau, although it carries the largest 1 / n. The backward recomputes
    scores in other tiles than the forward: it must not bring that weight back to life. Training calls of <= 16
    rows (the causal layout's packed-decode forward, and packed documents on the general kernels) and of more rows
    (the causal fast path, documents), many fresh seeds each (a recomputed score an ulp above the forward's is a
    matter of the inputs), d tau and the other gradients against the float64 oracle."""
    def documents(lengths):  # restarting positions, one segment per document (the layout the model finds)
        q_pos, k_pos, q_seg, k_seg = metadata(1, sum(lengths), sum(lengths), docs=lengths)
        return (q_pos, k_pos, q_seg, k_seg), False

    layouts = {"causal, 2 rows": (metadata(1, 2, 2), True), "causal, 40 rows": (metadata(1, 40, 40), True),
               "documents of 1-3 tokens": documents([1, 3, 1, 2, 1, 1]), "documents, 40 rows": documents([1, 30, 1, 8])}
    first_seed, errors = int(torch.randint(0, 2**31 - 1000, ())), {}
    for name, (meta, causal) in layouts.items():
        worst, q_len = 0.0, meta[0].shape[1]
        for seed in range(first_seed, first_seed + 12):
            inputs = make_inputs(1, 2, 1, q_len, q_len, 32, 8, torch.float32, [-1.0, -1.0], seed=seed)
            worst = max(worst, *check(kernels, inputs, meta, torch.float32, causal=causal).values())
        errors[name] = worst
    return {"first seed": first_seed, **errors}


def dead_rows_and_longer_key_buffer(kernels):
    """Rows whose visible scores are all -inf give 0 (never NaN) with both tau signs, and a key buffer longer than
    the metadata (a static cache) reads only the keys the call attends to; compared with the project's reference."""
    from modeling_lazy.lazy_attention_reference import LazyMetadata, lazy_attention_reference

    query, key, value, tau, bias, grad = make_inputs(2, 4, 2, 20, 26, 64, 8, torch.float32, [-1.0, 0.5, 0.0, -0.2])
    bias[:2, :4] = float("-inf")  # heads 0 and 1: every row at position <= 3 sees only -inf scores
    mask = torch.ones(2, 26, dtype=torch.long)
    mask[1, :3] = 0
    meta = LazyMetadata.from_mask(mask, query_length=20, batch_size=2, past_length=6, device=torch.device("cpu"))
    junk = torch.randn(2, 2, 5, 64)
    leaves = [x.clone().requires_grad_() for x in (query, key, value, tau, bias)]
    out = kernels.lazy_attention_triton(leaves[0], torch.cat([leaves[1], junk], 2), torch.cat([leaves[2], junk], 2),
                                        leaves[3], leaves[4], meta, 0.125)
    ref_leaves = [x.clone().requires_grad_() for x in (query, key, value, tau, bias)]
    expected, _ = lazy_attention_reference(*ref_leaves, meta, 0.125)
    assert torch.isfinite(out).all()
    out.backward(grad)
    expected.backward(grad)
    errors = {"out": relative_error(out.detach(), expected.detach().double())}
    for name, leaf, ref in zip(("dq", "dk", "dv", "dtau", "dbias"), leaves, ref_leaves):
        assert torch.isfinite(leaf.grad).all(), name
        errors[name] = relative_error(leaf.grad, ref.grad.double())
    assert max(errors.values()) < TOLERANCE[torch.float32], errors
    return errors


CAUSAL_CASES = {  # (dtype, batch, heads, kv_heads, q_len, k_len, head_dim, window, tau, GPU family of the blocks)
    "three-ranges-gqa2-odd-fp32": (torch.float32, 1, 4, 2, 301, 301, 64, 16, TAU_MIXED[:4], "sm90"),
    "window-long-gqa2-fp16": (torch.float16, 2, 4, 2, 90, 90, 64, 128, TAU_MIXED[:4], "sm90"),
    "gqa3-d128-odd-fp32": (torch.float32, 1, 3, 1, 77, 77, 128, 20, TAU_MIXED[:3], "sm90"),
    "after-cache-d128-bf16": (torch.bfloat16, 2, 2, 1, 40, 100, 128, 24, TAU_MIXED[:2], "sm90"),
    # more key tiles than query tiles: every key tile, cached keys included, gets its dk and dv
    "after-long-cache-fp32": (torch.float32, 1, 2, 1, 40, 150, 64, 24, [-1.0, 0.4], "sm90"),
    "sm80-blocks-odd-fp32": (torch.float32, 1, 2, 1, 157, 157, 64, 40, [-1.0, 0.4], "sm80"),
    "sm80-blocks-d128-window-long-fp32": (torch.float32, 1, 2, 1, 150, 150, 128, 100, [0.3, -1.0], "sm80"),
}


def causal_fast_path(kernels):
    """The causal fast path, forward and backward (plain causal metadata), against the float64 reference: windows
    short enough for all three key ranges (beyond the window, inside it, at the causal limit) and longer than the
    sequence, odd lengths, GQA, tau of both signs, D 64 and 128, a chunked prefill after cached keys (key offset),
    both block tables, contiguous key/value and views of longer buffers."""
    import modeling_lazy.lazy_attention_ops as ops  # the op layer launches what its decision table picks
    import modeling_lazy.lazy_attention_triton_backward as backward_kernels  # `_backward` calls `_causal_backward`
    import modeling_lazy.lazy_attention_triton_common as common  # every launcher asks it for the GPU family

    calls = []
    forward, backward, family = ops._causal_forward, backward_kernels._causal_backward, common._gpu_family
    ops._causal_forward = lambda *args: calls.append("forward") or forward(*args)
    backward_kernels._causal_backward = lambda *args: calls.append("backward") or backward(*args)
    try:
        errors = {}
        for index, (name, (dtype, bsz, heads, kv_heads, q_len, k_len, dim, window, tau, blocks)) in enumerate(
                CAUSAL_CASES.items()):
            common._gpu_family = lambda device, blocks=blocks: blocks
            inputs = make_inputs(bsz, heads, kv_heads, q_len, k_len, dim, window, dtype, tau)
            # every other case reads key/value views (the first rows of a longer buffer: a prefill into a cache
            # that appends in place)
            errors[name] = check(kernels, inputs, metadata(bsz, q_len, k_len), dtype, key_view=index % 2 == 1,
                                 causal=True)
    finally:
        ops._causal_forward, backward_kernels._causal_backward, common._gpu_family = forward, backward, family
    assert calls == ["forward", "backward"] * len(CAUSAL_CASES), calls
    return errors


def causal_fast_path_minus_inf_bias(kernels):
    """Heads with tau >= 0 run the causal forward in one pass (no weight is cut there): with tau = 0 a key whose bias
    is -inf has weight 0 and no share of U (so none of d tau), with tau > 0 it keeps tau/n; against the float64
    reference with -inf at some distances inside the window of every head, tau 0, > 0 and < 0, both block tables,
    all three key ranges, fresh inputs (the seed is in the result)."""
    import modeling_lazy.lazy_attention_triton_common as common

    seed = int(torch.randint(0, 2**31 - 1, ()))
    family, errors = common._gpu_family, {"seed": seed}
    try:
        for blocks in ("sm90", "sm80"):
            common._gpu_family = lambda device, blocks=blocks: blocks
            inputs = make_inputs(1, 4, 2, 203, 203, 64, 40, torch.float32, [0.0, 0.5, -1.0, 0.0], seed=seed)
            bias = inputs[4]
            for head, distances in enumerate([[1, 5, 6, 7, 30], [2, 9, 39], [3, 4, 20], [1, 2, 3, 38, 39]]):
                bias[head, distances] = float("-inf")
            errors[blocks] = check(kernels, inputs, metadata(1, 203, 203), torch.float32, causal=True)
    finally:
        common._gpu_family = family
    return errors


def document_metadata(kind, bsz, length):
    """`(q_pos, k_pos, q_seg, k_seg)` of a documents layout, as the model builds it from a padding mask and/or
    restarting positions (the oracle's `token_layout`): packed documents of mixed lengths (1-token documents, one
    longer than the bias window), right or left padding, an all-padding row."""
    from reference64 import token_layout

    from modeling_lazy.lazy_attention_reference import LazyMetadata

    mask, positions = torch.ones(bsz, length, dtype=torch.long), None
    if kind.startswith("packed"):
        docs = [1, 40, 3, 1, 19, 2]
        positions = torch.cat([torch.arange(n) for n in docs])
        positions = torch.cat([positions, torch.arange(length - len(positions))])[None].repeat(bsz, 1)
    if kind.endswith("right"):
        for b, n in enumerate([length, 37, 1, 0][:bsz]):
            mask[b, n:] = 0
    if kind.endswith("left"):
        for b, n in enumerate([length, 37, 1, 0][:bsz]):
            mask[b, :length - n] = 0
    meta = LazyMetadata.from_mask(mask, positions, query_length=length)
    want = token_layout(mask, positions, bsz, length)
    # the model's metadata has the oracle's visibility (segment ids may be numbered differently)
    sees = lambda q_seg, k_seg: q_seg[:, :, None] == k_seg[:, None, :]  # noqa: E731
    assert torch.equal(sees(meta.q_seg.long(), meta.k_seg.long()), sees(*want[2:]))
    return meta, want


DOCUMENT_CASES = {  # name: (dtype, batch, heads, kv heads, length, dim, window, tau, blocks, layout, dead head)
    "packed-mixed-gqa-sm90": (torch.float32, 1, 4, 2, 150, 64, 24, [-1.0, 0.6, 0.0, -0.4], "sm90", "packed", False),
    "right-padded-all-padding-row-sm80": (torch.float32, 4, 2, 1, 70, 64, 16, -1.0, "sm80", "right", False),
    "left-padded-d128-sm90": (torch.float32, 3, 2, 2, 60, 128, 200, [0.5, -1.0], "sm90", "left", False),
    "packed-and-padded-bf16-sm80": (torch.bfloat16, 3, 2, 1, 96, 64, 8, [-1.0, 0.3], "sm80", "packed+right", False),
    "packed-dead-rows-sm90": (torch.float32, 2, 2, 1, 96, 64, 8, [0.5, -1.0], "sm90", "packed+right", True),
}


class _NaNBuffers:
    """`torch` for the launcher modules, whose `empty` / `empty_like` floating-point buffers start as NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poisoned(buffer):
        return buffer.fill_(float("nan")) if buffer.is_floating_point() else buffer

    def empty(self, *args, **kwargs):
        return self._poisoned(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poisoned(torch.empty_like(*args, **kwargs))


def documents_fast_path(kernels):
    """Packed documents and padded rows run the causal fast path per document (forward and backward, no general
    kernel) against the float64 reference: mixed document lengths with 1-token documents and documents longer than
    the window, right and left padding, an all-padding row, GQA, tau of both signs, a head whose bias is -inf at
    distance 0 (its one-token rows have no normaliser: compared with the project's reference in float64, whose
    gradients, unlike the dense oracle's, are defined there), D 64 and 128, both block tables, float32 and
    bfloat16; padding gets exactly zero output and gradients, written by the kernels from the document table's runs
    of padding (the table covers every token; the launchers' buffers are poisoned with NaN here, so a token no
    kernel writes shows)."""
    import modeling_lazy.lazy_attention_ops as ops
    import modeling_lazy.lazy_attention_triton_backward as backward_kernels
    import modeling_lazy.lazy_attention_triton_common as common
    import modeling_lazy.lazy_attention_triton_forward as forward_kernels
    from modeling_lazy.lazy_attention_reference import lazy_attention_reference

    calls = []
    originals = (forward_kernels._forward, backward_kernels._backward, ops._forward, common._gpu_family)
    modules = (forward_kernels, backward_kernels)
    forward_kernels.torch = backward_kernels.torch = _NaNBuffers()

    def general(*args, **kwargs):
        raise AssertionError("a general kernel ran")

    forward_kernels._forward = ops._forward = general
    document_forward = ops._causal_forward
    # (tokens the document table covers, its runs of padding): the launcher's argument 9
    ops._causal_forward = lambda *args: calls.append(
        (int(args[9][:, 2].abs().sum()), int((args[9][:, 2] < 0).sum()))) or document_forward(*args)
    errors, expected_calls = {}, []
    try:
        for name, case in DOCUMENT_CASES.items():
            dtype, bsz, heads, kv_heads, length, dim, window, tau, blocks, kind, dead = case
            common._gpu_family = lambda device, blocks=blocks: blocks
            meta, layout = document_metadata(kind, bsz, length)
            padding = (meta.q_seg < 0).int()
            runs = int((padding.diff(dim=1, prepend=padding.new_zeros(bsz, 1)) > 0).sum())
            expected_calls.append((bsz * length, runs))
            query, key, value, tau_t, bias, grad = make_inputs(bsz, heads, kv_heads, length, length, dim, window,
                                                               dtype, tau)
            if dead:  # head 0: no key at distance 0, so a 1-token document's row has no normaliser
                bias[0, 0] = float("-inf")
            scaling = dim ** -0.5
            leaves = [x.clone().requires_grad_() for x in (query, key, value, tau_t, bias)]
            out = kernels.lazy_attention_triton(*leaves, meta, scaling)
            ref_leaves = [x.detach().double().requires_grad_() for x in (query, key, value, tau_t, bias)]
            if dead:
                expected = lazy_attention_reference(*ref_leaves, meta, scaling)[0]
            else:
                expected = reference(*ref_leaves, *layout, scaling)
            out.backward(grad.to(dtype))
            expected.backward(grad.double())
            padding = (meta.q_seg < 0)
            assert torch.equal(out.detach()[padding], torch.zeros_like(out.detach()[padding])), name
            for leaf in leaves[:3]:
                tokens = leaf.grad.transpose(1, 2)[padding]
                assert torch.equal(tokens, torch.zeros_like(tokens)), name
            errors[name] = {"out": relative_error(out.detach(), expected.detach())}
            for grad_name, leaf, ref in zip(("dq", "dk", "dv", "dtau", "dbias"), leaves, ref_leaves):
                errors[name][grad_name] = relative_error(leaf.grad, ref.grad)
            assert all(math.isfinite(e) for e in errors[name].values()), (name, errors[name])
            assert max(errors[name].values()) < TOLERANCE[dtype], (name, errors[name])
    finally:
        forward_kernels._forward, backward_kernels._backward, ops._forward, common._gpu_family = originals
        ops._causal_forward = document_forward
        for module in modules:
            module.torch = torch
    assert calls == expected_calls and any(runs == 0 for _, runs in calls), calls
    return errors


LEFT_PADDED_CASES = {  # name: (dtype, batch, heads, kv heads, q_len, k_len, dim, window, tau, blocks, left padding)
    "gqa2-padding-into-the-queries-sm90": (torch.float32, 4, 4, 2, 40, 100, 64, 24, TAU_MIXED[:4], "sm90",
                                           [0, 30, 75, 100]),  # the last row: padding so far
    "d128-window-long-bf16-sm80": (torch.bfloat16, 2, 2, 1, 33, 50, 128, 128, [-1.0, 0.4], "sm80", [20, 0]),
}


def left_padded_prefill_after_cache(kernels):
    """Inference of more than 16 query rows of a left-padded batch after cached keys (a chunked prefill, a batched
    continuation) runs the causal fast path per document from each row's first real key (never the general kernels)
    against the float64 reference: padding that ends among the cached keys or among the queries (those query rows
    give exactly 0), a row of padding so far (a short prompt in a chunked prefill), a row without padding, GQA, tau
    of both signs, a window longer than the keys, both block tables; the launcher's buffers poisoned with NaN, so a
    row no kernel writes shows."""
    import modeling_lazy.lazy_attention_ops as ops
    import modeling_lazy.lazy_attention_triton_common as common
    import modeling_lazy.lazy_attention_triton_forward as forward_kernels

    calls, errors = [], {}
    originals = (forward_kernels._forward, ops._forward, ops._causal_forward, common._gpu_family)
    forward_kernels.torch = _NaNBuffers()

    def general(*args, **kwargs):
        raise AssertionError("a general kernel ran")

    forward_kernels._forward = ops._forward = general
    ops._causal_forward = lambda *args: calls.append(len(args) > 11 and args[11] is not None) or originals[2](*args)
    try:
        for name, case in LEFT_PADDED_CASES.items():
            dtype, bsz, heads, kv_heads, q_len, k_len, dim, window, tau, blocks, pad = case
            common._gpu_family = lambda device, blocks=blocks: blocks
            meta = metadata(bsz, q_len, k_len, pad=pad)
            query, key, value, tau_t, bias, _ = make_inputs(bsz, heads, kv_heads, q_len, k_len, dim, window, dtype,
                                                            tau, seed=fresh_seed())
            scaling = dim ** -0.5
            calls.clear()
            with torch.no_grad():
                out = kernels.lazy_attention_triton(query, key, value, tau_t, bias, as_metadata(*meta), scaling)
            assert calls == [True], (name, calls)
            expected = reference(*(x.double() for x in (query, key, value, tau_t, bias)), *meta, scaling)
            padding = meta[2] < 0  # query rows before their row's first real key
            assert padding.any(), name
            assert torch.equal(out[padding], torch.zeros_like(out[padding])), name
            errors[name] = relative_error(out, expected)
            assert errors[name] < TOLERANCE[dtype], (name, errors[name])
    finally:
        forward_kernels._forward, ops._forward, ops._causal_forward, common._gpu_family = originals
        forward_kernels.torch = torch
    return errors


def training_workloads() -> dict:
    """The training batches people run, for a tiny model (vocabulary 97, 24 tokens): `lazy-finetune`'s collator
    (packed blocks, restarting `position_ids`), TRL's padding-free batches (`cu_seq_lens_q` with restarting
    positions), a right-padded SFT batch."""
    from lazy_llama_tools.finetune import PackedBlockCollator

    positions = [list(range(7)) + list(range(13)) + list(range(4)), list(range(24))]
    blocks = [{"input_ids": torch.randint(3, 97, (24,)).tolist(), "position_ids": pos} for pos in positions]
    batch = PackedBlockCollator()(blocks)
    padded = torch.ones(2, 24, dtype=torch.long)
    padded[1, 15:] = 0
    ids = torch.randint(3, 97, (1, 24))
    cu = torch.tensor([0, 5, 17, 24], dtype=torch.int32)
    trl = dict(input_ids=ids, labels=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12,
               position_ids=torch.cat([torch.arange(5), torch.arange(12), torch.arange(7)])[None])
    return {"lazy-finetune packed blocks": batch,
            "TRL padding-free (cu_seq_lens_q)": trl,
            "right-padded SFT batch": dict(input_ids=batch["input_ids"], attention_mask=padded,
                                           labels=batch["input_ids"].masked_fill(padded == 0, -100))}


def model_workloads_take_the_document_path(kernels):
    """Through the model (a tiny LazyLlama on the interpreted kernels, training forward + backward), the layouts
    people train on reach the causal fast path per document and never the general kernels: `lazy-finetune`'s
    collator (packed blocks, restarting `position_ids`), TRL's padding-free batches (`cu_seq_lens_q` with restarting
    positions), a right-padded SFT batch; and a left-padded batched `generate()` prefills per document."""
    import modeling_lazy.lazy_attention_ops as ops
    import modeling_lazy.lazy_attention_triton_forward as forward_kernels
    from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM

    torch.manual_seed(0)
    config = LazyLlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, lazy_bias_window=8,
                             max_position_embeddings=128)
    model = LazyLlamaForCausalLM(config)
    documents, general = [], []
    originals = (ops._causal_forward, ops._forward, forward_kernels._forward)
    ops._causal_forward = lambda *args: documents.append(args[-1] is not None) or originals[0](*args)
    ops._forward = lambda *args, **kwargs: general.append(1) or originals[1](*args, **kwargs)
    seen = {}
    try:
        for name, inputs in training_workloads().items():
            documents.clear()
            model.zero_grad()
            model(**inputs).loss.backward()
            seen[name] = list(documents)
            assert documents == [True] * config.num_hidden_layers and not general, (name, documents, general)
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), name
        documents.clear()
        prompts = torch.randint(3, 97, (2, 20))
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[1, :6] = 0
        with torch.no_grad():
            model.eval().generate(prompts, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
        seen["left-padded generate, prefill"] = list(documents)
        assert documents == [True] * config.num_hidden_layers, documents
    finally:
        ops._causal_forward, ops._forward, forward_kernels._forward = originals
    return seen


_NO_LAUNCH = {"view", "_unsafe_view", "transpose", "t", "as_strided", "expand", "slice", "select", "unsqueeze",
              "squeeze", "permute", "alias", "detach", "empty", "empty_like", "empty_strided", "new_empty",
              "new_empty_strided", "_reshape_alias", "lift_fresh", "split", "unbind", "narrow", "reshape",
              "split_with_sizes", "resolve_conj", "resolve_neg"}


def launcher_device_ops(kernels):
    """The small device ops the causal launchers run beside their kernels in one attention call (every aten op
    outside the kernels that is not a view, an allocation or a no-op conversion) are the numbers the static GPU
    model charges as launches (`LAUNCHER_OPS`): the plain layout's inference forward and training step, and a packed
    and a padded training step, MHA, float32 parameters, the sm90 blocks, each in two layers of one step (the first
    builds the documents' work lists, the next reuses them); and the Triton kernels launched are the model's
    (`SCENARIOS`, plus the running sums of V in training)."""
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    import modeling_lazy.lazy_attention_ops as ops
    from benchmarks import static_gpu_model as model

    state = {"in_kernel": 0, "log": None}
    run_grid = interpreter.GridExecutor.__call__

    def kernel_launch(self, *args, **kwargs):
        state["log"].append("kernel")
        state["in_kernel"] += 1
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            state["in_kernel"] -= 1

    class DeviceOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            no_op = name in ("to", "contiguous") and out is args[0]
            if not state["in_kernel"] and name not in _NO_LAUNCH and not no_op:
                state["log"].append(name)
            return out

    def counted(launcher):
        def run(*args, **kwargs):
            with DeviceOps():
                return launcher(*args, **kwargs)
        return run

    originals = (ops._causal_forward, ops._backward, interpreter.GridExecutor.__call__)
    ops._causal_forward, ops._backward = counted(ops._causal_forward), counted(ops._backward)
    interpreter.GridExecutor.__call__ = kernel_launch
    counts = {}
    try:
        for scenario, kind, training in (("forward", None, False), ("training", None, True),
                                         ("packed training", "packed", True), ("padded training", "right", True)):
            if kind is None:
                meta, bsz = as_metadata(*metadata(2, 96, 96), causal=True), 2
            else:
                bsz = 1 if kind == "packed" else 3
                meta = document_metadata(kind, bsz, 96)[0]
            query, key, value, tau, bias, grad = make_inputs(bsz, 4, 4, 96, 96, 64, 32, torch.bfloat16, -1.0)
            results = []
            # two layers of one step (the same metadata, so the same document table; each its own parameters), then
            # the second layer again on the same parameters (inference: a later call; training: a second micro-batch
            # before the optimizer step): the band kept with its distance_bias is not built again
            for layer in ("first", "next", "again"):
                if layer != "again":
                    leaves = [x.clone().requires_grad_(training) for x in (query, key, value, tau, bias)]
                for leaf in leaves:
                    leaf.grad = None
                state["log"] = []
                with torch.set_grad_enabled(training):
                    out = kernels.lazy_attention_triton(*leaves, meta, 0.125)
                    if training:
                        out.backward(grad.to(out.dtype))
                launched = state["log"].count("kernel")
                counts[(scenario, layer)] = (launched, len(state["log"]) - launched)
                results.append([out.detach()] + [leaf.grad for leaf in leaves if training])
            # the next layer's kernels, on the first one's work lists, and the call again, on the kept band, give the
            # same bits
            assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other)), scenario
    finally:
        ops._causal_forward, ops._backward, interpreter.GridExecutor.__call__ = originals
    for (scenario, layer), (launched, device_ops) in counts.items():
        impl = "lazy (per document)" if scenario.startswith(("packed", "padded")) else "lazy (causal fast path)"
        # the model charges a layer after the first; the first builds the documents' two work lists (forward and
        # backward tiles). Training charges the band (a step's parameters are new), inference does not (built at a
        # layer's first call only): a new distance_bias adds it to inference, the same one takes it from training.
        extra = 2 * model.WORK_LIST_OPS if impl == "lazy (per document)" and layer == "first" else 0
        if layer == "again":
            extra -= model.BAND_OPS if scenario.endswith("training") else 0
        else:
            extra += 0 if scenario.endswith("training") else model.BAND_OPS
        assert device_ops == model.LAUNCHER_OPS[(impl, scenario)] + extra, (scenario, layer, counts)
        assert launched == len(model.SCENARIOS[impl][scenario]) + scenario.endswith("training"), (scenario, counts)
    return {f"{scenario} ({layer})": count for (scenario, layer), count in counts.items()}


def causal_forward_stores_u(kernels):
    """With `store_u` (what training runs) the causal fast-path forward also returns U_i = sum_j m_ij v_j (m_ij = 1
    where the weight is > 0), from which its backward takes Delta and d tau, against float64: both block tables, three
    key ranges, a key offset, D 64 and 128, tau of both signs; the output is the inference forward's. Through
    `lazy_attention_triton` U is stored only with grad mode on (under no_grad tau and distance_bias still require
    grad, but no backward can follow)."""
    import modeling_lazy.lazy_attention_ops as ops  # the op layer launches what its decision table picks
    import modeling_lazy.lazy_attention_triton_common as common  # every launcher asks it for the GPU family

    errors, stored = {}, []
    cases = {"sm90-three-ranges": (150, 150, 64, 16, "sm90"), "sm80-after-cache-d128": (40, 100, 128, 24, "sm80")}
    family, forward = common._gpu_family, ops._causal_forward
    try:
        for name, (q_len, k_len, dim, window, blocks) in cases.items():
            common._gpu_family = lambda device, blocks=blocks: blocks
            query, key, value, tau, bias, _ = make_inputs(1, 2, 1, q_len, k_len, dim, window, torch.float32,
                                                          [0.4, -0.5])
            meta, scaling = metadata(1, q_len, k_len), dim ** -0.5
            q_pos, block_d = int32(meta)[0], kernels._check_inputs(query, key)
            out, _, u = kernels._causal_forward(query, key, value, tau, bias, q_pos, scaling, block_d, store_u=True)
            plain = kernels._causal_forward(query, key, value, tau, bias, q_pos, scaling, block_d)
            assert plain[2] is None and u.dtype == query.dtype, (plain[2], u.dtype)
            torch.testing.assert_close(out, plain[0], rtol=1e-5, atol=1e-6)
            _, weights = lazy_attention64(query, key, value, tau, bias, *meta, scaling)
            v = value.double().repeat_interleave(query.shape[1] // value.shape[1], dim=1)
            errors[name] = relative_error(u, ((weights > 0).double() @ v).transpose(1, 2))
        ops._causal_forward = lambda *args: stored.append(args[-1]) or forward(*args)
        params = (tau.requires_grad_(), bias.requires_grad_())
        with torch.no_grad():
            kernels.lazy_attention_triton(query, key, value, *params, as_metadata(*meta, causal=True), scaling)
        kernels.lazy_attention_triton(query, key, value, *params, as_metadata(*meta, causal=True), scaling)
    finally:
        common._gpu_family, ops._causal_forward = family, forward
    assert stored == [False, True], stored
    assert max(errors.values()) < TOLERANCE[torch.float32], errors
    return errors


def fresh_seed() -> int:
    """A fresh seed for one check, or `$LAZY_LLAMA_TEST_SEED` (conftest's replay variable, which reaches the child) to
    replay it; the checks that use it name it in their failure messages."""
    from conftest import SEED_ENV  # tests/ is on the child's path (this file runs as a script there)

    chosen = os.environ.get(SEED_ENV, "").strip()
    return int(chosen) if chosen else random.SystemRandom().randrange(2**31 - 1)


class DecodeCase(NamedTuple):
    """One packed-decode comparison: key lengths per batch row in a longer cache (the rest NaN), positions offset
    by `shift[b]` (n_i = q_pos + 1 changes, distances do not)."""

    dtype: torch.dtype
    heads: int
    kv_heads: int
    q_len: int
    head_dim: int
    window: int
    tau: list[float]
    lengths: list[int]  # keys per batch row
    capacity: int  # cache length (>= every key length)
    shift: list[int]  # position offset per batch row
    splits: int
    q_scale: float = 1.0


DECODE_CASES = {
    "gqa1-d64-one-row-window-short-3-splits-fp32": DecodeCase(
        torch.float32, 4, 4, 1, 64, 16, [-1.0, 0.4, -0.3, 0.0], [300, 123], 320, [0, 5], 3),
    "gqa3-d128-three-rows-2-splits-fp32": DecodeCase(
        torch.float32, 6, 2, 3, 128, 40, TAU_MIXED, [150, 97], 160, [11, 0], 2),
    "gqa4-d64-five-rows-two-row-tiles-window-long-bf16": DecodeCase(
        torch.bfloat16, 8, 2, 5, 64, 500, TAU_MIXED + [0.7, -0.6], [200, 41], 210, [0, 3], 1),
    "gqa4-d128-near-threshold-fp32": DecodeCase(
        torch.float32, 4, 1, 1, 128, 24, [-1.0] * 4, [90, 64], 130, [2, 0], 2, q_scale=0.2),
}


def decode_reference(query, key, value, tau, bias, lengths, shift, scaling):
    """The float64 reference per batch row over its first `lengths[b]` keys, positions `index + shift[b]`."""
    outs = []
    q_len = query.shape[2]
    for b, (length, offset) in enumerate(zip(lengths, shift)):
        k_pos = (torch.arange(length) + offset)[None]
        seg = torch.zeros(1, length, dtype=torch.long)
        outs.append(reference(query[b:b + 1], key[b:b + 1, :, :length], value[b:b + 1, :, :length], tau, bias,
                              k_pos[:, -q_len:], k_pos, seg[:, -q_len:], seg, scaling))
    return torch.cat(outs)


def packed_decode_matches_reference(kernels):
    """The packed decode (`_packed_decode`) against the float64 reference: GQA 1/3/4, D 64/128, one and several query
    rows (two row tiles), per-batch key lengths in a cache whose other keys are NaN, positions offset per row, tau
    of both signs and at the threshold, bias windows shorter and longer than the cache, one and several splits."""
    seed = fresh_seed()
    errors = {"seed": seed}
    for name, case in DECODE_CASES.items():
        bsz = len(case.lengths)
        query, key, value, tau, bias, _ = make_inputs(bsz, case.heads, case.kv_heads, case.q_len, case.capacity,
                                                      case.head_dim, case.window, case.dtype, case.tau, case.q_scale,
                                                      seed)
        for b, length in enumerate(case.lengths):  # keys beyond a row's length must never count
            key[b, :, length:] = float("nan")
            value[b, :, length:] = float("nan")
        scaling = case.head_dim ** -0.5
        expected = decode_reference(query, key, value, tau, bias, case.lengths, case.shift, scaling)
        lengths = torch.tensor(case.lengths, dtype=torch.int32)
        q_pos = (lengths[:, None] - case.q_len + torch.arange(case.q_len) + torch.tensor(case.shift)[:, None])
        out, lse, _ = kernels._packed_decode(query, key, value, tau, bias, q_pos.to(torch.int32).contiguous(), lengths,
                                             scaling, num_splits=case.splits)
        assert out.dtype == case.dtype and out.shape == expected.shape and torch.isfinite(lse).all()
        errors[name] = relative_error(out, expected)
        assert errors[name] < TOLERANCE[case.dtype], (name, errors)
    return errors


def packed_decode_left_padding(kernels):
    """The packed decode with per-row key starts (a left-padded batch): rows of different padding, the padding keys
    and values NaN (never read, never counted), positions counted from each row's first real key, GQA, tau of both
    signs, one and three splits, a start inside a key tile and one past a whole tile; against the float64 oracle on
    the rows' real keys alone. Through the op layer, a left-padded one-row call takes the packed decode with those
    starts, in two kernel launches (one split: the band is cached, the split-K combine happens in the second
    kernel, no log-sum-exp is kept)."""
    import modeling_lazy.lazy_attention_ops as ops
    import modeling_lazy.lazy_attention_triton_decode as decode_kernels
    from modeling_lazy.lazy_attention_reference import LazyMetadata

    seed = fresh_seed()
    errors = {"seed": seed}
    length, starts = 300, [0, 37, 150, 299]
    for dtype, splits, tau in ((torch.float32, 1, [-1.0, 0.4, 0.0, -0.3]), (torch.bfloat16, 3, [0.5, -1.0, -0.2, 0.1])):
        query, key, value, tau_t, bias, _ = make_inputs(4, 4, 2, 1, length, 64, 48, dtype, tau, seed=seed)
        expected = torch.empty(4, 1, 4, 64, dtype=torch.float64)
        for b, start in enumerate(starts):
            real = length - start
            expected[b] = decode_reference(query[b:b + 1], key[b:b + 1, :, start:], value[b:b + 1, :, start:], tau_t,
                                           bias, [real], [0], 0.125)[0]
            key[b, :, :start] = float("nan")
            value[b, :, :start] = float("nan")
        q_pos = (length - 1 - torch.tensor(starts, dtype=torch.int32))[:, None].contiguous()
        out = kernels._packed_decode(query, key, value, tau_t, bias, q_pos, torch.full((4,), length, dtype=torch.int32),
                                     0.125, num_splits=splits, key_starts=torch.tensor(starts, dtype=torch.int32),
                                     need_lse=False).out
        errors[f"{dtype}, {splits} splits"] = relative_error(out, expected)
        assert errors[f"{dtype}, {splits} splits"] < TOLERANCE[dtype], errors
    mask = (torch.arange(length)[None] >= torch.tensor(starts)[:, None]).long()
    meta = LazyMetadata.from_mask(mask, query_length=1, past_length=length - 1)
    seen, launches = [], []
    original, wrap = ops._packed_decode, decode_kernels.wrap_triton
    ops._packed_decode = lambda *args, **kw: seen.append(kw.get("key_starts")) or original(*args, **kw)
    decode_kernels.wrap_triton = lambda kernel: launches.append(kernel.fn.__name__) or wrap(kernel)
    try:
        with torch.no_grad():
            kernels.lazy_attention_triton(query, key, value, tau_t, bias, meta, 0.125)  # the step's facts, the band
            seen.clear()
            launches.clear()
            via_op = kernels.lazy_attention_triton(query, key, value, tau_t, bias, meta, 0.125)
    finally:
        ops._packed_decode, decode_kernels.wrap_triton = original, wrap
    assert len(seen) == 1 and seen[0].tolist() == starts, seen
    assert launches == ["_lazy_decode_lse_kernel", "_lazy_decode_out_kernel"], launches
    errors["through the op"] = relative_error(via_op, expected)
    assert errors["through the op"] < TOLERANCE[torch.bfloat16], errors
    return errors


def packed_decode_any_layout(kernels):
    """The packed decode of any layout (segments and positions read per key): a padding mask with holes, left
    padding with a hole, a row with only three real keys (head 0's bias is -inf at distances < 4, so that row has no
    normaliser there), an all-padding row (its queries see nothing), GQA, tau of both signs, one and three rows, one
    and three splits, float32 and bfloat16; the keys and values nobody sees NaN. Eager calls (keys cut to the
    written ones) and a static cache's whole buffer (`key_offset` a tensor, unwritten slots NaN) against the float64
    oracle on a layout written here from the mask. Through the op layer both run the packed decode with the
    metadata's segments and positions, in two launches, never the general kernels."""
    import modeling_lazy.lazy_attention_ops as ops
    import modeling_lazy.lazy_attention_triton_decode as decode_kernels
    from modeling_lazy.lazy_attention_reference import LazyMetadata

    seed = fresh_seed()
    errors = {"seed": seed}
    written, capacity = 230, 260
    mask = torch.ones(5, written, dtype=torch.long)
    mask[0, 40:90] = 0  # holes
    mask[0, 150:151] = 0
    mask[1, :37] = 0  # left padding and a hole
    mask[1, 100:140] = 0
    mask[2, :written - 3] = 0  # three real keys
    mask[3, :] = 0  # all padding
    for dtype, splits, q_len, tau in ((torch.float32, 1, 1, [-1.0, 0.4, 0.0, -0.3]),
                                      (torch.bfloat16, 3, 3, [0.5, -1.0, -0.2, 0.1])):
        query, key, value, tau_t, bias, _ = make_inputs(5, 4, 2, q_len, capacity, 64, 48, dtype, tau, seed=seed)
        bias[0, :4] = float("-inf")
        # one document per row (a hole is padding, not a document boundary), positions count the real keys
        k_pos, k_seg = (mask.cumsum(1) - 1).clamp(min=0), torch.where(mask.bool(), 0, -1)
        q_pos, q_seg = k_pos[:, -q_len:], k_seg[:, -q_len:].masked_fill(k_seg[:, -q_len:] < 0, -2)
        expected = reference(query, key[:, :, :written], value[:, :, :written], tau_t, bias, q_pos, k_pos, q_seg,
                             k_seg, 0.125)
        assert torch.isfinite(expected).all() and (expected[3] == 0).all()
        unseen = torch.cat([k_seg < 0, torch.ones(5, capacity - written, dtype=torch.bool)], 1)
        key = key.masked_fill(unseen[:, None, :, None], float("nan"))
        value = value.masked_fill(unseen[:, None, :, None], float("nan"))
        eager = LazyMetadata.from_mask(mask, query_length=q_len, past_length=written - q_len)
        padded_mask = torch.cat([mask, torch.zeros(5, capacity - written, dtype=torch.long)], 1)
        static = LazyMetadata.from_mask(padded_mask, query_length=q_len, key_length=capacity,
                                        past_length=torch.tensor(written - q_len))
        assert static.static_buffer and not eager.causal
        direct = kernels._packed_decode(query, key[:, :, :written], value[:, :, :written], tau_t, bias,
                                        eager.q_pos32, torch.full((5,), written, dtype=torch.int32), 0.125,
                                        num_splits=splits, need_lse=False,
                                        key_mask=(eager.q_seg, eager.k_seg, eager.k_pos32)).out
        errors[f"{dtype}, {q_len} rows, {splits} splits"] = relative_error(direct, expected)
        for name, meta, keys, values in (("eager", eager, key[:, :, :written], value[:, :, :written]),
                                         ("static buffer", static, key, value)):
            seen, launches = [], []
            original, wrap = ops._packed_decode, decode_kernels.wrap_triton
            ops._packed_decode = lambda *args, **kw: seen.append(kw.get("key_mask") is not None) or original(*args,
                                                                                                            **kw)
            decode_kernels.wrap_triton = lambda kernel: launches.append(kernel.fn.__name__) or wrap(kernel)
            try:
                with torch.no_grad():
                    out = kernels.lazy_attention_triton(query, keys, values, tau_t, bias, meta, 0.125)
            finally:
                ops._packed_decode, decode_kernels.wrap_triton = original, wrap
            assert seen == [True] and launches[-2:] == ["_lazy_decode_lse_kernel", "_lazy_decode_out_kernel"], (
                name, seen, launches)
            errors[f"{dtype}, {q_len} rows, {name}"] = relative_error(out, expected)
        assert max(v for k, v in errors.items() if k != "seed" and str(dtype) in k) < TOLERANCE[dtype], errors
    return errors


def packed_decode_skips_dead_value_tiles(kernels):
    """With a sharp local bias and tau = -1 every weight of the first key tiles is 0 for every row of the group:
    their V tiles (NaN here) are never read, and the output is the reference's (computed with those values 0)."""
    seed = fresh_seed()
    query, key, value, tau, bias, _ = make_inputs(1, 4, 1, 2, 600, 64, 8, torch.float32, [-1.0] * 4, 0.1, seed)
    bias[:, :2] = 8.0
    bias[:, 2:] = -30.0
    block_n = kernels._config("packed_decode", 64)[1]
    dead = 600 - 2 * block_n - 8  # keys below it weigh 0 for both rows; its tiles reach beyond the window
    expected = decode_reference(query, key, value, tau, bias, [600], [0], 0.125)
    value[:, :, :dead // block_n * block_n] = float("nan")
    errors = {"seed": seed}
    for splits in (1, 2):
        out = kernels._packed_decode(query, key, value, tau, bias, torch.tensor([[598, 599]], dtype=torch.int32),
                                     torch.tensor([600], dtype=torch.int32), 0.125, num_splits=splits).out
        errors[splits] = relative_error(out, expected)
    assert max(errors[1], errors[2]) < TOLERANCE[torch.float32], errors
    return errors


def packed_decode_dispatch(kernels):
    """`lazy_attention_triton` on decode-shaped calls with plain causal metadata runs the packed decode; output and
    gradients (the general backward from its row log-sum-exp) against the float64 reference."""
    import modeling_lazy.lazy_attention_ops as ops  # the op layer launches what its decision table picks

    calls = []
    original = ops._packed_decode
    ops._packed_decode = lambda *args, **kw: calls.append(1) or original(*args, **kw)
    try:
        errors = {}
        for name, (dtype, bsz, heads, kv_heads, q_len, k_len, dim, window, tau) in {
            "one-row-gqa4-bf16": (torch.bfloat16, 2, 4, 1, 1, 130, 64, 32, TAU_MIXED[:4]),
            "four-rows-gqa3-d128-fp32": (torch.float32, 1, 6, 2, 4, 90, 128, 100, TAU_MIXED),
        }.items():
            inputs = make_inputs(bsz, heads, kv_heads, q_len, k_len, dim, window, dtype, tau)
            errors[name] = check(kernels, inputs, metadata(bsz, q_len, k_len), dtype, key_view=True, causal=True)
    finally:
        ops._packed_decode = original
    assert len(calls) == 2, calls
    return errors


def paged_decode_matches_contiguous_and_reference(kernels):
    """`lazy_attention_triton_paged_decode` on a vLLM-layout cache (K and V in one tensor, NaN in every slot no
    request owns) with a shuffled block table and ragged lengths (shorter than a block, a block multiple), against
    the float64 reference and the contiguous packed decode; also paged with several splits."""
    import lazy_llama_vllm.lazy_attention_paged_triton as paged  # the vLLM plugin's entry points

    seed = fresh_seed()
    errors = {"seed": seed}
    for dtype, heads, kv_heads, dim, lengths, page, max_seq_len in (
            (torch.float32, 4, 2, 64, [37, 16, 70, 5], 16, None),
            (torch.bfloat16, 8, 2, 128, [50, 33, 8], 8, 64)):
        requests = len(lengths)
        max_blocks = max(triton_cdiv(n, page) for n in lengths) + 1
        query, key, value, tau, bias, _ = make_inputs(requests, heads, kv_heads, 1, max(lengths), dim, 20, dtype,
                                                      TAU_MIXED[:2] * (heads // 2), seed=seed)
        cache, table = paged_cache(key, value, lengths, page, max_blocks, seed)
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        scaling = dim ** -0.5
        out = paged.lazy_attention_triton_paged_decode(query[:, :, 0], cache, table, seq_lens, tau, bias, scaling,
                                                       max_seq_len=max_seq_len)
        expected = decode_reference(query, key, value, tau, bias, lengths, [0] * requests, scaling)[:, 0]
        contiguous = kernels._packed_decode(query, key.nan_to_num(), value, tau, bias, (seq_lens - 1)[:, None],
                                            seq_lens, scaling).out
        split = kernels._packed_decode(query, cache[..., :dim], cache[..., dim:], tau, bias,
                                       (seq_lens - 1)[:, None], seq_lens, scaling, num_splits=3, block_table=table).out
        assert out.shape == (requests, heads, dim) and out.dtype == dtype
        # the same cache with pages that hold a block's keys, then its values, passed as a (K, V) pair of views
        page_major = torch.cat([cache[..., :dim], cache[..., dim:]], dim=2)
        halves = (page_major[:, :, :page], page_major[:, :, page:])
        assert torch.equal(paged.lazy_attention_triton_paged_decode(query[:, :, 0], halves, table, seq_lens, tau,
                                                                    bias, scaling, max_seq_len=max_seq_len), out)
        name = f"{dtype}-d{dim}-page{page}"
        errors[name] = {"reference": relative_error(out, expected),
                        "contiguous": relative_error(out, contiguous[:, 0].double()),
                        "3 splits": relative_error(split[:, 0], expected)}
        assert max(errors[name].values()) < TOLERANCE[dtype], (name, errors)
    return errors


def paged_decode_bound_below_a_length(kernels):
    """A `max_seq_len` below a request's length (a caller's error the launcher cannot see without a host sync): that
    request reads only its first `max_seq_len` keys, never past the score scratch, and the other requests are exact.
    The long request comes first, so a scratch overrun would land in the rows after it."""
    import lazy_llama_vllm.lazy_attention_paged_triton as paged

    seed = fresh_seed()
    heads, kv_heads, dim, page, bound = 4, 2, 64, 16, 40  # the bound is no multiple of the key tile
    lengths = [70, 16, 37, 5]
    query, key, value, tau, bias, _ = make_inputs(len(lengths), heads, kv_heads, 1, max(lengths), dim, 20,
                                                  torch.float32, TAU_MIXED[:2] * (heads // 2), seed=seed)
    cache, table = paged_cache(key, value, lengths, page, max(triton_cdiv(n, page) for n in lengths) + 1, seed)
    scaling = dim ** -0.5
    out = paged.lazy_attention_triton_paged_decode(query[:, :, 0], cache, table, torch.tensor(lengths), tau, bias,
                                                   scaling, max_seq_len=bound)
    assert torch.isfinite(out).all(), seed
    # the first `bound` keys, the query standing after them at its own position (n = 70)
    read = [min(n, bound) for n in lengths]
    expected = decode_reference(query, key, value, tau, bias, read, [n - r for n, r in zip(lengths, read)], scaling)
    errors = {"seed": seed, "long request": relative_error(out[:1], expected[:1, 0]),
              "other requests": relative_error(out[1:], expected[1:, 0])}
    assert max(errors["long request"], errors["other requests"]) < TOLERANCE[torch.float32], errors
    return errors


def triton_cdiv(a, b):
    return -(-a // b)


def paged_cache(key, value, lengths, page, max_blocks, seed):
    """vLLM's layout of the first `lengths[r]` keys of `key, value [R, Hkv, >= max length, D]`: a cache
    `[num_blocks, Hkv, page, 2 D]` (K then V), NaN in every slot no request owns, and a shuffled block table
    `[R, max_blocks]` int32 whose padding entries point at block 0 (NaN)."""
    requests, kv_heads, _, dim = key.shape
    num_blocks = requests * max_blocks + 3
    cache = torch.full((num_blocks, kv_heads, page, 2 * dim), float("nan"), dtype=key.dtype)
    shuffled = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))
    order = (shuffled + 1).tolist()
    table = torch.zeros(requests, max_blocks, dtype=torch.int32)
    for r, length in enumerate(lengths):
        for j in range(length):
            if j % page == 0:
                table[r, j // page] = order.pop()
            cache[table[r, j // page], :, j % page] = torch.cat([key[r, :, j], value[r, :, j]], -1)
    return cache, table


class PagedCase(NamedTuple):
    """One mixed vLLM batch for `lazy_attention_triton_paged`: per request (query rows, keys in the cache)."""

    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    window: int
    page: int
    family: str  # the block table the launcher uses
    max_query_len: int | None


# two prompts of odd lengths (one over two query tiles), a prompt chunk after 59 cached keys, two decode tokens;
# the decode rows sit between the prompts (the work list maps tiles to requests in any order)
PAGED_REQUESTS = [(147, 147), (1, 70), (41, 100), (33, 33), (1, 5)]
PAGED_CASES = {
    "gqa1-d64-fp32": PagedCase(torch.float32, 2, 2, 64, 24, 16, "sm90", None),
    "gqa3-d128-sm80-blocks-bf16": PagedCase(torch.bfloat16, 6, 2, 128, 24, 8, "sm80", 147),
    "gqa3-d128-fp16": PagedCase(torch.float16, 3, 1, 128, 40, 16, "sm90", 200),
}


def paged_prefill_mixed_batch(kernels):
    """`lazy_attention_triton_paged` on a mixed vLLM batch (`PAGED_REQUESTS`) against the float64 reference computed
    per request on its own contiguous keys and positions: GQA 1 and 3, D 64 and 128, tau of both signs, a bias window
    shorter than the longest request (all three key ranges), both block tables, a shuffled block table, NaN in every
    cache slot no request owns. Also a batch of decode tokens only (`max_query_len=1`) and the batch with its decode
    tokens first (`num_decodes=2`): those run the packed decode."""
    import lazy_llama_vllm.lazy_attention_paged_triton as paged  # the vLLM plugin's entry points and launchers
    import modeling_lazy.lazy_attention_triton_common as common  # every launcher asks it for the GPU family

    seed = fresh_seed()
    errors = {"seed": seed}
    family, prefill, decode_kernels = common._gpu_family, paged._paged_prefill, paged._packed_decode
    calls = []
    paged._paged_prefill = lambda *args: calls.append("prefill") or prefill(*args)
    paged._packed_decode = lambda *args, **kw: calls.append("decode") or decode_kernels(*args, **kw)
    try:
        for name, case in PAGED_CASES.items():
            common._gpu_family = lambda device, chosen=case.family: chosen
            decodes_first = sorted(PAGED_REQUESTS, key=lambda request: request[0] > 1)
            for requests, num_decodes in ((PAGED_REQUESTS, 0), ([(1, n) for _, n in PAGED_REQUESTS], 0),
                                          (decodes_first, 2)):
                q_lens, lengths = zip(*requests)
                gen = torch.Generator().manual_seed(seed)
                query = torch.randn(sum(q_lens), case.heads, case.head_dim, generator=gen).to(case.dtype)
                key, value = (torch.randn(len(requests), case.kv_heads, max(lengths), case.head_dim, generator=gen)
                              .to(case.dtype) for _ in range(2))
                tau = torch.tensor((TAU_MIXED * 2)[:case.heads])
                bias = 0.5 * torch.randn(case.heads, case.window, generator=gen)
                max_blocks = max(triton_cdiv(n, case.page) for n in lengths) + 1
                cache, table = paged_cache(key, value, lengths, case.page, max_blocks, seed)
                starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
                scaling = case.head_dim ** -0.5
                decode = max(q_lens) == 1
                out = paged.lazy_attention_triton_paged(query, cache, table, starts, torch.tensor(lengths), tau,
                                                        bias, scaling, 1 if decode else case.max_query_len,
                                                        num_decodes=num_decodes)
                assert out.shape == query.shape and out.dtype == case.dtype
                if num_decodes:  # keys then values per page, as a (K, V) pair of views: the same result
                    page_major = torch.cat([cache[..., :case.head_dim], cache[..., case.head_dim:]], dim=2)
                    halves = (page_major[:, :, :case.page], page_major[:, :, case.page:])
                    assert torch.equal(paged.lazy_attention_triton_paged(
                        query, halves, table, starts, torch.tensor(lengths), tau, bias, scaling, case.max_query_len,
                        num_decodes=num_decodes), out)
                for r, (q_len, length) in enumerate(requests):
                    rows = slice(starts[r], starts[r + 1])
                    k_pos = torch.arange(length)[None]
                    seg = torch.zeros(1, length, dtype=torch.long)
                    expected = reference(query[rows].transpose(0, 1)[None], key[r:r + 1, :, :length],
                                         value[r:r + 1, :, :length], tau, bias, k_pos[:, -q_len:], k_pos,
                                         seg[:, -q_len:], seg, scaling)[0]
                    label = f"{name}{'-decode-only' if decode else ''}{'-decodes-first' * bool(num_decodes)}-{r}"
                    errors[label] = relative_error(out[rows], expected)
                    assert errors[label] < TOLERANCE[case.dtype], (label, errors)
    finally:
        common._gpu_family, paged._paged_prefill, paged._packed_decode = family, prefill, decode_kernels
    assert calls == ["prefill", "decode", "decode", "prefill", "decode", "prefill"] * len(PAGED_CASES), calls
    return errors


def refuses_what_it_cannot_run(kernels):
    q = torch.zeros(1, 1, 4, 300)
    with pytest.raises(ValueError, match="head_dim"):
        kernels._check_inputs(q, q)
    with pytest.raises(TypeError, match="float16, bfloat16 and float32"):
        kernels._check_inputs(q.double()[..., :64], q.double()[..., :64])


def model_greedy_generation_matches_eager(kernels):
    """LazyLlama with "lazy" on the interpreted Triton kernels generates eager's greedy tokens (left padding), with a
    dynamic and a static cache: the short padded prefill runs the packed decode of any layout, every decode step the
    packed decode from each row's first real key (no general kernel)."""
    import modeling_lazy.lazy_attention_ops as ops
    from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM

    torch.manual_seed(0)
    config = LazyLlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, lazy_bias_window=16,
                             max_position_embeddings=128)
    model = LazyLlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # sharper, varied heads so that Elastic-Softmax zeroes some weights
            layer.self_attn.tau.copy_(torch.tensor([-1.0, 0.5]))
            layer.self_attn.distance_bias.normal_(0.0, 1.0)
    input_ids = torch.tensor([[5, 17, 42, 8, 63, 21, 9, 30, 2, 77, 4], [0, 0, 0, 0, 12, 33, 7, 61, 25, 3, 90]])
    attention_mask = torch.tensor([[1] * 11, [0] * 4 + [1] * 7])
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert ops.uses_triton(torch.device("cpu"))
    calls = []  # the launcher each call reached
    originals = (ops._causal_forward, ops._packed_decode, ops._forward)
    ops._causal_forward = lambda *a: calls.append("per document" if a[-1] is not None else "causal") or originals[0](*a)
    ops._packed_decode = lambda *a, **kw: calls.append(
        "left-padded decode" if kw.get("key_starts") is not None else
        "any-layout decode" if kw.get("key_mask") is not None else "decode") or originals[1](*a, **kw)
    ops._forward = lambda *a, **kw: calls.append("general") or originals[2](*a, **kw)
    seen = {}
    try:
        with torch.no_grad():
            lazy_tokens = model.generate(input_ids, **kwargs)
            seen["dynamic cache"] = list(calls)
            calls.clear()
            static_tokens = model.generate(input_ids, cache_implementation="static", **kwargs)
            seen["static cache"] = list(calls)
    finally:
        ops._causal_forward, ops._packed_decode, ops._forward = originals
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager_tokens = model.generate(input_ids, **kwargs)
    # 2 layers: the padded prefill of 11 rows (<= 16: the packed decode of any layout), then 5 decode steps from each
    # row's first real key; a static cache (eager: its buffer cut to the written keys) the same
    for name, launched in seen.items():
        assert launched == ["any-layout decode"] * 2 + ["left-padded decode"] * (2 * 5), (name, launched)
    assert torch.equal(lazy_tokens, eager_tokens), (lazy_tokens, eager_tokens)
    assert torch.equal(static_tokens, eager_tokens), (static_tokens, eager_tokens)
    return {"tokens": lazy_tokens.tolist()}


def tiny_lazy_model(tau: list[float], window: int):
    """A 2-layer LazyLlama (4 query heads, 2 KV heads, head dim 16) whose layers have `tau` per head and a N(0, 1)
    distance bias of `window` distances (seed torch first)."""
    from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM

    config = LazyLlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, lazy_bias_window=window,
                             max_position_embeddings=128)
    model = LazyLlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.tau.copy_(torch.tensor(tau))
            layer.self_attn.distance_bias.normal_(0.0, 1.0)
    return model


def causal_forward_kind(args) -> str:
    """The path a `_causal_forward` call takes, from its arguments: with a document table (the 10th) per document,
    with a key table as well (the 12th) per row after a cache, else the plain causal layout."""
    if len(args) > 11 and args[11] is not None:
        return "after a cache"
    return "per document" if len(args) > 9 else "causal"


def model_chunked_prefill_left_padded(kernels):
    """`generate(prefill_chunk_size=20)` of a left-padded batch (45-token prompts, padded by 0, 30 and 40) on the
    interpreted kernels gives eager attention's greedy tokens, and every call reaches a fast path: the first chunk
    per document, the second (20 rows after 20 cached keys: one row's padding ends among its queries, one row is all
    padding so far) per document from each row's first real key, the last 5 rows the packed decode of any layout,
    then the left-padded decode."""
    import modeling_lazy.lazy_attention_ops as ops

    torch.manual_seed(0)
    model = tiny_lazy_model([-1.0, 0.5, -0.4, 0.0], window=16).eval()
    config = model.config
    gen = torch.Generator().manual_seed(fresh_seed())
    input_ids = torch.randint(3, 97, (3, 45), generator=gen)
    attention_mask = torch.ones(3, 45, dtype=torch.long)
    attention_mask[1, :30] = 0
    attention_mask[2, :40] = 0  # all padding in the first two chunks
    input_ids = input_ids * attention_mask
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                  prefill_chunk_size=20)
    calls = []
    originals = (ops._causal_forward, ops._packed_decode, ops._forward)
    ops._causal_forward = lambda *a: calls.append(causal_forward_kind(a)) or originals[0](*a)
    ops._packed_decode = lambda *a, **kw: calls.append(
        "left-padded decode" if kw.get("key_starts") is not None else
        "any-layout decode" if kw.get("key_mask") is not None else "decode") or originals[1](*a, **kw)
    ops._forward = lambda *a, **kw: calls.append("general") or originals[2](*a, **kw)
    try:
        with torch.no_grad():
            tokens = model.generate(input_ids, **kwargs)
    finally:
        ops._causal_forward, ops._packed_decode, ops._forward = originals
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager_tokens = model.generate(input_ids, **kwargs)
    layers = config.num_hidden_layers
    expected = (["per document"] * layers + ["after a cache"] * layers + ["any-layout decode"] * layers
                + ["left-padded decode"] * (2 * layers))
    assert calls == expected, calls
    assert torch.equal(tokens, eager_tokens), (tokens, eager_tokens)
    return {"tokens": tokens[:, 45:].tolist()}


def compiled_training_takes_the_document_path(kernels):
    """A training step under torch.compile (fullgraph; AOT autograd's graphs run as traced) on the
    interpreted kernels: for each layout of `training_workloads` every layer's forward graph node is
    `lazy_llama::triton_traced_attention` and its backward's the matching backward op, which run the causal fast
    path per document (never the general kernels); loss and every gradient equal eager's. A left-padded batch with
    a hole in its mask (no layout of documents) takes the general kernels through the same operators, also equal to
    eager. Other document boundaries in a batch of the same shape run the same graph (no recompile). Then one packed
    batch under Inductor, within float32 rounding of eager."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    import modeling_lazy.lazy_attention_ops as ops

    seed = fresh_seed()
    torch.manual_seed(seed)
    model = tiny_lazy_model([-1.0, 0.5, -0.3, 0.0], window=8)
    config = model.config
    graphs, launched = [], []

    def keep(graph, _):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    def step(inputs):
        return model(**inputs).loss

    originals = (ops._causal_forward, ops._backward, ops._forward)
    ops._causal_forward = lambda *args: (launched.append(("forward", len(args) > 9 and args[9] is not None))
                                         or originals[0](*args))  # documents: the 10th argument
    ops._backward = lambda *args, **kw: (launched.append(("backward", kw["documents"] is not None))
                                         or originals[1](*args, **kw))
    ops._forward = lambda *args, **kwargs: launched.append(("forward", False)) or originals[2](*args, **kwargs)
    workloads = training_workloads()
    holes = torch.ones(2, 24, dtype=torch.long)
    holes[0, :5] = 0
    holes[1, 10:12] = 0  # a hole inside a row: no layout of documents
    ids = workloads["lazy-finetune packed blocks"]["input_ids"]
    workloads["mask with a hole (general kernels)"] = dict(input_ids=ids, attention_mask=holes,
                                                           labels=ids.masked_fill(holes == 0, -100))
    results = {"seed": seed}
    try:
        for name, inputs in workloads.items():
            params = list(model.parameters())
            torch.compiler.reset()
            graphs.clear()
            launched.clear()
            compiled = torch.compile(step, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
            got_loss = compiled(inputs)
            got = torch.autograd.grad(got_loss, params)
            documents = "hole" not in name
            layers = config.num_hidden_layers
            assert launched == [("forward", documents)] * layers + [("backward", documents)] * layers, (name, launched)
            called = [[str(n.target).split(".")[1] for n in graph.graph.nodes
                       if n.op == "call_function" and str(n.target).startswith("lazy_llama.")] for graph in graphs]
            assert called == [["triton_traced_attention"] * layers, ["triton_traced_attention_backward"] * layers], \
                (name, called)
            want_loss = step(inputs)
            want = torch.autograd.grad(want_loss, params)
            assert torch.equal(got_loss, want_loss), (name, got_loss, want_loss)
            for p, g, w in zip(model.named_parameters(), got, want):
                assert torch.equal(g, w), (name, p[0], (g - w).abs().max())
            results[name] = round(float(got_loss.detach()), 4)
        # other document boundaries, the same shapes: values, not shapes, so the graph runs again unchanged
        other = dict(workloads["lazy-finetune packed blocks"])
        other["position_ids"] = torch.cat([torch.arange(n) for n in (1, 15, 8, 11, 13)])[None].reshape(2, 24)
        compiled = torch.compile(step, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
        torch.compiler.reset()
        compiled(workloads["lazy-finetune packed blocks"])
        launched.clear()
        with torch.compiler.set_stance("fail_on_recompile"):
            got = torch.autograd.grad(compiled(other), params)
        assert launched == [("forward", True)] * layers + [("backward", True)] * layers, launched
        want = torch.autograd.grad(step(other), params)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        inputs = workloads["lazy-finetune packed blocks"]
        torch.compiler.reset()
        got_loss = torch.compile(step)(inputs)
        got = torch.autograd.grad(got_loss, params)
        want_loss = step(inputs)
        want = torch.autograd.grad(want_loss, params)
        assert torch.allclose(got_loss, want_loss, rtol=1e-5, atol=1e-5), (got_loss, want_loss)
        for p, g, w in zip(model.named_parameters(), got, want):
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-5 * w.abs().max()), (p[0], (g - w).abs().max())
        results["inductor packed"] = round(float(got_loss.detach()), 4)
    finally:
        ops._causal_forward, ops._backward, ops._forward = originals
        torch.compiler.reset()
    return results


def compiled_static_cache_generation(kernels):
    """`generate(cache_implementation="static")` compiled (fullgraph; Dynamo's graph run as captured: the
    interpreter launches at once, so AOT autograd, which traces a Triton op's body, cannot run here) on the
    interpreted kernels: every layer of the decode graph calls `lazy_llama::triton_decode` (the packed decode of any
    layout over the static buffer, the written length a tensor), never the general kernels, and the tokens are eager
    attention's, for a left-padded batch and a second batch of another length without recompiling."""
    from transformers import CompileConfig

    torch.manual_seed(0)
    model = tiny_lazy_model([-1.0, 0.5, -0.3, 0.2], window=8).eval()
    config = model.config
    graphs = []

    def keep(graph, _, **_options):  # generate() passes its compile mode on
        graphs.append(graph)
        return graph.forward

    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=keep)
    compile_config._compile_all_devices = True  # compile on CPU too
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    gen = torch.Generator().manual_seed(fresh_seed())
    torch.compiler.reset()
    results = {}
    for index, lengths in enumerate(([9, 5], [4, 7])):
        ids = torch.randint(3, 97, (2, max(lengths)), generator=gen)
        mask = torch.stack([torch.arange(max(lengths)) >= max(lengths) - n for n in lengths]).long()
        ids = ids * mask
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile" if index else "default"):
            got = model.generate(ids, attention_mask=mask, cache_implementation="static",
                                 compile_config=compile_config, **kwargs)
        model.set_attn_implementation("eager")
        with torch.no_grad():
            want = model.generate(ids, attention_mask=mask, **kwargs)
        model.set_attn_implementation("lazy")
        assert torch.equal(got, want), (lengths, got, want)
        results[str(lengths)] = got.tolist()
    called = [[str(n.target).split(".")[1] for n in graph.graph.nodes
               if n.op == "call_function" and str(n.target).startswith("lazy_llama.")] for graph in graphs]
    assert called == [["triton_decode"] * config.num_hidden_layers], called
    return results


def compiled_static_cache_prefill(kernels):
    """`model.forward` compiled whole (fullgraph; transformers' static-cache recipe, Dynamo's graph run as captured)
    with a static cache on the interpreted kernels. Once the cache is initialised (a chunked prefill; a cache reset
    for another call) a prefill of more than 16 tokens hands a layer the cache's whole buffer, which
    `lazy_llama::triton_traced_attention` cuts to its written keys when it runs, so one prompt takes the causal fast
    path, a left-padded batch the per-document one and a chunked prefill's later chunk the per-row path after a
    cache (never the general kernels); the prefill's logits are the uncompiled model's and the greedy tokens eager
    attention's."""
    from transformers import StaticCache

    import modeling_lazy.lazy_attention_ops as ops

    torch.manual_seed(0)
    model = tiny_lazy_model([-1.0, 0.5, -0.4, 0.0], window=16).eval()
    config = model.config
    graphs, calls = [], []

    def keep(graph, _):
        graphs.append(graph)
        return graph.forward

    gen = torch.Generator().manual_seed(fresh_seed())
    workloads = {}
    for name, lengths, chunk in (("one prompt", [24], None), ("one prompt, chunked prefill", [45], 20),
                                 ("left-padded batch", [24, 19], None),
                                 ("left-padded batch, chunked prefill", [45, 15, 5], 20)):
        ids = torch.randint(3, 97, (len(lengths), max(lengths)), generator=gen)
        mask = torch.stack([torch.arange(max(lengths)) >= max(lengths) - n for n in lengths]).long()
        workloads[name] = (ids * mask, mask, chunk, len(lengths))
    # a prefill in one call initialises the static cache (its length an int then, the keys this call's: the
    # per-document path); a chunked prefill initialises it first, so each chunk of more than 16 rows hands over the
    # whole buffer, which the operator cuts (the last 5 rows and every decode step run the packed decode)
    expected = {"one prompt": ["per document"], "one prompt, chunked prefill": ["causal", "causal"],
                "left-padded batch": ["per document"],
                "left-padded batch, chunked prefill": ["per document", "after a cache"]}
    originals = (ops._causal_forward, ops._forward)
    ops._causal_forward = lambda *a: calls.append(causal_forward_kind(a)) or originals[0](*a)
    ops._forward = lambda *a, **kw: calls.append("general") or originals[1](*a, **kw)
    kwargs = {name: dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None,
                         prefill_chunk_size=chunk) for name, (ids, mask, chunk, rows) in workloads.items()}
    with torch.no_grad():  # uncompiled: the logits of a prefill in one call, and eager attention's greedy tokens
        want_logits = {name: model(ids, attention_mask=mask).logits
                       for name, (ids, mask, chunk, rows) in workloads.items() if chunk is None}
        model.set_attn_implementation("eager")
        want_tokens = {name: model.generate(ids, **kwargs[name]) for name, (ids, *_) in workloads.items()}
        model.set_attn_implementation("lazy")
    results = {}
    model.forward = torch.compile(model.forward, backend=keep, fullgraph=True)
    try:
        for name, (ids, mask, chunk, rows) in workloads.items():
            calls.clear()
            graphs.clear()
            torch.compiler.reset()  # each workload its graphs (batch sizes, chunk lengths: more than the limit)
            with torch.no_grad():
                got = model.generate(ids, cache_implementation="static", **kwargs[name])
            prefill = [call for call in calls]
            assert prefill == [kind for kind in expected[name] for _ in range(config.num_hidden_layers)], (
                name, prefill)
            called = [[str(n.target).split(".")[1] for n in graph.graph.nodes
                       if n.op == "call_function" and str(n.target).startswith("lazy_llama.")] for graph in graphs]
            assert ["triton_traced_attention"] * config.num_hidden_layers in called, (name, called)
            if chunk is None:  # the prefill's logits into a new static cache, and into the same one reset (its
                cache = StaticCache(config=config, max_cache_len=ids.shape[1] + 8)  # length a tensor: the buffer)
                want = want_logits[name]
                with torch.no_grad():
                    for reset in (False, True):
                        cache.reset()
                        calls.clear()
                        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
                        kind = "causal" if reset and rows == 1 else "per document"
                        assert calls == [kind] * config.num_hidden_layers, (name, reset, calls)
                        real = mask.bool()
                        assert torch.allclose(logits[real], want[real], rtol=1e-4, atol=1e-5), (
                            name, reset, (logits[real] - want[real]).abs().max())
            assert torch.equal(got, want_tokens[name]), (name, got, want_tokens[name])
            results[name] = got[:, ids.shape[1]:].tolist()
    finally:
        del model.forward
        ops._causal_forward, ops._forward = originals
        torch.compiler.reset()
    return results


CASES = {
    **{f"reference-{name}": reference_case(name) for name in REFERENCE_CASES},
    "sm80-block-table": ampere_blocks,
    "split-k-decode": split_k_decode_matches,
    "general-kernels-skip-dead-value-tiles": general_kernels_skip_dead_value_tiles,
    "dead-rows-and-longer-key-buffer": dead_rows_and_longer_key_buffer,
    "lone-key-rows-at-tau-minus-one": lone_key_rows_at_tau_minus_one,
    "causal-fast-path": causal_fast_path,
    "causal-forward-stores-u": causal_forward_stores_u,
    "causal-fast-path-minus-inf-bias": causal_fast_path_minus_inf_bias,
    "documents-fast-path": documents_fast_path,
    "model-workloads-take-the-document-path": model_workloads_take_the_document_path,
    "left-padded-prefill-after-cache": left_padded_prefill_after_cache,
    "compiled-training-takes-the-document-path": compiled_training_takes_the_document_path,
    "model-chunked-prefill-left-padded": model_chunked_prefill_left_padded,
    "packed-decode-reference": packed_decode_matches_reference,
    "packed-decode-skips-dead-value-tiles": packed_decode_skips_dead_value_tiles,
    "packed-decode-dispatch": packed_decode_dispatch,
    "packed-decode-left-padding": packed_decode_left_padding,
    "packed-decode-any-layout": packed_decode_any_layout,
    "paged-decode": paged_decode_matches_contiguous_and_reference,
    "paged-decode-bound-below-a-length": paged_decode_bound_below_a_length,
    "paged-prefill-mixed-batch": paged_prefill_mixed_batch,
    "refuses-what-it-cannot-run": refuses_what_it_cannot_run,
    "launcher-device-ops": launcher_device_ops,
    "model-greedy-generation-triton-vs-eager": model_greedy_generation_matches_eager,
    "compiled-static-cache-generation": compiled_static_cache_generation,
    "compiled-static-cache-prefill": compiled_static_cache_prefill,
}


# ---------------------------------------------------------------------------------------------------
# The pytest side: one child process runs every case under the interpreter; one test per case here.
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    pytest.importorskip("triton")
    results_file = tmp_path_factory.mktemp("triton_interpreter") / "results.json"
    env = {**os.environ, **ENVIRONMENT, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(results_file)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if not results_file.exists():
        pytest.fail(f"interpreter child failed (rc={child.returncode}):\n"
                    f"{child.stdout[-4000:]}\n{child.stderr[-4000:]}")
    return json.loads(results_file.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_triton_interpreter(case, interpreter_results):
    result = interpreter_results[case]
    if not result["ok"]:
        pytest.fail(f"{case} failed in the interpreter child:\n{result['error']}")


def _run_child(results_path: str) -> None:
    """Child entry point: the environment is set by the parent before this first import of triton."""
    assert all(os.environ.get(k) == v for k, v in ENVIRONMENT.items()), "run through pytest"
    torch.set_num_threads(1)
    import modeling_lazy.lazy_attention_triton as kernels

    assert kernels._INTERPRET
    results = {}
    for name, case in CASES.items():
        start = time.perf_counter()
        try:
            detail = case(kernels)
            results[name] = {"ok": True, "detail": repr(detail)}
        except BaseException:  # noqa: BLE001 - every failure is reported to the parent
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']} s) "
              f"{results[name].get('detail', '')}", flush=True)
    Path(results_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    _run_child(sys.argv[1])
