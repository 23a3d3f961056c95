"""Lazy Attention as PyTorch operators (namespace `lazy_llama`), and the one table that picks a kernel.

Every caller (the model's `"lazy"` attention, the vLLM backend, benchmarks, tests) calls `lazy_attention` (a vLLM
step against the paged cache calls `lazy_attention_paged` of lazy_llama_vllm/lazy_attention_paged_op.py).
`choose_kernel` decides from the device, grad mode, query rows, layout, dtype and `LAZY_LLAMA_BACKEND` which kernel
runs; each kernel family is a registered operator, so `torch.compile`, `make_fx` and `torch.export` see one node
per call (no graph break) and run the project's kernels in the compiled program:

    lazy_llama::attention                  the PyTorch path (CPU, or any device without triton); inference picks
                                           its kernel inside (SDPA at tau = 0, the fused C decode, the one-row and
                                           few-row decodes, the chunked prefill); training the chunked forward
    lazy_llama::attention_backward         its recomputing backward
    lazy_llama::triton_attention           Triton forward: the general layout, or (`causal`) the causal fast path,
                                           or (a document table) the causal fast path per document
    lazy_llama::triton_attention_backward  its backward
    lazy_llama::triton_traced_attention    under compile / export, any other layout (training, or > 16 rows): asks
                                           at run time whether it is one of documents (packed, padded rows)
    lazy_llama::triton_traced_attention_backward   its backward
    lazy_llama::triton_decode              Triton packed decode (inference, <= 16 query rows: the causal layout,
                                           left padding from each row's first key, or any layout through the
                                           metadata's segments and positions)
    lazy_llama::triton_paged               one vLLM step (prompts, chunks, decode tokens) against the paged cache,
                                           registered by the vLLM plugin (lazy_llama_vllm's paged module)

The Triton ops are `torch.library.triton_op`s whose launches go through `wrap_triton`: compile and export trace
their bodies (the launch becomes a graph node inductor schedules), and the same body, run on fake tensors, is their
fake implementation. The PyTorch ops and the two `triton_traced_*` ops are `custom_op`s with a `register_fake` (their
bodies, opaque to the tracer, run at run time: a document table needs host syncs). Autograd is registered on the
forward ops (`register_autograd`), the backward being the matching `*_backward` op.

Operators take tensors and scalars only, so a `LazyMetadata` travels as its tensors (`q_pos, k_pos, q_seg, k_seg`)
and its `causal` flag; the key offset is `Tk - Tq` of those tensors, except for a static cache's whole buffer under
torch.compile, where it is a 0-d tensor (`key_offset`): a growing cache changes a tensor's value, not a shape or a
constant, so decoding never recompiles.
"""

import os

import torch

from .lazy_attention_cpu import decode_supported
from .lazy_attention_reference import DECODE_MAX_ROWS, LazyMetadata, _is_causal_layout, environment_setting
from .lazy_attention_torch import (
    _parameter_fact,
    document_table,
    forget_parameter_facts,
    left_padded_documents,
    left_padding,
    softmax_only,
    torch_backward,
    torch_forward,
)

try:
    from .lazy_attention_triton import _backward, _causal_forward, _check_inputs, _forward, _packed_decode
except ImportError:  # triton not installed (CPU-only or Hub users): the PyTorch path serves every device
    _forward = None

BACKEND_ENV = "LAZY_LLAMA_BACKEND"
BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------
# The decision table
# ---------------------------------------------------------------------------------------------------


def requested_backend(backend: str | None = None) -> str:
    """`backend`, or `LAZY_LLAMA_BACKEND` (read at every call) when None: auto | triton | torch; a bad value is
    refused."""
    choice = (environment_setting("BACKEND", "auto") if backend is None else backend).strip().lower()
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} (or LAZY_ATTENTION_BACKEND, or backend=) must be one of auto, triton, torch; "
                         f"got {choice!r}.")
    return choice


