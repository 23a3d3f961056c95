"""One-shot GPU benchmark of the Lazy Attention Triton kernels (interleaved ratios, correctness first), a few minutes.

    python benchmarks/gpu_benchmark.py                 # full run on a CUDA GPU, prints markdown tables
    python benchmarks/gpu_benchmark.py --quick         # fewer lengths, no FlexAttention compile
    TRITON_INTERPRET=1 python benchmarks/gpu_benchmark.py --smoke   # tiny CPU run of every code path (no figures)

1. Correctness gate: output and the five gradients (q, k, v, distance_bias, tau) of the kernels against the
   float32 reference (`lazy_attention_reference`) for bf16 prefill (GQA, odd length, D 64/128, tau 0 and -1)
   and decode with a cache; any failure stops the run before a single time is printed.
2. Prefill, bf16, causal, H*D = 2048, B*L = 16k, L in {1k .. 16k}: Lazy forward (tau 0 / -1 on the causal
   fast path the model takes; tau -1 also on the general path, which skips dead key tiles) and forward+backward
   against SDPA (flash backend), FlexAttention with a distance-bias `score_mod` (+ causal block mask), and
   FlashAttention-2 when installed. Interleaved A B A B timing with CUDA events after warm-up, median of 20.
   FA-equivalent TFLOP/s = FlashAttention FLOPs / time (causal forward
   2*B*H*L^2*D, forward+backward 3.5x that); true TFLOP/s counts what the Lazy kernels do (forward 3 causal
   L x L x D products, FA 2; backward 9 more: Delta 2, dq 3, dk/dv 4).
3. Tile density d (key tiles that pass 2 multiplies by V / visible tiles, at the general forward's shipped tiles;
   counted here in PyTorch from the reference weights, `tile_density`) for random inputs at tau = -1 and for inputs
   with a strong local distance bias.
4. Decode: query length 1 against a KV cache (GQA 32/8 heads, D 128) of 1k-64k keys, B in {1, 8, 32}:
   latency against SDPA and effective bandwidth (K and V bytes read / time).

Quote ratios from one run; absolute times only count on the GPU they were measured on.
"""

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import modeling_lazy.lazy_attention_triton as lazy_triton  # noqa: E402
from modeling_lazy.lazy_attention_reference import (  # noqa: E402
    LazyMetadata,
    lazy_attention_reference,
    lazy_visibility,
)

REPEATS = 20
WARMUP = 3


# ---------------------------------------------------------------------------------------------------
# Inputs and timing
# ---------------------------------------------------------------------------------------------------


def make_inputs(bsz, heads, kv_heads, q_len, k_len, dim, tau, window, device, dtype=torch.bfloat16, grad=False,
                local_bias=False, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad)

    q, k, v = randn(bsz, heads, q_len, dim), randn(bsz, kv_heads, k_len, dim), randn(bsz, kv_heads, k_len, dim)
    tau_t = torch.full((heads,), float(tau), device=device).requires_grad_(grad)
    if local_bias:  # what a trained local head looks like: the nearest keys win, the rest drop below 1/n
        bias = torch.full((heads, window), -8.0)
        bias[:, :16] = 4.0
    else:
        bias = 1e-3 * torch.randn(heads, window, generator=gen)
    bias = bias.to(device).requires_grad_(grad)
    metadata = LazyMetadata.from_mask(query_length=q_len, batch_size=bsz, past_length=k_len - q_len, device=device)
    return (q, k, v, tau_t, bias), metadata


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(functions: dict, device, repeats=REPEATS, warmup=WARMUP) -> dict:
    """Median milliseconds of each callable, measured A B A B ... after warm-up."""
    for fn in functions.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fn()
                samples[name].append(1e3 * (time.perf_counter() - begin))
    return {name: statistics.median(values) for name, values in samples.items()}


# ---------------------------------------------------------------------------------------------------
# 1. Correctness gate
# ---------------------------------------------------------------------------------------------------


