"""The inference decode path of the CPU op (a few query rows, dense and sparse value reads) against the
materialising reference: causal and padded layouts, GQA, caches shorter and longer than the bias window,
tau of both signs, static-cache buffers, and rows without a normaliser."""

import pytest
import torch

from modeling_lazy import lazy_attention_reference as ref
from modeling_lazy import lazy_attention_torch as ops
from modeling_lazy.lazy_attention_cpu import available as cpu_ops_available

CPU = torch.device("cpu")
TAUS = {"zero": 0.0, "negative": -1.0, "mixed": [-1.5, 0.7, 0.0, -0.3, -2.0, 0.4]}
SHAPES = {  # (heads, kv_heads, q_len, past, window)
    "one-row-gqa-long-cache": (6, 2, 1, 300, 64),
    "one-row-cache-inside-window": (4, 2, 1, 20, 64),
    "one-row-mha": (3, 3, 1, 150, 32),
    "few-rows-gqa": (6, 3, 5, 200, 48),
    "few-rows-cache-inside-window": (4, 1, 16, 10, 64),
    "few-rows-no-cache": (4, 2, 12, 0, 64),
}
V_READS = {  # forced crossovers so that both value reads of the PyTorch path run at these small sizes; the native
    # CPU op (`lazy_attention_cpu`, one row per sequence in the causal layout) always reads only needed rows
    "dense-v": {"_SPARSE_V_MIN_KEYS": 1 << 30},
    "sparse-v": {"_SPARSE_V_MIN_KEYS": 0, "_SPARSE_V_MAX_DENSITY": 1.0},
    "c-kernel": {},
}


def _use(v_read, monkeypatch):
    """Select the decode implementation: a PyTorch value read (native op off) or the native op (which must be built)."""
    for name, value in V_READS[v_read].items():
        monkeypatch.setattr(ops, name, value)
    if v_read == "c-kernel":
        assert cpu_ops_available(), "the native CPU op is not built: run `python setup.py build_ext --inplace`"
    else:
        monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", "0")


def _tau(kind, heads):
    value = TAUS[kind]
    return torch.tensor(value[:heads] if isinstance(value, list) else [value] * heads, dtype=torch.float32)


