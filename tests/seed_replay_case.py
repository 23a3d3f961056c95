"""Not collected by a normal run (no `test_` prefix): `test_seed_replay.py` runs it in a child pytest on purpose."""

import torch


def test_fails_and_shows_its_seed(rng_seed):
    first_draw = torch.rand(()).item()
    assert False, f"seed {rng_seed}, torch initial seed {torch.initial_seed()}, first draw {first_draw!r}"
