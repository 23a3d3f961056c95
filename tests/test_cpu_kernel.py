"""The fused CPU decode kernel (`modeling_lazy.lazy_attention_cpu`) against a float64 computation written here:
contiguous caches with spare (NaN) capacity and paged caches read through a shuffled block table (NaN in every
unowned slot), GQA shapes, head sizes on and off the kernel's vector paths, key counts inside and beyond the bias
window, tau of both signs, rows without a normaliser; then its thread count, its build (cache, fallback) and
greedy generation with the kernel against the PyTorch path."""

import math
import os
import warnings

import pytest
import torch

from modeling_lazy import lazy_attention_cpu as cpu

SHAPES = {  # (heads, kv_heads, dim, dim_v)
    "gqa3-d64": (9, 3, 64, 64),  # SmolLM2's heads: the AVX2 score and value paths
    "mha-d12": (4, 4, 12, 12),  # head size off the vector paths: the scalar loops
    "gqa8-d32-v48": (8, 1, 32, 48),  # value heads of another size; 8 query heads per key head (two register blocks)
}
TAUS = {"negative": lambda h: torch.full((h,), -1.0), "mixed": lambda h: torch.randn(h), "zero": torch.zeros}


def _kernel():
    kernel = cpu.decode_kernel()
    assert kernel is not None, "the CPU decode kernel did not build: is a C compiler (cc) installed?"
    return kernel


