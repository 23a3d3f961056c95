"""`lazy-inspect` and `lazy-evaluate` on a tiny LazyLlama with hand-set tau and distance bias.

Every figure the tools report is recomputed here independently: attention weights in float64 from the
q/k projections captured by hooks (our own RoPE), then sparsity, sink, tile density and surviving mass by
plain loops; perplexity from the logits.
"""

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

import modeling_lazy  # noqa: F401
from lazy_llama_tools import evaluate, inspect_attention
from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM

WORDS = ("the cat dog sat on a mat and ran to house tree big small red blue green saw it was "
         "very happy today when we went out of town with some old friends who like tea").split()
TOKENS = 150  # 3 x 3 tiles of 64, the last one partial
TILE = 64
# Hand-set per (layer, head): tau, and a distance-bias rule. GQA: 4 query heads share 2 key/value heads.
TAU = [[-1.0, -2.0, 0.0, -0.5], [-1.5, -1.0, -3.0, 0.0]]


def _bias(layer: int, head: int, window: int) -> torch.Tensor:
    d = torch.arange(window, dtype=torch.float32)
    if (layer, head) == (0, 0):
        return torch.where(d == 0, 3.0, 0.0)  # favours the diagonal
    if (layer, head) == (0, 1):
        return -0.05 * d  # locality
    if (layer, head) == (1, 2):
        return torch.where(d >= 40, -20.0, 0.0)  # kills every key 40+ tokens back: whole tiles go dark
    return torch.zeros(window)


def _text() -> str:
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(400))


def _tokenizer(reverse: bool = False):
    """Word-level; `reverse` gives the same words and vocab size with other ids (another vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(WORDS), reverse=reverse)
    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]")


def _config(**extra):
    return dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                pad_token_id=None, tie_word_embeddings=False, **extra)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP spinning costs 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny LazyLlama (with tokenizer), a vanilla Llama with the same weights, and a text file."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    model = LazyLlamaForCausalLM(LazyLlamaConfig(**_config(lazy_bias_window=160)))
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            block.self_attn.tau.copy_(torch.tensor(TAU[layer]))
            for head in range(4):
                block.self_attn.distance_bias[head].copy_(_bias(layer, head, 160))
    tokenizer = _tokenizer()
    model.save_pretrained(root / "lazy")
    tokenizer.save_pretrained(root / "lazy")
    llama = LlamaForCausalLM(LlamaConfig(**_config()))
    missing = llama.load_state_dict(model.state_dict(), strict=False)
    assert not missing.missing_keys
    llama.save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    text = root / "text.txt"
    text.write_text(_text(), encoding="utf-8")
    return {"lazy": root / "lazy", "llama": root / "llama", "text": text, "root": root, "tokenizer": tokenizer}


# ---------------------------------------------------------------------------------------------------------
# Independent float64 recomputation
# ---------------------------------------------------------------------------------------------------------


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x `[H, T, D]` float64 -> rotated (half-split convention, positions 0..T-1)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _independent_weights(model, ids: torch.Tensor):
    """Per layer `[H, T, T]` float64 weights a_ij and the smallest |p_ij + tau_h/n_i| over heads with tau != 0."""
    captured = {}
    hooks = []
    for layer, block in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj"):
            hooks.append(getattr(block.self_attn, name).register_forward_hook(
                lambda mod, inp, out, key=(layer, name): captured.__setitem__(key, out.detach().double())))
    with torch.no_grad():
        model(input_ids=ids[None], use_cache=False)
    for hook in hooks:
        hook.remove()
    config = model.config
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    theta = config.rope_parameters["rope_theta"]
    length = ids.numel()
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    causal = j <= i
    all_weights, margin = [], math.inf
    for layer, block in enumerate(model.model.layers):
        q = _rope(captured[(layer, "q_proj")][0].view(length, heads, dim).transpose(0, 1), theta)
        k = _rope(captured[(layer, "k_proj")][0].view(length, kv_heads, dim).transpose(0, 1), theta)
        tau = block.self_attn.tau.detach().double()
        bias = block.self_attn.distance_bias.detach().double()
        window = bias.shape[1]
        weights = torch.zeros(heads, length, length, dtype=torch.float64)
        for h in range(heads):
            kh = k[h // (heads // kv_heads)]
            scores = (q[h] @ kh.T) * dim**-0.5
            dist = (i - j).clamp(min=0)
            scores = scores + torch.where(dist < window, bias[h][dist.clamp(max=window - 1)], 0.0)
            scores = scores.masked_fill(~causal, -math.inf)
            p = torch.softmax(scores, dim=-1)
            shifted = p + tau[h] / (i + 1)
            if tau[h] != 0 and length > 1:  # row 0 sees one key: p = 1, a = max(0, 1 + tau) exactly on both sides
                margin = min(margin, shifted[causal & (i > 0)].abs().min().item())
            weights[h] = torch.where(causal, shifted.clamp(min=0), 0.0)
        all_weights.append(weights)
    return all_weights, margin


def _independent_statistics(weights: torch.Tensor) -> dict:
    """Plain loops over one layer's `[H, T, T]` weights (single causal sequence, positions 0..T-1)."""
    heads, length, _ = weights.shape
    out = {"sparsity": [], "sink": [], "tile_density": [], "surviving_mass": []}
    tiles = math.ceil(length / TILE)
    for h in range(heads):
        w = weights[h]
        out["sparsity"].append(sum((w[i, : i + 1] == 0).sum().item() / (i + 1) for i in range(length)) / length)
        out["sink"].append(sum(w[i, 0].item() for i in range(1, length)) / (length - 1))
        out["surviving_mass"].append(sum(w[i, : i + 1].sum().item() for i in range(length)) / length)
        seen = alive = 0
        for a in range(tiles):
            for b in range(tiles):
                rows, cols = range(a * TILE, min((a + 1) * TILE, length)), range(b * TILE, min((b + 1) * TILE, length))
                if any(c <= r for r in rows for c in cols):  # the tile holds a visible pair
                    seen += 1
                    alive += bool((w[a * TILE: (a + 1) * TILE, b * TILE: (b + 1) * TILE] > 0).any())
        out["tile_density"].append(alive / seen)
    return out


