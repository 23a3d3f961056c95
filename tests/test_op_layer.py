"""The op layer (modeling_lazy/lazy_attention_ops.py): the decision table, the registered operators, and compiled
models that run the project's kernels.

CPU only and fast. The Triton operators are traced in a child process under TRITON_INTERPRET=1 with
`LAZY_LLAMA_BACKEND=triton` (that is how CPU tensors reach them), on fake tensors: tracing never launches a
kernel. (Fake CUDA tensors cannot be used on a CPU-only torch build: slicing, `contiguous` and factory calls on them
need a CUDA device guard the build lacks; the table's CUDA rows are checked on their own below.)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import CompileConfig, StaticCache

from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM
from modeling_lazy import lazy_attention_ops as ops
from modeling_lazy.lazy_attention_reference import LazyMetadata, lazy_attention_reference

ROOT = Path(__file__).resolve().parents[1]
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
HAS_TRITON = ops._forward is not None


def tiny_model(**overrides) -> LazyLlamaForCausalLM:
    config = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, lazy_bias_window=8, max_position_embeddings=64)
    model = LazyLlamaForCausalLM(LazyLlamaConfig(**{**config, **overrides})).eval()
    with torch.no_grad():  # varied heads: some weights are zeroed by the ReLU, some survive
        for layer in model.model.layers:
            layer.self_attn.tau.copy_(torch.linspace(-1.0, 0.5, config["num_attention_heads"]))
            layer.self_attn.distance_bias.normal_(0.0, 0.5)
    return model


def lazy_ops(graph: torch.fx.GraphModule) -> list[str]:
    """The `lazy_llama::*` operators called in a graph, in order."""
    return [str(node.target).split(".")[1] for node in graph.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("lazy_llama.")]


# ---------------------------------------------------------------------------------------------- the decision table

def table(device, rows=1, causal=True, grad=False, dtype=torch.float32, batch=2, static=False, **kw):
    return ops.choose_kernel(device, dtype, rows, batch, causal, static, grad, **kw)


@pytest.mark.skipif(not HAS_TRITON, reason="the Triton rows need the triton package")
def test_table_sends_cuda_calls_to_the_triton_operators(monkeypatch):
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
    assert table(CUDA, rows=300, grad=True) == "triton_causal"  # training: the causal fast path (stores U)
    assert table(CUDA, rows=4, grad=True) == "triton_causal"  # <= 16 rows: its packed-decode forward
    assert table(CUDA, rows=300) == "triton_causal"  # prefill
    assert table(CUDA, rows=1) == table(CUDA, rows=16) == "triton_decode"  # decode
    assert table(CUDA, rows=300, causal=False, grad=True) == table(CUDA, rows=1, causal=False, grad=True) == "triton"
    assert table(CUDA, rows=300, causal=False) == "triton"  # eager, no documents: the general kernels
    # traced (compile, export): an operator that asks for documents when it runs; inference with few rows: decode
    assert table(CUDA, rows=300, causal=False, traced=True) == table(CUDA, rows=3, causal=False, grad=True,
                                                                     traced=True) == "triton_traced"
    assert table(CUDA, rows=16, causal=False, traced=True) == "triton_decode"
    assert table(CUDA, rows=300, traced=True) == "triton_causal"
    assert table(CUDA, rows=1, causal=False, grad=True, static=True, traced=True) == "triton"
    # inference with <= 16 rows, any layout (padding, holes, a compiled static cache's buffer): the packed decode
    assert table(CUDA, rows=1, causal=False) == table(CUDA, rows=16, causal=False) == "triton_decode"
    assert table(CUDA, rows=1, causal=False, static=True) == table(CUDA, rows=5, causal=False, static=True) == (
        "triton_decode")
    assert table(CUDA, rows=1, causal=False, grad=True, static=True) == "triton"  # one row: Tk - Tq holds
    assert table(CUDA, rows=5, causal=False, grad=True, static=True) == "torch_train"  # general kernel: Tk - Tq
    assert table(CUDA, rows=17, causal=False, static=True) == "torch_prefill"  # (a static buffer is only traced)
    # a compiled prefill of > 16 rows into a static cache: the traced operator cuts the buffer when it runs
    assert table(CUDA, rows=17, causal=False, static=True, traced=True) == "triton_traced"
    assert table(CUDA, rows=17, causal=False, grad=True, static=True, traced=True) == "torch_train"
    assert table(CUDA, rows=300, causal=False, documents=True) == "triton_documents"
    # a left-padded batch after a cache: inference with > 16 rows per document from each row's first key
    assert table(CUDA, rows=300, causal=False, left_padded=True) == "triton_left_padded"
    assert table(CUDA, rows=300, causal=False, grad=True, left_padded=True) == "triton"  # training: general
    assert table(CUDA, rows=1, causal=False, left_padded=True) == "triton_decode"
    assert table(CUDA, rows=1, dtype=torch.float64) == "torch_decode"
    assert table(CUDA, rows=300, dtype=torch.float64) == "torch_prefill"  # auto: float64 is not a Triton dtype
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    assert table(CUDA, rows=300, grad=True) == "torch_train"
    assert table(CUDA, rows=1, causal=False) == "torch_decode"
    assert table(CUDA, rows=1) == "torch_decode"  # the C decode is for CPU tensors only
    assert table(CUDA, rows=1, batch=1) == "torch_one_row"


def test_table_rows_of_the_pytorch_path(monkeypatch):
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
    assert table(CPU, rows=300, grad=True) == table(CPU, rows=1, grad=True, causal=False) == "torch_train"
    assert table(CPU, rows=300) == "torch_prefill"
    assert table(CPU, rows=16, causal=False) == "torch_decode"
    assert table(CPU, rows=1, causal=False) == "torch_decode"  # padding: the general decode
    assert table(CPU, rows=1, static=True) == "torch_decode"
    assert table(CPU, rows=1, batch=1) == "torch_one_row"  # the native op does not take the tensors
    assert table(CPU, rows=1, softmax_only=True) == "torch_sdpa"
    assert table(CPU, rows=1, softmax_only=True, dtype=torch.bfloat16) == "torch_decode"
    # native_layout: `lazy_attention_cpu.decode_supported` vouched for the tensors (installed op, dtype, strides)
    assert table(CPU, rows=1, native_layout=True) == "cpu_decode"
    assert table(CPU, rows=1, native_layout=True, dtype=torch.bfloat16) == "cpu_decode"
    assert table(CPU, rows=1, native_layout=True, static=True) == "torch_decode"
    assert table(CPU, rows=2, native_layout=True, batch=1) == "torch_decode"


def test_backend_variable_is_read_at_every_call_and_refused_when_wrong(monkeypatch):
    monkeypatch.setenv(ops.BACKEND_ENV, "Torch ")
    assert ops.requested_backend() == "torch" and not ops.uses_triton(CUDA)
    monkeypatch.setenv(ops.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="LAZY_LLAMA_BACKEND.*auto, triton, torch; got 'fast'"):
        table(CPU)
    monkeypatch.setenv(ops.BACKEND_ENV, "auto")
    assert not ops.uses_triton(CPU)
    if HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") != "1":
        monkeypatch.setenv(ops.BACKEND_ENV, "triton")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            table(CPU)  # CPU tensors reach the kernels only through the interpreter
    with pytest.raises(ValueError, match="got 'cuda'"):
        ops.uses_triton(CPU, backend="cuda")


# ---------------------------------------------------------------------------------------------- the operators

def _op_inputs(rng_seed, q_len, k_len, padded=False, grad=False):
    gen = torch.Generator().manual_seed(rng_seed)
    bsz, heads, kv_heads, dim, window = 2, 4, 2, 8, 6
    query = torch.randn(bsz, heads, q_len, dim, generator=gen)
    key, value = (torch.randn(bsz, kv_heads, k_len, dim, generator=gen) for _ in range(2))
    tau = -1.0 + 0.5 * torch.randn(heads, generator=gen)
    bias = torch.randn(heads, window, generator=gen)
    mask = torch.ones(bsz, k_len, dtype=torch.long)
    if padded:
        mask[1, :3] = 0
    meta = LazyMetadata.from_mask(mask, query_length=q_len, past_length=k_len - q_len)
    leaves = [t.requires_grad_(grad) for t in (query, key, value, tau, bias)]
    return leaves, meta, dim**-0.5


@pytest.mark.parametrize("q_len, k_len, padded", [(12, 12, False), (12, 20, True), (1, 20, False), (1, 20, True)])
def test_pytorch_operator_passes_opcheck(q_len, k_len, padded, rng_seed):
    """`torch.library.opcheck`: schema, fake implementation (shapes, dtypes) and autograd registration of
    `lazy_llama::attention` agree with the real kernel, for inference and training calls."""
    for grad in (False, True):
        (q, k, v, tau, bias), meta, scaling = _op_inputs(rng_seed, q_len, k_len, padded, grad)
        args = (q, k, v, tau, bias, meta.q_pos, meta.k_pos, meta.q_seg, meta.k_seg, None, meta.causal, scaling, grad)
        torch.library.opcheck(torch.ops.lazy_llama.attention.default, args)


@pytest.mark.parametrize("q_len, k_len, padded", [(12, 12, False), (12, 20, True)])
def test_backward_operator_passes_opcheck(q_len, k_len, padded, rng_seed):
    """`lazy_llama::attention_backward` against its fake, strides included (Inductor asserts every output's strides
    against the fake): with the query laid out as the model hands it over ([B, T, H, D] memory)."""
    (q, k, v, tau, bias), meta, scaling = _op_inputs(rng_seed, q_len, k_len, padded)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    forward = (q, k, v, tau, bias, meta.q_pos, meta.k_pos, meta.q_seg, meta.k_seg, None, meta.causal, scaling, True)
    out, lse = torch.ops.lazy_llama.attention(*forward)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(rng_seed))
    args = (grad_out, q, k, v, tau, bias, meta.q_pos, meta.k_pos, meta.q_seg, meta.k_seg, None, lse, meta.causal,
            scaling)
    torch.library.opcheck(torch.ops.lazy_llama.attention_backward.default, args)


@pytest.mark.parametrize("q_len, k_len, padded", [(12, 12, False), (12, 20, True)])
def test_operator_gradients_equal_the_float64_reference(q_len, k_len, padded, rng_seed):
    """The op layer's autograd (register_autograd -> lazy_llama::attention_backward) gives the float64 reference's
    output and five gradients."""
    leaves, meta, scaling = _op_inputs(rng_seed, q_len, k_len, padded, grad=True)
    out = ops.lazy_attention(*leaves, meta, scaling, backend="torch")
    reference = [t.detach().double().requires_grad_() for t in leaves]
    want, _ = lazy_attention_reference(*reference, meta, scaling)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    expected = torch.autograd.grad(want, reference, grad.double())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- compiled models

def _compiled(graphs: list):
    """A torch.compile backend that keeps the graphs and runs them as traced (aot_eager: the ops run as in eager)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def keep(graph, _):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def test_compiled_static_cache_decode_runs_the_operator_and_equals_eager(rng_seed):
    """`generate(cache_implementation="static")` compiled (fullgraph): the decode graph calls `lazy_llama::attention`
    in every layer, the tokens and logits equal the uncompiled ones, and a second left-padded batch of another
    length reuses the graph (no recompile)."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(rng_seed)
    batches = []
    for lengths in ([7, 4], [3, 6]):
        ids = torch.randint(3, 97, (2, max(lengths)), generator=gen)
        mask = torch.stack([torch.arange(max(lengths)) >= max(lengths) - n for n in lengths]).long()
        batches.append((ids * mask, mask))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                  output_logits=True)
    expected = [model.generate(ids, attention_mask=mask, **kwargs) for ids, mask in batches]
    graphs = []
    config = CompileConfig(fullgraph=True, dynamic=False, backend=_compiled(graphs))
    config._compile_all_devices = True  # compile on CPU too
    torch.compiler.reset()
    for index, ((ids, mask), want) in enumerate(zip(batches, expected)):
        with torch.compiler.set_stance("fail_on_recompile" if index else "default"):
            got = model.generate(ids, attention_mask=mask, cache_implementation="static", compile_config=config,
                                 **kwargs)
        assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
        for a, b in zip(got.logits, want.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1, len(graphs)
    assert lazy_ops(graphs[0]) == ["attention"] * model.config.num_hidden_layers


def test_compiled_training_step_runs_the_operators_without_graph_breaks(rng_seed):
    """A training step compiled with fullgraph=True: the forward graph calls `lazy_llama::attention`, the backward
    graph `lazy_llama::attention_backward`, per layer; loss and gradients equal eager; `torch._dynamo.explain`
    counts 0 graph breaks; a batch of another length runs the dynamic graph again without recompiling."""
    model = tiny_model().train()
    gen = torch.Generator().manual_seed(rng_seed)
    ids = torch.randint(3, 97, (2, 11), generator=gen)

    def step(input_ids):
        return model(input_ids, labels=input_ids).loss

    loss = step(ids)
    want = torch.autograd.grad(loss, list(model.parameters()))
    explained = torch._dynamo.explain(step)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    graphs = []
    torch.compiler.reset()
    compiled = torch.compile(step, backend=_compiled(graphs), fullgraph=True, dynamic=True)
    got_loss = compiled(ids)
    got = torch.autograd.grad(got_loss, list(model.parameters()))
    torch.testing.assert_close(got_loss, loss, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    layers = model.config.num_hidden_layers
    assert [lazy_ops(graph) for graph in graphs] == [["attention"] * layers, ["attention_backward"] * layers]
    with torch.compiler.set_stance("fail_on_recompile"):
        other = torch.randint(3, 97, (2, 17), generator=gen)
        torch.autograd.grad(compiled(other), list(model.parameters()))


def test_inductor_compiled_training_step_equals_eager(rng_seed):
    """`torch.compile(model)` with its default backend (Inductor, which asserts each operator output's strides against
    its fake) trains: plain rows, packed documents (restarting `position_ids`) and right-padded rows give eager's loss
    and gradients; packed under bf16 autocast too, within bf16 rounding."""
    gen = torch.Generator().manual_seed(rng_seed)
    ids = torch.randint(3, 97, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    layouts = {"plain": {}, "packed": {"position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]] * 2)},
               "padded": {"attention_mask": mask}}
    torch.manual_seed(rng_seed)
    model = tiny_model().train()
    compiled = torch.compile(model)
    for name, inputs in layouts.items():
        loss = model(ids, labels=ids, **inputs).loss
        want = torch.autograd.grad(loss, list(model.parameters()))
        got_loss = compiled(ids, labels=ids, **inputs).loss
        got = torch.autograd.grad(got_loss, list(model.parameters()))
        torch.testing.assert_close(got_loss, loss, atol=1e-5, rtol=1e-5, msg=name)
        for (param, _), a, b in zip(model.named_parameters(), got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"{name}: {param}")
    # bf16 autocast (Trainer's bf16=True), packed: within bf16 rounding of eager (matmuls round differently fused)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids, **layouts["packed"]).loss
    want = torch.autograd.grad(loss, list(model.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_loss = compiled(ids, labels=ids, **layouts["packed"]).loss
    got = torch.autograd.grad(got_loss, list(model.parameters()))
    torch.testing.assert_close(got_loss, loss, atol=2e-3, rtol=0)
    for (param, _), a, b in zip(model.named_parameters(), got, want):
        assert float((a - b).norm()) <= 5e-2 * float(b.norm()) + 1e-6, param


def test_explain_counts_no_graph_break_in_a_static_cache_decode_step(rng_seed):
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(rng_seed))
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        explained = torch._dynamo.explain(model)(ids[:, :1], cache=cache, use_cache=True)
    assert explained.graph_break_count == 0, explained.break_reasons


# ---------------------------------------------------------------------------------------------- the Triton operators

TRITON_TRACE = r"""
import sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from modeling_lazy import lazy_attention_ops as ops
from modeling_lazy.lazy_attention_reference import LazyMetadata
from lazy_llama_vllm.lazy_attention_paged_op import lazy_attention_paged  # the vLLM plugin's paged operator

