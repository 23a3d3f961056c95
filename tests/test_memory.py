"""The CPU "lazy" path needs extra memory linear in L (no L x L tensor), forward and backward."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from modeling_lazy.lazy_attention_reference import LazyMetadata
    from modeling_lazy.lazy_attention_torch import lazy_attention_torch
    length, heads, dim = int(sys.argv[1]), 4, 64
    torch.manual_seed(0)
    q = torch.randn(1, heads, length, dim, requires_grad=True)
    k = torch.randn(1, heads, length, dim, requires_grad=True)
    v = torch.randn(1, heads, length, dim, requires_grad=True)
    tau = torch.full((heads,), -1.0, requires_grad=True)
    bias = torch.zeros(heads, 1024, requires_grad=True)
    meta = LazyMetadata.from_mask(query_length=length)
    torch.autograd.grad(lazy_attention_torch(q[:, :, :64], k[:, :, :64], v[:, :, :64], tau, bias,
                                             LazyMetadata.from_mask(query_length=64),
                                             dim ** -0.5).sum(), [q])  # warm-up: allocator, kernels
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = lazy_attention_torch(q, k, v, tau, bias, meta, dim ** -0.5)
    grads = torch.autograd.grad((out * out).sum(), [q, k, v, tau, bias])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert all(torch.isfinite(g).all() for g in grads)
    print(json.dumps({"length": length, "extra_mib": (peak - before) / 1024}))
""")


def peak_extra_mib(length: int) -> float:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(length)], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])["extra_mib"]


def test_lazy_cpu_path_memory_is_linear_at_8k():
    small, large = peak_extra_mib(2048), peak_extra_mib(8192)
    print(f"peak extra RSS, forward+backward, H=4 D=64: L=2048 {small:.1f} MiB, L=8192 {large:.1f} MiB")
    # One float32 L x L score matrix per head at 8k would be 4 x 256 MiB = 1 GiB; the chunked path stays
    # within a few chunk buffers plus O(L) inputs / gradients.
    assert large < 256, large
    assert large < 6 * max(small, 8.0), (small, large)
