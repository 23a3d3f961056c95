"""GPU check of the causal training forward's U (`U_i = sum_j m_ij v_j`, the backward's Delta and d tau read it):
U, O and d tau of the causal fast path against float32 references, per block configuration (the shipped one, the
other GPU family's, one pipeline stage), at tau = 0.5, 0 and -1. Prints one line per case; run on a CUDA GPU."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: TRITON_INTERPRET=1 --smoke only

import modeling_lazy.lazy_attention_triton_common as common  # noqa: E402
from modeling_lazy.lazy_attention_reference import LazyMetadata, lazy_attention_reference  # noqa: E402
from modeling_lazy.lazy_attention_triton_backward import _causal_backward  # noqa: E402
from modeling_lazy.lazy_attention_triton_forward import _causal_forward  # noqa: E402


def relative(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def case(bsz, heads, length, dim, tau_value, label):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(bsz, heads, length, dim, generator=gen).to(DEVICE).bfloat16() for _ in range(3))
    tau = torch.full((heads,), tau_value, device=DEVICE)
    bias = (1e-3 * torch.randn(heads, 256, generator=gen)).to(DEVICE)
    scaling = dim**-0.5
    q_pos = torch.arange(length, device=DEVICE, dtype=torch.int32).expand(bsz, length).contiguous()
    res = _causal_forward(q, k, v, tau, bias, q_pos, scaling, common._check_inputs(q, k), store_u=True)
    meta = LazyMetadata.from_mask(query_length=length, batch_size=bsz, device=DEVICE)
    out_ref, w = lazy_attention_reference(q.float(), k.float(), v.float(), tau, bias, meta, scaling)
    u_ref = ((w > 0).float() @ v.float()).transpose(1, 2)
    row_err = (res.u - u_ref).abs().amax(-1)  # [B, Tq, H]
    bad = (row_err > 1e-2 * u_ref.abs().amax()).nonzero()
    grad = torch.randn(bsz, length, heads, dim, generator=gen).to(DEVICE).bfloat16()
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    q_seg = torch.zeros_like(q_pos)
    back = _causal_backward(grad, q, k, v, dq, dk, dv, tau, bias, q_pos, q_seg, res.lse, scaling,
                            common._check_inputs(q, k), res.out, res.u)
    leaves = [x.float().requires_grad_() for x in (q, k, v)] + [tau.clone().requires_grad_()]
    ref, _ = lazy_attention_reference(*leaves, bias, meta, scaling)
    ref.backward(grad.float())
    print(f"{label:>14} D{dim} tau {tau_value:+.1f}: out {relative(res.out, out_ref):.1e}  "
          f"U {relative(res.u, u_ref):.1e}  rows with a wrong U {len(bad)} (first {bad[:3].tolist()})  "
          f"dtau {relative(back.d_tau, leaves[3].grad):.1e}  dq {relative(dq, leaves[0].grad):.1e}", flush=True)


def compile_probe():
    """torch.compile (aot_eager) of one Lazy Attention call and its backward on the GPU, with gradients asked of
    different inputs: which leaf, if any, the traced graph claims to mutate."""
    from modeling_lazy.lazy_attention_triton import lazy_attention_triton

    meta = LazyMetadata.from_mask(query_length=256, batch_size=1, device=DEVICE)
    for wanted in ("q", "q k v", "tau", "bias", "q k v tau bias"):
        torch._dynamo.reset()
        x = {name: torch.randn(1, 4, 256, 64, device=DEVICE, dtype=torch.bfloat16) for name in "qkv"}
        x["tau"], x["bias"] = torch.full((4,), -0.5, device=DEVICE), 1e-2 * torch.randn(4, 32, device=DEVICE)
        for name in wanted.split():
            x[name].requires_grad_()

        def f(q, k, v, tau, bias):
            return lazy_attention_triton(q, k, v, tau, bias, meta, 0.125).float().sum()

        try:
            torch.compile(f, backend="aot_eager")(*x.values()).backward()
            print(f"compile probe, grads of {wanted}: ok", flush=True)
        except Exception as error:  # noqa: BLE001 - report which case fails
            print(f"compile probe, grads of {wanted}: {type(error).__name__}: {str(error).splitlines()[-1][:200]}",
                  flush=True)


def main():
    if "--compile" in sys.argv:
        compile_probe()
    sizes = ((64, (1, 2, 70)),) if "--smoke" in sys.argv else ((64, (2, 8, 1000)), (128, (2, 6, 777)))
    shipped = {family: dict(table) for family, table in common._CONFIGS.items()}
    variants = {"shipped sm90": shipped["sm90"]}
    if "--variants" in sys.argv:
        variants["sm80 blocks"] = shipped["sm80"]
        variants["sm90, 1 stage"] = {key: (*value[:3], 1) for key, value in shipped["sm90"].items()}
    for label, table in variants.items():
        common._CONFIGS["sm90"] = table
        for dim, (bsz, heads, length) in sizes:
            for tau_value in (0.5, 0.0, -1.0):  # U from the running sums of V (> 0, 0), a product (< 0)
                case(bsz, heads, length, dim, tau_value, label)
    common._CONFIGS["sm90"] = shipped["sm90"]


if __name__ == "__main__":
    main()