def _expected(q, keys, values, tau, bias, positions, scale):
    """float64 Lazy Attention of one decode row per sequence: q [B, Hq, D]; keys[b] / values[b] [Hkv, n_b, D]."""
    bsz, heads, _ = q.shape
    window = bias.shape[1]
    out = torch.zeros(bsz, heads, values[0].shape[-1], dtype=torch.float64)
    for b in range(bsz):
        k, v = keys[b].double(), values[b].double()
        n = k.shape[1]
        group = heads // k.shape[0]
        for h in range(heads):
            scores = (k[h // group] @ q[b, h].double()) * scale
            for t in range(n):
                d = n - 1 - t
                if d < window:
                    scores[t] += float(bias[h, d])
            if math.isinf(float(scores.max())):
                continue  # no finite score: no normaliser, weights 0
            p = torch.softmax(scores, 0)
            a = torch.clamp_min(p + float(tau[h]) / (int(positions[b]) + 1), 0.0)
            out[b, h] = a @ v[h // group]
    return out


@pytest.mark.parametrize("tau_kind", list(TAUS))
@pytest.mark.parametrize("keys", [1, 13, 40, 300], ids=lambda n: f"{n}keys")  # window 64: inside and beyond it
@pytest.mark.parametrize("shape", list(SHAPES))
def test_contiguous_cache_matches_float64(shape, keys, tau_kind, rng_seed):
    heads, kv_heads, dim, dim_v = SHAPES[shape]
    bsz, capacity = 2, keys + 9
    q = torch.randn(bsz, heads, dim) * 2
    k = torch.full((bsz, kv_heads, capacity, dim), float("nan"))
    v = torch.full((bsz, kv_heads, capacity, dim_v), float("nan"))  # unwritten slots must never be read
    k[:, :, :keys], v[:, :, :keys] = torch.randn(bsz, kv_heads, keys, dim), torch.randn(bsz, kv_heads, keys, dim_v)
    tau, bias = TAUS[tau_kind](heads), torch.randn(heads, 64)
    positions = torch.tensor([keys - 1, keys + 6])  # a sequence whose positions are offset (n = position + 1)
    out = torch.full((bsz, heads, dim_v), float("nan"))
    cpu.lazy_decode_cpu(_kernel(), q, k, v, tau, bias, dim**-0.5, out, kv_heads, seq_len=keys, positions=positions)
    want = _expected(q, k[:, :, :keys], v[:, :, :keys], tau, bias, positions, dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {rng_seed}: {m}")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_paged_cache_through_a_shuffled_block_table(shape, rng_seed):
    """vLLM's layout as the serving backend stores it: page (block, head) holds block_size keys then block_size
    values; requests of 1, 16 (one full page), 37 and 70 keys own shuffled blocks, every other slot is NaN."""
    heads, kv_heads, dim, dim_v = SHAPES[shape]
    block, lengths = 16, [1, 16, 37, 70]
    needed = [-(-n // block) for n in lengths]
    order = (torch.randperm(sum(needed) + 3) + 1).tolist()
    table = torch.zeros(len(lengths), max(needed) + 1, dtype=torch.int32)  # a spare column: never read
    for r, count in enumerate(needed):
        table[r, :count] = torch.tensor([order.pop() for _ in range(count)])
    cache = torch.full((len(order) + sum(needed) + 1, kv_heads, block * (dim + dim_v)), float("nan"))
    keys = [torch.randn(kv_heads, n, dim) for n in lengths]
    values = [torch.randn(kv_heads, n, dim_v) for n in lengths]
    for r, n in enumerate(lengths):
        for t in range(n):
            page = cache[int(table[r, t // block])]  # [Hkv, block * (D + Dv)]
            page[:, (t % block) * dim: (t % block + 1) * dim] = keys[r][:, t]
            page[:, block * dim + (t % block) * dim_v: block * dim + (t % block + 1) * dim_v] = values[r][:, t]
    flat = cache.view(cache.shape[0], kv_heads, -1)
    page_size = block * (dim + dim_v)
    q = torch.randn(len(lengths) * 2, heads, dim)[::2] * 2  # a strided query (vLLM's q is a view of qkv)
    tau, bias = torch.randn(heads) - 0.5, torch.randn(heads, 24)
    out = torch.full((len(lengths), heads, dim_v), float("nan"))
    cpu.lazy_decode_cpu(_kernel(), q, flat, flat.view(-1)[block * dim:], tau, bias, dim**-0.5, out, kv_heads,
                        seq_lens=torch.tensor(lengths, dtype=torch.int32), block_table=table, block_size=block,
                        key_strides=(kv_heads * page_size, page_size, dim),
                        value_strides=(kv_heads * page_size, page_size, dim_v))
    want = _expected(q, keys, values, tau, bias, torch.tensor(lengths) - 1, dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {rng_seed}: {m}")


@pytest.mark.parametrize("tau_value", [-0.5, 0.0, 0.7])
def test_rows_without_a_normaliser_give_zero(tau_value, rng_seed):
    """A bias of -inf on every distance a row sees leaves it no finite score: 0 (not NaN), whatever tau."""
    heads, kv_heads, dim, keys = 4, 2, 16, 5
    q, k, v = torch.randn(1, heads, dim), torch.randn(1, kv_heads, keys, dim), torch.randn(1, kv_heads, keys, dim)
    tau, bias = torch.full((heads,), tau_value), torch.randn(heads, 8)
    bias[1, :keys] = float("-inf")
    bias[2, :2] = float("-inf")  # head 2 still sees three keys
    out = torch.empty(1, heads, dim)
    cpu.lazy_decode_cpu(_kernel(), q, k, v, tau, bias, dim**-0.5, out, kv_heads, seq_len=keys)
    assert torch.isfinite(out).all() and (out[0, 1] == 0).all() and (out[0, 2] != 0).any(), f"seed {rng_seed}"
    want = _expected(q, k, v, tau, bias, torch.tensor([keys - 1]), dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {rng_seed}: {m}")


def test_threads_give_the_same_bits(rng_seed):
    """Each (sequence, key head) task is computed the same way on any thread: 2 threads equal 1 bitwise."""
    heads, kv_heads, dim, keys, bsz = 9, 3, 64, 500, 4
    q, k, v = torch.randn(bsz, heads, dim), *torch.randn(2, bsz, kv_heads, keys, dim)
    tau, bias = torch.randn(heads) - 1, torch.randn(heads, 64)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out = torch.empty(bsz, heads, dim)
            results.append(cpu.lazy_decode_cpu(_kernel(), q, k, v, tau, bias, 0.125, out, kv_heads, seq_len=keys))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]), f"seed {rng_seed}"


def test_build_is_cached_and_leaves_no_partial_file(tmp_path):
    first = cpu._build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu._build(tmp_path) == first and first.stat().st_mtime_ns == stamp  # built once per source and CPU
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # the scratch directory is gone


def test_without_a_compiler_the_pytorch_path_takes_over(tmp_path, monkeypatch, rng_seed):
    """No compiler: one clear warning, `decode_kernel()` is None, and decoding still runs (PyTorch path)."""
    from modeling_lazy import lazy_attention_reference as ref
    from modeling_lazy.lazy_attention_torch import lazy_attention_torch

    monkeypatch.setattr(cpu, "_LIBRARY", [])
    monkeypatch.setenv("LAZY_LLAMA_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="could not be built") as caught:
        assert cpu.decode_kernel() is None
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused once: no warning on every call
        assert cpu.decode_kernel() is None
        meta = ref.lazy_attention_metadata(None, None, 30, 1, 1, torch.device("cpu"))
        q, k, v = torch.randn(1, 4, 1, 8), *torch.randn(2, 1, 2, 31, 8)
        tau, bias = torch.full((4,), -1.0), torch.randn(4, 8)
        with torch.no_grad():
            got = lazy_attention_torch(q, k, v, tau, bias, meta, 8**-0.5)
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, 8**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")


def test_switched_off_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_LIBRARY", [])
    monkeypatch.setenv("LAZY_LLAMA_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("LAZY_ATTENTION_CPU_KERNEL", "0")
    assert cpu.decode_kernel() is None and not os.listdir(tmp_path)


def test_greedy_generation_with_the_kernel_equals_the_pytorch_path(monkeypatch, rng_seed):
    """A tiny float32 LazyLlama (tau of both signs, visible bias): the kernel's tokens and scores equal the
    PyTorch decode path's, for one sequence and for a batch (both in the causal layout)."""
    from modeling_lazy import lazy_attention_torch as ops
    from tests.conftest import tiny_model

    _kernel()
    calls = []
    kernel_decode = ops._kernel_decode
    monkeypatch.setattr(ops, "_kernel_decode", lambda *args: calls.append(1) or kernel_decode(*args))
    model = tiny_model(seed=rng_seed, attn_implementation="lazy")
    for ids in (torch.randint(3, 97, (1, 30)), torch.randint(3, 97, (3, 12))):
        results = []
        for switch in ("1", "0"):
            monkeypatch.setenv("LAZY_ATTENTION_CPU_KERNEL", switch)
            calls.clear()
            with torch.no_grad():
                results.append(model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                              output_scores=True, return_dict_in_generate=True))
            assert len(calls) == (11 * model.config.num_hidden_layers if switch == "1" else 0)
        (kernel, torch_path) = results
        assert torch.equal(kernel.sequences, torch_path.sequences), f"seed {rng_seed}"
        torch.testing.assert_close(torch.stack(kernel.scores), torch.stack(torch_path.scores), atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"seed {rng_seed}: {m}")


@pytest.mark.parametrize("tau_kind", list(TAUS))
@pytest.mark.parametrize("case", ["many-chunks", "cached-keys", "long-window"])
def test_prefill_elastic_rows_match_float64(case, tau_kind, rng_seed, monkeypatch):
    """Inference prefill in the causal layout takes its Elastic-Softmax from the C library, chunk by chunk: against
    the float64 reference, with chunks forced small, cached keys before the queries, rows without a normaliser."""
    from modeling_lazy import lazy_attention_reference as ref
    from modeling_lazy import lazy_attention_torch as ops

    _kernel()
    calls = []
    rows = ops.lazy_elastic_rows
    monkeypatch.setattr(ops, "lazy_elastic_rows", lambda *args: calls.append(1) or rows(*args))
    if case == "many-chunks":
        monkeypatch.setattr(ops, "_CHUNK_ELEMENTS", 2048)  # a few rows per chunk
    heads, kv_heads, dim = 6, 2, 16
    q_len, past, window = {"many-chunks": (70, 0, 16), "cached-keys": (40, 25, 8), "long-window": (33, 3, 128)}[case]
    bsz = 2
    meta = ref.lazy_attention_metadata(None, None, past, q_len, bsz, torch.device("cpu"))
    q = torch.randn(bsz, heads, q_len, dim) * 2
    k, v = torch.randn(bsz, kv_heads, past + q_len, dim), torch.randn(bsz, kv_heads, past + q_len, dim)
    tau, bias = TAUS[tau_kind](heads), torch.randn(heads, window)
    bias[1, :4] = float("-inf")  # head 1: the first four rows of a sequence see only -inf scores
    with torch.no_grad():
        got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
    assert calls, "the C Elastic-Softmax was not used"
    want, _ = ref.lazy_attention_reference(q.double(), k.double(), v.double(), tau.double(), bias.double(), meta,
                                           dim**-0.5)
    assert torch.isfinite(got).all(), f"seed {rng_seed}"
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {rng_seed}: {m}")
