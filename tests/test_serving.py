"""vLLM serving (the `serving` plugin): greedy tokens from vLLM equal `generate()`.

Collected only where vLLM is installed (the serving environment, `make test-low`). Each test builds its
reference with transformers in this process and runs vLLM in a child process (`tests/serving_worker.py`;
vLLM's engine wants its own process), one engine per test.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from modeling_lazy import LazyLlamaForCausalLM

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed in this environment (`make test-low` runs these in the serving venv)",
)

WORKER = Path(__file__).with_name("serving_worker.py")
ROOT = Path(__file__).resolve().parents[1]
# Small pages and a small token budget: prompts span many KV blocks and are prefilled in chunks, so
# chunks of one prompt run in the same step as other prompts' decodes.
ENGINE = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256, block_size=16,
              max_num_batched_tokens=32, enable_chunked_prefill=True, enable_prefix_caching=True, max_num_seqs=8)


def run_vllm(tmp_path: Path, model: Path, runs: list[dict], timeout: int = 900, env=None, **engine):
    """Run the worker on `model` with ENGINE (overridden by `engine`); returns the finished process."""
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": str(model), "engine": {**ENGINE, **engine}, "runs": runs}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, str(WORKER), str(request)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return proc


def results(proc, key: str = "runs"):
    """The worker's `RESULT` entry `key` (its runs, or `async_scheduling`)."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"vLLM worker failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])[key]


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """`generate()` of one unpadded prompt, never stopping early (vLLM runs with `ignore_eos`)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_lazy_folder(folder: Path, seed: int, tau: float = -1.0, bias_std: float = 1.0, **overrides) -> Path:
    """A tiny random LazyLlama (GQA 4/2 heads, window 8) with tau ~ N(tau, 0.2) and bias ~ N(0, bias_std)."""
    torch.manual_seed(seed)
    config = tiny_config(vocab_size=128, lazy_bias_window=8, eos_token_id=None, bos_token_id=None, **overrides)
    model = LazyLlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.tau.normal_(tau, 0.2)
            layer.self_attn.distance_bias.normal_(0.0, bias_std)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    return folder


def test_random_lazy_llama_mixed_batches_chunked_prefill_and_prefix_cache(tmp_path, rng_seed):
    """Prompts of many lengths together (chunked prefills beside decodes), two prompts sharing a long
    prefix, then a later request whose prefix comes from the prefix cache: every token equals generate()."""
    print(f"seed {rng_seed}")
    folder = random_lazy_folder(tmp_path / "model", rng_seed)
    model = LazyLlamaForCausalLM.from_pretrained(folder).eval()
    gen = torch.Generator().manual_seed(rng_seed)

    def tokens(n):
        return torch.randint(3, 128, (n,), generator=gen).tolist()

    shared = tokens(70)
    first = [tokens(3), tokens(17), tokens(45), tokens(130), shared + tokens(9), shared + tokens(21)]
    later = [shared + tokens(5)]
    new_tokens = 12
    runs = results(run_vllm(tmp_path, folder, [{"prompts": first, "max_tokens": new_tokens},
                                               {"prompts": later, "max_tokens": new_tokens}]))

    for run, prompts in zip(runs, (first, later)):
        for got, prompt in zip(run, prompts):
            assert got["tokens"] == greedy(model, prompt, new_tokens), (
                f"prompt of {len(prompt)} tokens, seed {rng_seed}")
    assert runs[1][0]["cached"] >= 64, "the later request did not reuse the shared prefix from the cache"

    # The comparison can tell Lazy Attention from softmax attention: with tau = 0 and no bias the
    # same weights give other tokens.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.tau.zero_()
            layer.self_attn.distance_bias.zero_()
    softmax = [greedy(model, prompt, new_tokens) for prompt in first]
    assert any(s != got["tokens"] for s, got in zip(softmax, runs[0])), "tau/bias had no effect on the tokens"


def test_async_scheduling_greedy_tokens_and_logprobs_equal_generate(tmp_path, rng_seed):
    """With `async_scheduling=True` (what the OpenAI server asks for by default), prompts of mixed lengths
    prefilled in chunks: the greedy tokens equal generate() and vLLM's log-probability of every chosen token
    equals the transformers model's, i.e. the distribution the server samples from is the model's."""
    print(f"seed {rng_seed}")
    folder = random_lazy_folder(tmp_path / "model", rng_seed)
    model = LazyLlamaForCausalLM.from_pretrained(folder).eval()
    gen = torch.Generator().manual_seed(rng_seed)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (4, 29, 61, 100)]
    new_tokens = 10
    proc = run_vllm(tmp_path, folder, [{"prompts": prompts, "max_tokens": new_tokens}], async_scheduling=True)
    print(f"engine async_scheduling after vLLM's platform checks: {results(proc, 'async_scheduling')}")
    for got, prompt in zip(results(proc)[0], prompts):
        expected = greedy(model, prompt, new_tokens)
        assert got["tokens"] == expected, f"prompt of {len(prompt)} tokens, seed {rng_seed}"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + expected])).logits[0, len(prompt) - 1: -1]
        chosen = logits.log_softmax(-1).gather(-1, torch.tensor(expected)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got["logprobs"]), chosen, rtol=0, atol=1e-4)


def test_converted_smollm2_at_tau_0_and_minus_half(tmp_path):
    """The converted SmolLM2 (a real trained model): vLLM equals generate() at tau = 0 (exactly Llama)
    and at tau = -0.5 (set in place on the served model, prefix cache reset), and answers Paris."""
    from transformers import AutoTokenizer

    from lazy_llama_vllm.smollm2 import converted_smollm2

    folder = converted_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=True, return_dict=True)
    prompts = [list(chat["input_ids"]),
               tokenizer("The Brown Corpus was compiled in the 1960s at").input_ids,
               tokenizer("def fibonacci(n):").input_ids]
    new_tokens = 16
    runs = results(run_vllm(tmp_path, folder, [{"prompts": prompts, "max_tokens": new_tokens, "tau": 0.0},
                                               {"prompts": prompts, "max_tokens": new_tokens, "tau": -0.5}],
                            skip_tokenizer_init=False, max_model_len=512, max_num_batched_tokens=64))
    model = LazyLlamaForCausalLM.from_pretrained(folder).eval()
    for tau, run in zip((0.0, -0.5), runs):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.tau.fill_(tau)
        for got, prompt in zip(run, prompts):
            assert got["tokens"] == greedy(model, prompt, new_tokens), f"tau {tau}, prompt {tokenizer.decode(prompt)!r}"
    assert "Paris" in tokenizer.decode(runs[0][0]["tokens"])
    assert runs[0] != runs[1], "tau = -0.5 changed no token: the comparison would not notice a missing tau"


def test_tensor_parallel_2(tmp_path, rng_seed):
    """tensor_parallel_size=2 on CPU: tau and distance_bias are sharded with their heads."""
    print(f"seed {rng_seed}")
    folder = random_lazy_folder(tmp_path / "model", rng_seed)
    model = LazyLlamaForCausalLM.from_pretrained(folder).eval()
    gen = torch.Generator().manual_seed(rng_seed)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 33)]
    # vLLM pins each rank's threads to a NUMA node by default; small machines have one node for both ranks.
    runs = results(run_vllm(tmp_path, folder, [{"prompts": prompts, "max_tokens": 8}], tensor_parallel_size=2,
                            env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}))
    for got, prompt in zip(runs[0], prompts):
        assert got["tokens"] == greedy(model, prompt, 8), f"seed {rng_seed}"


def test_unservable_folder_fails_with_a_clear_message(tmp_path, rng_seed):
    """A config that does not match its weights (edited lazy_bias_window) is refused by name."""
    folder = random_lazy_folder(tmp_path / "model", rng_seed)
    config = json.loads((folder / "config.json").read_text())
    config["lazy_bias_window"] = 16
    (folder / "config.json").write_text(json.dumps(config))
    proc = run_vllm(tmp_path, folder, [{"prompts": [[5, 6, 7]], "max_tokens": 2}])
    assert proc.returncode != 0
    assert "config.json implies (4, 16)" in proc.stdout + proc.stderr


TRITON_STEP = r"""
import os, sys, types
import torch
from lazy_llama_vllm.lazy_attention_backend import LazyAttentionImpl, LazyAttentionMetadataBuilder, LazyPageLayout

