"""Fine-tuning with `transformers.Trainer` (`lazy_llama_tools.finetune`) on a tiny LazyLlama: packing and labels, loss
decrease, parameter groups, `lazy-only`, resume, PEFT LoRA, and a 2-process CPU DDP run (torchrun, gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port
from finetune_fixtures import write_corpora, write_tiny_model
from safetensors.torch import load_file
from transformers import TrainingArguments

import modeling_lazy  # noqa: F401
from lazy_llama_tools import finetune
from lazy_llama_tools.finetune import (
    LazyAttentionCallback,
    PackedBlockCollator,
    build_trainer,
    configure_trainable,
    load_documents,
    load_model,
    packed_dataset,
)
from modeling_lazy import is_lazy_parameter

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 64


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    files = write_corpora(root / "data")
    model_dir = write_tiny_model(root / "model")
    _, tokenizer = load_model(str(model_dir))
    train = packed_dataset(load_documents([str(files["train"])]), tokenizer, BLOCK)
    evaluation = packed_dataset(load_documents([str(files["eval"])]), tokenizer, BLOCK)
    return {"root": root, "files": files, "model_dir": model_dir, "train": train, "eval": evaluation}


def training_args(output_dir, **overrides) -> TrainingArguments:
    values = dict(output_dir=str(output_dir), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  max_steps=6, learning_rate=3e-3, weight_decay=0.1, logging_steps=1, save_strategy="no",
                  report_to="none", disable_tqdm=True, seed=0, use_cpu=True, dataloader_num_workers=0)
    values.update(overrides)
    return TrainingArguments(**values)


def fresh_model(workspace):
    return load_model(str(workspace["model_dir"]))[0]


def lazy_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if is_lazy_parameter(n)}


def test_packed_blocks_keep_documents_apart(workspace):
    """Positions restart per document, labels ignore each document's first token, and the loss of a packed block
    equals the loss of its documents scored one by one."""
    model = fresh_model(workspace).eval()
    batch = PackedBlockCollator()([workspace["train"][i] for i in range(2)])
    pos, labels = batch["position_ids"], batch["labels"]
    assert pos.shape == (2, BLOCK) and (pos[:, 0] == 0).all()
    assert int((pos == 0).sum()) >= 4, "the blocks should hold document boundaries"
    assert torch.equal(labels == -100, pos == 0)

    with torch.no_grad():
        packed = model(**batch).loss
        nll, count = 0.0, 0
        for row in range(2):
            starts = (pos[row] == 0).nonzero().flatten().tolist() + [BLOCK]
            for begin, end in zip(starts[:-1], starts[1:]):
                if end - begin < 2:
                    continue
                ids = batch["input_ids"][row : row + 1, begin:end]
                nll += model(input_ids=ids, labels=ids).loss.item() * (end - begin - 1)
                count += end - begin - 1
    torch.testing.assert_close(packed.item(), nll / count, rtol=1e-5, atol=1e-5)


def test_full_mode_loss_decreases_with_lazy_param_group(workspace, tmp_path):
    model = fresh_model(workspace)
    args = training_args(tmp_path, max_steps=20, learning_rate=3e-3)
    trainer = build_trainer(model, args, workspace["train"], lazy_lr_multiplier=5.0, stats_every_n_logs=10)
    assert isinstance(trainer.callback_handler.callbacks[0], LazyAttentionCallback)

    # tau and distance_bias get gradients.
    batch = PackedBlockCollator()([workspace["train"][i] for i in range(4)])
    model(**batch).loss.backward()
    for name, param in lazy_params(model).items():
        assert param.grad is not None and param.grad.abs().sum() > 0 and torch.isfinite(param.grad).all(), name
    model.zero_grad(set_to_none=True)

    trainer.train()
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    lazy_ids = {id(p) for p in lazy_params(model).values()}
    assert {id(p) for p in groups["lazy"]["params"]} == lazy_ids
    assert groups["lazy"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    assert groups["lazy"]["initial_lr"] == pytest.approx(5 * groups["decay"]["initial_lr"])
    assert not lazy_ids & {id(p) for p in groups["decay"]["params"] + groups["no_decay"]["params"]}
    assert not any(is_lazy_parameter(n) for n in trainer.get_decay_parameter_names(model))

    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    logged = next(e for e in trainer.state.log_history if "loss" in e)
    assert {"lazy/sparsity", "lazy/sink", "lazy/tau", "lazy/sparsity/layer_01", "lazy/tau/layer_00"} <= set(logged)


def test_lazy_only_changes_nothing_else(workspace, tmp_path):
    """Only tau and distance_bias move (with weight decay on and gradient checkpointing)."""
    model = configure_trainable(fresh_model(workspace), "lazy-only")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = training_args(tmp_path, max_steps=4, learning_rate=1e-2, gradient_checkpointing=True)
    trainer = build_trainer(model, args, workspace["train"], workspace["eval"], lazy_lr_multiplier=2.0)
    trainer.train()
    assert [g["name"] for g in trainer.optimizer.param_groups] == ["lazy"]
    for name, param in model.named_parameters():
        if is_lazy_parameter(name):
            assert not torch.equal(param, before[name]), f"{name} did not train"
        else:
            assert torch.equal(param, before[name]), f"{name} changed in lazy-only mode"
    metrics = trainer.evaluate()
    assert "eval_perplexity" in trainer.state.log_history[-1] and "eval_lazy/sparsity" in trainer.state.log_history[-1]
    assert metrics["eval_loss"] > 0


def test_resume_continues_from_saved_step(workspace, tmp_path):
    common = dict(max_steps=6, save_strategy="steps", save_steps=3)
    straight = build_trainer(fresh_model(workspace), training_args(tmp_path / "a", **common), workspace["train"])
    straight.train()
    assert (tmp_path / "a" / "checkpoint-3").is_dir()

    resumed = build_trainer(fresh_model(workspace), training_args(tmp_path / "b", **common), workspace["train"])
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    steps = [e["step"] for e in resumed.state.log_history if "loss" in e]
    assert steps[0] == 1 and steps[-3:] == [4, 5, 6]  # history up to step 3 comes from the checkpoint
    assert resumed.state.global_step == 6
    straight_losses = {e["step"]: e["loss"] for e in straight.state.log_history if "loss" in e}
    for entry in resumed.state.log_history:
        if "loss" in entry:
            assert entry["loss"] == pytest.approx(straight_losses[entry["step"]], rel=1e-5)
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("train_lazy", [True, False], ids=["lora+tau/bias", "lora-only"])
def test_peft_lora_run(workspace, tmp_path, train_lazy):
    """LoRA mode trains the adapters and (by default) tau/distance_bias beside them, nothing else; the saved
    adapter loaded with plain `PeftModel.from_pretrained` on a fresh base reproduces the trained model's logits
    (an adapter saved by PEFT alone would lose tau and bias: checked, so the comparison can fail)."""
    peft = pytest.importorskip("peft")
    model = configure_trainable(fresh_model(workspace), "lora", lora_r=4, lora_alpha=8, lora_train_lazy=train_lazy)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = training_args(tmp_path / "out", max_steps=4, learning_rate=1e-2, save_strategy="steps", save_steps=4)
    trainer = build_trainer(model, args, workspace["train"])
    trainer.train()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in trained if "lora_" not in n} == ({n for n in before if is_lazy_parameter(n)} if train_lazy
                                                          else set())
    for name, param in model.named_parameters():
        if name in trained and ("lora_B" in name or is_lazy_parameter(name)):  # lora_B starts at 0; both must move
            assert not torch.equal(param, before[name]), f"{name} did not train"
        elif name not in trained:
            assert torch.equal(param, before[name]), f"frozen {name} changed"
    assert all(e["loss"] == e["loss"] for e in trainer.state.log_history if "loss" in e)  # finite, not NaN
    assert "lazy/sparsity" in next(e for e in trainer.state.log_history if "loss" in e)
    trainer.save_model()
    out = tmp_path / "out"
    assert (out / "adapter_config.json").is_file()
    stored = load_file(out / finetune.ADAPTER_WEIGHTS)
    lazy_keys = {k for k in stored if is_lazy_parameter(k)}
    assert len(lazy_keys) == (4 if train_lazy else 0)
    assert lazy_keys <= set(load_file(out / "checkpoint-4" / finetune.ADAPTER_WEIGHTS))  # checkpoints carry them

    ids = torch.tensor(workspace["train"][0]["input_ids"])[None, :32]
    model.eval()
    with torch.no_grad():
        want = model(ids).logits
        reloaded = peft.PeftModel.from_pretrained(fresh_model(workspace), str(out)).eval()
        torch.testing.assert_close(reloaded(ids).logits, want, atol=1e-5, rtol=1e-5)
        if train_lazy:  # what PEFT's own save gives: the base's tau and bias, other logits
            model.save_pretrained(tmp_path / "plain")
            plain = peft.PeftModel.from_pretrained(fresh_model(workspace), str(tmp_path / "plain")).eval()
            assert (plain(ids).logits - want).abs().max() > 1e-3


def test_lora_command_saves_tau_and_bias_with_the_adapter_and_announces_the_final_evaluation(workspace, tmp_path,
                                                                                              capsys):
    """`lazy-finetune MODEL --mode lora`: the output folder's adapter carries the trained tau/distance_bias, the
    plain PEFT load on a fresh base gives the trained values, and the final evaluation prints its progress lines."""
    peft = pytest.importorskip("peft")
    out = tmp_path / "out"
    finetune.main([str(workspace["model_dir"]), "--mode", "lora", "--train-file", str(workspace["files"]["train"]),
                   "--eval-file", str(workspace["files"]["eval"]), "--output-dir", str(out), "--block-size",
                   str(BLOCK), "--max-train-blocks", "4", "--max-eval-blocks", "2", "--per-device-train-batch-size",
                   "2", "--max-steps", "2", "--learning-rate", "1e-2", "--lazy-lr-multiplier", "5", "--save-strategy",
                   "no", "--report-to", "none", "--disable-tqdm", "true", "--use-cpu", "true",
                   "--dataloader-num-workers", "0", "--stats-tokens", "16"])
    err = capsys.readouterr().err
    assert f"lazy-finetune: final evaluation on 2 blocks of {BLOCK} tokens ..." in err
    assert "lazy-finetune: eval_loss " in err and ", perplexity " in err
    stored = load_file(out / finetune.ADAPTER_WEIGHTS)
    base = fresh_model(workspace)
    reloaded = peft.PeftModel.from_pretrained(fresh_model(workspace), str(out))
    moved = 0
    for name, param in reloaded.named_parameters():
        if is_lazy_parameter(name):
            assert torch.equal(param, stored[name]), name
            moved += not torch.equal(param, base.get_parameter(name.removeprefix("base_model.model.")))
    assert moved == 4  # every tau and distance_bias tensor trained and came back


def test_modules_to_save_naming_tau_or_bias_warns(workspace, tmp_path):
    """PEFT's `modules_to_save=["tau", "distance_bias"]` matches no module and trains nothing: saying so."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["tau", "distance_bias"])
    model = peft.get_peft_model(fresh_model(workspace), config)
    assert not any(p.requires_grad for n, p in model.named_parameters() if is_lazy_parameter(n))  # what PEFT does
    with pytest.warns(UserWarning, match=r"modules_to_save=\['distance_bias', 'tau'\] matches no module"):
        build_trainer(model, training_args(tmp_path, max_steps=1), workspace["train"])
    with pytest.warns(UserWarning, match="matches no module"):
        finetune.save_lora_adapter(model, tmp_path / "adapter")


