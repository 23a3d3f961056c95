"""CPU benchmarks of PERFORMANCE.md: ratios of LazyLlama against SDPA / vanilla LlamaForCausalLM (sdpa).

Every ratio is measured in one process, interleaved (A B A B ...), after a warm-up, as the median of the
per-round ratios; the spread is the min-max of those ratios. Tables are printed as markdown.

    python -m benchmarks.cpu_benchmarks            # full sizes (tens of minutes on 2 cores)
    python -m benchmarks.cpu_benchmarks --smoke    # tiny sizes, seconds (run in CI)
    python -m benchmarks.cpu_benchmarks --only attention,memory
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import textwrap
import time

import torch
import torch.nn.functional as F
import transformers

import modeling_lazy  # noqa: F401
from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM
from modeling_lazy.lazy_attention_reference import lazy_attention_metadata
from modeling_lazy.lazy_attention_torch import lazy_attention_torch

SIZES = {
    "full": dict(attn_lengths=[256, 1024, 2048, 4096], heads=8, dim=64, rounds=5,
                 memory_lengths=[1024, 2048, 4096, 8192, 16384],
                 # SmolLM2-135M's widths, heads and vocabulary with 6 of its 30 layers (ratios are per layer;
                 # 30 layers would make the full run take over an hour on 2 cores)
                 model=dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=6,
                            num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
                 prefill=[128, 512, 2048], prompts=[128, 1024], new_tokens=64, train=[512, 2048]),
    "smoke": dict(attn_lengths=[64, 256], heads=4, dim=32, rounds=3, memory_lengths=[256, 1024],
                  model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
                  prefill=[32, 128], prompts=[16], new_tokens=8, train=[64]),
}


def interleaved_ratio(fn_a, fn_b, rounds):
    """Median and (min, max) of time(fn_a) / time(fn_b), alternating calls after one warm-up each."""
    fn_a(), fn_b()
    ratios, times_a, times_b = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn_a()
        t1 = time.perf_counter()
        fn_b()
        t2 = time.perf_counter()
        times_a.append(t1 - t0)
        times_b.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    return statistics.median(ratios), min(ratios), max(ratios), statistics.median(times_a), statistics.median(times_b)


def _row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _fmt(med, lo, hi):
    return f"{med:.2f}x ({lo:.2f}-{hi:.2f})"


def bench_attention(size):
    heads, dim = size["heads"], size["dim"]
    print("\n### Attention op: lazy CPU path / SDPA (causal, fp32); < 1 means lazy is faster\n")
    print(_row(["L", "tau", "forward", "forward+backward", "lazy fwd s", "sdpa fwd s"]))
    print(_row(["---"] * 6))
    for length in size["attn_lengths"]:
        for tau_value in (0.0, -1.0):
            q, k, v = (torch.randn(1, heads, length, dim) for _ in range(3))
            tau = torch.full((heads,), tau_value)
            bias = torch.randn(heads, 1024) * 1e-3
            meta = lazy_attention_metadata(None, None, 0, length, 1, q.device)

            def lazy_fwd():
                with torch.no_grad():
                    lazy_attention_torch(q, k, v, tau, bias, meta, dim**-0.5)

            def sdpa_fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)

            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            taug, biasg = tau.clone().requires_grad_(), bias.clone().requires_grad_()

            def lazy_both():
                lazy_attention_torch(qg, kg, vg, taug, biasg, meta, dim**-0.5).sum().backward()

            def sdpa_both():
                F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).sum().backward()

            fwd = interleaved_ratio(lazy_fwd, sdpa_fwd, size["rounds"])
            both = interleaved_ratio(lazy_both, sdpa_both, size["rounds"])
            print(_row([length, tau_value, _fmt(*fwd[:3]), _fmt(*both[:3]), f"{fwd[3]:.3f}", f"{fwd[4]:.3f}"]))


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.nn.functional as F
    from modeling_lazy.lazy_attention_reference import lazy_attention_metadata
    from modeling_lazy.lazy_attention_torch import lazy_attention_torch
    kind, length, heads, dim = sys.argv[1], int(sys.argv[2]), 4, 64
    q, k, v = (torch.randn(1, heads, length, dim, requires_grad=True) for _ in range(3))
    tau, bias = torch.full((heads,), -1.0, requires_grad=True), torch.zeros(heads, 1024, requires_grad=True)
    meta = lazy_attention_metadata(None, None, 0, length, 1, q.device)
    run = {"lazy": lambda: lazy_attention_torch(q, k, v, tau, bias, meta, dim ** -0.5),
           "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}[kind]
    def status(key):  # KiB, from /proc/self/status
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))
    with open("/proc/self/clear_refs", "w") as handle:  # reset the peak (VmHWM) to the current resident set
        handle.write("5")
    before = status("VmRSS")
    run().sum().backward()
    print(json.dumps((status("VmHWM") - before) / 1024))
""")


