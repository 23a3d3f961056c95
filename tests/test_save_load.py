"""Checkpoints: Auto-class round trip, dtypes, and trust_remote_code in a Python without our packages."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from conftest import tiny_model
from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM, LazyLlamaModel

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def test_auto_round_trip_keeps_tau_and_bias(tmp_path, rng_seed):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "lazy_llama"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_lazy.LazyLlamaConfig",
        "AutoModel": "modeling_lazy.LazyLlamaModel",
        "AutoModelForCausalLM": "modeling_lazy.LazyLlamaForCausalLM",
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


REMOTE_SCRIPT = textwrap.dedent("""
    import sys, torch
    try:
        import modeling_lazy  # must not be importable: the checkpoint's own code has to do the work
        raise SystemExit("project package leaked into the clean interpreter")
    except ImportError:
        pass
    from transformers import AutoModel, AutoModelForCausalLM
    path, ids_path, out_path = sys.argv[1:4]
    ids = torch.load(ids_path)
    lm = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    base = AutoModel.from_pretrained(path, trust_remote_code=True)
    assert type(lm).__name__ == "LazyLlamaForCausalLM", type(lm)
    assert type(base).__name__ == "LazyLlamaModel", type(base)
    assert lm.config._attn_implementation == "lazy"
    torch.save({"logits": lm(ids).logits, "hidden": base(ids).last_hidden_state}, out_path)
""")


def clean_python_env(tmp_path):
    """Environment for a subprocess that cannot see the project (no PYTHONPATH, user site off, own HF cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_"))}
    env["HF_HOME"] = str(tmp_path / "hf_home")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run_clean_python(script: str, args, tmp_path):
    """Run `script` with `-I` (isolated: no cwd, no PYTHONPATH) and the project's editable-install path hooks
    removed, from a temporary directory."""
    prelude = textwrap.dedent(f"""
        import sys
        root = {str(PROJECT_ROOT)!r}
        def project(path):  # the project tree, but not a virtual environment that happens to live inside it
            return path == root or (path.startswith(root + "/") and not path.startswith(sys.prefix))
        sys.path[:] = [p for p in sys.path if p and not project(p)]
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h).lower()]
        for key in [k for k in sys.path_importer_cache if project(k)]:
            del sys.path_importer_cache[key]
    """)
    script_path = tmp_path / "clean_script.py"
    script_path.write_text(prelude + script)
    return subprocess.run([sys.executable, "-I", str(script_path), *map(str, args)], cwd=tmp_path,
                          env=clean_python_env(tmp_path), capture_output=True, text=True, timeout=600)


def test_trust_remote_code_in_a_python_without_the_project(tmp_path, rng_seed):
    model = tiny_model()
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    ids = torch.randint(3, 97, (2, 10))
    torch.save(ids, tmp_path / "ids.pt")
    result = run_clean_python(REMOTE_SCRIPT, [ckpt, tmp_path / "ids.pt", tmp_path / "out.pt"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["logits"], model(ids).logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out["hidden"], model.model(ids).last_hidden_state, atol=1e-6, rtol=1e-6)
