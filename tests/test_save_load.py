"""Checkpoints: Auto-class round trip, dtypes, and trust_remote_code in a Python without our packages."""

import json
import os

import torch
from conftest import run_without_project, tiny_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM, LazyLlamaModel


def test_auto_round_trip_keeps_tau_and_bias(tmp_path, rng_seed):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "lazy_llama"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_lazy.LazyLlamaConfig",
        "AutoModel": "modeling_lazy.LazyLlamaModel",
        "AutoModelForCausalLM": "modeling_lazy.LazyLlamaForCausalLM",
        "AutoModelForSequenceClassification": "modeling_lazy.LazyLlamaForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_lazy.LazyLlamaForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_lazy.LazyLlamaForQuestionAnswering",
    }
    for name in ("configuration_lazy.py", "modeling_lazy.py", "lazy_attention_torch.py"):
        assert (tmp_path / name).is_file(), name
    assert not list(tmp_path.glob("*.bin")) and list(tmp_path.glob("*.safetensors"))

    assert isinstance(AutoConfig.from_pretrained(tmp_path), LazyLlamaConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # no trust_remote_code: the package is imported
    assert isinstance(loaded, LazyLlamaForCausalLM)
    assert loaded.config._attn_implementation == "lazy"
    for a, b in zip(model.model.layers, loaded.model.layers):  # loading never re-initialises tau / bias
        assert torch.equal(a.self_attn.tau, b.self_attn.tau)
        assert torch.equal(a.self_attn.distance_bias, b.self_attn.distance_bias)
    ids = torch.randint(3, 97, (2, 11))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    base = AutoModel.from_pretrained(tmp_path)
    assert isinstance(base, LazyLlamaModel)
    torch.testing.assert_close(base(ids).last_hidden_state, model.model(ids).last_hidden_state)


def test_bf16_load_keeps_lazy_parameters_float32(tmp_path):
    tiny_model(seed=3).save_pretrained(tmp_path)
    for dtype in (torch.bfloat16, torch.float16):
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.weight.dtype == dtype
        assert attn.tau.dtype == torch.float32 and attn.distance_bias.dtype == torch.float32
        logits = model(torch.randint(3, 97, (1, 9))).logits
        assert logits.dtype == dtype and torch.isfinite(logits).all()


def test_saving_a_half_precision_model_writes_lazy_parameters_float32(tmp_path):
    """`model.to(bf16)` casts every parameter but `tau`/`distance_bias`, which stay float32 (their values unrounded)
    and are saved so."""
    from safetensors import safe_open

    model = tiny_model(seed=4, tie_word_embeddings=True)
    tau = model.model.layers[1].self_attn.tau.detach().clone()
    model.save_pretrained(tmp_path / "fp32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    with safe_open(tmp_path / "fp32" / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
    with safe_open(tmp_path / "bf16" / "model.safetensors", framework="pt") as weights:
        assert set(weights.keys()) == names  # the same tensors (a tied lm_head is still left out)
        for name in names:
            expected = torch.float32 if name.rsplit(".", 1)[-1] in ("tau", "distance_bias") else torch.bfloat16
            assert weights.get_tensor(name).dtype == expected, name
        assert torch.equal(weights.get_tensor("model.layers.1.self_attn.tau"), tau)
        assert not torch.equal(tau, tau.to(torch.bfloat16).float())  # a bfloat16 round trip would have shown


def test_missing_lazy_parameters_are_initialised_from_config(tmp_path):
    """A checkpoint without tau / bias (e.g. a Llama) gets them from `_init_weights`, per the config."""
    from safetensors.torch import load_file, save_file

    tiny_model(seed=4).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.endswith(("tau", "distance_bias"))},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = LazyLlamaConfig.from_pretrained(tmp_path, lazy_tau_init=-0.25, lazy_bias_init_std=0.0)
    model = LazyLlamaForCausalLM.from_pretrained(tmp_path, config=config)
    for layer in model.model.layers:
        assert torch.all(layer.self_attn.tau == -0.25) and torch.all(layer.self_attn.distance_bias == 0)
    loaded_q = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(loaded_q, weights["model.layers.0.self_attn.q_proj.weight"])


REMOTE_SCRIPT = """
import sys, torch
from transformers import AutoModel, AutoModelForCausalLM
path, ids_path, out_path = sys.argv[1:4]
ids = torch.load(ids_path)
lm = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
base = AutoModel.from_pretrained(path, trust_remote_code=True)
assert type(lm).__name__ == "LazyLlamaForCausalLM" and type(lm).__module__.startswith("transformers_modules.")
assert type(base).__name__ == "LazyLlamaModel", type(base)
assert lm.config._attn_implementation == "lazy"
torch.save({"logits": lm(ids).logits, "hidden": base(ids).last_hidden_state}, out_path)
"""


def test_trust_remote_code_in_a_python_without_the_project(tmp_path, rng_seed):
    model = tiny_model()
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    ids = torch.randint(3, 97, (2, 10))
    torch.save(ids, tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    result = run_without_project(REMOTE_SCRIPT, [ckpt, tmp_path / "ids.pt", tmp_path / "out.pt"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["logits"], model(ids).logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out["hidden"], model.model(ids).last_hidden_state, atol=1e-6, rtol=1e-6)


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_an_interrupted_save_loses_nothing(tmp_path, monkeypatch, rng_seed):
    """A save that stops part way (here Ctrl-C while the code files are copied, after the weights and config are
    written) leaves no folder where there was none, and an earlier save untouched; no hidden folder stays behind."""
    import shutil

    copy = shutil.copyfile
    copied = []

    def interrupted(source, destination):
        if len(copied) == 3:
            raise KeyboardInterrupt
        copied.append(source)
        return copy(source, destination)

    new = tmp_path / "new"
    old = tmp_path / "old"
    tiny_model(seed=1).save_pretrained(old)
    (old / "notes.txt").write_text("mine")
    before = _files(old)
    model = tiny_model(seed=2)
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "copyfile", interrupted)
        for target in (new, old):
            copied.clear()
            try:
                model.save_pretrained(target)
            except KeyboardInterrupt:
                pass
            else:
                raise AssertionError("the interruption did not happen")
    assert not new.exists()
    assert _files(old) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_saving_over_a_folder_replaces_the_model_and_keeps_other_files(tmp_path, rng_seed):
    """A second save into the same folder: the new model loads (no weight file of the old save shadows it: shards
    after a single file, a single file after shards), and files that are not the model's stay."""
    folder = tmp_path / "model"
    for seed, shard in ((1, "20KB"), (2, None), (3, "20KB")):
        model = tiny_model(seed=seed)
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        (folder / "trainer_state.json").write_text("{}")
        weights = sorted(p.name for p in folder.glob("model[.-]*"))
        assert weights == (["model.safetensors"] if shard is None else
                           sorted([*(p.name for p in folder.glob("model-*-of-*.safetensors")),
                                   "model.safetensors.index.json"])), weights
        loaded = LazyLlamaForCausalLM.from_pretrained(folder)
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert (folder / "trainer_state.json").exists() and (folder / "modeling_lazy.py").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_save_killed_earlier_is_cleaned_up(tmp_path):
    """The hidden folder of a save whose process died (SIGKILL) goes at the next save into the same place; one of
    a live process stays."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".model.saving-{int(gone.stdout)}-0badcafe"
    alive = tmp_path / f".model.saving-{os.getpid()}-0badcafe"
    for leftover in (dead, alive):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"half")
    tiny_model(seed=0).save_pretrained(tmp_path / "model")
    assert not dead.exists() and alive.exists()
    assert LazyLlamaForCausalLM.from_pretrained(tmp_path / "model") is not None


def test_saving_through_a_link_to_a_folder_writes_into_that_folder(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    for seed in (1, 2):
        model = tiny_model(seed=seed)
        model.save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "config.json").is_file()
    loaded = LazyLlamaForCausalLM.from_pretrained(tmp_path / "link")
    assert all(torch.equal(t, loaded.state_dict()[n]) for n, t in model.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_an_existing_folder_is_kept_and_written_from_inside(tmp_path, monkeypatch):
    """An existing target may be a mount point or sit in a read-only parent, and has its own permissions: it is
    never renamed over, and the hidden folder is made inside it (on its file system), not beside it."""
    import shutil

    folder = tmp_path / "volume"
    folder.mkdir(mode=0o750)
    folder.chmod(0o750)
    dead = folder / ".saving-999999999-0badcafe"  # a save killed earlier, inside the folder (no such pid)
    dead.mkdir()
    renamed = []
    rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renamed.append(os.fspath(b)), rename(a, b))[1])
    copy = shutil.copyfile
    staged = []
    monkeypatch.setattr(shutil, "copyfile", lambda a, b: (staged.append(os.path.dirname(b)), copy(a, b))[1])
    model = tiny_model(seed=4)
    model.save_pretrained(folder)
    assert str(folder) not in renamed
    assert staged and all(os.path.dirname(path) == str(folder) for path in staged), staged
    assert (folder.stat().st_mode & 0o777) == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["volume"] and not list(folder.glob(".saving-*"))
    loaded = LazyLlamaForCausalLM.from_pretrained(folder)
    assert all(torch.equal(t, loaded.state_dict()[n]) for n, t in model.state_dict().items())


def test_a_variant_save_removes_that_variant_s_stale_shards_only(tmp_path):
    folder = tmp_path / "model"
    tiny_model(seed=1).save_pretrained(folder)  # the default variant: kept
    tiny_model(seed=2).save_pretrained(folder, variant="v1", max_shard_size="20KB")
    assert list(folder.glob("model.v1-*-of-*.safetensors")) and (folder / "model.safetensors.index.v1.json").exists()
    model = tiny_model(seed=3)
    model.save_pretrained(folder, variant="v1")
    weights = sorted(p.name for p in folder.glob("model[.-]*"))
    assert weights == ["model.safetensors", "model.v1.safetensors"], weights
    loaded = LazyLlamaForCausalLM.from_pretrained(folder, variant="v1")
    assert all(torch.equal(t, loaded.state_dict()[n]) for n, t in model.state_dict().items())
