"""torch.compile sees exactly what each Triton kernel writes.

A `torch.library.triton_op` is traced through its launches; functionalization asks torch's analysis of the kernel's
Triton IR which pointer arguments it stores to, and copies every "written" input back. A false positive makes
compiled training fail outright when that input is a leaf that requires grad (q, k, v, tau: "a leaf Variable that
requires grad is being used in an in-place operation", seen on an H200) and costs copies otherwise. The analysis
follows store addresses back through helper calls and counts every tensor such a call takes, so the kernels compute
store addresses in tensor-free helpers. Here every launcher of the model and of the vLLM plugin runs once with its
launches captured (nothing executes), and the analysis of each kernel must name exactly its output buffers. No GPU:
the Triton front end is given an sm_90 target. Runs in a child process (it imports the kernels in compiled mode).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import torch, triton
from triton.backends.compiler import GPUTarget


class _Driver:  # the Triton front end only asks for the target
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(_Driver())
from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

import lazy_llama_vllm.lazy_attention_paged_triton as paged
import modeling_lazy.lazy_attention_triton_backward as backward
import modeling_lazy.lazy_attention_triton_common as common
import modeling_lazy.lazy_attention_triton_decode as decode
import modeling_lazy.lazy_attention_triton_forward as forward
from modeling_lazy.lazy_attention_reference import LazyMetadata

launches = []


class _Capture:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda **kwargs: launches.append((self.kernel, kwargs))


for module in (forward, backward, decode, paged):
    module.wrap_triton = _Capture
common._gpu_family = lambda device: "sm90"
B, H, HKV, L, D = 1, 4, 2, 256, 64
q, k, v = torch.randn(B, H, L, D, dtype=torch.bfloat16), *torch.randn(2, B, HKV, L, D, dtype=torch.bfloat16)
tau, bias, scaling = torch.full((H,), -0.5), torch.randn(H, 32), 0.125
block_d = common._check_inputs(q, k)
q_pos = torch.arange(L, dtype=torch.int32)[None]
res = forward._causal_forward(q, k, v, tau, bias, q_pos, scaling, block_d, store_u=True)
grad = torch.randn(B, L, H, D, dtype=torch.bfloat16)
dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
backward._causal_backward(grad, q, k, v, dq, dk, dv, tau, bias, q_pos, torch.zeros_like(q_pos), res.lse, scaling,
                          block_d, res.out, res.u)
documents = torch.tensor([[0, 0, 100], [0, 100, 150]], dtype=torch.int32)  # packed: the causal path per document
res = forward._causal_forward(q, k, v, tau, bias, q_pos, scaling, block_d, store_u=True, documents=documents)
backward._causal_backward(grad, q, k, v, dq, dk, dv, tau, bias, q_pos, torch.zeros_like(q_pos), res.lse, scaling,
                          block_d, res.out, res.u, documents)
mask = torch.ones(B, L, dtype=torch.long)
mask[0, :5] = 0
meta = LazyMetadata.from_mask(mask, query_length=L)
positions = (meta.q_pos32, meta.k_pos32, meta.q_seg, meta.k_seg)
forward._forward(q, k, v, tau, bias, *positions, scaling)
forward._forward(q[:, :, -1:], k, v, tau, bias, meta.q_pos32[:, -1:], meta.k_pos32, meta.q_seg[:, -1:], meta.k_seg,
                 scaling, num_splits=3)
backward._backward(grad, q, k, v, tau, bias, *positions, torch.zeros(B, H, L), scaling)
decode._packed_decode(q[:, :, -1:], k, v, tau, bias, q_pos[:, -1:], torch.full((B,), L, dtype=torch.int32), scaling)
decode._packed_decode(q[:, :, -1:], k, v, tau, bias, meta.q_pos32[:, -1:], torch.full((B,), L, dtype=torch.int32),
                      scaling, need_lse=False, key_mask=(meta.q_seg[:, -1:], meta.k_seg, meta.k_pos32))
pages = torch.randn(8, HKV, 16, D, dtype=torch.bfloat16)
table = torch.arange(8, dtype=torch.int32).view(2, 4)
paged._paged_prefill(torch.randn(40, H, D, dtype=torch.bfloat16), pages, pages, table,
                     torch.tensor([0, 20, 40], dtype=torch.int32), torch.tensor([20, 40], dtype=torch.int32), tau,
                     bias, scaling)
seen = {}
for kernel, kwargs in launches:
    accesses = identify_accessed_tensors(kernel, kwargs, {})
    label = kernel.fn.__name__ + (" documents" if kwargs.get("DOCUMENTS") else "")
    seen[label + (" key mask" if kwargs.get("KEY_MASK") else "")] = sorted(
        dep.name for dep in accesses.read_writes.writes)
for name, writes in sorted(seen.items()):
    print(f"{name}:", ",".join(writes))
'''

OUTPUTS = {  # kernel -> the buffers it really stores to
    "_lazy_causal_fwd_kernel": "LSE,OUT,U",
    "_lazy_causal_bwd_delta_kernel": "DELTA,DTAU_PART,LSE_ROWS,THR",
    "_lazy_causal_bwd_dq_kernel": "DBIAS_PART,DQ",
    "_lazy_causal_bwd_dkdv_kernel": "DK,DV",
    "_lazy_causal_fwd_kernel documents": "LSE,OUT,U",
    "_lazy_value_sums_kernel": "VSUM",
    "_lazy_value_sums_kernel documents": "VSUM",
    "_lazy_causal_bwd_delta_kernel documents": "DELTA,DK,DQ,DTAU_PART,DV,LSE_ROWS,THR",  # and the padding's gradients
    "_lazy_causal_bwd_dq_kernel documents": "DBIAS_PART,DQ",
    "_lazy_causal_bwd_dkdv_kernel documents": "DK,DV",
    "_lazy_fwd_kernel": "LSE,OUT",
    "_lazy_fwd_split_lse_kernel": "L_PART,M_PART",
    "_lazy_fwd_split_out_kernel": "O_PART",
    "_lazy_bwd_delta_kernel": "DELTA,DTAU_PART",
    "_lazy_bwd_dq_kernel": "DQ",
    "_lazy_bwd_dkdv_kernel": "DBIAS_PART,DK,DV",
    "_lazy_decode_lse_kernel": "L_PART,M_PART,SCORES",
    "_lazy_decode_out_kernel": "LSE,O_PART",
    "_lazy_decode_lse_kernel key mask": "L_PART,M_PART,SCORES",
    "_lazy_decode_out_kernel key mask": "O_PART",  # inference: no log-sum-exp stored
    "_lazy_paged_fwd_kernel": "OUT",
}


def test_compile_sees_only_the_buffers_each_kernel_writes():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = dict(line.split(": ", 1) if ": " in line else (line.rstrip(":"), "") for line in done.stdout.split("\n")
                 if line)
    assert found == OUTPUTS, f"kernel writes as torch.compile sees them: {found}"
