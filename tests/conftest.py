"""Shared fixtures: tiny random LazyLlama models with hand-set, non-trivial tau and distance bias."""

import os
import random
import socket

import pytest
import torch

import modeling_lazy  # noqa: F401  (registers the Auto classes)
from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM


def tiny_config(**overrides) -> LazyLlamaConfig:
    values = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, lazy_bias_window=6, max_position_embeddings=256, rope_theta=10000.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    values.update(overrides)
    return LazyLlamaConfig(**values)


def randomize_lazy(model, tau_scale: float = 1.0, bias_scale: float = 0.5, generator=None) -> None:
    """Give every layer tau of both signs and a visible distance bias (fresh random values each call)."""
    with torch.no_grad():
        for layer in model.base_model.layers:  # a head or causal LM, or the base model itself
            attn = layer.self_attn
            attn.tau.copy_((torch.rand(attn.tau.shape, generator=generator) * 2 - 1) * tau_scale * 2)
            attn.distance_bias.normal_(0.0, bias_scale, generator=generator)


def tiny_model(seed=None, attn_implementation=None, **overrides) -> LazyLlamaForCausalLM:
    if seed is not None:
        torch.manual_seed(seed)
    model = LazyLlamaForCausalLM(tiny_config(**overrides))
    randomize_lazy(model)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model.eval()


def free_port() -> int:
    """A local TCP port free now, for a torchrun rendezvous (a fixed one fails when something else holds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SEED_ENV = "LAZY_LLAMA_TEST_SEED"


@pytest.fixture
def rng_seed(request):
    """Seeds torch for one test: a fresh seed each run, or `$LAZY_LLAMA_TEST_SEED` to replay a failure.

    The seed is reported with every failing test that uses this fixture (see `pytest_runtest_makereport`).
    """
    chosen = os.environ.get(SEED_ENV, "").strip()
    seed = int(chosen) if chosen else random.SystemRandom().randrange(2**31 - 1)
    torch.manual_seed(seed)
    request.node.stash[_SEED_KEY] = seed
    return seed


_SEED_KEY = pytest.StashKey[int]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Add the seed of `rng_seed` to the report of a failing test, with the command that replays it."""
    report = yield
    seed = item.stash.get(_SEED_KEY, None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"{SEED_ENV}={seed} python -m pytest '{item.nodeid}'"))
    return report


PROJECT_PACKAGES = ("modeling_lazy", "configuration_lazy", "conversion", "lazy_llama_tools")


def run_without_project(script: str, args=(), *, cwd, env, timeout: int = 600):
    """Run `script` in a fresh interpreter that has the environment's packages but cannot import this project.

    `-I -S`: no cwd or PYTHONPATH on sys.path and no `.pth` files (the editable install is one); the
    site-packages directory is then appended by hand. The script first proves the project is unreachable.
    """
    import subprocess
    import sys
    import sysconfig
    import textwrap
    from pathlib import Path

    prelude = textwrap.dedent(f"""
        import sys
        sys.path.append({sysconfig.get_paths()["purelib"]!r})
        for _package in {PROJECT_PACKAGES!r}:
            try:
                __import__(_package)
            except ImportError:
                continue
            raise SystemExit(f"the clean interpreter can import {{_package}}: the test would prove nothing")
    """)
    path = Path(cwd) / "clean_script.py"
    path.write_text(prelude + textwrap.dedent(script))
    return subprocess.run([sys.executable, "-I", "-S", str(path), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
