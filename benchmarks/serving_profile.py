"""Where a vLLM decode step spends its time on CPU: LazyLlama vs the same weights as a vanilla Llama.

    .venv-serve/bin/python -m benchmarks.serving_profile [--out benchmarks/results/serving_cpu_profile.json]

Runs in the serving environment. For each model, in its own process (one engine each, LazyLlama first): a
batch of `--batch` prompts of `--prompt` random tokens (as `serving_benchmark`), decoded for `--steps` steps
under `torch.profiler`; only the engine steps that schedule one token per request (decode steps) are profiled.
Writes per op: self CPU ms per decode step and calls per step; `attention_ms` is the inclusive time of vLLM's
attention and cache-write custom ops (the backend's whole work), `step_ms` the profiled wall time of a step.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATTENTION_OPS = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update")


def profile_decode(folder: str, args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from benchmarks.serving_benchmark import prompts

    state = {"on": False, "self": collections.Counter(), "total": collections.Counter(),
             "calls": collections.Counter(), "steps": 0, "wall": 0.0}
    execute = GPUModelRunner.execute_model  # the CPU model runner's too

    def profiled(runner, scheduler_output, *rest, **options):
        if not (state["on"] and scheduler_output.total_num_scheduled_tokens == args.batch):
            return execute(runner, scheduler_output, *rest, **options)
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = execute(runner, scheduler_output, *rest, **options)
        state["wall"] += time.perf_counter() - start
        state["steps"] += 1
        for event in prof.key_averages():
            state["self"][event.key] += event.self_cpu_time_total
            state["total"][event.key] += event.cpu_time_total
            state["calls"][event.key] += event.count
        return out

    GPUModelRunner.execute_model = profiled
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=False,
              max_model_len=args.prompt + args.steps + 16, max_num_seqs=args.batch)
    batch = [{"prompt_token_ids": ids} for ids in prompts(args.batch, args.prompt, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
    llm.generate(batch, params, use_tqdm=False)  # warm-up
    state["on"] = True
    llm.generate(batch, params, use_tqdm=False)
    steps = state["steps"]
    ops = {key: {"self_ms_per_step": us / steps / 1e3, "calls_per_step": state["calls"][key] / steps}
           for key, us in state["self"].most_common(args.top)}
    return {"decode_steps": steps, "torch_threads": torch.get_num_threads(), "step_ms": state["wall"] / steps * 1e3,
            "attention_ms": sum(state["total"][key] for key in ATTENTION_OPS) / steps / 1e3, "ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving_cpu_profile.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(profile_decode(args.child, args)), flush=True)
        return

    from benchmarks.serving_benchmark import code_commit
    from lazy_llama_tools.data import smollm2_llama_dir
    from lazy_llama_vllm.smollm2 import converted_smollm2

    commit = code_commit()
    report = {"command": "python -m benchmarks.serving_profile " + " ".join(sys.argv[1:]), "commit": commit,
              "settings": {"batch": args.batch, "prompt": args.prompt, "steps": args.steps}, "runs": {}}
    for name, folder in (("vllm_lazy", converted_smollm2()), ("vllm_llama", smollm2_llama_dir())):
        command = [sys.executable, "-m", "benchmarks.serving_profile", "--child", str(folder), "--batch",
                   str(args.batch), "--prompt", str(args.prompt), "--steps", str(args.steps), "--top", str(args.top)]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
        load_before = os.getloadavg()
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        run = json.loads(lines[-1][len("RESULT "):])
        run["load_average_before_after"] = [load_before, os.getloadavg()]
        report["runs"][name] = run
        print(f"{name}: {run['step_ms']:.0f} ms per decode step, attention {run['attention_ms']:.0f} ms")
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
