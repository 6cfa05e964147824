"""benchmarks/chaos.py's pure parts, without root or namespaces: its schedule is a function of the
seed alone, keeps its spacing and two machines training at all times, fills every freed slot
again before the end and holds every kind of event over the default 15 minutes; its figures
count each kind's events, measure each event's time lost over the rounds around it, and count
rounds logged twice and missing, on a small made-up run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chaos():
    """benchmarks/chaos.py as `python benchmarks/chaos.py` runs it: its directory on the module
    search path, where it finds machines.py and provenance.py."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("chaos", ROOT / "benchmarks" / "chaos.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["chaos"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def default(chaos, seed: int = 0):
    return chaos.schedule(seed, 4, 15 * 60)


def test_the_schedule_is_the_seeds_alone(chaos):
    assert default(chaos) == default(chaos)
    assert default(chaos) != default(chaos, seed=1)


@pytest.mark.parametrize("seed", range(20))
def test_events_keep_their_spacing_and_two_machines_training(chaos, seed):
    plan = default(chaos, seed)
    gaps = [b.t - a.t for a, b in zip(plan, plan[1:], strict=False)]
    assert plan[0].t >= 30 and min(gaps) >= 30 - 0.1  # times are rounded to 0.1 s
    assert plan[-1].t <= 15 * 60 - 30 + 0.1  # the tail holds no event
    assert min(n for _, n in chaos.training(plan, 4)) >= 2
    live = set(range(4))
    for e in plan:
        if e.kind in ("kill", "partition"):
            assert e.machine in live and len(live) >= 3
        if e.kind == "kill":
            live.remove(e.machine)
        if e.kind == "join":
            assert e.machine not in live and len(live) < 4  # a new machine, into a free slot
            live.add(e.machine)
        if e.kind == "partition":
            assert 3 <= e.hold_s <= 8
        if e.kind == "coordinator restart":
            assert e.machine == -1 and 1 <= e.hold_s <= 5
    assert len(live) == 4  # every freed slot is held again at the end


def test_every_kind_over_the_default_fifteen_minutes(chaos):
    assert {e.kind for e in default(chaos)} == set(chaos.KINDS)


def test_too_few_machines_or_gaps_that_cannot_hold_are_refused(chaos):
    with pytest.raises(ValueError, match="--machines 2"):
        chaos.schedule(0, 2, 900)
    with pytest.raises(ValueError, match="--min-gap"):
        chaos.schedule(0, 4, 900, min_gap_s=50, mean_gap_s=40)


def rounds(wall: list[float], first: int = 1) -> list[dict]:
    """Round records of one worker's clock from round `first` on."""
    return [{"kind": "round", "round": first + i, "time/wall_s": w} for i, w in enumerate(wall)]


def test_figures_on_a_small_run(chaos):
    # Two machines, 12 rounds of 1 s but round 5 (3 s: a kill's rendezvous) and round 10 (2 s:
    # a join's admission); round 9 follows a checkpoint (1.5 s). Machine b's clock is its own.
    a = [1, 2, 3, 4, 7, 8, 9, 10, 11.5, 13.5, 14.5, 15.5]
    b = [w + 100 + 0.5 * (i >= 4) for i, w in enumerate(a)]  # round 5: 3.5 s, the median 3.25
    logs = [rounds(a), rounds(b)]
    left = {"kind": "membership", "event": "left", "round": 4, "reason": "no heartbeat for 5 s"}
    joined = {"kind": "membership", "event": "joined", "round": 8}
    run = [*rounds(a), left, joined, *rounds([16.5], first=12)]  # round 12 logged twice
    run = [r for r in run if r.get("round") != 7]  # and round 7 missing
    done = [
        {"kind": "kill", "survived": True, "r_at": 3, "r_ok": 6},
        {"kind": "join", "survived": True, "r_at": 6, "r_ok": 9, "join_s": 12.0},
        {"kind": "partition", "survived": False, "r_at": 11, "error": "no rounds"},
    ]
    plan = [
        chaos.Event(10, "kill", 1),
        chaos.Event(40, "join", 4),
        chaos.Event(70, "partition", 0, 5.0),
        chaos.Event(100, "coordinator restart", -1, 2.0),
    ]
    base = {"plain": 1.0, "eval": 1.5}
    f = chaos.figures(plan, done, logs, run, base, extra={8}, rounds=12)

    assert done[0]["window"] == [4, 5, 6] and done[0]["lost_s"] == pytest.approx(2.25)
    assert done[0]["detected_by"] == "heartbeat"
    assert done[1]["window"] == [9, 10] and done[1]["lost_s"] == pytest.approx(1.0)
    assert done[2]["window"] is None and done[2]["lost_s"] is None
    kill, join = f["by_kind"]["kill"], f["by_kind"]["join"]
    assert (kill["scheduled"], kill["run"], kill["survived"]) == (1, 1, 1)
    assert kill["lost_mean_s"] == kill["lost_worst_s"] == pytest.approx(2.25)
    assert (join["survived"], join["lost_worst_s"]) == (1, pytest.approx(1.0))
    part, coord = f["by_kind"]["partition"], f["by_kind"]["coordinator restart"]
    assert (part["scheduled"], part["run"], part["survived"], part["lost_mean_s"]) == (
        1,
        1,
        0,
        None,
    )
    assert (coord["scheduled"], coord["run"]) == (1, 0)
    assert f["join_s"] == {"mean": 12.0, "worst": 12.0}
    assert f["rounds"] == {"expected": 12, "logged": 11, "logged_more_than_once": 1, "missing": 1}


def test_a_coordinator_restarts_window_runs_to_two_rounds_past_its_return(chaos):
    ev = {"kind": "coordinator restart", "r_at": 20, "r_back": 21, "r_ok": 25}
    assert chaos.window(ev, []) == [21, 22, 23]


def test_same_is_bit_for_bit(chaos):
    import torch

    x = torch.tensor([1.0, 2.0])
    assert chaos.same({"m": [x, 1]}, {"m": [x.clone(), 1]})
    assert not chaos.same({"m": [x, 1]}, {"m": [x.double(), 1]})
    assert not chaos.same({"m": [x]}, {"m": [x + 1e-7]})
    assert not chaos.same({"m": (x,)}, {"m": [x]})