def _metadata(layout, bsz, past, q_len):
    if layout == "causal":
        return ref.LazyMetadata.from_mask(query_length=q_len, batch_size=bsz, past_length=past, device=CPU)
    mask = torch.ones(bsz, past + q_len, dtype=torch.long)
    mask[0, : past // 2 + 1] = 0  # left padding of row 0 (general layout)
    if bsz > 2:
        mask[2, : past + q_len - 1] = 0  # a row that is almost all padding: its queries see 1 key or none
    return ref.LazyMetadata.from_mask(mask, query_length=q_len, batch_size=bsz, past_length=past, device=CPU)


@pytest.mark.parametrize("v_read", list(V_READS))
@pytest.mark.parametrize("tau_kind", list(TAUS))
@pytest.mark.parametrize("layout", ["causal", "padded"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("bsz", [1, 3])  # one sequence and one row: the one-row path of plain generation
def test_decode_matches_reference(bsz, shape, layout, tau_kind, v_read, rng_seed, monkeypatch):
    _use(v_read, monkeypatch)
    heads, kv_heads, q_len, past, window = SHAPES[shape]
    dim = 16
    meta = _metadata(layout, bsz, past, q_len)
    q = torch.randn(bsz, heads, q_len, dim) * 3  # peaked rows: with tau < 0 most weights are 0
    k = torch.randn(bsz, kv_heads, past + q_len, dim)
    v = torch.randn(bsz, kv_heads, past + q_len, dim)
    tau, bias = _tau(tau_kind, heads), torch.randn(heads, window) * 0.5
    want, weights = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    with torch.no_grad():
        got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
    valid = meta.q_seg >= 0
    assert got.shape == want.shape and torch.isfinite(got).all(), f"seed {rng_seed}"
    torch.testing.assert_close(got[valid], want[valid], atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")
    if tau_kind == "negative":  # the sparse read really skips rows here
        assert (weights[valid[:, None, :].expand_as(weights[..., 0])] == 0).float().mean() > 0.5


@pytest.mark.parametrize("v_read", list(V_READS))
def test_decode_reads_only_the_attended_keys_of_a_static_buffer(v_read, rng_seed, monkeypatch):
    """A static cache hands over its whole (partly unwritten, possibly strided) buffer."""
    _use(v_read, monkeypatch)
    bsz, heads, kv_heads, past, dim = 2, 4, 2, 40, 16
    meta = ref.LazyMetadata.from_mask(query_length=1, batch_size=bsz, past_length=past, device=CPU)
    q = torch.randn(bsz, heads, 1, dim) * 3
    kv = torch.randn(2, bsz, kv_heads, 64, dim)
    kv[:, :, :, past + 1 :] = float("nan")  # unwritten slots must never be read into the result
    k_strided = torch.randn(bsz, 64, kv_heads, dim).transpose(1, 2)  # not contiguous: the gather fallback
    k_strided[:, :, : past + 1] = kv[0, :, :, : past + 1]
    v_strided = torch.full((bsz, 64, kv_heads, dim), float("nan")).transpose(1, 2)
    v_strided[:, :, : past + 1] = kv[1, :, :, : past + 1]
    tau, bias = _tau("mixed", heads), torch.randn(heads, 8)
    want, _ = ref.lazy_attention_reference(q, kv[0, :, :, : past + 1], kv[1, :, :, : past + 1], tau, bias, meta,
                                           dim**-0.5)
    with torch.no_grad():
        for k_buf, v_buf in ((kv[0], kv[1]), (k_strided, v_strided)):
            got = ops.lazy_attention_torch(q, k_buf, v_buf, tau, bias, meta, dim**-0.5)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")


@pytest.mark.parametrize("v_read", list(V_READS))
@pytest.mark.parametrize("tau_value", [-0.5, 0.0, 0.7])
def test_decode_rows_without_a_normaliser_give_zero(tau_value, v_read, rng_seed, monkeypatch):
    _use(v_read, monkeypatch)
    bsz, heads, past, q_len, dim = 2, 2, 1, 4, 8
    meta = ref.LazyMetadata.from_mask(query_length=q_len, batch_size=bsz, past_length=past, device=CPU)
    q, k, v = torch.randn(bsz, heads, q_len, dim), *torch.randn(2, bsz, 1, past + q_len, dim)
    tau, bias = _tau("zero", heads) + tau_value, torch.randn(heads, 8)
    bias[0, :3] = float("-inf")  # head 0: the rows at positions 0..2 see only -inf scores
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    with torch.no_grad():
        got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
    assert torch.isfinite(got).all() and (got[:, :2, 0] == 0).all(), f"seed {rng_seed}"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")


@pytest.mark.parametrize("v_read", list(V_READS))
@pytest.mark.parametrize("layout", ["causal", "padded"])
def test_a_nan_in_a_visible_key_makes_its_rows_nan_as_in_the_reference(layout, v_read, rng_seed, monkeypatch):
    """A NaN score is not a row without a normaliser (all scores -inf, output 0): the rows that see the NaN key
    stay NaN, as in the reference (a float16 overflow is not hidden); the other rows are unaffected."""
    _use(v_read, monkeypatch)
    bsz, heads, kv_heads, q_len, past, dim = 3, 4, 2, 3, 12, 8
    meta = _metadata(layout, bsz, past, q_len)
    q = torch.randn(bsz, heads, q_len, dim)
    k, v = torch.randn(bsz, kv_heads, past + q_len, dim), torch.randn(bsz, kv_heads, past + q_len, dim)
    k[1, 0, past] = float("nan")  # row 1, key/value head 0: seen by its query heads 0 and 1
    tau, bias = _tau("mixed", heads), torch.randn(heads, 8)
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    with torch.no_grad():
        got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
    assert torch.equal(got.isnan(), want.isnan()) and got[1, :, :2].isnan().all(), f"seed {rng_seed}"
    valid = (meta.q_seg >= 0)[..., None, None].expand_as(got) & ~want.isnan()
    torch.testing.assert_close(got[valid], want[valid], atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
def test_decode_other_dtypes(dtype, rng_seed, monkeypatch):
    monkeypatch.setattr(ops, "_SPARSE_V_MIN_KEYS", 0)
    bsz, heads, kv_heads, past, dim = 2, 4, 2, 70, 16
    meta = ref.LazyMetadata.from_mask(query_length=1, batch_size=bsz, past_length=past, device=CPU)
    q = (torch.randn(bsz, heads, 1, dim) * 3).to(dtype)
    k, v = (torch.randn(bsz, kv_heads, past + 1, dim).to(dtype) for _ in range(2))
    tau, bias = _tau("negative", heads), torch.randn(heads, 16)
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    with torch.no_grad():
        got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
    assert got.dtype == dtype
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-12, "rtol": 1e-10}
    torch.testing.assert_close(got, want, **tol, msg=f"seed {rng_seed}")


def test_training_never_takes_the_decode_path(rng_seed, monkeypatch):
    """With gradients wanted, one query row still runs the differentiable operator (and its gradients are right)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the decode path is inference-only")

    monkeypatch.setattr(ops, "_decode_forward", refuse)
    monkeypatch.setattr(ops, "_one_row_decode", refuse)
    monkeypatch.setattr(ops, "_kernel_decode", refuse)
    bsz, heads, past, dim = 1, 4, 30, 8
    meta = ref.LazyMetadata.from_mask(query_length=1, batch_size=bsz, past_length=past, device=CPU)
    q = torch.randn(bsz, heads, 1, dim, requires_grad=True)
    k, v = (torch.randn(bsz, 2, past + 1, dim, requires_grad=True) for _ in range(2))
    tau, bias = _tau("mixed", heads).requires_grad_(), torch.randn(heads, 8, requires_grad=True)
    got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")
    grads = torch.autograd.grad(got.sum(), [q, k, v, tau, bias])
    want_grads = torch.autograd.grad(want.sum(), [q, k, v, tau, bias])
    for name, a, b in zip(["q", "k", "v", "tau", "bias"], grads, want_grads):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=f"d{name}, seed {rng_seed}")


@pytest.mark.parametrize("v_read", list(V_READS))
def test_decode_with_every_weight_zero(v_read, rng_seed, monkeypatch):
    """tau far below 0 leaves no key weighted: the sparse read gathers no row and the output is 0."""
    _use(v_read, monkeypatch)
    bsz, heads, past, dim = 2, 4, 50, 8
    meta = ref.LazyMetadata.from_mask(query_length=1, batch_size=bsz, past_length=past, device=CPU)
    q, k, v = torch.randn(bsz, heads, 1, dim), *torch.randn(2, bsz, 2, past + 1, dim)
    tau, bias = torch.full((heads,), -1e3), torch.randn(heads, 8)
    with torch.no_grad():
        got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    assert (want == 0).all() and (got == 0).all(), f"seed {rng_seed}"


@pytest.mark.parametrize("positions", [False, True], ids=["no-position-ids", "position-ids"])
@pytest.mark.parametrize("past", [0, 7])
def test_all_ones_mask_gives_the_no_mask_metadata(past, positions):
    q_len, bsz = 3, 2
    position_ids = torch.arange(past, past + q_len)[None] if positions else None
    plain = ref.LazyMetadata.from_mask(None, position_ids, query_length=q_len, batch_size=bsz, past_length=past)
    ones = ref.LazyMetadata.from_mask(torch.ones(bsz, past + q_len, dtype=torch.long), position_ids, query_length=q_len,
                                      past_length=past)
    assert ones.causal and plain.causal
    for name, a, b in zip(plain._fields, plain, ones):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
    shifted = ref.LazyMetadata.from_mask(None, position_ids + 1, query_length=q_len, batch_size=bsz,
                                         past_length=past) if positions else None
    assert shifted is None or shifted.causal == (past == 0)  # a cache at 0 .. past - 1 must be continued


@pytest.mark.parametrize("path", ["_kernel_decode", "_one_row_decode"])
def test_generate_with_an_all_ones_mask_decodes_in_the_causal_layout(path, monkeypatch, rng_seed):
    """What generate() passes without padding (a 2-D mask of ones, positions) must take the causal decode path:
    the native op, or with it switched off the PyTorch one-row path."""
    from tests.conftest import tiny_model

    _use("c-kernel" if path == "_kernel_decode" else "dense-v", monkeypatch)
    seen = []
    taken = getattr(ops, path)

    def spy(*args):
        seen.append(next(a for a in args if isinstance(a, ref.LazyMetadata)).causal)
        return taken(*args)

    monkeypatch.setattr(ops, path, spy)  # taken only in the causal layout
    model = tiny_model(seed=rng_seed, attn_implementation="lazy")
    ids = torch.randint(3, 97, (1, 20))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert len(seen) == 3 * model.config.num_hidden_layers and all(seen), seen


@pytest.mark.parametrize("layout", ["causal", "padded"])
def test_decode_traces_as_one_graph(layout, rng_seed):
    """Under torch.compile the decode path has no host sync (the sparse read, which needs one, is skipped)."""
    bsz, heads, dim = 2, 4, 8
    past = ops._SPARSE_V_MIN_KEYS + 10
    meta = _metadata(layout, bsz, past, 1)
    q, k, v = torch.randn(bsz, heads, 1, dim) * 3, *torch.randn(2, bsz, 2, past + 1, dim)
    tau, bias = _tau("mixed", heads), torch.randn(heads, 8)
    compiled = torch.compile(lambda *args: ops.lazy_attention_torch(*args, meta, dim**-0.5), backend="eager",
                             fullgraph=True)
    with torch.no_grad():
        got = compiled(q, k, v, tau, bias)
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    valid = meta.q_seg >= 0
    torch.testing.assert_close(got[valid], want[valid], atol=2e-5, rtol=1e-4, msg=f"seed {rng_seed}")


@pytest.mark.parametrize("q_len, past", [(1, 40), (9, 0), (1, 0)], ids=["decode", "prefill", "first-token"])
def test_tau_zero_and_zero_bias_is_softmax_attention_through_sdpa(q_len, past, rng_seed, monkeypatch):
    """A checkpoint converted at tau = 0 (zero bias) is plain causal softmax attention: SDPA computes it, exactly."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    heads, kv_heads, dim = 6, 2, 16
    meta = ref.LazyMetadata.from_mask(query_length=q_len, batch_size=1, past_length=past, device=CPU)
    q = torch.randn(1, heads, q_len, dim, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, past + q_len, dim, dtype=torch.float64) for _ in range(2))
    tau, bias = torch.zeros(heads), torch.zeros(heads, 16)
    want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
    with torch.no_grad():
        got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
        assert calls, "the SDPA route was not taken"
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10, msg=f"seed {rng_seed}")
        calls.clear()
        tau[1] = -0.25  # one head with a nonzero tau, changed in place: no longer softmax attention
        want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
        got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
        assert not calls, "tau != 0 must not take the SDPA route"
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10, msg=f"seed {rng_seed}")


def test_cached_bias_facts_follow_in_place_updates_and_longer_caches(rng_seed):
    """The one-row path keeps a reversed copy of the bias per parameter: an in-place update (optimizer step,
    load_state_dict) must be seen at once, and a cache longer than the copy's capacity must grow it."""
    heads, kv_heads, dim, window = 4, 2, 16, 40
    tau, bias = _tau("negative", heads), torch.randn(heads, window)
    with torch.no_grad():
        for past in (5, 30, 1500, 3000, 30):  # 1500 and 3000 exceed the first capacity (1024), then double it
            for update in range(2):
                meta = ref.LazyMetadata.from_mask(query_length=1, batch_size=1, past_length=past, device=CPU)
                q = torch.randn(1, heads, 1, dim) * 3
                k, v = (torch.randn(1, kv_heads, past + 1, dim) for _ in range(2))
                want, _ = ref.lazy_attention_reference(q, k, v, tau, bias, meta, dim**-0.5)
                got = ops.lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"past {past}, seed {rng_seed}")
                bias.mul_(1.5).add_(0.25)  # in place: same tensor, new values (-inf stays -inf)
                if update == 0:
                    bias[1, :3] = float("-inf")  # -inf appears: rows that see only these distances give 0