def _cli(workspace, output_dir, batch_per_device):
    return ["-m", "lazy_llama_tools.finetune", str(workspace["model_dir"]),
            "--train-file", str(workspace["files"]["train"]), "--eval-file", str(workspace["files"]["eval"]),
            "--output-dir", str(output_dir), "--block-size", str(BLOCK), "--max-train-blocks", "8",
            "--max-eval-blocks", "4", "--per-device-train-batch-size", str(batch_per_device),
            "--per-device-eval-batch-size", "2", "--max-steps", "1", "--logging-steps", "1", "--save-strategy", "no",
            "--report-to", "none", "--disable-tqdm", "true", "--use-cpu", "true", "--seed", "0",
            "--dataloader-num-workers", "0", "--lazy-lr-multiplier", "3", "--stats-tokens", "32"]


def test_torchrun_two_process_gloo_matches_single_process(workspace, tmp_path):
    """One step on a global batch of 8 blocks (the whole 8-block training set, so sampling order cannot matter):
    torchrun with 2 CPU processes (gloo, 4 blocks each) gives the loss and the weights of one process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    subprocess.run([sys.executable, *_cli(workspace, single, 8)], cwd=ROOT, env=env, check=True, timeout=300,
                   capture_output=True)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         *_cli(workspace, ddp, 4), "--ddp-backend", "gloo"],
        cwd=ROOT, env=env, timeout=300, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    states = [json.loads((d / "trainer_state.json").read_text()) for d in (single, ddp)]
    losses = [next(e["loss"] for e in s["log_history"] if "loss" in e) for s in states]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    assert all("eval_perplexity" in s["log_history"][-1] for s in states)
    weights = [load_file(str(d / "model.safetensors")) for d in (single, ddp)]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_bad_input_is_refused_in_one_line_before_tokenising(workspace, tmp_path, monkeypatch):
    def tokenised(*args, **kwargs):
        raise AssertionError("the input should have been refused before tokenising")

    monkeypatch.setattr(finetune, "packed_dataset", tokenised)
    train = str(workspace["files"]["train"])
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n \t\n")
    (tmp_path / "latin1.txt").write_bytes("un café au lait\n".encode("latin-1"))
    cases = [
        (["--train-file", str(tmp_path / "missing.txt")], "does not exist"),
        (["--train-file", str(tmp_path / "empty.txt")], "is empty"),
        (["--train-file", str(tmp_path / "blank.txt")], "holds only whitespace"),
        (["--train-file", str(tmp_path / "latin1.txt")], "is not UTF-8 text (invalid byte at offset 6)"),
        (["--train-file", train, "--eval-file", str(tmp_path / "empty.txt")], "--eval-file"),
        (["--train-file", train, "--block-size", "0"], "--block-size must be at least 2"),
        (["--train-file", train, "--block-size", "100000"], "more than the model's max_position_embeddings (512)"),
        (["--train-file", train, "--resume-from-checkpoint", str(tmp_path / "nope")], "no such checkpoint folder"),
    ]
    model = str(workspace["model_dir"])
    common = ["--output-dir", str(tmp_path / "out"), "--block-size", str(BLOCK), "--max-steps", "1", "--report-to",
              "none", "--use-cpu", "true"]
    runs = [([model, *common, *extra], message) for extra, message in cases]
    runs.append(([str(tmp_path / "no-model"), *common, "--train-file", train], "no-model: no such folder"))
    for argv, message in runs:
        with pytest.raises(SystemExit) as exit_info:
            finetune.main(argv)
        text = str(exit_info.value.code)
        assert text.startswith("lazy-finetune: error:") and message in text and "\n" not in text, (argv, text)


def test_hangup_stops_training_in_one_line_and_last_skips_an_incomplete_checkpoint(workspace, tmp_path,
                                                                                     monkeypatch, capsys):
    import shutil
    import signal

    from transformers import TrainerCallback

    class HangUpAtStep3(TrainerCallback):  # the terminal is closed during step 3 (checkpoint-2 is saved)
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                os.kill(os.getpid(), signal.SIGHUP)

    build = finetune.build_trainer
    monkeypatch.setattr(finetune, "build_trainer", lambda *args, **kwargs: build(*args, **kwargs,
                                                                                 callbacks=[HangUpAtStep3()]))
    out = tmp_path / "out"
    argv = [str(workspace["model_dir"]), "--train-file", str(workspace["files"]["train"]),
            "--output-dir", str(out), "--block-size", str(BLOCK), "--max-train-blocks", "8",
            "--per-device-train-batch-size", "2", "--save-strategy", "steps", "--save-steps", "2",
            "--logging-steps", "50", "--report-to", "none", "--disable-tqdm", "true", "--use-cpu", "true",
            "--dataloader-num-workers", "0", "--stats-tokens", "16"]

    def unhandled(*args):
        raise AssertionError("lazy-finetune does not handle SIGHUP")

    previous = signal.signal(signal.SIGHUP, unhandled)
    try:
        with pytest.raises(SystemExit) as exit_info:
            finetune.main(argv + ["--max-steps", "50"])
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert exit_info.value.code == 130
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lazy-finetune")]
    assert lines == [f"lazy-finetune: interrupted; the newest complete checkpoint is {out / 'checkpoint-2'}: "
                     "continue with --resume-from-checkpoint last."]
    # a save that was killed half-way: checkpoint-4 without its trainer_state.json
    (out / "checkpoint-4").mkdir()
    shutil.copy(out / "checkpoint-2" / "model.safetensors", out / "checkpoint-4")
    monkeypatch.setattr(finetune, "build_trainer", build)
    finetune.main(argv + ["--max-steps", "4", "--resume-from-checkpoint", "last"])
    assert f"skipping {out / 'checkpoint-4'}: incomplete" in capsys.readouterr().err
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and (out / "checkpoint-4" / "trainer_state.json").is_file()
    # resuming with other trainable parameters (another --mode): torch refuses the optimizer state; one line
    with pytest.raises(SystemExit) as exit_info:
        finetune.main(argv + ["--max-steps", "6", "--resume-from-checkpoint", "last", "--mode", "lazy-only"])
    message = str(exit_info.value.code)
    assert message.startswith(f"lazy-finetune: error: {out / 'checkpoint-4'} was saved by a run with other "
                              "trainable parameters") and "--mode" in message and "\n" not in message, message


def test_a_stale_gguf_quantization_note_does_not_stop_training_or_saving(workspace, tmp_path):
    """A folder saved from a GGUF rebuild may still say `quantization_config: gguf` although its tensors are plain:
    the loaders drop the note, so Trainer accepts the model and a loaded model can be saved again."""
    import shutil

    from lazy_llama_tools.loading import load_causal_lm

    folder = tmp_path / "noted"
    shutil.copytree(workspace["model_dir"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    model = load_model(str(folder))[0]
    build_trainer(model, training_args(tmp_path / "out"), workspace["train"])  # Trainer refuses "quantized" models
    loaded = load_causal_lm(str(folder), device="cpu")
    assert not getattr(loaded, "is_quantized", False)
    loaded.save_pretrained(tmp_path / "again")


def _refusal(argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        finetune.main(argv)
    text = str(exit_info.value.code)
    assert text.startswith("lazy-finetune: error:") and "\n" not in text, (argv, text)
    return text


def _model_copy(workspace, folder, **config_changes) -> str:
    import shutil

    shutil.copytree(workspace["model_dir"], folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return str(folder)


def test_unusable_or_foreign_model_folders_are_refused_in_one_line_before_any_model_is_built(workspace, tmp_path,
                                                                                              monkeypatch):
    """Missing or corrupt files, a config LazyLlamaConfig rejects, no tokenizer, and checkpoints that are no Llama
    (refused by the converter's own check): one line each; a foreign architecture before any model is built."""
    def no_training(*args, **kwargs):
        raise AssertionError("the model should have been refused before tokenising")

    monkeypatch.setattr(finetune, "packed_dataset", no_training)
    common = ["--train-file", str(workspace["files"]["train"]), "--output-dir", str(tmp_path / "out"),
              "--block-size", str(BLOCK), "--max-steps", "1", "--report-to", "none", "--use-cpu", "true"]
    no_weights = _model_copy(workspace, tmp_path / "noweights")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    not_json = _model_copy(workspace, tmp_path / "notjson")
    Path(not_json, "config.json").write_text("{bad")
    null = _model_copy(workspace, tmp_path / "null")
    Path(null, "config.json").write_text("null")
    truncated = _model_copy(workspace, tmp_path / "truncated")
    weights = Path(truncated, "model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-100])
    no_tokenizer = _model_copy(workspace, tmp_path / "notokenizer")
    for path in Path(no_tokenizer).glob("tokenizer*"):
        path.unlink()
    cases = [
        (no_weights, "noweights cannot be loaded: Error no file named model.safetensors"),
        (not_json, "is not a valid JSON file"),
        (null, "null cannot be loaded: config.json does not hold a JSON object"),
        (truncated, "truncated cannot be loaded:"),
        (no_tokenizer, "no tokenizer could be loaded from"),
        (_model_copy(workspace, tmp_path / "heads", num_key_value_heads=3), "a multiple of num_key_value_heads"),
        (_model_copy(workspace, tmp_path / "window", lazy_bias_window=256.5), "lazy_bias_window"),
    ]
    for model, message in cases:
        assert message in _refusal([model, *common]), model

    def built(*args, **kwargs):
        raise AssertionError("a model was built for a checkpoint that is no Llama")

    monkeypatch.setattr(modeling_lazy.LazyLlamaForCausalLM, "from_pretrained", built)
    foreign = [
        (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), "unsupported architecture: model_type 'qwen2'"),
        (dict(model_type="llama", sliding_window=8), "sliding-window attention"),
        (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type 'gpt2'"),
    ]
    for index, (changes, message) in enumerate(foreign):
        text = _refusal([_model_copy(workspace, tmp_path / f"foreign{index}", **changes), *common])
        assert message in text and "lazy-finetune trains a LazyLlama, or a Llama" in text


def test_bad_data_and_options_are_refused_in_one_line(workspace, tmp_path, monkeypatch):
    """Malformed JSON lines, a record whose text is no string, an --output-dir that is a file or cannot be written,
    a folder that is no checkpoint, LoRA target modules the model lacks."""
    import errno

    (tmp_path / "bad.jsonl").write_text('{"text": "hello"}\nnot json\n')
    (tmp_path / "number.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(finetune.FinetuneError, match=r"bad.jsonl: not valid JSON lines \(.*\): give one JSON object"):
        load_documents([str(tmp_path / "bad.jsonl")])
    with pytest.raises(finetune.FinetuneError, match="field 'text' must hold text"):
        load_documents([str(tmp_path / "number.jsonl")])
    with pytest.raises(finetune.FinetuneError, match="pass --text-column"):
        load_documents([str(workspace["files"]["eval"])], text_column="body")
    with pytest.raises(finetune.FinetuneError, match="LoRA cannot be set up with target modules"):
        configure_trainable(fresh_model(workspace), "lora", lora_target_modules=["nope"])

    def no_training(*args, **kwargs):
        raise AssertionError("the input should have been refused before tokenising")

    monkeypatch.setattr(finetune, "packed_dataset", no_training)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "notacheckpoint").mkdir()
    model, train = str(workspace["model_dir"]), str(workspace["files"]["train"])
    common = [model, "--train-file", train, "--block-size", str(BLOCK), "--max-steps", "1", "--report-to", "none",
              "--use-cpu", "true"]
    assert "is a file, not a folder" in _refusal([*common, "--output-dir", str(tmp_path / "afile")])
    assert "is not a complete checkpoint (no trainer_state.json)" in _refusal(
        [*common, "--output-dir", str(tmp_path / "o"), "--resume-from-checkpoint", str(tmp_path / "notacheckpoint")])

    def read_only(target):
        raise OSError(errno.EROFS, "Read-only file system", str(target))

    monkeypatch.setattr(finetune, "temporary_folder", read_only)
    assert "cannot be written (Read-only file system)" in _refusal([*common, "--output-dir", str(tmp_path / "ro")])


def test_final_model_is_built_beside_the_output_and_holds_no_pickle(workspace, tmp_path, monkeypatch):
    """The final save goes to a hidden folder beside --output-dir and moves in when complete: a save that fails
    (a full disk) leaves a fresh output folder absent, with one line; a finished one holds safetensors and JSON
    only (no training_args.bin), with the modes the umask allows, as the converter's outputs."""
    import errno
    import stat

    out = tmp_path / "out"
    argv = [str(workspace["model_dir"]), "--train-file", str(workspace["files"]["train"]), "--output-dir", str(out),
            "--block-size", str(BLOCK), "--max-train-blocks", "2", "--per-device-train-batch-size", "2",
            "--max-steps", "1", "--save-strategy", "no", "--report-to", "none", "--disable-tqdm", "true",
            "--use-cpu", "true", "--dataloader-num-workers", "0", "--stats-tokens", "16"]
    save = finetune.LazyTrainer.save_model

    def disk_full(self, output_dir=None, _internal_call=False):
        save(self, output_dir, _internal_call)
        raise OSError(errno.ENOSPC, "No space left on device", output_dir)

    monkeypatch.setattr(finetune.LazyTrainer, "save_model", disk_full)
    assert "cannot write the final model to" in _refusal(argv)
    assert not out.exists() or not any(out.iterdir())
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []

    monkeypatch.setattr(finetune.LazyTrainer, "save_model", save)
    finetune.main(argv)
    names = {path.name for path in out.iterdir()}
    assert {"model.safetensors", "config.json", "trainer_state.json", finetune.TRAINING_ARGS_JSON} <= names
    assert not [name for name in names if name.endswith((".bin", ".pt", ".pth", ".pkl"))], names
    assert json.loads((out / finetune.TRAINING_ARGS_JSON).read_text())["max_steps"] == 1
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []
