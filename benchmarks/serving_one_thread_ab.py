"""The serving backend's one-thread limit, on and off, alternated inside one LazyLlama vLLM engine (CPU).

    .venv-serve/bin/python -m benchmarks.serving_one_thread_ab [--out benchmarks/results/serving_cpu_one_thread_ab.json]

Runs in the serving environment. One engine on the converted SmolLM2 (tau = 0) decodes a batch of `--batch`
prompts of `--prompt` random tokens for `--steps` steps, `--rounds` times with the limit at its default and
`--rounds` times at 0 (every op of the backend on vLLM's threads), alternately, so that both see the same load.
Per decode step (profiled): wall ms, the backend's inclusive ms (attention and cache writes) and the self ms of
vLLM's linear layers and rotary embedding, which run on vLLM's OpenMP threads in both modes.
"""

import argparse
import collections
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKEND_OPS = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update")
PARALLEL_OPS = ("_C::onednn_mm", "_C::rotary_embedding")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving_cpu_one_thread_ab.json")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import lazy_llama_vllm.lazy_attention_backend as backend
    from benchmarks.serving_benchmark import code_commit, prompts
    from lazy_llama_vllm.smollm2 import converted_smollm2

    commit = code_commit()
    state = {"mode": None, "stats": collections.defaultdict(collections.Counter)}
    execute = GPUModelRunner.execute_model

    def profiled(runner, scheduler_output, *rest, **options):
        if state["mode"] is None or scheduler_output.total_num_scheduled_tokens != args.batch:
            return execute(runner, scheduler_output, *rest, **options)
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = execute(runner, scheduler_output, *rest, **options)
        stats = state["stats"][state["mode"]]
        stats["wall_ms"] += (time.perf_counter() - start) * 1e3
        stats["steps"] += 1
        for event in prof.key_averages():
            if event.key in PARALLEL_OPS:
                stats[event.key] += event.self_cpu_time_total / 1e3
            if event.key in BACKEND_OPS:
                stats["backend_ms"] += event.cpu_time_total / 1e3
        return out

    GPUModelRunner.execute_model = profiled
    llm = LLM(model=str(converted_smollm2()), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=args.prompt + args.steps + 16, max_num_seqs=args.batch)
    batch = [{"prompt_token_ids": ids} for ids in prompts(args.batch, args.prompt, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
    llm.generate(batch, params, use_tqdm=False)  # warm-up
    load_before = os.getloadavg()
    default = backend._ONE_THREAD_MAX_ELEMENTS
    for _ in range(args.rounds):
        for mode, limit in (("one_thread_limit_default", default), ("one_thread_limit_0", 0)):
            backend._ONE_THREAD_MAX_ELEMENTS, state["mode"] = limit, mode
            llm.generate(batch, params, use_tqdm=False)
            state["mode"] = None
    backend._ONE_THREAD_MAX_ELEMENTS = default
    per_step = {mode: {key: value / stats["steps"] for key, value in stats.items() if key != "steps"}
                | {"decode_steps": stats["steps"]} for mode, stats in state["stats"].items()}
    report = {"command": "python -m benchmarks.serving_one_thread_ab", "commit": commit, "settings": vars(args)
              | {"out": str(args.out)}, "load_average_before_after": [load_before, os.getloadavg()],
              "per_decode_step_ms": per_step}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(per_step, indent=1))


if __name__ == "__main__":
    main()