# ---------------------------------------------------------------------------------------------------------
# A small JSON Schema validator (the subset the report schema uses; jsonschema is not a dependency)
# ---------------------------------------------------------------------------------------------------------

_TYPES = {"object": dict, "array": list, "string": str, "null": type(None), "boolean": bool}


def _is_type(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, _TYPES[name])


def _validate(value, schema: dict, root: dict, path: str = "$") -> list[str]:
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return _validate(value, target, root, path)
    errors = []
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, name) for name in names):
            return [f"{path}: {value!r} is not of type {names}"]
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if "oneOf" in schema:
        matches = sum(not _validate(value, option, root, path) for option in schema["oneOf"])
        if matches != 1:
            errors.append(f"{path}: matches {matches} of oneOf")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        errors += [f"{path}: missing {key!r}" for key in schema.get("required", []) if key not in value]
        properties = schema.get("properties", {})
        for key, item in value.items():
            if key in properties:
                errors += _validate(item, properties[key], root, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected {key!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "items" in schema:
            for index, item in enumerate(value):
                errors += _validate(item, schema["items"], root, f"{path}[{index}]")
    return errors


def _check_schema(report: dict):
    schema = json.loads(inspect_attention.SCHEMA_FILE.read_text())
    assert _validate(report, schema, schema) == []
    broken = json.loads(json.dumps(report))
    broken["model"]["text"]["layers"][0]["sparsity"][0] = 1.5
    del broken["plots"]["tau"]
    assert len(_validate(broken, schema, schema)) == 2  # the validator does catch violations


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------


def _run_inspect(tiny, out: Path, *extra: str) -> dict:
    inspect_attention.main([str(tiny["lazy"]), "--text", str(tiny["text"]), "--out", str(out),
                            "--tokens", str(TOKENS), "--map-tokens", "40", "--repeated-length", "70", *extra])
    return json.loads((out / "report.json").read_text())


def _check_plots(report: dict, out: Path):
    for name in report["plots"].values():
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n", name


def test_inspect_statistics_equal_independent_values(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    report = _run_inspect(tiny, out, "--dtype", "float64", "--baseline", "tau=0")
    captured = capsys.readouterr()
    printed = captured.out
    assert "sparsity" in printed and "report.json" in printed
    # progress on stderr, one line per long step, for the model and the baseline, before the summary
    progress = [line for line in captured.err.splitlines() if line.startswith("lazy-inspect: ")]
    lazy = str(tiny["lazy"])
    for expected in (f"loading {lazy} ...", f"{lazy}: statistics on 1 x {TOKENS} tokens of text ...",
                     f"{lazy}: statistics on 70 repeated tokens ...", f"{lazy} at tau=0: statistics on 1 x {TOKENS}",
                     f"writing the plots and report.json to {out} ..."):
        assert any(line.startswith(f"lazy-inspect: {expected}") for line in progress), (expected, progress)
    _check_schema(report)
    _check_plots(report, out)

    model = LazyLlamaForCausalLM.from_pretrained(tiny["lazy"], dtype=torch.float64).eval()
    text_ids = torch.tensor(tiny["tokenizer"](tiny["text"].read_text())["input_ids"][:TOKENS])
    repeated = torch.full((70,), report["input"]["repeated_token_id"])
    for part, ids in (("text", text_ids), ("repeated", repeated)):
        weights, margin = _independent_weights(model, ids)
        assert margin > 1e-9  # no weight sits on the ReLU threshold, so exact-zero counts are well defined
        for layer, w in enumerate(weights):
            expected = _independent_statistics(w)
            got = report["model"][part]["layers"][layer]
            for key, values in expected.items():
                # The tool aggregates in float32; one flipped zero would move sparsity by >= 1/150^2 = 4e-5.
                assert got[key] == pytest.approx(values, abs=1e-6), (part, layer, key)
            assert got["tau"] == TAU[layer]
    # The hand-set heads do what they were set up to do (so the comparison above is not vacuous).
    text = report["model"]["text"]["layers"]
    assert text[1]["tile_density"][2] < 1  # tile (2, 0) is entirely >= 40 tokens back: dark
    assert text[0]["sparsity"][2] == 0.0 and text[1]["sparsity"][2] > 0.5
    assert report["model"]["text"]["mean"]["sparsity"] > 0.1
    # tau = 0 baseline: same weights, no zeros, surviving mass 1.
    base = report["baseline"]
    assert base["name"].endswith("at tau=0") and base["text"]["mean"]["sparsity"] == 0.0
    assert base["text"]["mean"]["surviving_mass"] == pytest.approx(1.0, abs=1e-9)


def test_inspect_vanilla_llama_baseline_and_refusal(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    report = _run_inspect(tiny, out, "--baseline", str(tiny["llama"]), "--map-layers", "1")
    _check_schema(report)
    _check_plots(report, out)
    base = report["baseline"]
    assert base["model_type"] == "llama" and base["lazy_bias_window"] is None
    assert base["text"]["mean"]["tau"] == 0.0 and base["text"]["mean"]["sparsity"] == 0.0
    assert base["text"]["mean"]["surviving_mass"] == pytest.approx(1.0, abs=1e-5)
    assert report["input"]["map_heads"][0]["layer"] == 1
    with pytest.raises(SystemExit, match="not a LazyLlama.*--baseline"):
        inspect_attention.main([str(tiny["llama"]), "--text", str(tiny["text"]), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="not a LazyLlama"):
        evaluate.main([str(tiny["llama"]), "--text", str(tiny["text"])])


def test_statistics_of_packed_documents_equal_each_document_measured_alone(tiny, rng_seed):
    """Documents packed in one row with restarting `position_ids` (1-token documents included): pairs across
    documents are not visible and `n_i` restarts, so every figure equals the float64 one of the documents measured
    one by one (per-row means pooled over all documents' rows)."""
    from lazy_llama_tools.metrics import attention_statistics, pooled_attention_statistics

    model = LazyLlamaForCausalLM.from_pretrained(tiny["lazy"], dtype=torch.float64).eval()
    lengths = [int(n) for n in torch.randint(1, 50, (4,))] + [1]
    print("document lengths", lengths, "seed", rng_seed)
    documents = [torch.randint(3, 64, (n,)) for n in lengths]
    packed = torch.cat(documents)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    stats = attention_statistics(model, packed, position_ids=positions)
    pooled = pooled_attention_statistics(model, packed, position_ids=positions)
    per_document = [_independent_weights(model, ids)[0] for ids in documents]
    for layer in range(2):
        rows = [(w[:, i, : i + 1], i) for doc in per_document for w in [doc[layer]] for i in range(w.shape[1])]
        zero_share = torch.stack([(row == 0).double().mean(-1) for row, _ in rows])  # [rows, H]
        mass = torch.stack([row.sum(-1) for row, _ in rows])
        sink = torch.stack([row[:, 0] for row, i in rows if i > 0])
        pairs = torch.cat([row for row, _ in rows], dim=-1)  # [H, all visible pairs]
        got, got_pooled = stats["layers"][layer], pooled["layers"][layer]
        assert got["sparsity"] == pytest.approx(zero_share.mean(0).tolist(), abs=1e-6), layer
        assert got["surviving_mass"] == pytest.approx(mass.mean(0).tolist(), abs=1e-6), layer
        assert got["sink"] == pytest.approx(sink.mean(0).tolist(), abs=1e-6), layer
        assert got_pooled["sparsity_pooled"] == pytest.approx((pairs == 0).double().mean(-1).tolist(), abs=1e-6)
        assert got_pooled["removed_mass"] == pytest.approx((1 - mass).mean(0).tolist(), abs=1e-6)
    assert stats["mean"]["sparsity"] > 0.05  # the hand-set heads cut weights: the comparison is not vacuous


def test_a_vanilla_baseline_in_float16_has_no_rounding_zeros(tiny):
    """Llama's eager attention rounds its softmax to the model's dtype; in float16 small weights become exact zeros.
    The statistics read a model without Lazy Attention in float32: softmax keeps every weight, at every dtype."""
    from transformers import LlamaForCausalLM

    from lazy_llama_tools.metrics import attention_statistics

    ids = torch.tensor(tiny["tokenizer"](tiny["text"].read_text())["input_ids"][:TOKENS])[None]
    figures = {}
    for dtype in (torch.float32, torch.float16):
        llama = LlamaForCausalLM.from_pretrained(tiny["llama"], dtype=dtype).eval()
        with torch.no_grad():
            for block in llama.model.layers:  # peaky attention: softmax weights below float16's smallest
                block.self_attn.q_proj.weight.mul_(16)
                block.self_attn.k_proj.weight.mul_(16)
        figures[dtype] = attention_statistics(llama, ids)["mean"]
    assert figures[torch.float16]["sparsity"] == 0.0 == figures[torch.float32]["sparsity"]
    assert figures[torch.float16]["surviving_mass"] == pytest.approx(1.0, abs=1e-5)
    assert figures[torch.float16]["sink"] == pytest.approx(figures[torch.float32]["sink"], abs=2e-3)


def test_a_figure_with_nothing_to_average_over_is_nan(tiny):
    """The sink averages over queries at position > 0: a 1-token input has none, so it is NaN (0 would read as "no
    sink"); the other figures are defined."""
    from lazy_llama_tools.metrics import attention_statistics, pooled_attention_statistics

    model = LazyLlamaForCausalLM.from_pretrained(tiny["lazy"]).eval()
    stats = attention_statistics(model, torch.tensor([[5]]))
    assert all(math.isnan(value) for layer in stats["layers"] for value in layer["sink"])
    assert math.isnan(stats["mean"]["sink"]) and stats["mean"]["surviving_mass"] == pytest.approx(
        sum(max(0.0, 1 + t) for layer in TAU for t in layer) / 8)
    pooled = pooled_attention_statistics(model, torch.tensor([[5]]))["mean"]
    assert math.isnan(pooled["sink_share"]) and math.isnan(pooled["sink_share_pooled"])


def _direct_nll(model, ids: torch.Tensor, context: int, stride: int) -> list[float]:
    """NLL of every token t >= 1, scored in the first window (starts 0, stride, ...) whose end passes t; windows
    overlap by at least one token (stride <= context - 1), so t always has history inside its window."""
    stride = min(stride, context - 1)
    nlls = []
    for t in range(1, ids.numel()):
        begin = max(0, math.ceil((t + 1 - context) / stride)) * stride
        with torch.no_grad():
            logits = model(input_ids=ids[None, begin:t], use_cache=False).logits[0, -1].double()
        nlls.append(-torch.log_softmax(logits, -1)[ids[t]].item())
    return nlls


@pytest.mark.parametrize("context, stride", [
    pytest.param(64, None, id="one-window"),
    pytest.param(16, 8, id="stride-8-overlapping"),
    pytest.param(16, None, id="default-stride-capped"),
])
def test_evaluate_perplexity_is_exp_mean_nll(tiny, tmp_path, capsys, context, stride):
    out = tmp_path / "ppl.json"
    argv = [str(tiny["lazy"]), "--text", str(tiny["text"]), "--context", str(context), "--max-tokens", "40",
            "--json", str(out), "--no-progress", "--baseline", str(tiny["llama"])]
    evaluate.main(argv + (["--stride", str(stride)] if stride else []))
    assert "perplexity" in capsys.readouterr().out
    result = json.loads(out.read_text())["results"][0]
    model = LazyLlamaForCausalLM.from_pretrained(tiny["lazy"]).eval()
    ids = torch.tensor(tiny["tokenizer"](tiny["text"].read_text())["input_ids"][:40])
    nlls = _direct_nll(model, ids, context, stride or context)
    assert result["tokens"] == 39
    assert result["perplexity"] == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=1e-5)


TASK_YAML = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def test_lm_eval_harness_runs_a_local_task(tiny, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = [" ".join(_text().split()[k * 20: k * 20 + 20]) for k in range(3)]
    data = tasks / "tiny.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tasks / "tiny_rolling.yaml").write_text(TASK_YAML.format(data=data))

    model = LazyLlamaForCausalLM.from_pretrained(tiny["lazy"]).eval()
    lm = HFLM(pretrained=model, tokenizer=tiny["tokenizer"], batch_size=1, max_length=64)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_rolling"],
                                      task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    metrics = results["results"]["tiny_rolling"]
    word_ppl = metrics["word_perplexity,none"]
    assert math.isfinite(word_ppl) and word_ppl > 1

    # Cross-check: the word perplexity equals exp(total NLL / words) computed directly (each doc is scored
    # after a prefix token: HFLM uses the BOS token as the first context).
    total = 0.0
    for doc in docs:
        ids = torch.tensor([1] + tiny["tokenizer"](doc)["input_ids"])
        total += sum(_direct_nll(model, ids, 64, 64))
    words = sum(len(d.split()) for d in docs)
    assert word_ppl == pytest.approx(math.exp(total / words), rel=1e-4)


def _error_of(tool, argv, capsys) -> str:
    """The one-line error a tool ends with: its SystemExit message, or argparse's last line."""
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv)
    if isinstance(exit_info.value.code, str):
        return exit_info.value.code
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_arguments_and_missing_models_are_refused_in_one_line(tiny, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    lazy, text = str(tiny["lazy"]), str(tiny["text"])
    (tmp_path / "empty.txt").write_text("")
    untokenized = tmp_path / "no-tokenizer"  # the model alone, as model.save_pretrained() writes it
    untokenized.mkdir()
    for path in Path(lazy).iterdir():
        if path.name == "config.json" or path.suffix in (".safetensors", ".py"):
            shutil.copy(path, untokenized / path.name)
    for tool, argv, message in [
        (evaluate, [str(untokenized), "--text", text], "No tokenizer could be loaded from"),
        (inspect_attention, [str(untokenized), "--text", text], "No tokenizer could be loaded from"),
        (evaluate, [lazy, "--text", str(tmp_path / "empty.txt")], "is empty"),
        (evaluate, [lazy, "--text", text, "--max-tokens", "0"], "argument --max-tokens: must be at least 1, got 0"),
        (evaluate, [lazy, "--text", text, "--context", "1"], "argument --context: must be at least 2, got 1"),
        (evaluate, [lazy, "--text", text, "--context", "8", "--stride", "9"],
         "argument --stride: must be at most --context (8), got 9"),
        (inspect_attention, [lazy, "--text", text, "--tokens", "0"], "argument --tokens: must be at least 2"),
        (inspect_attention, [lazy, "--text", text, "--repeated-length", "0"], "argument --repeated-length: must be"),
        (inspect_attention, [lazy, "--text", text, "--device", "banana"], "unknown device 'banana'"),
        (evaluate, [str(tmp_path / "models" / "lazy"), "--text", text], "models/lazy: no such folder"),
        (inspect_attention, [lazy, "--text", text, "--baseline", "./llama-copy"], "./llama-copy: no such folder"),
    ] + ([] if torch.cuda.is_available() else [
        (inspect_attention, [lazy, "--text", text, "--device", "cuda"], "is not available: this PyTorch"),
    ]):
        error = _error_of(tool, argv, capsys)
        assert message in error and "\n" not in error, (argv, error)
    # A name that could be a Hub id: said to be neither a local folder nor a loadable repository (offline here).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    error = _error_of(evaluate, ["no-such-model", "--text", text], capsys)
    assert "no-such-model is not a local folder, and loading it as a Hub repository id failed" in error


def test_baseline_with_another_vocabulary_is_refused(tiny, tmp_path, capsys):
    """Same vocab_size, same weights, but the words map to other ids: the scores would not be comparable."""
    import shutil

    other = tmp_path / "other-vocabulary"
    shutil.copytree(tiny["llama"], other)
    _tokenizer(reverse=True).save_pretrained(other)
    for tool, extra in ((evaluate, ["--max-tokens", "40", "--context", "16", "--no-progress"]),
                        (inspect_attention, ["--out", str(tmp_path / "out"), "--tokens", "40"])):
        error = _error_of(tool, [str(tiny["lazy"]), "--text", str(tiny["text"]), "--baseline", str(other), *extra],
                          capsys)
        assert "has another vocabulary" in error and "not be comparable" in error, error
    assert "ratio" not in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inspect_and_evaluate_on_cuda(tiny, tmp_path):
    report = _run_inspect(tiny, tmp_path / "out", "--device", "cuda", "--baseline", "tau=0")
    _check_schema(report)
    evaluate.main([str(tiny["lazy"]), "--text", str(tiny["text"]), "--device", "cuda", "--max-tokens", "40",
                   "--context", "16", "--stride", "8", "--no-progress"])


def _broken_copy(tiny, folder: Path, **config_changes) -> str:
    import shutil

    shutil.copytree(tiny["lazy"], folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return str(folder)


def test_corrupt_or_inconsistent_model_folders_are_refused_in_one_line(tiny, tmp_path, capsys):
    """Truncated weights, a missing shard, a tensor shape that disagrees with config.json, a RoPE entry without its
    fields, a window the config class rejects, a config.json that is no object: one line each, in both tools."""
    text = str(tiny["text"])
    truncated = _broken_copy(tiny, tmp_path / "truncated")
    weights = Path(truncated, "model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-100])
    sharded = tmp_path / "sharded"
    LazyLlamaForCausalLM.from_pretrained(tiny["lazy"]).save_pretrained(sharded, max_shard_size="20KB")
    tiny["tokenizer"].save_pretrained(sharded)
    sorted(sharded.glob("model-*.safetensors"))[1].unlink()
    null = _broken_copy(tiny, tmp_path / "null")
    Path(null, "config.json").write_text("null")
    cases = [
        (truncated, "truncated cannot be loaded:"),
        (str(sharded), "sharded cannot be loaded:"),
        (_broken_copy(tiny, tmp_path / "shape", intermediate_size=48), "shape cannot be loaded:"),
        (_broken_copy(tiny, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0}),
         "yarn cannot be loaded:"),
        (_broken_copy(tiny, tmp_path / "window", lazy_bias_window=256.5), "lazy_bias_window"),
        (null, "config.json does not hold a JSON object"),
    ]
    for model, message in cases:
        for tool, extra in ((evaluate, ["--context", "16", "--max-tokens", "40", "--no-progress"]),
                            (inspect_attention, ["--tokens", "40", "--out", str(tmp_path / "out")])):
            error = _error_of(tool, [model, "--text", text, *extra], capsys)
            assert message in error and "\n" not in error, (model, error)


def test_unwritable_outputs_and_bad_map_layers_are_refused_before_any_measuring(tiny, tmp_path, capsys, monkeypatch):
    def measured(*args, **kwargs):
        raise AssertionError("the arguments should have been refused before measuring")

    monkeypatch.setattr(evaluate, "evaluate_perplexity", measured)
    monkeypatch.setattr(inspect_attention, "attention_statistics", measured)
    lazy, text = str(tiny["lazy"]), str(tiny["text"])
    for target, message in ((tmp_path / "no" / "such" / "r.json", "does not exist; create it"),
                            (tmp_path, "is a folder: give a file name")):
        error = _error_of(evaluate, [lazy, "--text", text, "--context", "16", "--json", str(target)], capsys)
        assert error.startswith("lazy-evaluate: error: --json") and message in error, error
    for layers, message in (("99", "map layers [99] out of range (models have [2] layers)"),
                            ("one", "--map-layers takes comma-separated layer numbers")):
        error = _error_of(inspect_attention, [lazy, "--text", text, "--tokens", "40", "--map-layers", layers,
                                              "--out", str(tmp_path / "out")], capsys)
        assert message in error, error
