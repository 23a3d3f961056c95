"""The native CPU ops (`torch.ops.lazy_llama.cpu_*`, `modeling_lazy.lazy_attention_cpu`) against a float64
computation written here: contiguous caches with spare (NaN) capacity and paged caches read through a shuffled block
table (NaN in every unowned slot), GQA shapes, head sizes on and off the vector paths (each test on the AVX2 and the
scalar variant), key counts inside and beyond the bias window, tau of both signs, rows without a normaliser, NaN and
Inf rows, bfloat16 / float16 caches; then the registration (dispatcher, fake tensors, clear errors), threads, the
install-time build (nothing compiled at run time, the PyTorch path without the module), greedy generation, the
causal prefill's row pass, and one run of these tests against a sanitizer build."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from reference64 import decode64, lazy_attention64, token_layout

from modeling_lazy import lazy_attention_cpu as cpu

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # (heads, kv_heads, dim, dim_v)
    "gqa3-d64": (9, 3, 64, 64),  # SmolLM2's heads: the AVX2 score and value paths
    "mha-d12": (4, 4, 12, 12),  # head size off the vector paths: the scalar loops
    "gqa8-d32-v48": (8, 1, 32, 48),  # value heads of another size; 8 query heads per key head (two register blocks)
}
TAUS = {"negative": lambda h: torch.full((h,), -1.0), "mixed": lambda h: torch.randn(h), "zero": torch.zeros}
HALF = {"bfloat16": (torch.bfloat16, 1e-2), "float16": (torch.float16, 2e-3)}  # dtype, output rounding (relative)


@pytest.fixture(params=["native", "scalar"])
def isa(request, monkeypatch):
    """Each op test runs on the vector code this CPU selects and on the generic scalar code."""
    assert cpu.available(), "the native CPU op is not built: run `python setup.py build_ext --inplace`"
    if request.param == "scalar":
        monkeypatch.setenv("LAZY_LLAMA_CPU_ISA", "scalar")
    else:
        monkeypatch.delenv("LAZY_LLAMA_CPU_ISA", raising=False)
    assert torch.ops.lazy_llama.cpu_vector_isa() in (("scalar",) if request.param == "scalar" else ("avx2+fma",
                                                                                                      "scalar"))
    return request.param


def _contiguous_case(shape, keys, tau_kind, dtype=torch.float32):
    heads, kv_heads, dim, dim_v = SHAPES[shape]
    bsz, capacity = 2, keys + 9
    q = (torch.randn(bsz, heads, dim) * 2).to(dtype)
    k = torch.full((bsz, kv_heads, capacity, dim), float("nan"), dtype=dtype)
    v = torch.full((bsz, kv_heads, capacity, dim_v), float("nan"), dtype=dtype)  # unwritten slots: never read
    k[:, :, :keys], v[:, :, :keys] = torch.randn(bsz, kv_heads, keys, dim), torch.randn(bsz, kv_heads, keys, dim_v)
    tau, bias = TAUS[tau_kind](heads), torch.randn(heads, 64)
    positions = torch.tensor([keys - 1, keys + 6])  # a sequence whose positions are offset (n = position + 1)
    return q, k, v, tau, bias, positions


@pytest.mark.parametrize("tau_kind", list(TAUS))
@pytest.mark.parametrize("keys", [1, 13, 40, 300], ids=lambda n: f"{n}keys")  # window 64: inside and beyond it
@pytest.mark.parametrize("shape", list(SHAPES))
def test_contiguous_cache_matches_float64(shape, keys, tau_kind, isa, rng_seed):
    q, k, v, tau, bias, positions = _contiguous_case(shape, keys, tau_kind)
    dim = q.shape[-1]
    out = cpu.lazy_decode_cpu(q, k, v, tau, bias, dim**-0.5, seq_len=keys, positions=positions)
    want = decode64(q, k[:, :, :keys], v[:, :, :keys], tau, bias, positions, dim**-0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {rng_seed}: {m}")


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_half_precision_caches_match_float64(shape, dtype, isa, rng_seed):
    """bfloat16 / float16 query and caches: converted on load, accumulated in float32, written in the query dtype;
    against float64 of the same (rounded) inputs, within the output's rounding."""
    torch_dtype, rounding = HALF[dtype]
    q, k, v, tau, bias, positions = _contiguous_case(shape, 300, "mixed", torch_dtype)
    dim = q.shape[-1]
    out = cpu.lazy_decode_cpu(q, k, v, tau, bias, dim**-0.5, seq_len=300, positions=positions)
    assert out.dtype == torch_dtype
    want = decode64(q, k[:, :, :300], v[:, :, :300], tau, bias, positions, dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=rounding, rtol=rounding,
                               msg=lambda m: f"seed {rng_seed}: {m}")
    # the float32 op on the same rounded inputs, rounded once at the end: the conversion adds no error of its own
    full = cpu.lazy_decode_cpu(q.float(), k.float(), v.float(), tau, bias, dim**-0.5, seq_len=300,
                               positions=positions)
    assert torch.equal(out, full.to(torch_dtype)), f"seed {rng_seed}"


