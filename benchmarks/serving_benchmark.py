"""Output tokens/s of vLLM serving SmolLM2-135M as LazyLlama vs the same weights as a vanilla Llama (CPU).

    .venv-serve/bin/python -m benchmarks.serving_benchmark [--out benchmarks/serving_cpu.json]

Runs in the serving environment (`make serve-setup`). Three measurements, each in its own process:
vLLM on the converted LazyLlama folder (tau = 0, this plugin's attention), vLLM on the source Llama folder
(vLLM's own CPU attention), and LazyLlama `generate()` (transformers, no vLLM). Each serves a batch of
`--batch` requests submitted together and one single request, `--prompt` random prompt tokens and
`--new-tokens` generated tokens each (greedy, EOS ignored), after a short warm-up; the best of `--repeats`
timings is kept. Prints a table of ratios and writes the raw numbers as JSON.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49000, (length,), generator=generator).tolist() for _ in range(count)]


def run_vllm(folder: str, args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, dtype=args.dtype, enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=False,
              max_model_len=args.prompt + args.new_tokens + 16, max_num_seqs=max(args.batch, 1))
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def timed(batch: list[list[int]]) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outputs)
        return best

    llm.generate([{"prompt_token_ids": prompts(1, 16, 0)[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    return {"batch_s": timed(prompts(args.batch, args.prompt, 1)), "single_s": timed(prompts(1, args.prompt, 2))}


def run_generate(folder: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import modeling_lazy  # noqa: F401  (registers LazyLlama)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()

    def timed(batch: list[list[int]]) -> float:
        ids = torch.tensor(batch)
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     do_sample=False, pad_token_id=0)
            best = min(best, time.perf_counter() - start)
            assert out.shape[1] == ids.shape[1] + args.new_tokens
        return best

    with torch.no_grad():
        model.generate(torch.tensor(prompts(1, 16, 0)), max_new_tokens=4, do_sample=False, pad_token_id=0)
    return {"batch_s": timed(prompts(args.batch, args.prompt, 1)), "single_s": timed(prompts(1, args.prompt, 2)),
            "torch_threads": torch.get_num_threads()}


def code_commit() -> str:
    """The measured code's commit, `+dirty` when tracked files differ from it (`unknown` outside git)."""
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def child(kind: str, folder: str, args) -> dict:
    """Run one measurement in a fresh process (one engine per process); returns its JSON line."""
    command = [sys.executable, "-m", "benchmarks.serving_benchmark", "--child", kind, "--folder", folder,
               "--batch", str(args.batch), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--dtype", args.dtype]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}  # GiB; without it vLLM claims most of the RAM
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "serving_cpu.json")
    parser.add_argument("--tau", type=float, default=0.0,
                        help="tau of every head of the served LazyLlama (0: the exact conversion, which is softmax "
                             "attention and takes SDPA in the CPU op; -1: Elastic-Softmax with exact zeros)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the engines' dtype (`make serve` picks bfloat16 where the CPU computes it natively)")
    parser.add_argument("--no-generate", action="store_true",
                        help="skip the (slow) transformers generate() run: only the two vLLM engines")
    parser.add_argument("--child", choices=["vllm", "generate"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        load_before = os.getloadavg()
        result = run_vllm(args.folder, args) if args.child == "vllm" else run_generate(args.folder, args)
        result["load_average_before_after"] = [load_before, os.getloadavg()]  # the machine is shared: read with it
        print("RESULT " + json.dumps(result), flush=True)
        return

    import torch
    import transformers
    import vllm

    from lazy_llama_tools.data import smollm2_llama_dir
    from lazy_llama_vllm.smollm2 import converted_smollm2

    lazy, llama = str(converted_smollm2(args.tau)), str(smollm2_llama_dir())
    commit = code_commit()  # before the runs: a commit made while they run is not the code measured
    started = time.time()
    runs = {"vllm_lazy": child("vllm", lazy, args), "vllm_llama": child("vllm", llama, args)}
    if not args.no_generate:
        runs["generate_lazy"] = child("generate", lazy, args)
    tokens = {"batch": args.batch * args.new_tokens, "single": args.new_tokens}
    rates = {name: {case: tokens[case] / run[f"{case}_s"] for case in tokens} for name, run in runs.items()}
    ratios = {case: {"lazy_vs_llama_vllm": rates["vllm_lazy"][case] / rates["vllm_llama"][case]}
              for case in tokens}
    if not args.no_generate:
        for case in tokens:
            ratios[case]["vllm_lazy_vs_generate_lazy"] = rates["vllm_lazy"][case] / rates["generate_lazy"][case]
    report = {
        "command": "python -m benchmarks.serving_benchmark " + " ".join(sys.argv[1:]),
        "commit": commit,
        "settings": {"batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens, "tau": args.tau,
                     "repeats": args.repeats, "dtype": args.dtype, "enforce_eager": True, "greedy": True},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "machine": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
        "wall_s": time.time() - started,
        "seconds": runs, "output_tokens_per_s": rates, "ratios": ratios,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| case | vLLM LazyLlama tok/s | vLLM Llama tok/s | generate() LazyLlama tok/s | Lazy/Llama (vLLM) | "
          "vLLM/generate (Lazy) |\n| --- | --- | --- | --- | --- | --- |")
    for case in tokens:
        generate = rates.get("generate_lazy", {}).get(case)
        versus = ratios[case].get("vllm_lazy_vs_generate_lazy")
        print(f"| {case} | {rates['vllm_lazy'][case]:.1f} | {rates['vllm_llama'][case]:.1f} | "
              f"{'-' if generate is None else f'{generate:.1f}'} | {ratios[case]['lazy_vs_llama_vllm']:.2f}x | "
              f"{'-' if versus is None else f'{versus:.2f}x'} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