assert ops.uses_triton(torch.device("cpu"))
B, H, HKV, D, W = 2, 4, 2, 16, 8


def traced(fn, *args):
    graph = make_fx(fn, tracing_mode="fake")(*args)
    return [str(n.target).split(".")[1] for n in graph.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("lazy_llama.")]


def attention(q_len, k_len, mask=None, static=False, grad=None):
    grad = q_len > 1 if grad is None else grad

    if static:  # a static cache's buffer: the written length is a tensor
        past = torch.tensor(k_len - q_len - 3, dtype=torch.long)  # 3 slots unwritten
        meta = LazyMetadata.from_mask(mask, query_length=q_len, batch_size=B, past_length=past, key_length=k_len)
    else:
        meta = LazyMetadata.from_mask(mask, query_length=q_len, batch_size=B, past_length=k_len - q_len)

    def run(query, key, value, tau, bias, q_pos, k_pos, q_seg, k_seg, past):  # the metadata's tensors as inputs
        call = meta._replace(q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg, q_pos32=q_pos.int(),
                             k_pos32=k_pos.int(), key_offset=past if static else meta.key_offset)
        out = ops.lazy_attention(query, key, value, tau, bias, call, D ** -0.5)
        return torch.autograd.grad(out.sum(), (query, key, value, tau, bias)) if grad else out

    leaves = [torch.randn(B, H, q_len, D), torch.randn(B, HKV, k_len, D), torch.randn(B, HKV, k_len, D),
              torch.randn(H), torch.randn(H, W)]
    return traced(run, *[t.requires_grad_(grad) for t in leaves], meta.q_pos, meta.k_pos, meta.q_seg, meta.k_seg,
                  meta.key_offset if static else torch.zeros(()))