def test_inference_mode_runs_and_sees_in_place_updates(rng_seed):
    """Under `torch.inference_mode()` every tensor a call makes (positions, masks, caches) is an inference tensor, and
    so is every parameter of a model built or loaded there: such tensors have no version counter to stamp a cached
    fact with. An ordinary model's `generate()` of a left-padded batch, and a model of inference tensors, run there
    (nothing is cached for inference tensors) and give what the same weights give under `no_grad`, also after the
    bias changes in place inside inference mode."""
    from tests.conftest import tiny_model

    model = tiny_model(seed=rng_seed, attn_implementation="lazy")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.tau.normal_(-0.5, 0.5)
    ids = torch.randint(3, 97, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        padded = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.inference_mode():
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                          do_sample=False), padded)
        twin = tiny_model(attn_implementation="lazy")
        twin.load_state_dict(model.state_dict())
        assert twin.model.layers[0].self_attn.distance_bias.is_inference()
        for step in range(2):
            with torch.no_grad():
                want = model(ids).logits
                want_tokens = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            torch.testing.assert_close(twin(ids).logits, want, atol=1e-5, rtol=1e-5,
                                       msg=f"step {step}, seed {rng_seed}")
            assert torch.equal(twin.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False), want_tokens)
            for mine, theirs in zip(twin.model.layers, model.model.layers):  # the same change to both, in place
                mine.self_attn.distance_bias.mul_(-3.0).add_(0.5)
                with torch.no_grad():
                    theirs.self_attn.distance_bias.mul_(-3.0).add_(0.5)