def triton_runs_on(device: torch.device) -> bool:
    """True when the Triton kernels can run on `device`: triton installed, and CUDA (or TRITON_INTERPRET=1 set
    before import, which runs them on CPU tensors)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return _forward is not None and (device.type == "cuda" or interpreting)


def uses_triton(device: torch.device, dtype: torch.dtype = torch.float32, backend: str | None = None) -> bool:
    """True when calls on `device` in `dtype` go to the Triton kernels. `backend` (default: `LAZY_LLAMA_BACKEND`)
    `auto`: CUDA and a float16/bfloat16/float32 dtype; `triton`: always, refused where the kernels cannot run;
    `torch`: never."""
    choice = requested_backend(backend)
    if choice == "torch":
        return False
    if choice == "triton":
        if not triton_runs_on(device):
            raise RuntimeError(
                f"{BACKEND_ENV}=triton needs the `triton` package and CUDA tensors (or TRITON_INTERPRET=1 set "
                "before import to run the kernels on CPU). Install triton or set the variable to auto/torch."
            )
        return True
    return device.type == "cuda" and dtype in TRITON_DTYPES and triton_runs_on(device)


def choose_kernel(device: torch.device, dtype: torch.dtype, query_rows: int, batch: int, causal: bool,
                  static_buffer: bool, needs_grad: bool, *, backend: str | None = None, softmax_only: bool = False,
                  native_layout: bool = False, left_padded: bool = False, documents: bool = False,
                  traced: bool = False) -> str:
    """The kernel for one attention call: the whole routing of LazyLlama in one table, read top to bottom.

    Args: the query's device and dtype, query rows `Tq`, batch `B`, the metadata's layout (`causal`;
    `static_buffer`: a static cache's whole buffer under torch.compile), whether a backward follows (`needs_grad`),
    `backend` (None: `LAZY_LLAMA_BACKEND`), and three facts only real tensors give (asked inside the PyTorch op;
    False at trace time): `softmax_only` (tau and the distance bias all zero, and SDPA's causal mask aligned: one
    query row or no cached keys) and `native_layout` (key and value in the query's dtype with contiguous channels,
    the native op's layout: `lazy_attention_cpu.decode_supported`, which also says whether the op is installed),
    `left_padded` (a left-padded batch, each row's real keys one run at its end: `lazy_attention_torch.left_padding`;
    asked for one query row, and for more than 16 in inference) and `documents` (packed documents and/or padded
    rows, each document a causal layout of its own, no cache: `lazy_attention_torch.document_table`), both asked in
    eager calls only, and `traced` (under torch.compile or export, where those facts are unknown when the graph is
    made).

        Triton (uses_triton: LAZY_LLAMA_BACKEND, device, dtype); a static buffer: inference (traced; with Tq > 16
        the operator below cuts it), or training with one query row
          causal, training or Tq > 16                     triton_causal  (the causal fast path; training stores U
                                                                          for its backward; <= 16 rows: the packed
                                                                          decode forward, the general backward)
          documents (packed, padded rows; eager)          triton_documents (the causal fast path per document:
                                                                          work lists of document tiles)
          left-padded after a cache, inference, Tq > 16   triton_left_padded (the same, each row one document
            (eager)                                                       from its first real key)
          traced, not causal, training or Tq > 16         triton_traced  (an operator opaque to the tracer that
            (a static buffer: inference)                                  asks for documents when it runs: the
                                                                          lines above, else the general kernels;
                                                                          a static buffer cut to its written keys
                                                                          first, then also the causal fast path)
          inference, Tq <= 16                             triton_decode  (the packed decode, split-K: causal; Tq = 1
                                                                          left-padded (eager): each row from its
                                                                          first real key; else any layout: a static
                                                                          buffer, masks with holes, segments and
                                                                          positions read per key)
          otherwise (training with a cache, Tq > 16       triton         (the general kernels)
            with holes, or a cache and padding that is
            not left padding)
        PyTorch (lazy_llama::attention)
          training                                        torch_train    (chunked forward, recomputing backward)
          tau = 0 and zero bias, causal, float32/64       torch_sdpa     (scaled_dot_product_attention)
          Tq = 1, causal or left-padded, native op        cpu_decode     (the native decode op; a left-padded
            takes the tensors                                             row starts at its first real key)
          Tq = 1, B = 1, causal                           torch_one_row  (five ops)
          Tq <= 16                                        torch_decode   (one pass, any layout)
          otherwise                                       torch_prefill  (chunked, inference)
    """
    few_rows = query_rows <= DECODE_MAX_ROWS
    if uses_triton(device, dtype, backend) and not (static_buffer and query_rows > 1
                                                    and (needs_grad or not (few_rows or traced))):
        if causal and (needs_grad or not few_rows):
            return "triton_causal"
        if documents and not causal and not static_buffer:
            return "triton_documents"
        if left_padded and not (causal or static_buffer or needs_grad or few_rows):
            return "triton_left_padded"
        if traced and not causal and (needs_grad or not few_rows) and not (static_buffer and needs_grad):
            return "triton_traced"
        return "triton_decode" if few_rows and not needs_grad else "triton"
    if needs_grad:
        return "torch_train"
    plain_row = query_rows == 1 and causal and not static_buffer
    if softmax_only and causal and not static_buffer and dtype in (torch.float32, torch.float64):
        return "torch_sdpa"
    if ((plain_row or (query_rows == 1 and left_padded)) and device.type == "cpu" and native_layout
            and not torch.compiler.is_compiling()):
        return "cpu_decode"
    if plain_row and batch == 1:
        return "torch_one_row"
    return "torch_decode" if query_rows <= DECODE_MAX_ROWS else "torch_prefill"


# ---------------------------------------------------------------------------------------------------
# The PyTorch path as operators (any device; the CPU's kernels)
# ---------------------------------------------------------------------------------------------------


def _concrete_metadata(q_pos, k_pos, q_seg, k_seg, key_offset, causal, training) -> LazyMetadata:
    """The `LazyMetadata` of an operator call, with an int key offset: a static cache's buffer (`key_offset` a 0-d
    tensor) is cut to its written keys, and for inference its layout is checked again, so that the op runs the
    eager kernels (training keeps the general layout: the forward's saved statistics are the general path's)."""
    q_len = q_pos.shape[1]
    if key_offset is None:
        offset = k_pos.shape[1] - q_len
    else:
        offset = int(key_offset)
        k_pos, k_seg = k_pos[:, : offset + q_len], k_seg[:, : offset + q_len]
        causal = not training and _is_causal_layout(q_pos, k_pos, q_seg, k_seg, offset)
    # the PyTorch kernels never read the int32 position copies: the int64 tensors stand in for them (no copy)
    return LazyMetadata.from_tensors(q_pos, k_pos, q_seg, k_seg, key_offset=offset, causal=causal,
                                     positions32=(q_pos, k_pos))


def _torch_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tau: torch.Tensor,
                     distance_bias: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, q_seg: torch.Tensor,
                     k_seg: torch.Tensor, key_offset: torch.Tensor | None, causal: bool, scaling: float,
                     training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out [B, Tq, Hq, D] query dtype, lse [B, Hq, Tq] of the general layout when training, else [0])`."""
    metadata = _concrete_metadata(q_pos, k_pos, q_seg, k_seg, key_offset, causal, training)
    if not training:
        return (_torch_inference(query, key, value, tau, distance_bias, metadata, scaling),
                query.new_empty(0, dtype=torch.float32))
    out, lse = torch_forward("torch_train", query, key, value, tau, distance_bias, metadata, scaling)
    return out.contiguous(), query.new_empty(0, dtype=torch.float32) if lse is None else lse


def _torch_inference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tau: torch.Tensor,
                     distance_bias: torch.Tensor, metadata: LazyMetadata, scaling: float) -> torch.Tensor:
    """`out [B, Tq, Hq, D]` (query dtype, contiguous, as the fake implementation says: the decode kernels give a
    transposed view) of an inference call on the PyTorch path, `metadata` with an int key offset: the body of the
    operator, and what eager calls run without the operator (a decode step pays every microsecond of the way)."""
    key_starts = None
    native = decode_supported(query, key, value)
    if native and query.shape[2] == 1 and not metadata.causal:
        key_starts = left_padding(metadata)
    kernel = choose_kernel(query.device, query.dtype, query.shape[2], query.shape[0], metadata.causal, False, False,
                           backend="torch", softmax_only=softmax_only(query, tau, distance_bias, metadata),
                           native_layout=native, left_padded=key_starts is not None)
    return torch_forward(kernel, query, key, value, tau, distance_bias, metadata, scaling,
                         key_starts=key_starts)[0].contiguous()