padded = torch.ones(B, 40, dtype=torch.long)
padded[1, :5] = 0
found = {
    "forward and backward (causal)": attention(40, 40),
    "forward and backward (padded)": attention(40, 40, padded),
    "decode": attention(1, 40),
    "decode (static cache, compiled)": attention(1, 40, static=True),
    "prefill (static cache, compiled)": attention(20, 40, static=True, grad=False),
    "decode (padded, compiled)": attention(1, 40, padded),
}


def paged(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, tau, bias):
    return lazy_attention_paged(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, tau, bias,
                                D ** -0.5, max_query_len=9, max_seq_len=40, num_decodes=2)


found["paged step"] = traced(paged, torch.randn(12, H, D), torch.randn(8, HKV, 16, D), torch.randn(8, HKV, 16, D),
                             torch.zeros(3, 3, dtype=torch.int32), torch.tensor([0, 1, 2, 11], dtype=torch.int32),
                             torch.tensor([20, 30, 9], dtype=torch.int32), torch.randn(H), torch.randn(H, W))
for name, names in found.items():
    print(name, "=", ",".join(names))

# the fakes agree with the kernels (shapes, dtypes, strides): real interpreted launches on small inputs
q, k, v = torch.randn(1, H, 20, D), torch.randn(1, HKV, 20, D), torch.randn(1, HKV, 20, D)
meta = LazyMetadata.from_mask(query_length=20)
positions = (meta.q_pos32, meta.k_pos32, meta.q_seg, meta.k_seg)
checks = {"triton_attention": [(q, k, v, torch.randn(H), torch.randn(H, W), *positions, causal, store, 0.25)
                               for causal, store in ((True, True), (True, False), (False, False))]
                              + [(q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.randn(H), torch.randn(H, W),
                                  *positions, True, True, 0.25)],  # U is stored in the input dtype
          "triton_decode": [(q[:, :, -2:], k, v, torch.randn(H), torch.randn(H, W), meta.q_pos32[:, -2:],
                             torch.full((1,), 20, dtype=torch.int32), 0.25),
                            (q[:, :, -2:], k, v, torch.randn(H), torch.randn(H, W), meta.q_pos32[:, -2:],
                             torch.full((1,), 20, dtype=torch.int32), 0.25, None, meta.q_seg[:, -2:].contiguous(),
                             meta.k_seg, meta.k_pos32)]}