def test_left_padded_batched_generate_decodes_with_the_native_op(monkeypatch, rng_seed):
    """Batched `generate()` with left padding: every decode step of every layer runs the native op with per-row key
    starts, and each row generates what its prompt generates alone (Elastic-Softmax's n_i follows the positions)."""
    from tests.conftest import tiny_model

    _use("c-kernel", monkeypatch)
    seen = []
    taken = ops._kernel_decode
    monkeypatch.setattr(ops, "_kernel_decode", lambda *args: seen.append(args[-1]) or taken(*args))
    model = tiny_model(seed=rng_seed, attn_implementation="lazy")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.tau.normal_(-0.5, 0.5)
        prompts = [torch.randint(3, 97, (n,)) for n in (9, 4, 7)]
        ids = torch.zeros(3, 9, dtype=torch.long)
        mask = torch.zeros(3, 9, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, 9 - len(p):], mask[b, 9 - len(p):] = p, 1
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        assert len(seen) == 4 * model.config.num_hidden_layers, len(seen)
        assert all(s is not None and s.tolist() == [0, 5, 2] for s in seen), seen[0]
        monkeypatch.setenv("LAZY_LLAMA_CPU_KERNEL", "0")
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=5,
                                   min_new_tokens=5, do_sample=False)
            assert torch.equal(batched[b, 9:], alone[0, len(p):]), f"row {b}, seed {rng_seed}"