def _torch_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              tau: torch.Tensor, distance_bias: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                              q_seg: torch.Tensor, k_seg: torch.Tensor, key_offset: torch.Tensor | None,
                              lse: torch.Tensor, causal: bool, scaling: float
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    metadata = _concrete_metadata(q_pos, k_pos, q_seg, k_seg, key_offset, causal, True)
    grads = torch_backward(grad_out, query, key, value, tau, distance_bias, metadata,
                           None if lse.numel() == 0 and metadata.causal else lse, scaling)
    return _laid_out_as_promised(grads, (query, key, value, tau, distance_bias))


def _laid_out_as_promised(grads, inputs) -> tuple[torch.Tensor, ...]:
    """The backward operators' gradients with the strides their fakes promise (`torch.empty_like` of each input):
    Inductor asserts every output's strides against the fake (a slice such as the bias gradient's first W columns
    would fail that); a copy only where they differ."""
    laid_out = []
    for grad, x in zip(grads, inputs):
        if grad.stride() != torch.empty_like(x, device="meta").stride():
            grad = torch.empty_like(x, dtype=grad.dtype).copy_(grad)
        laid_out.append(grad)
    return tuple(laid_out)


def _torch_attention_fake(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, key_offset, causal,
                          scaling, training):
    bsz, num_heads, q_len, _ = query.shape
    out = query.new_empty(bsz, q_len, num_heads, value.shape[-1])
    general = training and (not causal or key_offset is not None)
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32  # the compute dtype
    return out, query.new_empty((bsz, num_heads, q_len) if general else (0,), dtype=dtype)