seed = int(sys.argv[1])
gen = torch.Generator().manual_seed(seed)
heads, kv_heads, dim, page = 4, 2, 64, 16
# decode requests first (as vLLM orders them for this backend), then a whole prompt and a chunk after a prefix
q_lens, seq_lens = [1, 1, 37, 20], [70, 33, 37, 50]
num_blocks = sum(-(-n // page) for n in seq_lens) + 3
order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
table = torch.zeros(len(q_lens), 8, dtype=torch.int32)
for r, n in enumerate(seq_lens):
    for b in range(-(-n // page)):
        table[r, b] = order.pop()
# 1e4 in every slot no request owns: a wrong read shows
cache = torch.full((num_blocks, kv_heads, page, 2 * dim), 1e4)
impl = LazyAttentionImpl(heads, dim, dim ** -0.5, kv_heads, tau=-1.0 + 0.2 * torch.randn(heads, generator=gen),
                         distance_bias=torch.randn(heads, 24, generator=gen))
for r, n in enumerate(seq_lens):  # every key of every request through the backend's own cache writer
    slots = table[r, torch.arange(n) // page].long() * page + torch.arange(n) % page
    impl.do_kv_cache_update(None, torch.randn(n, kv_heads, dim, generator=gen),
                            torch.randn(n, kv_heads, dim, generator=gen), cache, slots)
starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
common = types.SimpleNamespace(num_reqs=len(q_lens), query_start_loc_cpu=starts, query_start_loc=starts,
                               seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table_tensor=table,
                               num_actual_tokens=int(starts[-1]), max_seq_len=max(seq_lens))
builder = object.__new__(LazyAttentionMetadataBuilder)
builder.block_size, builder.device = page, torch.device("cpu")
builder.layout = LazyPageLayout(kv_heads, page, dim)
query = torch.randn(int(starts[-1]) + 3, heads, dim, generator=gen)  # vLLM pads the step: 3 unused rows
outputs = {}
for backend in ("triton", "torch"):
    os.environ["LAZY_LLAMA_BACKEND"] = backend
    metadata = builder.build(0, common)
    assert (metadata.paged is not None) == (backend == "triton") and metadata.paged is None or \
        metadata.paged.num_decodes == 2
    outputs[backend] = impl.forward(None, query, None, None, cache, metadata, torch.zeros_like(query))
count = int(starts[-1])
tri, ref = outputs["triton"][:count], outputs["torch"][:count]
error = ((tri - ref).abs().max() / ref.abs().max()).item()
print("ERROR", error, "nan rows triton", tri.isnan().any(-1).any(-1).nonzero().flatten().tolist(), "torch",
      ref.isnan().any(-1).any(-1).nonzero().flatten().tolist())
assert torch.isfinite(tri).all() and error < 2e-4, error
assert (outputs["triton"][count:] == 0).all()  # padding rows untouched
"""


def test_triton_paged_path_equals_the_pytorch_path(tmp_path, rng_seed):
    """On CUDA the backend runs the step through `lazy_attention_paged` (the `lazy_llama::triton_paged` op); here the
    same code under the Triton interpreter (CPU tensors, `LAZY_LLAMA_BACKEND=triton`) against the backend's
    PyTorch path, on one mixed step: two decode requests first, a whole prompt, a chunk after 30 cached keys; shuffled
    pages, huge values in unowned slots."""
    pytest.importorskip("triton")
    script = tmp_path / "triton_step.py"
    script.write_text(TRITON_STEP)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script), str(rng_seed)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "ERROR" in proc.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("decode", ["c-kernel", "pytorch"])
def test_cpu_path_reads_only_owned_cache_rows_and_runs_small_groups_on_one_thread(decode, dtype, monkeypatch,
                                                                                   rng_seed):
    """The backend's CPU path on one step (three decodes of different lengths in one group, then a chunk after 5
    cached keys), NaN in every cache slot no request owns: each request's output equals Lazy Attention over its own
    keys written out here, so no unowned row is read (the PyTorch path pads the decodes to the longest with owned
    rows; the native op reads each request's pages in place); the group under the one-thread limit runs on one
    thread, the other on the caller's threads, restored after. In bfloat16 (`make serve`'s cache) too, against
    float64 of the rounded inputs."""
    import types

    import lazy_llama_vllm.lazy_attention_backend as backend
    from modeling_lazy.lazy_attention_cpu import available

    gen = torch.Generator().manual_seed(rng_seed)
    heads, kv_heads, dim, page, window = 4, 2, 16, 16, 8
    q_lens, seq_lens = [1, 1, 1, 20], [40, 7, 23, 25]
    order = (torch.randperm(16, generator=gen) + 1).tolist()
    table = torch.zeros(len(q_lens), 4, dtype=torch.int32)
    for r, n in enumerate(seq_lens):
        for b in range(-(-n // page)):
            table[r, b] = order.pop()
    cache = torch.full((17, kv_heads, page, 2 * dim), float("nan"), dtype=dtype)
    tau, bias = -1.0 + 0.2 * torch.randn(heads, generator=gen), torch.randn(heads, window, generator=gen)
    impl = backend.LazyAttentionImpl(heads, dim, dim**-0.5, kv_heads, tau=tau, distance_bias=bias)
    if decode == "c-kernel":
        assert available(), "the native CPU op is not built: run `python setup.py build_ext --inplace`"
    else:
        monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", "0")
    keys = [torch.randn(n, kv_heads, dim, generator=gen).to(dtype) for n in seq_lens]
    values = [torch.randn(n, kv_heads, dim, generator=gen).to(dtype) for n in seq_lens]
    for r, n in enumerate(seq_lens):
        slots = table[r, torch.arange(n) // page].long() * page + torch.arange(n) % page
        impl.do_kv_cache_update(None, keys[r], values[r], cache, slots)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    common = types.SimpleNamespace(num_reqs=len(q_lens), query_start_loc_cpu=starts, query_start_loc=starts,
                                   seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table_tensor=table,
                                   num_actual_tokens=int(starts[-1]), max_seq_len=max(seq_lens))
    builder = object.__new__(backend.LazyAttentionMetadataBuilder)
    builder.block_size, builder.device = page, torch.device("cpu")
    builder.layout = backend.LazyPageLayout(kv_heads, page, dim)
    monkeypatch.setenv("LAZY_LLAMA_BACKEND", "torch")
    metadata = builder.build(0, common)
    query = torch.randn(int(starts[-1]), heads, dim, generator=gen).to(dtype)

    threads_seen = []
    for name in ("lazy_attention", "lazy_decode_cpu"):
        monkeypatch.setattr(backend, name, lambda *args, op=getattr(backend, name), **kwargs: threads_seen.append(
            (op.__name__, torch.get_num_threads())) or op(*args, **kwargs))
    monkeypatch.setattr(backend, "_ONE_THREAD_MAX_ELEMENTS", 1000)  # decodes 3 * 4 * 40 keys; the chunk 4 * 20 * 25
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = impl.forward(None, query, None, None, cache, metadata, torch.zeros_like(query))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    decodes = "lazy_decode_cpu" if decode == "c-kernel" else "lazy_attention"
    assert threads_seen == [(decodes, 1), ("lazy_attention", 2)]

    for r, (m, n) in enumerate(zip(q_lens, seq_lens)):
        q = query[int(starts[r]): int(starts[r + 1])].double()  # [m, Hq, D]
        k = keys[r].double().repeat_interleave(heads // kv_heads, 1)
        v = values[r].double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
        distance = (n - m + torch.arange(m))[:, None] - torch.arange(n)  # [m, n]
        scores = scores + torch.where((distance >= 0) & (distance < window),
                                      bias.double()[:, distance.clamp(0, window - 1)], 0.0)
        scores = scores.masked_fill(distance < 0, float("-inf"))
        weights = torch.relu(scores.softmax(-1) + tau.double()[:, None, None] / (n - m + torch.arange(m) + 1)[:, None])
        weights = weights.masked_fill(distance < 0, 0.0)
        expected = torch.einsum("hqk,khd->qhd", weights, v)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's rounding
        assert out.dtype == dtype
        torch.testing.assert_close(out[int(starts[r]): int(starts[r + 1])].double(), expected, rtol=tol, atol=tol,
                                   msg=lambda text, r=r: f"request {r} (seed {rng_seed}): {text}")


def test_cache_write_in_c_equals_the_pytorch_write(monkeypatch, rng_seed):
    """The float32 cache write (one native call) leaves the cache exactly as the PyTorch write does: strided key and
    value views (vLLM splits them from one projection), padded tokens (slot -1) skipped, other slots untouched."""
    import lazy_llama_vllm.lazy_attention_backend as backend
    from modeling_lazy.lazy_attention_cpu import available

    assert available(), "the native CPU op is not built: run `python setup.py build_ext --inplace`"
    heads, kv_heads, dim, page, tokens = 4, 2, 16, 8, 11
    impl = backend.LazyAttentionImpl(heads, dim, dim**-0.5, kv_heads, tau=torch.zeros(heads),
                                     distance_bias=torch.zeros(heads, 4))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    key = qkv[:, heads * dim: (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    value = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(6 * page)[:tokens]
    slots[[2, 7]] = -1
    caches = []
    for switch in ("1", "0"):
        monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", switch)
        cache = torch.full((6, kv_heads, page, 2 * dim), float("nan"))
        impl.do_kv_cache_update(None, key, value, cache, slots)
        caches.append(cache)
    assert torch.equal(caches[0].isnan(), caches[1].isnan()), f"seed {rng_seed}"
    assert torch.equal(caches[0].nan_to_num(7.0), caches[1].nan_to_num(7.0)), f"seed {rng_seed}"
    assert int((~caches[0].isnan()).sum()) == (tokens - 2) * kv_heads * 2 * dim


@pytest.mark.parametrize("step", ["cache write", "attention"])
def test_value_heads_of_another_size_are_refused_clearly(step):
    """Lazy Attention is defined for Llama's equal key and value head sizes: a cache laid out for other value heads
    is refused with a message that names both sizes, at the cache write and at the attention step alike."""
    import lazy_llama_vllm.lazy_attention_backend as backend

    heads, kv_heads, dim = 4, 2, 16
    impl = backend.LazyAttentionImpl(heads, dim, dim**-0.5, kv_heads, tau=torch.zeros(heads),
                                     distance_bias=torch.zeros(heads, 4))
    cache = torch.zeros(4, kv_heads, 8, dim + 24)
    with pytest.raises(ValueError, match="value heads of the key head size 16; this cache holds values of 24"):
        if step == "cache write":
            impl.do_kv_cache_update(None, torch.randn(3, kv_heads, dim), torch.randn(3, kv_heads, 24), cache,
                                    torch.arange(3))
        else:
            metadata = backend.LazyServingMetadata(num_actual_tokens=1, groups=[])
            impl.forward(None, torch.randn(1, heads, dim), None, None, cache, metadata, torch.zeros(1, heads, 24))