def test_left_padding_is_recognised_only_where_it_holds():
    """`left_padding` gives per-row key starts only when each row's real keys are one run at the end, at the positions
    they would have alone, also for several query rows (a prefill after a cache, its padding possibly ending among
    the queries); a hole in the mask or explicit shifted positions give None."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    meta = ref.LazyMetadata.from_mask(mask, query_length=1, past_length=4)
    assert ops.left_padding(meta).tolist() == [2, 0]
    hole = ref.LazyMetadata.from_mask(torch.tensor([[1, 0, 1, 1, 1]]), query_length=1, past_length=4)
    assert ops.left_padding(hole) is None
    shifted = ref.LazyMetadata.from_mask(mask, torch.tensor([[7], [4]]), query_length=1, past_length=4)
    assert ops.left_padding(shifted) is None
    rows = ref.LazyMetadata.from_mask(mask, query_length=2, past_length=3)
    assert ops.left_padding(rows).tolist() == [2, 0]
    into_queries = ref.LazyMetadata.from_mask(torch.tensor([[0, 0, 0, 0, 1], [0, 1, 1, 1, 1]]), query_length=3,
                                              past_length=2)
    assert ops.left_padding(into_queries).tolist() == [4, 1]
    all_padding = torch.tensor([[0, 0, 0, 0, 0], [0, 1, 1, 1, 1]])  # a short prompt's row, padding so far
    assert ops.left_padding(ref.LazyMetadata.from_mask(all_padding, query_length=3, past_length=2)).tolist() == [5, 1]
    assert ops.left_padding(ref.LazyMetadata.from_mask(all_padding, query_length=1, past_length=4)) is None
    hole_rows = ref.LazyMetadata.from_mask(torch.tensor([[1, 1, 0, 1, 1]]), query_length=3, past_length=2)
    assert ops.left_padding(hole_rows) is None
    packed = ref.LazyMetadata.from_mask(None, torch.tensor([[0, 1, 0, 1, 2]]), query_length=5)
    assert ops.left_padding(packed) is None