# traced calls of other layouts: a padded batch (documents) and a mask with a hole (the general kernels), U or not
for mask in (padded[:, :20], torch.ones(B, 20, dtype=torch.long).index_fill_(1, torch.tensor([7, 8]), 0)):
    meta = LazyMetadata.from_mask(mask, query_length=20, batch_size=B)
    qb, kb, vb = torch.randn(B, H, 20, D), torch.randn(B, HKV, 20, D), torch.randn(B, HKV, 20, D)
    tensors = (meta.q_pos, meta.k_pos, meta.q_seg, meta.k_seg, meta.q_pos32, meta.k_pos32)
    for store in (True, False):
        args = (qb, kb, vb, torch.randn(H), torch.randn(H, W), *tensors, store, 0.25)
        checks.setdefault("triton_traced_attention", []).append(args)
    out, lse, u = torch.ops.lazy_llama.triton_traced_attention(*args[:-2], True, 0.25)
    checks.setdefault("triton_traced_attention_backward", []).append(
        (torch.randn_like(out), *args[:-2], lse, out, u, 0.25))
# a static cache's whole buffer (inference): 20 rows after 6 written keys, 40 slots
past = torch.tensor(6)
meta = LazyMetadata.from_mask(padded, query_length=20, batch_size=B, past_length=past, key_length=40)
tensors = (meta.q_pos, meta.k_pos, meta.q_seg, meta.k_seg, meta.q_pos32, meta.k_pos32)
checks["triton_traced_attention"].append((torch.randn(B, H, 20, D), torch.randn(B, HKV, 40, D),
                                          torch.randn(B, HKV, 40, D), torch.randn(H), torch.randn(H, W), *tensors,
                                          False, 0.25, past))