def _torch_attention_backward_fake(grad_out, query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg,
                                   key_offset, lse, causal, scaling):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), torch.empty_like(tau),
            torch.empty_like(distance_bias))


def _torch_setup_context(ctx, inputs, output):
    (query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, key_offset, causal, scaling, _) = inputs
    ctx.save_for_backward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, output[1])
    ctx.key_offset, ctx.causal, ctx.scaling = key_offset, causal, scaling


def _torch_autograd(ctx, grad_out, _grad_lse):
    query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse = ctx.saved_tensors
    grads = torch.ops.lazy_llama.attention_backward(grad_out, query, key, value, tau, distance_bias, q_pos, k_pos,
                                                    q_seg, k_seg, ctx.key_offset, lse, ctx.causal, ctx.scaling)
    return (*grads, None, None, None, None, None, None, None, None)


# ---------------------------------------------------------------------------------------------------
# The Triton kernels as operators (CUDA; CPU tensors under TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------------


def _work_lists(documents: torch.Tensor) -> dict:
    """The launchers' work lists of one document table, kept while it lives: every layer of a forward, and their
    backwards, read the same table (`document_table` builds it once per forward), so the lists are built by the
    first call only (18 small device ops each)."""
    return _parameter_fact(documents, "work lists", dict)


def _triton_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tau: torch.Tensor,
                      distance_bias: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, q_seg: torch.Tensor,
                      k_seg: torch.Tensor, causal: bool, store_u: bool, scaling: float,
                      documents: torch.Tensor | None = None, key_starts: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out [B, Tq, Hq, D], lse [B, Hq, Tq] float32, u)`: `causal` (the plain causal layout) runs the causal fast
    path (`u` = its U when `store_u`, for the backward; `tl.dot` needs 16 rows, so <= 16 rows run the packed decode,
    whose backward is the general one), `documents` (`document_table`) the causal fast path per document (its runs of
    padding get zeros), `key_starts` (`left_padding`, inference after a cache) the same with each row one document
    from its first real key, otherwise the general kernel (key offset `Tk - Tq`); u is `[0]` when not stored."""
    if key_starts is not None:
        q_len, k_len = query.shape[2], key.shape[2]
        tables = _parameter_fact(key_starts, ("documents", q_len, k_len),
                                 lambda: left_padded_documents(key_starts, q_len, k_len))
        out, lse, u = _causal_forward(query, key, value, tau, distance_bias, q_pos, scaling,
                                      _check_inputs(query, key), False, tables[0], _work_lists(tables[0]), tables[1])
    elif documents is not None:
        out, lse, u = _causal_forward(query, key, value, tau, distance_bias, q_pos, scaling,
                                      _check_inputs(query, key), store_u, documents, _work_lists(documents))
    elif causal and query.shape[2] > DECODE_MAX_ROWS:
        out, lse, u = _causal_forward(query, key, value, tau, distance_bias, q_pos, scaling,
                                      _check_inputs(query, key), store_u)
    elif causal:
        key_lengths = torch.full((query.shape[0],), key.shape[2], dtype=torch.int32, device=query.device)
        out, lse, u = _packed_decode(query, key, value, tau, distance_bias, q_pos, key_lengths, scaling)
    else:
        out, lse, u = _forward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, scaling)
    return out, lse, lse.new_empty(0) if u is None else u


def _triton_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               tau: torch.Tensor, distance_bias: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                               q_seg: torch.Tensor, k_seg: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                               u: torch.Tensor, causal: bool, scaling: float, documents: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, d_tau, d_bias = _backward(grad_out, query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg,
                                          lse, scaling, causal=causal, out=out, u=u, documents=documents,
                                          work_lists=None if documents is None else _work_lists(documents))
    return _laid_out_as_promised((dq, dk, dv, d_tau.to(tau.dtype), d_bias.to(distance_bias.dtype)),
                                 (query, key, value, tau, distance_bias))


def _triton_setup_context(ctx, inputs, output):
    query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, causal, _, scaling, documents, _ = inputs
    out, lse, u = output
    ctx.save_for_backward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse, out, u, documents)
    ctx.causal, ctx.scaling = causal, scaling


def _triton_autograd(ctx, grad_out, _grad_lse, _grad_u):
    query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse, out, u, documents = ctx.saved_tensors
    grads = torch.ops.lazy_llama.triton_attention_backward(grad_out, query, key, value, tau, distance_bias, q_pos,
                                                           k_pos, q_seg, k_seg, lse, out, u, ctx.causal, ctx.scaling,
                                                           documents)
    return (*grads, None, None, None, None, None, None, None, None, None)


def _run_time_metadata(q_pos, k_pos, q_seg, k_seg) -> LazyMetadata:
    """The `LazyMetadata` of a traced call's metadata tensors (int64 positions), to ask for its layout at run time."""
    return LazyMetadata.from_tensors(q_pos, k_pos, q_seg, k_seg, causal=False, positions32=(q_pos, k_pos))


def _written_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor,
                  k_pos32: torch.Tensor, key_offset: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor, torch.Tensor, bool]:
    """`(k_len, k_pos, k_seg, k_pos32, causal)` of a static cache's buffer cut to its written keys (`key_offset + Tq`,
    one host sync): the layout an eager call of the same tokens sees, and whether it is the plain causal one. Once
    per forward (the metadata tensors are every layer's)."""
    def build():
        k_len = int(key_offset) + q_pos.shape[1]
        cut = [t[:, :k_len].contiguous() for t in (k_pos, k_seg, k_pos32)]
        return k_len, *cut, _is_causal_layout(q_pos, cut[0], q_seg, cut[1], k_len - q_pos.shape[1])

    return _parameter_fact(k_seg, ("written keys", id(q_pos), id(key_offset)), build)


def _triton_traced_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tau: torch.Tensor,
                             distance_bias: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                             q_seg: torch.Tensor, k_seg: torch.Tensor, q_pos32: torch.Tensor, k_pos32: torch.Tensor,
                             store_u: bool, scaling: float, key_offset: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`lazy_llama::triton_attention` of a layout that is not the plain causal one, under torch.compile or export:
    whether the layout is one of documents (packed, padded rows) is a fact of the tensors' values, and its document
    table needs host syncs, so this operator is opaque to the tracer and asks when it runs (the causal fast path per
    document, or in inference a left-padded batch after a cache, else the general kernels). `key_offset` (a 0-d
    tensor; inference only): the keys are a static cache's whole buffer, cut here to the written ones, whose layout
    may then also be the plain causal one (a compiled prefill of one prompt). `u` has the forward's full shape when
    `store_u`, as the fake says (unused, and not written, where the general kernels ran)."""
    causal = False
    if key_offset is not None:
        k_len, k_pos, k_seg, k_pos32, causal = _written_keys(q_pos, k_pos, q_seg, k_seg, k_pos32, key_offset)
        key, value = key.narrow(2, 0, k_len), value.narrow(2, 0, k_len)
    documents = key_starts = None
    if not causal:
        metadata = _run_time_metadata(q_pos, k_pos, q_seg, k_seg)
        documents = document_table(metadata)
        if documents is None and not store_u and query.shape[2] > DECODE_MAX_ROWS:
            key_starts = left_padding(metadata)
    out, lse, u = _triton_attention(query, key, value, tau, distance_bias, q_pos32, k_pos32, q_seg, k_seg, causal,
                                    store_u, scaling, documents, key_starts)
    if store_u and documents is None:
        u = query.new_empty(out.shape)
    return out, lse, u


def _triton_traced_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                      value: torch.Tensor, tau: torch.Tensor, distance_bias: torch.Tensor,
                                      q_pos: torch.Tensor, k_pos: torch.Tensor, q_seg: torch.Tensor,
                                      k_seg: torch.Tensor, q_pos32: torch.Tensor, k_pos32: torch.Tensor,
                                      lse: torch.Tensor, out: torch.Tensor, u: torch.Tensor, scaling: float
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _triton_attention_backward(grad_out, query, key, value, tau, distance_bias, q_pos32, k_pos32, q_seg, k_seg,
                                      lse, out, u, False, scaling,
                                      document_table(_run_time_metadata(q_pos, k_pos, q_seg, k_seg)))


def _triton_traced_setup_context(ctx, inputs, output):
    query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, q_pos32, k_pos32, _, scaling, key_offset = inputs
    if key_offset is not None:
        raise NotImplementedError("lazy_llama::triton_traced_attention: a static cache's buffer is for inference only.")
    out, lse, u = output
    ctx.save_for_backward(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, q_pos32, k_pos32, lse,
                          out, u)
    ctx.scaling = scaling


def _triton_traced_autograd(ctx, grad_out, _grad_lse, _grad_u):
    grads = torch.ops.lazy_llama.triton_traced_attention_backward(grad_out, *ctx.saved_tensors, ctx.scaling)
    return (*grads, None, None, None, None, None, None, None, None, None)


def _triton_traced_attention_fake(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, q_pos32, k_pos32,
                                  store_u, scaling, key_offset=None):
    bsz, num_heads, q_len, dim = query.shape
    f32 = dict(dtype=torch.float32, device=query.device)
    u = query.new_empty(bsz, q_len, num_heads, dim) if store_u else torch.empty(0, **f32)
    return query.new_empty(bsz, q_len, num_heads, dim), torch.empty(bsz, num_heads, q_len, **f32), u


def _triton_traced_attention_backward_fake(grad_out, query, key, value, tau, distance_bias, *_):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), torch.empty_like(tau),
            torch.empty_like(distance_bias))


def _triton_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tau: torch.Tensor,
                   distance_bias: torch.Tensor, q_pos: torch.Tensor, key_lengths: torch.Tensor, scaling: float,
                   key_starts: torch.Tensor | None = None, q_seg: torch.Tensor | None = None,
                   k_seg: torch.Tensor | None = None, k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """`out [B, Tq, Hq, D]`: query row t of batch row b stands at key index `key_lengths[b] - Tq + t`; with
    `key_starts`, batch row b's keys start at `key_starts[b]` (left padding); with the metadata's `q_seg`, `k_seg`
    and int32 `k_pos`, any layout (visibility by segment, distances by position)."""
    key_mask = None if q_seg is None else (q_seg, k_seg, k_pos)
    return _packed_decode(query, key, value, tau, distance_bias, q_pos, key_lengths, scaling, key_starts=key_starts,
                          need_lse=False, key_mask=key_mask).out


def _key_lengths(metadata: LazyMetadata, batch: int, k_len: int, device: torch.device) -> torch.Tensor:
    """`[B]` int32 filled with `k_len`, built once per forward (every layer's decode reads the same); for a static
    cache's buffer, its written length `key_offset + Tq` (a tensor: no host sync)."""
    if metadata.static_buffer:
        written = metadata.key_offset + metadata.q_pos.shape[1]
        return written.to(device=device, dtype=torch.int32).reshape(1).expand(batch).contiguous()
    build = lambda: torch.full((batch,), k_len, dtype=torch.int32, device=device)  # noqa: E731
    if _tracing(metadata.k_pos):
        return build()
    return _parameter_fact(metadata.k_pos, ("key_lengths", batch, k_len), build)


def _triton_attention_fake(query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, causal, store_u,
                           scaling, documents=None, key_starts=None):
    bsz, num_heads, q_len, dim = query.shape
    f32 = dict(dtype=torch.float32, device=query.device)
    fast = documents is not None or (causal and q_len > DECODE_MAX_ROWS)
    u = query.new_empty(bsz, q_len, num_heads, dim) if store_u and fast else torch.empty(0, **f32)  # U: as out
    return query.new_empty(bsz, q_len, num_heads, dim), torch.empty(bsz, num_heads, q_len, **f32), u


def _triton_attention_backward_fake(grad_out, query, key, value, tau, distance_bias, q_pos, k_pos, q_seg, k_seg, lse,
                                    out, u, causal, scaling, documents=None):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), torch.empty_like(tau),
            torch.empty_like(distance_bias))


def _triton_decode_fake(query, key, value, tau, distance_bias, q_pos, key_lengths, scaling, key_starts=None,
                        q_seg=None, k_seg=None, k_pos=None):
    bsz, num_heads, q_len, dim = query.shape
    return query.new_empty(bsz, q_len, num_heads, dim)


def _registered(name: str) -> bool:
    """True when `lazy_llama::<name>` exists already: the installed package and a checkpoint's flat copy of these
    files (trust_remote_code) share the operator registry, and the first one to load registers."""
    return hasattr(torch.ops.lazy_llama, name)


def _register() -> None:
    if not _registered("attention"):
        op = torch.library.custom_op("lazy_llama::attention", _torch_attention, mutates_args=())
        op.register_fake(_torch_attention_fake)
        backward = torch.library.custom_op("lazy_llama::attention_backward", _torch_attention_backward,
                                           mutates_args=())
        backward.register_fake(_torch_attention_backward_fake)
        op.register_autograd(_torch_autograd, setup_context=_torch_setup_context)
    if _forward is not None and not _registered("triton_attention"):
        for name, launch, fake in (("triton_attention", _triton_attention, _triton_attention_fake),
                                   ("triton_attention_backward", _triton_attention_backward,
                                    _triton_attention_backward_fake),
                                   ("triton_decode", _triton_decode, _triton_decode_fake)):
            # a fake of its own: the launchers' bodies can run on fake tensors only where `wrap_triton` traces
            # (not under TRITON_INTERPRET=1, which launches at once)
            torch.library.triton_op(f"lazy_llama::{name}", launch, mutates_args=()).register_fake(fake)
        torch.library.register_autograd("lazy_llama::triton_attention", _triton_autograd,
                                        setup_context=_triton_setup_context)
    if _forward is not None and not _registered("triton_traced_attention"):
        # plain custom ops (opaque to compile: the body runs at run time, host syncs and all); marked unsafe for CUDA
        # graphs, which cannot capture a host sync
        for name, body, fake in (("triton_traced_attention", _triton_traced_attention, _triton_traced_attention_fake),
                                 ("triton_traced_attention_backward", _triton_traced_attention_backward,
                                  _triton_traced_attention_backward_fake)):
            torch.library.custom_op(f"lazy_llama::{name}", body, mutates_args=(),
                                    tags=(torch.Tag.cudagraph_unsafe,)).register_fake(fake)
        torch.library.register_autograd("lazy_llama::triton_traced_attention", _triton_traced_autograd,
                                        setup_context=_triton_traced_setup_context)


_register()


# ---------------------------------------------------------------------------------------------------
# The public entry points
# ---------------------------------------------------------------------------------------------------


def _tracing(query: torch.Tensor) -> bool:
    """True under torch.compile / export / make_fx (or with fake tensors): calls must be operators then."""
    return (torch.compiler.is_compiling() or type(query) not in (torch.Tensor, torch.nn.Parameter)
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None)


def lazy_attention(query, key, value, tau, distance_bias, metadata: LazyMetadata, scaling, backend: str | None = None):
    """Lazy Attention through the op layer: `out [B, Tq, Hq, D]` in the query dtype, differentiable in query, key,
    value, tau and distance_bias.

    Args:
        query: `[B, Hq, Tq, D]`; key, value: `[B, Hkv, >= Tk, D]` (a static cache may hand over its whole buffer).
        tau: `[Hq]`; distance_bias: `[Hq, W]`; metadata: the call's `LazyMetadata`; scaling: the score scale.
        backend: None (read `LAZY_LLAMA_BACKEND`), or `"triton"` / `"torch"` to force one for this call.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, tau, distance_bias))
    traced = _tracing(query)
    kernel = choose_kernel(query.device, query.dtype, query.shape[2], query.shape[0], metadata.causal,
                           metadata.static_buffer, needs_grad, backend=backend, traced=traced)
    documents = key_starts = None
    if (kernel in ("triton", "triton_decode") and not metadata.causal and not metadata.static_buffer
            and not traced):  # facts only real tensors give (a few host syncs per forward)
        documents = document_table(metadata) if kernel == "triton" else None
        if documents is None and (query.shape[2] == 1 or query.shape[2] > DECODE_MAX_ROWS) and not needs_grad:
            key_starts = left_padding(metadata)  # one row: the packed decode; more: the per-document path
        kernel = choose_kernel(query.device, query.dtype, query.shape[2], query.shape[0], metadata.causal,
                               metadata.static_buffer, needs_grad, backend=backend, documents=documents is not None,
                               left_padded=key_starts is not None)
    scaling = float(scaling)
    if kernel.startswith("torch"):
        key_offset = metadata.key_offset if metadata.static_buffer else None
        if not needs_grad and not traced:  # eager inference: the op's body without the dispatcher's cost
            if metadata.static_buffer:  # cut to the written keys (the model's metadata serves every other call)
                metadata = _concrete_metadata(metadata.q_pos, metadata.k_pos, metadata.q_seg, metadata.k_seg,
                                              key_offset, metadata.causal, False)
            return _torch_inference(query, key, value, tau, distance_bias, metadata, scaling)
        return torch.ops.lazy_llama.attention(query, key, value, tau, distance_bias, metadata.q_pos, metadata.k_pos,
                                              metadata.q_seg, metadata.k_seg, key_offset, metadata.causal, scaling,
                                              needs_grad)[0]
    if not metadata.static_buffer and key.shape[2] != metadata.key_length:  # the kernels take the key offset
        k_len = metadata.key_length                                            # from the shapes (Tk - Tq)
        key, value = key.narrow(2, 0, k_len), value.narrow(2, 0, k_len)
    q_pos, k_pos = metadata.q_pos32, metadata.k_pos32
    if kernel == "triton_left_padded":
        return torch.ops.lazy_llama.triton_attention(query, key, value, tau, distance_bias, q_pos, k_pos,
                                                     metadata.q_seg, metadata.k_seg, False, False, scaling, None,
                                                     key_starts)[0]
    if kernel == "triton_traced":
        return torch.ops.lazy_llama.triton_traced_attention(query, key, value, tau, distance_bias, metadata.q_pos,
                                                            metadata.k_pos, metadata.q_seg, metadata.k_seg, q_pos,
                                                            k_pos, needs_grad, scaling,
                                                            metadata.key_offset if metadata.static_buffer else None)[0]
    if kernel == "triton_decode":
        if metadata.causal or key_starts is not None:
            return torch.ops.lazy_llama.triton_decode(
                query, key, value, tau, distance_bias, q_pos,
                _key_lengths(metadata, query.shape[0], key.shape[2], query.device), scaling, key_starts)
        return torch.ops.lazy_llama.triton_decode(query, key, value, tau, distance_bias, q_pos,
                                                  _key_lengths(metadata, query.shape[0], key.shape[2], query.device),
                                                  scaling, None, metadata.q_seg, metadata.k_seg, k_pos)
    return torch.ops.lazy_llama.triton_attention(query, key, value, tau, distance_bias, q_pos, k_pos, metadata.q_seg,
                                                 metadata.k_seg, kernel == "triton_causal", needs_grad, scaling,
                                                 documents)[0]


__all__ = ["BACKEND_ENV", "choose_kernel", "forget_parameter_facts", "lazy_attention", "uses_triton"]
