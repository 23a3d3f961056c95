"""A failing test that uses `rng_seed` reports its seed, and `LAZY_LLAMA_TEST_SEED` replays the same random inputs."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE = "tests/seed_replay_case.py"


def _run_case(seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LAZY_LLAMA_TEST_SEED"}
    if seed is not None:
        env["LAZY_LLAMA_TEST_SEED"] = seed
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", CASE], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stdout + result.stderr  # the case fails on purpose
    return result.stdout


def test_failure_report_names_the_seed_and_the_replay_command():
    out = _run_case(None)
    shown = re.search(r"seed (\d+), torch initial seed (\d+), first draw (\S+)", out)
    assert shown and shown[1] == shown[2], out
    assert f"LAZY_LLAMA_TEST_SEED={shown[1]} python -m pytest '{CASE}::test_fails_and_shows_its_seed'" in out, out

    replay = _run_case(shown[1])
    again = re.search(r"seed (\d+), torch initial seed (\d+), first draw (\S+)", replay)
    assert again and again.groups() == shown.groups(), replay