def _relative(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def correctness_gate(device, shapes, keep_going=False) -> list[str]:
    lines, failures = [], 0
    for bsz, heads, kv_heads, q_len, k_len, dim, tau in shapes:
        leaves, meta = make_inputs(bsz, heads, kv_heads, q_len, k_len, dim, tau, 256, device, grad=True, seed=1)
        ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
        scaling = dim**-0.5
        out = lazy_triton.lazy_attention_triton(*leaves, meta, scaling)
        ref, _ = lazy_attention_reference(*ref_leaves, meta, scaling)
        grad = torch.randn_like(ref)
        out.backward(grad.to(out.dtype))
        ref.backward(grad)
        errors = [_relative(out.detach(), ref.detach())]
        errors += [_relative(x.grad, r.grad) for x, r in zip(leaves, ref_leaves)]
        ok = max(errors) < 4e-2  # bf16 bound of tests/test_triton_kernels.py
        failures += not ok
        lines.append(f"| {bsz}x{heads}/{kv_heads}x{q_len}->{k_len}x{dim} | {tau} | "
                     + " | ".join(f"{e:.1e}" for e in errors) + f" | {'ok' if ok else 'FAIL'} |")
    header = ["| B x Hq/Hkv x Tq->Tk x D | tau | out | dq | dk | dv | dtau | dbias | gate |",
              "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(header + lines), flush=True)
    if failures and not keep_going:
        raise SystemExit(f"correctness gate failed for {failures} configuration(s): no timings reported")
    if failures:
        print(f"\n**Correctness gate failed for {failures} configuration(s); --keep-going: the timings below are of "
              "kernels with a known error.**", flush=True)
    return lines


def documents_gate(device, keep_going=False, shrink=1) -> None:
    """Packed documents (`cu_seq_lens`) and right/left-padded batches through the public entry point: the op layer
    must run the causal fast path per document (`_causal_forward` with a document table), and the output and five
    gradients must match the float32 reference as the plain gate's do; then a left-padded batch after a cache
    (inference), which must run it per row from the first real key, its output matching the reference. `shrink`
    divides every length (the interpreter's smoke run)."""
    import modeling_lazy.lazy_attention_ops as ops

    ran, forward = [], ops._causal_forward
    # the launcher's arguments 10 (a document table) and 12 (its documents' keys: after a cache)
    ops._causal_forward = lambda *args: ran.append(
        "after a cache" if len(args) > 11 and args[11] is not None else
        "per document" if len(args) > 9 and args[9] is not None else "other") or forward(*args)
    gen = torch.Generator(device="cpu").manual_seed(5)
    documents = [max(1, n // shrink) for n in (1, 700, 3, 129, 1, 1000, 64, 90)]
    cu = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()], device=device)
    row = 1000 // shrink
    right = (torch.arange(row) < torch.tensor([row, 640 // shrink, 1, 300 // shrink])[:, None]).long().to(device)
    layouts = [("packed, cu_seq_lens", LazyMetadata.from_cu_seq_lens(cu), 1, sum(documents)),
               ("right-padded", LazyMetadata.from_mask(right, query_length=row), 4, row),
               ("left-padded", LazyMetadata.from_mask(right.flip(1), query_length=row), 4, row)]
    lines, failures = [], 0
    try:
        for label, meta, bsz, length in layouts:
            for tau in (-1.0, 0.5):
                x = [torch.randn(bsz, h, length, 128, generator=gen).to(device, torch.bfloat16) for h in (8, 2, 2)]
                bias = 0.3 * torch.randn(8, 256, generator=gen).to(device)
                leaves = [t.requires_grad_() for t in (*x, torch.full((8,), tau, device=device), bias)]
                ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
                out = lazy_triton.lazy_attention_triton(*leaves, meta, 128**-0.5)
                ref, _ = lazy_attention_reference(*ref_leaves, meta, 128**-0.5)
                grad = torch.randn(ref.shape, generator=gen).to(device)
                out.backward(grad.to(out.dtype))
                ref.backward(grad)
                errors = [_relative(out.detach(), ref.detach())]
                errors += [_relative(t.grad, r.grad) for t, r in zip(leaves, ref_leaves)]
                ok = max(errors) < 4e-2 and ran[-1:] == ["per document"]
                failures += not ok
                path = "per document" if ran[-1:] == ["per document"] else "OTHER PATH"
                lines.append(f"| {label} {bsz}x{length} | {tau} | " + " | ".join(f"{e:.1e}" for e in errors)
                             + f" | {path} | {'ok' if ok else 'FAIL'} |")
        # inference after a cache, left-padded (a chunked prefill's later chunk): each row from its first real key
        ran.clear()
        chunk, total = 300 // shrink + 17, 1000 // shrink + 17
        starts = torch.tensor([0, 400 // shrink, total - 100 // shrink])  # the last row's padding ends in the chunk
        mask = (torch.arange(total) >= starts[:, None]).long().to(device)
        meta = LazyMetadata.from_mask(mask, query_length=chunk, past_length=total - chunk)
        for tau in (-1.0, 0.5):
            q = torch.randn(3, 8, chunk, 128, generator=gen).to(device, torch.bfloat16)
            k, v = (torch.randn(3, 2, total, 128, generator=gen).to(device, torch.bfloat16) for _ in range(2))
            args = (q, k, v, torch.full((8,), tau, device=device), 0.3 * torch.randn(8, 256, generator=gen).to(device))
            with torch.no_grad():
                out = lazy_triton.lazy_attention_triton(*args, meta, 128**-0.5)
                ref, _ = lazy_attention_reference(*(t.float() for t in args), meta, 128**-0.5)
            error = _relative(out, ref)
            after_cache = ran[-1:] == ["after a cache"]
            ok = error < 4e-2 and after_cache
            failures += not ok
            path = "per document from the first key" if after_cache else "OTHER PATH"
            lines.append(f"| left-padded after a cache 3x{chunk} (+{total - chunk} cached; inference) | {tau} | "
                         f"{error:.1e} | - | - | - | - | - | {path} | {'ok' if ok else 'FAIL'} |")
    finally:
        ops._causal_forward = forward
    print("\n| layout (GQA 8/2, D 128) | tau | out | dq | dk | dv | dtau | dbias | kernels | gate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines), flush=True)
    if failures and not keep_going:
        raise SystemExit(f"documents gate failed for {failures} configuration(s): no timings reported")


# ---------------------------------------------------------------------------------------------------
# 2. Prefill timings
# ---------------------------------------------------------------------------------------------------


def _flex_callable(q, k, v, bias, window, backward, grad):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    length = q.shape[2]
    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, length, length, device=q.device)

    def score_mod(score, b, h, qi, ki):
        d = qi - ki
        return score + torch.where((d >= 0) & (d < window), bias[h, d.clamp(0, window - 1)], 0.0)

    flex = torch.compile(flex_attention, dynamic=False)

    def run():
        out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
        if backward:
            torch.autograd.backward(out, grad)
        return out
    return run


def _fa2_callable(q, k, v, backward, grad):
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(backward) for x in (q, k, v))
    gt = grad.transpose(1, 2).contiguous() if grad is not None else None

    def run():
        out = flash_attn_func(qt, kt, vt, causal=True)
        if backward:
            torch.autograd.backward(out, gt)
        return out
    return run


def _prefill_rows(device, dim, heads, window, length, bsz, backward, with_flex) -> list[str]:
    """Time every method for one (D, L, pass) point; return its table rows. Runs in its own frame so that
    the inputs and the closures over them are freed on return, before the caller empties the CUDA cache."""
    rows = []
    fa_fwd_flops = 2 * bsz * heads * length * length * dim
    leaves, meta = make_inputs(bsz, heads, heads, length, length, dim, 0.0, window, device, grad=backward)
    q, k, v, tau0, bias = leaves
    tau1 = torch.full_like(tau0.detach(), -1.0).requires_grad_(backward)
    grad = torch.randn(bsz, length, heads, dim, device=device, dtype=q.dtype) if backward else None
    grad_sdpa = grad.transpose(1, 2) if backward else None
    scaling = dim**-0.5

    def lazy(tau, causal=True):
        def run():
            if backward:
                out = lazy_triton.lazy_attention_triton(q, k, v, tau, bias, meta, scaling)
                torch.autograd.backward(out, grad)
            else:
                positions = lazy_triton._kernel_inputs(k, v, meta)[2]
                if causal and meta.causal:  # the causal fast path (dense: no tile skipping)
                    lazy_triton._causal_forward(q, k, v, tau, bias, positions[0], scaling,
                                                lazy_triton._check_inputs(q, k))
                else:  # the general forward (skips the V tiles of dead key tiles)
                    lazy_triton._forward(q, k, v, tau, bias, *positions, scaling)
        return run

    def sdpa():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            torch.autograd.backward(out, grad_sdpa)

    functions = {"sdpa-flash": sdpa, "lazy tau=0": lazy(tau0), "lazy tau=-1": lazy(tau1)}
    if not backward:
        functions["lazy tau=-1 general"] = lazy(tau1, causal=False)
    fa2 = _fa2_callable(q, k, v, backward, grad)
    if fa2 is not None:
        functions["flash-attn-2"] = fa2
    if with_flex:
        try:
            functions["flex+bias"] = _flex_callable(q, k, v, bias, window, backward, grad_sdpa)
            functions["flex+bias"]()
        except Exception as error:  # noqa: BLE001 - report and go on without it
            print(f"FlexAttention unavailable at L={length}, D={dim}: {type(error).__name__}: {error}")
            functions.pop("flex+bias", None)
    times = time_interleaved(functions, device)
    base = times["sdpa-flash"]
    fa_flops = fa_fwd_flops * (3.5 if backward else 1.0)
    lazy_flops = fa_fwd_flops * (6.0 if backward else 1.5)
    for name, ms in times.items():
        true_flops = lazy_flops if name.startswith("lazy") else fa_flops
        rows.append(f"| {'fwd+bwd' if backward else 'fwd'} | {dim} | {length} | {bsz}x{heads} | {name} | "
                    f"{ms:.3f} | {ms / base:.2f} | {fa_flops / ms / 1e9:.0f} | {true_flops / ms / 1e9:.0f} |")
    print("\n".join(rows), flush=True)
    return rows


def prefill_table(device, lengths, dims, tokens, with_flex, width=2048) -> None:
    rows = []
    for dim in dims:
        heads = width // dim
        window = 1024
        for length in lengths:
            bsz = max(1, tokens // length)
            for backward in (False, True):
                rows += _prefill_rows(device, dim, heads, window, length, bsz, backward, with_flex)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print("\n| pass | D | L | B x H | method | ms | / SDPA | FA-equiv TFLOP/s | true TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows), flush=True)


# ---------------------------------------------------------------------------------------------------
# 3. Tile density, 4. decode
# ---------------------------------------------------------------------------------------------------


def tile_density(query, key, value, tau, distance_bias, metadata, scaling) -> tuple[int, int, float]:
    """`(visited, visible, density)` of the general forward at its shipped tiles (the blocks `_forward` launches:
    decode blocks for <= 16 query rows), counted from the float32 reference weights: the (query tile, key tile)
    pairs whose `a @ V` product pass 2 computes (some weight a_ij > 0), the pairs with any visible (causal,
    same-document, non-padding) entry, and their ratio. One query head at a time (one `[B, Tq, Tk]` weight matrix
    in memory); a weight within rounding of the kernel's float32 threshold test may count differently."""
    q_len, dim = query.shape[2], query.shape[3]
    groups = query.shape[1] // key.shape[1]
    kind = "decode" if q_len <= lazy_triton.DECODE_MAX_ROWS else "fwd"
    block_m, block_n, _, _ = lazy_triton._config(kind, max(16, 1 << (dim - 1).bit_length()),
                                                 lazy_triton._gpu_family(query.device))

    def tiles(x):  # [B, Tq, Tk] bool -> [B, q tiles, key tiles]: any entry of each tile
        x = F.pad(x, (0, -x.shape[2] % block_n, 0, -x.shape[1] % block_m))
        return x.view(x.shape[0], x.shape[1] // block_m, block_m, x.shape[2] // block_n, block_n).any(4).any(2)

    visible = tiles(lazy_visibility(metadata)[:, 0])
    visited = 0
    with torch.no_grad():
        for h in range(query.shape[1]):
            kv = slice(h // groups, h // groups + 1)
            _, weights = lazy_attention_reference(query[:, h:h + 1], key[:, kv], value[:, kv], tau[h:h + 1],
                                                  distance_bias[h:h + 1], metadata, scaling)
            visited += int((tiles(weights[:, 0, :, :metadata.key_length] > 0) & visible).sum())
    visible_count = int(visible.sum()) * query.shape[1]
    return visited, visible_count, visited / max(1, visible_count)


def density_table(device, length, dim, width=2048) -> None:
    print("\n| inputs | L | D | visited tiles | visible tiles | tile density d |")
    print("|---|---|---|---|---|---|")
    for label, tau, local in (("random, tau=0", 0.0, False), ("random, tau=-1", -1.0, False),
                              ("local bias, tau=-1", -1.0, True)):
        leaves, meta = make_inputs(1, width // dim, width // dim, length, length, dim, tau, 1024, device,
                                   local_bias=local)
        visited, visible, density = tile_density(*leaves, meta, dim**-0.5)
        print(f"| {label} | {length} | {dim} | {visited} | {visible} | {density:.3f} |", flush=True)


def decode_table(device, cache_lengths, batches, heads=32, kv_heads=8, dim=128) -> None:
    print("\n| B | cache L | method | ms | / SDPA | K+V GB/s | tile density d |")
    print("|---|---|---|---|---|---|---|")
    for bsz in batches:
        for length in cache_lengths:
            if bsz * length > 2 ** 21:  # keep K+V under ~4 GB
                continue
            for label, tau, local in (("tau=0", 0.0, False), ("tau=-1 local", -1.0, True)):
                leaves, meta = make_inputs(bsz, heads, kv_heads, 1, length, dim, tau, 1024, device, local_bias=local)
                q, k, v, tau_t, bias = leaves
                scaling = dim**-0.5
                meta32 = lazy_triton._kernel_inputs(k, v, meta)[2]

                def lazy():
                    lazy_triton._forward(q, k, v, tau_t, bias, *meta32, scaling)

                def sdpa():
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

                times = time_interleaved({"sdpa": sdpa, f"lazy {label}": lazy}, device)
                density = tile_density(q, k, v, tau_t, bias, meta, scaling)[2]
                kv_bytes = 2 * k.numel() * k.element_size()
                for name, ms in times.items():
                    d = f"{density:.2f}" if name.startswith("lazy") else ""
                    print(f"| {bsz} | {length} | {name} | {ms:.4f} | {ms / times['sdpa']:.2f} | "
                          f"{kv_bytes / ms / 1e6:.0f} | {d} |", flush=True)


# ---------------------------------------------------------------------------------------------------


def _sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sdpa_flash_lower_right(q, k, v):
    """SDPA-flash with the causal mask aligned to the last key (queries after cached keys)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))


def prefill_after_cache_row(device, heads, dim, shrink, gen) -> None:
    """A left-padded batch's prefill chunk after cached keys (inference: `generate(prefill_chunk_size=...)`'s second
    chunk), 4 rows of 2048 queries after 2048 keys, one row's padding ending among the queries: Lazy through its
    public entry point against SDPA-flash per row on the useful tokens."""
    chunk, cached = 2048 // shrink, 2048 // shrink
    starts = [s // shrink for s in (0, 512, 1024, 2600)]
    total = chunk + cached
    q = torch.randn(4, heads, chunk, dim, generator=gen).to(device, torch.bfloat16)
    k, v = (torch.randn(4, heads, total, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    tau = torch.full((heads,), -1.0, device=device)
    bias = (1e-3 * torch.randn(heads, 1024, generator=gen)).to(device)
    mask = (torch.arange(total) >= torch.tensor(starts)[:, None]).long().to(device)
    meta = LazyMetadata.from_mask(mask, query_length=chunk, past_length=cached)
    scaling = dim**-0.5

    def lazy():
        with torch.no_grad():
            lazy_triton.lazy_attention_triton(q, k, v, tau, bias, meta, scaling)

    def sdpa_useful():
        with torch.no_grad():
            for b, s in enumerate(starts):
                first = max(0, s - cached)
                _sdpa_flash_lower_right(q[b:b + 1, :, first:], k[b:b + 1, :, s:], v[b:b + 1, :, s:])

    times = time_interleaved({"sdpa-flash (useful tokens)": sdpa_useful, "lazy": lazy}, device, repeats=10)
    label = f"left-padded prefill after a cache, 4 x {chunk} after {cached} (forward)"
    for name, ms in times.items():
        print(f"| {label} | {name} | {ms:.3f} | {ms / times['sdpa-flash (useful tokens)']:.2f} |", flush=True)


def workload_table(device, heads=16, dim=128, shrink=1) -> None:
    """What users run, forward+backward in bf16 (H*D = 2048, 16k tokens): the plain causal layout, packed documents
    of mixed lengths (`cu_seq_lens`), a right-padded batch with 25% padding; Lazy through its public entry point
    (the op layer picks the kernels), SDPA-flash on the same useful tokens (one call per document or row) and on
    the padded batch as it is. Then a left-padded prefill after a cache (forward), and decode after left padding
    against the same rows unpadded. `shrink` divides
    every length (the interpreter's smoke run)."""
    print("\n| workload | method | ms | / SDPA-flash (useful tokens) |")
    print("|---|---|---|---|")
    gen = torch.Generator(device="cpu").manual_seed(3)
    scaling = dim**-0.5
    documents = [n // shrink for n in (256, 4096, 512, 1024, 2048, 256, 3072, 1024, 512, 768, 2048, 768)]  # 16k
    row = 4096 // shrink
    padded = [n // shrink for n in (4096, 3072, 2560, 2560)]  # 12288 of 16384: 25% padding

    def leaves(bsz, length):
        x = [torch.randn(bsz, heads, length, dim, generator=gen).to(device, torch.bfloat16).requires_grad_()
             for _ in range(3)]
        tau = torch.full((heads,), -1.0, device=device).requires_grad_()
        bias = (1e-3 * torch.randn(heads, 1024, generator=gen)).to(device).requires_grad_()
        return (*x, tau, bias)

    cases = []
    q, k, v, tau, bias = leaves(4, row)
    meta = LazyMetadata.from_mask(query_length=row, batch_size=4, device=device)
    cases.append((f"plain causal 4 x {row}", (q, k, v, tau, bias), meta, [(b, 0, row) for b in range(4)]))
    q, k, v, tau, bias = leaves(1, sum(documents))
    cu = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()], device=device)
    meta = LazyMetadata.from_cu_seq_lens(cu)
    spans = [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(documents))]
    cases.append((f"packed {len(documents)} documents ({min(documents)}-{max(documents)})", (q, k, v, tau, bias),
                  meta, spans))
    q, k, v, tau, bias = leaves(4, row)
    mask = (torch.arange(row) < torch.tensor(padded)[:, None]).long().to(device)
    meta = LazyMetadata.from_mask(mask, query_length=row)
    cases.append((f"right-padded 4 x {row}, 25% padding", (q, k, v, tau, bias), meta,
                  [(b, 0, n) for b, n in enumerate(padded)]))
    for label, (q, k, v, tau, bias), meta, spans in cases:
        grad = torch.randn(q.shape[0], q.shape[2], heads, dim, generator=gen).to(device, torch.bfloat16)

        def lazy():
            out = lazy_triton.lazy_attention_triton(q, k, v, tau, bias, meta, scaling)
            torch.autograd.backward(out, grad)

        def sdpa_useful():
            for b, s, e in spans:
                out = _sdpa_flash(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e])
                torch.autograd.backward(out, grad[b:b + 1, s:e].transpose(1, 2))

        functions = {"sdpa-flash (useful tokens)": sdpa_useful, "lazy": lazy}
        if "padded" in label:
            def sdpa_padded():
                torch.autograd.backward(_sdpa_flash(q, k, v), grad.transpose(1, 2))
            functions["sdpa-flash (padded batch)"] = sdpa_padded
        times = time_interleaved(functions, device, repeats=10)
        for name, ms in times.items():
            print(f"| {label} | {name} | {ms:.3f} | {ms / times['sdpa-flash (useful tokens)']:.2f} |", flush=True)
    del cases  # the decode rows allocate their own tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()
    prefill_after_cache_row(device, heads, dim, shrink, gen)
    decode_workloads(device, shrink)


def decode_workloads(device, shrink=1, tolerance=4e-2, heads=32, kv_heads=8, dim=128) -> None:
    """Decode, batch 8 (GQA 32/8, D 128 by default; bf16) after 4k and 32k keys (divided by `shrink`): SDPA on the
    unpadded rows, Lazy on them (the packed decode), on a left-padded batch (from each row's first key) and on the
    same batch in a static cache's buffer with its written length as a tensor (the packed decode of any layout).
    Each Lazy path is checked against the float32 reference first; an error above `tolerance` stops the run."""
    print("\n| decode | method | ms | / SDPA (unpadded) | error vs float32 reference |")
    print("|---|---|---|---|---|")
    for length in (4096 // shrink, 32768 // shrink):
        with torch.no_grad():
            (q, k, v, tau, bias), plain_meta = make_inputs(8, heads, kv_heads, 1, length, dim, -1.0, 1024, device)
            pad = torch.tensor([0, 100, 300, 700, 1500, 40, 2000, 5]) // shrink
            mask = (torch.arange(length) >= pad[:, None]).long().to(device)
            left = LazyMetadata.from_mask(mask, query_length=1, past_length=length - 1)
            # a static cache's buffer (1/8 unwritten) with the written length as a tensor, as torch.compile runs it
            capacity = length + length // 8
            k_buf, v_buf = (torch.cat([x, torch.zeros_like(x[:, :, : capacity - length])], 2) for x in (k, v))
            static = LazyMetadata.from_mask(torch.cat([mask, torch.zeros_like(mask[:, : capacity - length])], 1),
                                            query_length=1, key_length=capacity,
                                            past_length=torch.tensor(length - 1, device=device))

            def lazy_left():
                return lazy_triton.lazy_attention_triton(q, k, v, tau, bias, left, dim**-0.5)

            def lazy_static():
                return lazy_triton.lazy_attention_triton(q, k_buf, v_buf, tau, bias, static, dim**-0.5)

            def lazy_plain():
                return lazy_triton.lazy_attention_triton(q, k, v, tau, bias, plain_meta, dim**-0.5)

            def sdpa():
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            expected = {"lazy, unpadded (packed decode)": plain_meta, "lazy, left-padded batch": left,
                        "lazy, left-padded static buffer (any layout)": left}
            errors = {name: _relative(run(), lazy_attention_reference(
                *(x.float() for x in (q, k, v)), tau, bias, expected[name], dim**-0.5)[0])
                for name, run in (("lazy, unpadded (packed decode)", lazy_plain),
                                  ("lazy, left-padded batch", lazy_left),
                                  ("lazy, left-padded static buffer (any layout)", lazy_static))}
            if max(errors.values()) > tolerance:
                raise SystemExit(f"decode gate failed at {length} keys: {errors}")
            times = time_interleaved({"sdpa": sdpa, "lazy, unpadded (packed decode)": lazy_plain,
                                      "lazy, left-padded batch": lazy_left,
                                      "lazy, left-padded static buffer (any layout)": lazy_static}, device)
        for name, ms in times.items():
            error = f"{errors[name]:.1e}" if name in errors else ""
            print(f"| B 8, {length} keys | {name} | {ms:.4f} | {ms / times['sdpa']:.2f} | {error} |", flush=True)


def _innermost(error: BaseException) -> BaseException:
    while error.__cause__ is not None:  # Triton's compiler message sits at the bottom of Inductor's chain
        error = error.__cause__
    return error


def _report_failure(check: str, error: BaseException) -> None:
    """One table row for a failed check, and its innermost error in full on stderr."""
    print(f"| {check} | FAILED: {type(error).__name__}: {str(error).splitlines()[-1][:300]} |", flush=True)
    cause = _innermost(error)
    print(f"{check}, innermost error: {type(cause).__name__}: {str(cause)[-4000:]}", file=sys.stderr, flush=True)


def model_check(device, compile_step=True) -> None:
    """The whole model on the GPU: float32 logits of the Triton path against the eager reference (padded batch),
    greedy generation equal to eager's, and the two places `torch.compile` (Inductor) meets the project's Triton
    kernels: a compiled bf16 training step (torch.compile over the op layer) whose loss and gradients match the
    uncompiled step and whose profile shows the project's Triton kernels, and `generate()` with a static cache,
    which transformers compiles on GPUs (the decode forward), and transformers' recipe of compiling the whole forward
    (the prefill into the static buffer too), whose tokens match the uncompiled generation."""
    from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM

    config = LazyLlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             lazy_bias_window=64, lazy_tau_init=-0.5, lazy_bias_init_std=0.02)
    torch.manual_seed(0)
    model = LazyLlamaForCausalLM(config).to(device).eval()
    ids = torch.randint(3, 512, (2, 300), device=device)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        lazy = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=mask).logits
        tokens_eager = model.generate(ids[:1, :40], max_new_tokens=16, do_sample=False)
        model.set_attn_implementation("lazy")
        tokens_lazy = model.generate(ids[:1, :40], max_new_tokens=16, do_sample=False)
    real = mask.bool()
    error = _relative(lazy[real], eager[real])
    same = torch.equal(tokens_lazy, tokens_eager)
    print(f"\n| check | result |\n|---|---|\n| float32 logits, Triton vs eager (padded batch) | {error:.1e} |")
    print(f"| greedy generate, Triton vs eager (16 tokens) | {'identical' if same else 'DIFFERENT'} |", flush=True)
    if not compile_step:
        return
    model.to(torch.bfloat16)
    compiled_generation_check(model, ids[:, :40], mask[:, :40])
    model.train()
    batch = torch.randint(3, 512, (2, 512), device=device)
    # packed documents (restarting positions): under compile an operator finds them when it runs
    packed = torch.cat([torch.arange(n, device=device) for n in (100, 300, 112)])[None].repeat(2, 1)
    for name, inputs in (("", {}), (" (packed documents)", dict(position_ids=packed))):
        def step(m):
            m.zero_grad(set_to_none=True)
            loss = m(batch, labels=batch, **inputs).loss
            loss.backward()
            return loss.detach().float(), [p.grad.float().clone() for p in m.parameters() if p.grad is not None]

        loss_eager, grads_eager = step(model)
        torch.compiler.reset()
        compiled = torch.compile(model)
        started = time.perf_counter()
        try:
            loss_compiled, grads_compiled = step(compiled)
        except Exception as error:  # noqa: BLE001 - reported, the timings go on
            _report_failure(f"compiled bf16 training step{name}", error)
            continue
        compile_s = time.perf_counter() - started
        grad_error = max(_relative(a, b) for a, b in zip(grads_compiled, grads_eager))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(compiled)
            torch.cuda.synchronize()
        kernels = sorted({e.name.split("_kernel")[0] + "_kernel" for e in prof.events() if "_lazy" in e.name})
        print(f"| compiled bf16 training step{name}: loss, eager / compiled | {loss_eager.item():.4f} / "
              f"{loss_compiled.item():.4f} (first step {compile_s:.0f} s with compilation) |")
        print(f"| compiled step{name}: max relative gradient difference | {grad_error:.1e} |")
        print(f"| compiled step{name}: Lazy Triton kernels in the profile | {', '.join(kernels) or 'NONE'} |",
              flush=True)


def compiled_generation_check(model, ids, mask) -> None:
    """Greedy `generate()` of a left-padded batch with a static cache, compiled (what transformers does on GPUs for
    a static cache; Inductor, fullgraph) against the same without compiling: the same tokens (bf16 model)."""
    from transformers import CompileConfig

    arguments = dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                     cache_implementation="static")
    with torch.no_grad():
        plain = model.generate(ids, **arguments, disable_compile=True)
        started = time.perf_counter()
        try:
            compiled = model.generate(ids, **arguments, compile_config=CompileConfig(fullgraph=True, dynamic=False))
        except Exception as error:  # noqa: BLE001 - reported, the checks go on
            _report_failure("compiled static-cache generate", error)
            return
    print(f"| compiled bf16 static-cache generate (left-padded batch of 2, 16 tokens), compiled vs not | "
          f"{'identical' if torch.equal(plain, compiled) else 'DIFFERENT'} (first call "
          f"{time.perf_counter() - started:.0f} s with compilation) |", flush=True)
    # transformers' static-cache recipe: the whole forward compiled (CUDA graphs), so the prefill is in a graph too,
    # and one StaticCache reused (reset) across calls: the second call's prefill gets its whole buffer (the operator
    # cuts it when it runs)
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 16)
    reused = {k: v for k, v in arguments.items() if k != "cache_implementation"}
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    try:
        recipe = []
        with torch.no_grad():
            for _ in range(2):
                cache.reset()
                recipe.append(model.generate(ids, **reused, cache=cache, disable_compile=True))
    except Exception as error:  # noqa: BLE001 - reported, the checks go on
        _report_failure("static-cache recipe (model.forward compiled)", error)
        return
    finally:
        del model.forward
    same = all(torch.equal(plain, tokens) for tokens in recipe)
    print(f"| static-cache recipe (model.forward compiled, reduce-overhead; a StaticCache reused by two calls), "
          f"compiled vs not | {'identical' if same else 'DIFFERENT'} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="L in {1k, 4k}, no FlexAttention")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--keep-going", action="store_true", help="time even when the correctness gate fails")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the decode workloads (with --smoke: tiny, on CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--documents", action="store_true",
                        help="only the gates, the documents gate, the model check and the workload table")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not (args.smoke and os.environ.get("TRITON_INTERPRET") == "1"):
        raise SystemExit("no CUDA GPU: run this on a GPU machine (or --smoke with TRITON_INTERPRET=1 on CPU)")
    import triton

    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (interpreter smoke run)"
    print(f"# Lazy Attention GPU benchmark\n\n{gpu}; torch {torch.__version__}, triton {triton.__version__}, "
          f"CUDA {torch.version.cuda}, Python {platform.python_version()}\n")
    torch.manual_seed(0)
    global REPEATS, WARMUP
    if args.decode_only:
        if args.smoke:
            REPEATS, WARMUP = 1, 0
        decode_workloads(device, **(dict(shrink=128, heads=4, kv_heads=2, dim=64) if args.smoke else {}))
        return
    if args.smoke:
        REPEATS, WARMUP = 2, 1
        correctness_gate(device, [(1, 2, 1, 40, 40, 64, -1.0), (1, 2, 1, 1, 50, 64, 0.0)])
        documents_gate(device, shrink=20)
        model_check(device, compile_step=False)
        workload_table(device, heads=2, dim=64, shrink=64)
        prefill_table(device, [64], [64], 64, with_flex=False, width=128)
        density_table(device, 128, 64, width=64)
        decode_table(device, [128], [1], heads=4, kv_heads=2, dim=64)
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    print("## 1. Correctness gate (bf16 vs float32 reference; max |error| / max |reference|)\n")
    correctness_gate(device, [(2, 8, 2, 1000, 1000, 64, 0.0), (2, 8, 2, 1000, 1000, 64, -1.0),
                              (2, 6, 2, 777, 777, 128, -1.0), (2, 8, 2, 1, 3000, 128, -1.0),
                              (2, 8, 4, 100, 2100, 128, -0.5)], keep_going=args.keep_going)
    print("\n### Documents: packed and padded layouts on the causal fast path per document\n")
    documents_gate(device, keep_going=args.keep_going)
    if args.documents:
        print("\n## 2. The model on the GPU (Triton path, eager reference, torch.compile)")
        model_check(device)
        print("\n## 4. Workloads: packed documents, padding, left-padded decode (bf16, D 128)")
        workload_table(device)
        return
    print("\n## 2. The model on the GPU (Triton path, eager reference, torch.compile)")
    model_check(device)
    lengths = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]
    print("\n## 3. Prefill, bf16, causal, H*D = 2048, B*L = 16k\n")
    prefill_table(device, lengths, [64, 128], 16384, with_flex=not args.quick)
    print("\n## 4. Workloads: packed documents, padding, left-padded decode (bf16, D 128)")
    workload_table(device)
    print("\n## 5. Decode (q length 1, GQA 32/8, D 128, bf16)")
    decode_table(device, [1024, 4096, 16384] if args.quick else [1024, 4096, 16384, 65536], [1, 8, 32])
    print("\n## 6. Tile density (the general forward's shipped tiles; see tile_density)")
    density_table(device, 4096, 128)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
