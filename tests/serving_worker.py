"""Runs vLLM (in the serving virtual environment) for tests/test_serving.py; not a test module itself.

    python tests/serving_worker.py REQUEST.json

REQUEST.json: {"model": dir, "engine": {LLM keyword arguments}, "runs": [{"prompts": [[token ids], ...],
"max_tokens": n, "tau": optional float set on every head before the run (the prefix cache is reset then)}, ...]}.
Each run submits all its prompts together (greedy).
Prints one line `RESULT {"runs": [[{"tokens": [...], "logprobs": [...], "cached": n}, ...]], "async_scheduling": b}`:
`logprobs` are vLLM's log-probabilities of the chosen tokens (raw logits, float32); `async_scheduling` is what
the engine runs with after vLLM's platform checks.
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that a run can change tau in place.
"""

import functools
import json
import os
import sys


def set_tau(value: float, model) -> int:
    """Give every head of every layer the Elastic-Softmax offset `value` (in place, in the served model)."""
    import torch

    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.tau"):
                param.fill_(value)
                count += 1
    return count


def main(path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    with open(path) as handle:
        request = json.load(handle)
    llm = LLM(model=request["model"], **request["engine"])
    results = []
    for run in request["runs"]:
        if run.get("tau") is not None:
            changed = llm.apply_model(functools.partial(set_tau, run["tau"]))
            assert all(changed), f"no tau parameter found in the served model: {changed}"
            # A layer's cached K/V come from the layers below it, whose attention uses tau: after
            # changing the weights, cached prefixes belong to another model.
            assert llm.reset_prefix_cache(), "could not reset the prefix cache"
        params = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in run["prompts"]], params, use_tqdm=False)
        results.append([{"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                         "logprobs": [step[token].logprob for step, token in zip(out.outputs[0].logprobs,
                                                                                 out.outputs[0].token_ids)]}
                        for out in outputs])
    async_scheduling = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    print("RESULT " + json.dumps({"runs": results, "async_scheduling": async_scheduling}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
