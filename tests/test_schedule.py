"""The inner lr schedule: optim.decay_steps lets a run go on past another's step count at the
floor lr, repeating the shorter run exactly over the steps they share."""

from __future__ import annotations

import pytest

from frugaltrain.optim import lr_factor
from frugaltrain.sim import SimSection, simulate


def test_the_lr_stays_at_its_floor_past_the_decay():
    assert lr_factor(11, 12, 2, 0.1) > 0.1
    assert [lr_factor(s, 12, 2, 0.1) for s in (12, 13, 40)] == [pytest.approx(0.1)] * 3


def _rounds(make_config, *sets: str) -> list[dict]:
    """The simulated run's round records, less the host's own wall clock."""
    records = simulate(make_config(*sets), SimSection()).records
    return [
        {k: v for k, v in r.items() if k != "time/real_s"}
        for r in records
        if r.get("kind") == "round"
    ]


STRATEGIES = {
    "diloco": ("outer.strategy='diloco'",),
    "streaming": ("outer.strategy='streaming'", "model.n_layer=2", "outer.streaming.fragments=2"),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_longer_run_repeats_the_shorter_one_over_their_shared_steps(make_config, strategy):
    sets = ("run.workers=2", *STRATEGIES[strategy])
    short = _rounds(make_config, *sets, "run.steps=12")
    long = _rounds(make_config, *sets, "run.steps=24", "optim.decay_steps=12")
    assert [r for r in long if r["step"] <= 12] == short
    assert long[-1]["step"] == 24
    # without decay_steps the 24-step run decays over 24 steps: a different run from step 1
    other = _rounds(make_config, *sets, "run.steps=24")
    assert other[0]["loss/train"] != short[0]["loss/train"]