for name, calls in checks.items():
    for args in calls:
        torch.library.opcheck(getattr(torch.ops.lazy_llama, name).default, args,
                              test_utils=("test_schema", "test_faketensor"))
print("opcheck = ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="the Triton operators need the triton package")
def test_triton_operators_appear_in_traced_graphs(tmp_path):
    """Forward, backward, decode (also a compiled static cache's) and the paged vLLM step trace (fake tensors, no
    kernel runs) to graphs that call the `lazy_llama` Triton operators (a padded batch: the operators that ask for
    documents at run time); `opcheck` holds each operator's fake against its interpreted kernels (shapes, dtypes,
    strides)."""
    script = tmp_path / "trace.py"
    script.write_text(TRITON_TRACE)
    env = {**os.environ, "TRITON_INTERPRET": "1", ops.BACKEND_ENV: "triton", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    found = dict(line.split(" = ") for line in proc.stdout.splitlines() if " = " in line)
    assert found == {
        "forward and backward (causal)": "triton_attention,triton_attention_backward",
        "forward and backward (padded)": "triton_traced_attention,triton_traced_attention_backward",
        "decode": "triton_decode",
        "decode (static cache, compiled)": "triton_decode",
        "prefill (static cache, compiled)": "triton_traced_attention",
        "decode (padded, compiled)": "triton_decode",
        "paged step": "triton_paged",
        "opcheck": "ok",
    }, proc.stdout