def _paged_case(shape, dtype=torch.float32):
    """vLLM's layout as the serving backend stores it: page (block, head) holds block_size keys then block_size
    values; requests of 1, 16 (one full page), 37 and 70 keys own shuffled blocks, every other slot is NaN."""
    heads, kv_heads, dim, dim_v = SHAPES[shape]
    block, lengths = 16, [1, 16, 37, 70]
    needed = [-(-n // block) for n in lengths]
    order = (torch.randperm(sum(needed) + 3) + 1).tolist()
    table = torch.zeros(len(lengths), max(needed) + 1, dtype=torch.int32)  # a spare column: never read
    for r, count in enumerate(needed):
        table[r, :count] = torch.tensor([order.pop() for _ in range(count)])
    cache = torch.full((len(order) + sum(needed) + 1, kv_heads, block * (dim + dim_v)), float("nan"), dtype=dtype)
    keys = [torch.randn(kv_heads, n, dim).to(dtype) for n in lengths]
    values = [torch.randn(kv_heads, n, dim_v).to(dtype) for n in lengths]
    for r, n in enumerate(lengths):
        for t in range(n):
            page = cache[int(table[r, t // block])]  # [Hkv, block * (D + Dv)]
            page[:, (t % block) * dim: (t % block + 1) * dim] = keys[r][:, t]
            page[:, block * dim + (t % block) * dim_v: block * dim + (t % block + 1) * dim_v] = values[r][:, t]
    key_pages = cache[..., : block * dim].unflatten(-1, (block, dim))  # [blocks, Hkv, block, D] views
    value_pages = cache[..., block * dim:].unflatten(-1, (block, dim_v))
    q = (torch.randn(len(lengths) * 2, heads, dim)[::2] * 2).to(dtype)  # strided (vLLM's q is a view of qkv)
    return q, key_pages, value_pages, table, torch.tensor(lengths, dtype=torch.int32), keys, values


@pytest.mark.parametrize("shape", list(SHAPES))
def test_paged_cache_through_a_shuffled_block_table(shape, isa, rng_seed):
    q, key_pages, value_pages, table, lengths, keys, values = _paged_case(shape)
    heads, dim = q.shape[1:]
    tau, bias = torch.randn(heads) - 0.5, torch.randn(heads, 24)
    out = cpu.lazy_decode_cpu(q, key_pages, value_pages, tau, bias, dim**-0.5, seq_lens=lengths, block_table=table)
    want = decode64(q, keys, values, tau, bias, lengths.long() - 1, dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {rng_seed}: {m}")


def test_paged_bfloat16_cache(isa, rng_seed):
    q, key_pages, value_pages, table, lengths, keys, values = _paged_case("gqa3-d64", torch.bfloat16)
    heads, dim = q.shape[1:]
    tau, bias = torch.randn(heads) - 0.5, torch.randn(heads, 24)
    out = cpu.lazy_decode_cpu(q, key_pages, value_pages, tau, bias, dim**-0.5, seq_lens=lengths, block_table=table)
    want = decode64(q, keys, values, tau, bias, lengths.long() - 1, dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2, msg=lambda m: f"seed {rng_seed}: {m}")


@pytest.mark.parametrize("tau_value", [-0.5, 0.0, 0.7])
def test_rows_without_a_normaliser_give_zero(tau_value, isa, rng_seed):
    """A bias of -inf on every distance a row sees leaves it no finite score: 0 (not NaN), whatever tau."""
    heads, kv_heads, dim, keys = 4, 2, 16, 5
    q, k, v = torch.randn(1, heads, dim), torch.randn(1, kv_heads, keys, dim), torch.randn(1, kv_heads, keys, dim)
    tau, bias = torch.full((heads,), tau_value), torch.randn(heads, 8)
    bias[1, :keys] = float("-inf")
    bias[2, :2] = float("-inf")  # head 2 still sees three keys
    out = cpu.lazy_decode_cpu(q, k, v, tau, bias, dim**-0.5, seq_len=keys)
    assert torch.isfinite(out).all() and (out[0, 1] == 0).all() and (out[0, 2] != 0).any(), f"seed {rng_seed}"
    want = decode64(q, k, v, tau, bias, torch.tensor([keys - 1]), dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {rng_seed}: {m}")


NON_FINITE = {  # where a NaN or Inf is planted: (tensor, index) over q [B, Hq, 1, D] and k [B, Hkv, T, D]
    "nan-key-row": ("k", (0, 1, 5, 3)),
    "nan-key-in-window": ("k", (1, 0, -1, 0)),  # the newest key: distance 0, inside the bias window
    "nan-query-head": ("q", (1, 2, 0, 7)),
    "inf-key": ("k", (0, 0, 9, 2)),  # +inf * q: a score of +inf or -inf
    "nan-everywhere-in-a-head": ("q", (0, 3, 0, slice(None))),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(NON_FINITE))
def test_nan_and_inf_propagate_as_in_the_pytorch_path(case, dtype, isa, monkeypatch, rng_seed):
    """A NaN (or Inf) in a query or key gives the same NaN pattern in the output with the native op on and off,
    and the same finite values elsewhere; the float64 oracle agrees."""
    from modeling_lazy import lazy_attention_reference as ref
    from modeling_lazy import lazy_attention_torch as ops

    torch_dtype = getattr(torch, dtype)
    bsz, heads, kv_heads, dim, past = 2, 6, 2, 16, 80
    meta = ref.LazyMetadata.from_mask(query_length=1, batch_size=bsz, past_length=past, device=torch.device("cpu"))
    q = torch.randn(bsz, heads, 1, dim).to(torch_dtype)
    k, v = (torch.randn(bsz, kv_heads, past + 1, dim).to(torch_dtype) for _ in range(2))
    name, index = NON_FINITE[case]
    (q if name == "q" else k)[index] = float("inf") if case.startswith("inf") else float("nan")
    if case.startswith("inf"):  # positive query entries against the +inf: scores of +inf, a NaN softmax
        q[0, :, 0, index[-1]] = q[0, :, 0, index[-1]].abs() + 0.1
    tau, bias = torch.randn(heads) - 0.5, torch.randn(heads, 16)
    calls = []
    kernel_decode = ops._kernel_decode
    monkeypatch.setattr(ops, "_kernel_decode", lambda *args: calls.append(1) or kernel_decode(*args))
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", switch)
        with torch.no_grad():
            results.append(ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5))
    assert calls == [1], "the native op was not used"
    native, pytorch = results
    assert native.isnan().any(), f"seed {rng_seed}: the planted value did not reach the output"
    assert torch.equal(native.isnan(), pytorch.isnan()), f"seed {rng_seed}: NaN patterns differ"
    want = decode64(q[:, :, 0], k, v, tau, bias, torch.full((bsz,), past), dim**-0.5)  # [B, Hq, D]
    assert torch.equal(native[:, 0].isnan(), want.isnan()), f"seed {rng_seed}: NaN pattern differs from float64"
    tol = 1e-5 if dtype == "float32" else 1e-2
    torch.testing.assert_close(native, pytorch, atol=tol, rtol=tol, equal_nan=True, msg=f"seed {rng_seed}")


@pytest.mark.parametrize("case", ["nan-key", "nan-query"])
def test_nan_in_a_prefill_propagates_as_in_the_reference(case, isa, monkeypatch, rng_seed):
    """The causal prefill's native row pass: a NaN key poisons exactly the rows that see it, a NaN query its row,
    as in the float64 reference; the PyTorch path (op off) gives the same pattern (its chunks set the future
    triangle to -inf rather than add it, so a NaN future key stays out of the rows that cannot see it)."""
    from modeling_lazy import lazy_attention_reference as ref
    from modeling_lazy import lazy_attention_torch as ops

    bsz, heads, kv_heads, dim, q_len = 2, 4, 2, 16, 30
    meta = ref.LazyMetadata.from_mask(query_length=q_len, batch_size=bsz, device=torch.device("cpu"))
    q, k, v = torch.randn(bsz, heads, q_len, dim), *torch.randn(2, bsz, kv_heads, q_len, dim)
    if case.startswith("nan-key"):
        k[0, 1, 11, 4] = float("nan")
    else:
        q[1, 2, 17, 0] = float("nan")
    tau, bias = torch.randn(heads) - 0.5, torch.randn(heads, 8)
    calls = []
    rows = ops.lazy_elastic_rows
    monkeypatch.setattr(ops, "lazy_elastic_rows", lambda *args: calls.append(1) or rows(*args))
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", switch)
        with torch.no_grad():
            results.append(ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5))
    assert calls, "the native row pass was not used"
    want = lazy_attention64(q, k, v, tau, bias, *token_layout(None, None, bsz, q_len), dim**-0.5)[0].transpose(1, 2)
    native, pytorch = results
    assert native.isnan().any() and torch.equal(native.isnan(), want.isnan()), f"seed {rng_seed}"
    torch.testing.assert_close(native.double(), want, atol=1e-5, rtol=1e-5, equal_nan=True, msg=f"seed {rng_seed}")
    assert torch.equal(native.isnan(), pytorch.isnan()), f"seed {rng_seed}"
    torch.testing.assert_close(pytorch.double(), want, atol=1e-5, rtol=1e-5, equal_nan=True, msg=f"seed {rng_seed}")


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
            results.append(cpu.lazy_decode_cpu(q, k, v, tau, bias, 0.125, seq_len=keys))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]), f"seed {rng_seed}"


def test_ops_are_registered_for_the_cpu_only():
    """The ops live in torch.ops.lazy_llama with typed schemas and a CPU kernel; other devices get the dispatcher's
    error (no CUDA kernel is registered), fake tensors trace through the Python fake implementations."""
    assert cpu.available()
    for name in ("cpu_decode", "cpu_elastic_rows_", "cpu_cache_write_"):
        qualified = f"lazy_llama::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA"), name
    schema = str(torch.ops.lazy_llama.cpu_decode.default._schema)
    assert "Tensor? block_table" in schema and "float scale" in schema, schema
    assert "Tensor(a!) scores" in str(torch.ops.lazy_llama.cpu_elastic_rows_.default._schema)

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(3, 8, 64), torch.empty(3, 2, 40, 64), torch.empty(3, 2, 40, 48)
        out = torch.ops.lazy_llama.cpu_decode(q, k, v, torch.empty(8), torch.empty(8, 16), 0.125, 40, None, None,
                                              None)
    assert out.shape == (3, 8, 48) and out.dtype == torch.float32


def test_compiled_decode_keeps_the_native_op_in_one_graph(rng_seed):
    """torch.compile(fullgraph=True) traces through the wrapper and the fake implementation: the graph holds the op
    and the compiled call gives the eager bits."""
    q, k, v, tau, bias, positions = _contiguous_case("gqa3-d64", 40, "mixed")
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    def decode(q, k, v, tau, bias, positions):
        return cpu.lazy_decode_cpu(q, k, v, tau, bias, 0.125, seq_len=40, positions=positions)

    got = torch.compile(decode, backend=backend, fullgraph=True)(q, k, v, tau, bias, positions)
    assert len(graphs) == 1 and "lazy_llama.cpu_decode" in graphs[0], graphs
    assert torch.equal(got, decode(q, k, v, tau, bias, positions)), f"seed {rng_seed}"


def test_opcheck_of_the_decode_op(rng_seed):
    """PyTorch's own consistency checks of a custom op (schema, fake implementation, dispatch) on real inputs."""
    q, k, v, tau, bias, positions = _contiguous_case("gqa3-d64", 40, "mixed")
    torch.library.opcheck(torch.ops.lazy_llama.cpu_decode.default,
                          (q, k, v, tau, bias, 0.125, 40, None, None, positions))


def test_meta_tensors_and_bad_inputs_get_an_error_not_a_crash():
    q, k, v, tau, bias, _ = _contiguous_case("mha-d12", 13, "zero")
    assert not cpu.decode_supported(q.to("meta"), k, v) and not cpu.decode_supported(q, k.to("meta"), v.to("meta"))
    assert not cpu.decode_supported(q.bfloat16(), k, v)  # mixed dtypes
    assert not cpu.decode_supported(q, k.transpose(-1, -2), v)
    with pytest.raises(ValueError, match="runs on CPU tensors only"):
        cpu.lazy_decode_cpu(q.to("meta"), k.to("meta"), v.to("meta"), tau, bias, 0.1, seq_len=13)
    with pytest.raises(ValueError, match="runs on CPU tensors only"):
        cpu.lazy_elastic_rows(torch.empty(1, 2, 3, 3, device="meta"), 0, tau, bias, torch.zeros(1, 3, dtype=torch.long),
                              0)
    with pytest.raises(RuntimeError, match="different devices"):  # the op itself, mixed devices
        torch.ops.lazy_llama.cpu_decode(q, k.to("meta"), v, tau, bias, 0.1, 13, None, None, None)
    with pytest.raises(RuntimeError, match="seq_len 30 is outside"):
        cpu.lazy_decode_cpu(q, k, v, tau, bias, 0.1, seq_len=30)
    with pytest.raises(RuntimeError, match="share one dtype"):
        cpu.lazy_decode_cpu(q, k.double(), v.double(), tau, bias, 0.1, seq_len=13)
    with pytest.raises(RuntimeError, match="unit last stride"):
        torch.ops.lazy_llama.cpu_decode(q, k.transpose(-1, -2), v, tau.float(), bias.float(), 0.1, 13, None, None,
                                        None)
    pages = k.view(2, 4, -1, 12)[:, :, :4]  # 2 blocks of 4 rows
    table = torch.tensor([[0, 7], [1, 0]], dtype=torch.int32)  # block 7 does not exist
    with pytest.raises(RuntimeError, match=r"block_table\[0, 1\] = 7 is outside"):
        cpu.lazy_decode_cpu(q, pages, pages, tau, bias, 0.1, seq_lens=torch.tensor([6, 2], dtype=torch.int32),
                            block_table=table)
    with pytest.raises(RuntimeError, match="exceeds"):
        cpu.lazy_decode_cpu(q, pages, pages, tau, bias, 0.1, seq_lens=torch.tensor([9, 2], dtype=torch.int32),
                            block_table=table)
    cache = torch.zeros(2, 4, 4, 12)
    with pytest.raises(RuntimeError, match="slot 8 of token 0 is outside"):
        cpu.lazy_cache_write(k[0, :, 0][None], v[0, :, 0][None], torch.tensor([8]), cache, cache)


def test_cache_write_of_every_dtype(rng_seed):
    """The paged write copies rows of any dtype exactly into the `[blocks, Hkv, block_size, D]` views."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        key, value = torch.randn(5, 2, 8).to(dtype), torch.randn(5, 2, 6).to(dtype)
        key_cache, value_cache = torch.zeros(3, 2, 4, 8, dtype=dtype), torch.zeros(3, 2, 4, 6, dtype=dtype)
        slots = torch.tensor([9, -1, 0, 4, 11])
        cpu.lazy_cache_write(key, value, slots, key_cache, value_cache)
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(key_cache[slot // 4, :, slot % 4], key[i]), (dtype, i)
                assert torch.equal(value_cache[slot // 4, :, slot % 4], value[i]), (dtype, i)
        assert int((key_cache != 0).any(-1).sum()) == 8, dtype  # 4 tokens x 2 heads, nothing else written


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", "0")
    q, k, v, *_ = _contiguous_case("mha-d12", 13, "zero")
    assert not cpu.available() and not cpu.decode_supported(q, k, v)


GENERATE_SCRIPT = """
import sys, warnings
if sys.argv[2] == "absent":
    sys.modules["lazy_llama_cpu"] = None  # the module is not installed: `import lazy_llama_cpu` fails
import torch
from transformers import AutoModelForCausalLM

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
assert out.shape == (1, 18)
lines = [str(w.message) for w in caught if "lazy_llama_cpu" in str(w.message)]
print("NATIVE", "lazy_llama_cpu" in sys.modules and sys.modules["lazy_llama_cpu"] is not None)
print("LINES", len(lines))
for line in lines:
    print("LINE", line)
"""


@pytest.mark.parametrize("module", ["installed", "absent"])
def test_generate_compiles_nothing_and_runs_without_the_module(module, tmp_path):
    """A checkpoint loaded with trust_remote_code and generate(), in a fresh HOME: the native op is imported (never
    compiled: HOME holds no new file), or, with the module absent, generation runs the PyTorch path after one
    clear line."""
    from tests.conftest import tiny_model

    tiny_model(seed=3).save_pretrained(tmp_path / "ckpt")
    home, hf_home = tmp_path / "home", tmp_path / "hf"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_", "TORCH", "TRITON"))}
    env.update(HOME=str(home), HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT),
               LAZY_LLAMA_CPU_KERNEL="1")
    done = subprocess.run([sys.executable, "-c", GENERATE_SCRIPT, str(tmp_path / "ckpt"), module], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"NATIVE {module == 'installed'}" in done.stdout, done.stdout
    if module == "installed":
        assert "LINES 0" in done.stdout, done.stdout
    else:
        assert "LINES 1" in done.stdout and "not installed" in done.stdout, done.stdout
    created = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert created == [], f"generate() left files in HOME: {created}"


def test_greedy_generation_with_the_kernel_equals_the_pytorch_path(monkeypatch, rng_seed):
    """A tiny float32 LazyLlama (tau of both signs, visible bias): the kernel's tokens and scores equal the
    PyTorch decode path's, for one sequence and for a batch (both in the causal layout)."""
    from modeling_lazy import lazy_attention_torch as ops
    from tests.conftest import tiny_model

    assert cpu.available()
    calls = []
    kernel_decode = ops._kernel_decode
    monkeypatch.setattr(ops, "_kernel_decode", lambda *args: calls.append(1) or kernel_decode(*args))
    model = tiny_model(seed=rng_seed, attn_implementation="lazy")
    for ids in (torch.randint(3, 97, (1, 30)), torch.randint(3, 97, (3, 12))):
        results = []
        for switch in ("1", "0"):
            monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", switch)
            calls.clear()
            with torch.no_grad():
                results.append(model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                              output_scores=True, return_dict_in_generate=True))
            assert len(calls) == (11 * model.config.num_hidden_layers if switch == "1" else 0)
        (kernel, torch_path) = results
        assert torch.equal(kernel.sequences, torch_path.sequences), f"seed {rng_seed}"
        torch.testing.assert_close(torch.stack(kernel.scores), torch.stack(torch_path.scores), atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"seed {rng_seed}: {m}")


def test_bfloat16_generation_decodes_with_the_native_op(monkeypatch, rng_seed):
    """bf16 generate() takes the native op for every decode step; its next-token logits after a shared prefix
    equal the PyTorch path's within bf16 rounding."""
    from modeling_lazy import lazy_attention_torch as ops
    from tests.conftest import tiny_model

    calls = []
    kernel_decode = ops._kernel_decode
    monkeypatch.setattr(ops, "_kernel_decode", lambda *args: calls.append(1) or kernel_decode(*args))
    model = tiny_model(seed=rng_seed, attn_implementation="lazy").to(torch.bfloat16)
    ids = torch.randint(3, 97, (2, 16))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert len(calls) == 4 * model.config.num_hidden_layers, len(calls)
    logits = []
    for switch in ("1", "0"):
        monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", switch)
        with torch.no_grad():
            prefix = model(out[:, :-1], use_cache=True)
            logits.append(model(out[:, -1:], cache=prefix.past_key_values).logits.float())
    torch.testing.assert_close(logits[0], logits[1], atol=3e-2, rtol=3e-2, msg=lambda m: f"seed {rng_seed}: {m}")


@pytest.mark.parametrize("tau_kind", list(TAUS))
@pytest.mark.parametrize("case", ["many-chunks", "cached-keys", "long-window"])
def test_prefill_elastic_rows_match_float64(case, tau_kind, isa, rng_seed, monkeypatch):
    """Inference prefill in the causal layout takes its Elastic-Softmax from the native row pass, chunk by chunk:
    against the float64 reference, with chunks forced small, cached keys before the queries, rows without a
    normaliser."""
    from modeling_lazy import lazy_attention_reference as ref
    from modeling_lazy import lazy_attention_torch as ops

    calls = []
    rows = ops.lazy_elastic_rows
    monkeypatch.setattr(ops, "lazy_elastic_rows", lambda *args: calls.append(1) or rows(*args))
    if case == "many-chunks":
        monkeypatch.setattr(ops, "_CHUNK_ELEMENTS", 2048)  # a few rows per chunk
    heads, kv_heads, dim = 6, 2, 16
    q_len, past, window = {"many-chunks": (70, 0, 16), "cached-keys": (40, 25, 8), "long-window": (33, 3, 128)}[case]
    bsz = 2
    meta = ref.LazyMetadata.from_mask(query_length=q_len, batch_size=bsz, past_length=past, device=torch.device("cpu"))
    q = torch.randn(bsz, heads, q_len, dim) * 2
    k, v = torch.randn(bsz, kv_heads, past + q_len, dim), torch.randn(bsz, kv_heads, past + q_len, dim)
    tau, bias = TAUS[tau_kind](heads), torch.randn(heads, window)
    bias[1, :4] = float("-inf")  # head 1: the first four rows of a sequence see only -inf scores
    with torch.no_grad():
        got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
    assert calls, "the native row pass was not used"
    layout = token_layout(None, None, bsz, past + q_len, q_len)
    want = lazy_attention64(q, k, v, tau, bias, *layout, dim**-0.5)[0].transpose(1, 2)
    assert torch.isfinite(got).all(), f"seed {rng_seed}"
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {rng_seed}: {m}")


SANITIZED_TESTS = ("test_contiguous_cache_matches_float64 or test_paged or test_half or test_nan or test_rows_without"
                   " or test_left_padded or test_split")


def test_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """The op tests above once more against a build with -fsanitize=address,undefined,float-cast-overflow (GCC's
    `undefined` leaves out float-to-int conversions such as NaN to int; ASan preloaded into Python, leak checks off:
    CPython and torch keep allocations for the process's life). About a minute to compile and a
    minute to run on 2 cores; any out-of-bounds access or undefined behaviour (e.g. a NaN converted to int) aborts
    the run. Skipped only where the compiler has no sanitizer runtime."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    asan = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(asan) or not os.path.exists(asan):
        pytest.skip("the compiler has no AddressSanitizer runtime (libasan)")
    tree = tmp_path / "tree"  # the sources and tests beside the sanitized module, without the in-place build
    for name in ("modeling_lazy", "configuration_lazy", "tests"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tree)
    build = textwrap.dedent(f"""
        from setuptools import setup
        from torch.utils.cpp_extension import BuildExtension, CppExtension
        flags = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined,float-cast-overflow",
                 "-fno-sanitize-recover=all",
                 "-fopenmp"]
        setup(name="sanitized", script_args=["build_ext", "--build-lib", {str(tree)!r},
                                             "--build-temp", {str(tmp_path / 'tmp')!r}],
              ext_modules=[CppExtension("lazy_llama_cpu", [{str(ROOT / 'csrc' / 'lazy_attention_cpu.cpp')!r}],
                                        extra_compile_args=flags, extra_link_args=flags)],
              cmdclass={{"build_ext": BuildExtension.with_options(use_ninja=False)}})
    """)
    done = subprocess.run([sys.executable, "-c", build], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(tree), LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    check = "import lazy_llama_cpu as m, sys; assert m.__file__.startswith(sys.argv[1]), m.__file__"
    done = subprocess.run([sys.executable, "-c", "import torch; " + check, str(tree)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           "tests/test_cpu_kernel.py", "-k", SANITIZED_TESTS], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=600)
    found = [i for i in (done.stderr.find(m) for m in ("ERROR: AddressSanitizer", "runtime error:")) if i >= 0]
    report = done.stderr[min(found):][:4000] if found else done.stderr[-4000:]  # the sanitizer's own report first
    assert done.returncode == 0, done.stdout[-2000:] + report
    assert " passed" in done.stdout and "runtime error" not in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["gqa3-d64", "mha-d12"])
def test_left_padded_rows_start_at_their_first_key(shape, dtype, isa, rng_seed):
    """`key_starts` (a left-padded batch): sequence b sees keys `key_starts[b] .. n - 1` as if they were all its keys;
    the padding rows before them are never read (NaN there changes nothing). Against float64 of the real keys."""
    heads, kv_heads, dim, dim_v = SHAPES[shape]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    bsz, keys = 3, 90
    starts = torch.tensor([0, 17, 89], dtype=torch.int32)  # no padding, some, all but one key
    q = (torch.randn(bsz, heads, dim) * 2).to(torch_dtype)
    k = torch.randn(bsz, kv_heads, keys, dim).to(torch_dtype)
    v = torch.randn(bsz, kv_heads, keys, dim_v).to(torch_dtype)
    for b, s in enumerate(starts.tolist()):
        k[b, :, :s], v[b, :, :s] = float("nan"), float("nan")
    tau, bias = TAUS["mixed"](heads) - 0.5, torch.randn(heads, 40)
    positions = keys - 1 - starts.long()
    out = cpu.lazy_decode_cpu(q, k, v, tau, bias, dim**-0.5, seq_len=keys, positions=positions, key_starts=starts)
    real = [slice(s, keys) for s in starts.tolist()]
    want = decode64(q, [k[b, :, real[b]] for b in range(bsz)], [v[b, :, real[b]] for b in range(bsz)], tau, bias,
                    positions, dim**-0.5)
    tolerance = 1e-5 if torch_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want, atol=tolerance, rtol=tolerance,
                               msg=lambda m: f"seed {rng_seed}: {m}")


def test_key_starts_outside_the_sequence_are_refused():
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 90, 8), torch.randn(3, 2, 90, 8)
    with pytest.raises(RuntimeError, match="key_starts\\[0\\] = 91 is outside the sequence's 90 keys"):
        cpu.lazy_decode_cpu(q, k, v, torch.zeros(4), torch.zeros(4, 8), 0.125, seq_len=90,
                            key_starts=torch.tensor([91, 0, 0]))


SPLIT_CASES = ["contiguous", "paged", "left-padded", "nan-key", "no-normaliser-head", "positive-tau"]


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_keys_match_float64(case, splits, isa, rng_seed):
    """Split-K (each sequence's keys cut into slices computed as separate parallel items, then combined through
    their max and normaliser): the same float64 answer as the whole row, for contiguous and paged caches, left
    padding, a NaN key (its heads NaN, the others finite), a head without any finite score (0) and tau > 0 (every
    visible key weighted)."""
    heads, kv_heads, dim, dim_v = SHAPES["gqa3-d64"]
    tau = torch.randn(heads) - 0.5 if case != "positive-tau" else torch.rand(heads) + 0.1
    bias = torch.randn(heads, 40)
    positions, starts = None, None
    if case == "paged":
        q, k, v, table, lengths, keys, values = _paged_case("gqa3-d64")
        out = cpu.lazy_decode_cpu(q, k, v, tau, bias, dim**-0.5, seq_lens=lengths, block_table=table,
                                  num_splits=splits)
        want = decode64(q, keys, values, tau, bias, lengths.long() - 1, dim**-0.5)
    else:
        bsz, n = 2, 203
        q = torch.randn(bsz, heads, dim) * 2
        k, v = torch.randn(bsz, kv_heads, n, dim), torch.randn(bsz, kv_heads, n, dim_v)
        if case == "left-padded":
            starts = torch.tensor([0, 58], dtype=torch.int32)
            positions = n - 1 - starts.long()
        if case == "nan-key":
            k[1, 2, 150, 5] = float("nan")
        if case == "no-normaliser-head":
            bias = torch.randn(heads, 256)  # a window longer than the keys: every key of head 4 scores -inf
            bias[4] = float("-inf")
        out = cpu.lazy_decode_cpu(q, k, v, tau, bias, dim**-0.5, seq_len=n, positions=positions, key_starts=starts,
                                  num_splits=splits)
        first = [0, 0] if starts is None else starts.tolist()
        want = decode64(q, [k[b, :, first[b]:] for b in range(bsz)], [v[b, :, first[b]:] for b in range(bsz)], tau,
                        bias, positions if positions is not None else torch.full((bsz,), n - 1), dim**-0.5)
    assert torch.equal(out.isnan(), want.isnan()), f"seed {rng_seed}: NaN pattern differs"
    if case == "nan-key":
        assert out[1, 6:9].isnan().all() and not out[0].isnan().any()
    torch.testing.assert_close(out.double().nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed {rng_seed}: {m}")
    whole = cpu.lazy_decode_cpu(q, k, v, tau, bias, dim**-0.5, **(
        dict(seq_lens=lengths, block_table=table) if case == "paged" else
        dict(seq_len=n, positions=positions, key_starts=starts)), num_splits=1)
    torch.testing.assert_close(out.nan_to_num(), whole.nan_to_num(), atol=1e-5, rtol=1e-5)


def test_split_count_is_chosen_from_tasks_and_threads(rng_seed):
    """With 2 threads, one sequence of 3 KV heads at 8k keys (the automatic choice splits it: whole, the second
    thread would idle on the third task) gives the answer computed whole."""
    heads, kv_heads, dim = 9, 3, 64
    q, k, v = torch.randn(1, heads, dim), torch.randn(1, kv_heads, 8192, dim), torch.randn(1, kv_heads, 8192, dim)
    tau, bias = torch.full((heads,), -1.0), torch.randn(heads, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        auto = cpu.lazy_decode_cpu(q, k, v, tau, bias, 0.125, seq_len=8192)
    finally:
        torch.set_num_threads(threads)
    whole = cpu.lazy_decode_cpu(q, k, v, tau, bias, 0.125, seq_len=8192, num_splits=1)
    torch.testing.assert_close(auto, whole, atol=1e-6, rtol=1e-5, msg=lambda m: f"seed {rng_seed}: {m}")