def bench_memory(size):
    print("\n### Peak extra RSS, forward+backward (fresh process per point, H=4, D=64), MiB\n")
    print(_row(["L", "lazy", "sdpa"]))
    print(_row(["---"] * 3))
    for length in size["memory_lengths"]:
        cells = [length]
        for kind in ("lazy", "sdpa"):
            out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, kind, str(length)], capture_output=True,
                                 text=True, check=True)
            cells.append(f"{json.loads(out.stdout.strip().splitlines()[-1]):.1f}")
        print(_row(cells))


def _models(size, tau_value):
    config = LazyLlamaConfig(**size["model"], lazy_bias_window=1024, max_position_embeddings=8192,
                             lazy_tau_init=tau_value, lazy_bias_init_std=0.0 if tau_value == 0 else 1e-3)
    lazy = LazyLlamaForCausalLM(config).eval()
    llama_config = transformers.LlamaConfig(**{k: v for k, v in config.to_dict().items() if not k.startswith("lazy_")})
    llama = transformers.LlamaForCausalLM._from_config(llama_config, attn_implementation="sdpa").eval()
    llama.load_state_dict({k: v for k, v in lazy.state_dict().items() if not k.endswith(("tau", "distance_bias"))},
                          strict=False)
    return lazy, llama


def bench_model(size):
    vocab = size["model"]["vocab_size"]
    print("\n### Model: LazyLlama time / LlamaForCausalLM (sdpa) time, same weights; tokens/s ratio = 1 / this\n")
    print(_row(["measure", "tau", "time ratio (spread)", "tokens/s ratio", "lazy s", "llama s"]))
    print(_row(["---"] * 6))
    for tau_value in (0.0, -1.0):
        lazy, llama = _models(size, tau_value)
        for length in size["prefill"]:
            ids = torch.randint(0, vocab, (1, length))
            with torch.no_grad():
                r = interleaved_ratio(lambda: lazy(ids, logits_to_keep=1), lambda: llama(ids, logits_to_keep=1),
                                      size["rounds"])
            print(_row([f"prefill L={length}", tau_value, _fmt(*r[:3]), f"{1 / r[0]:.2f}x", f"{r[3]:.3f}", f"{r[4]:.3f}"]))
        for length in size["prompts"]:
            ids = torch.randint(0, vocab, (1, length))
            gen = dict(max_new_tokens=size["new_tokens"], min_new_tokens=size["new_tokens"], do_sample=False,
                       attention_mask=torch.ones_like(ids), pad_token_id=0)
            r = interleaved_ratio(lambda: lazy.generate(ids, **gen), lambda: llama.generate(ids, **gen),
                                  max(3, size["rounds"] // 2))
            print(_row([f"generate {size['new_tokens']} after {length}", tau_value, _fmt(*r[:3]),
                        f"{1 / r[0]:.2f}x", f"{r[3]:.3f}", f"{r[4]:.3f}"]))
        for length in size["train"]:
            ids = torch.randint(0, vocab, (1, length))
            opt_lazy = torch.optim.AdamW(lazy.parameters(), lr=1e-6)
            opt_llama = torch.optim.AdamW(llama.parameters(), lr=1e-6)

            def step(model, opt):
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            lazy.train(), llama.train()
            r = interleaved_ratio(lambda: step(lazy, opt_lazy), lambda: step(llama, opt_llama),
                                  max(3, size["rounds"] // 2))
            lazy.eval(), llama.eval()
            print(_row([f"train step L={length}", tau_value, _fmt(*r[:3]), f"{1 / r[0]:.2f}x", f"{r[3]:.3f}",
                        f"{r[4]:.3f}"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds), for CI")
    parser.add_argument("--only", default="attention,memory,model", help="comma-separated subset")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = SIZES["smoke" if args.smoke else "full"]
    torch.manual_seed(0)
    print(f"machine: {platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}")
    benches = {"attention": bench_attention, "memory": bench_memory, "model": bench_model}
    for name in args.only.split(","):
        benches[name.strip()](size)


if __name__ == "__main__":
    main()
