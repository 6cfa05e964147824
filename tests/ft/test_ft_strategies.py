"""Recovery in every strategy on the real runtime: 3 gloo worker processes, faults injected,
run.timeout_s left at its default (300 s) so that no recovery may lean on it.

Bounds are asserted from the rounds' recorded wall times: the longest gap between two round ends
is at most what detects the fault (a gloo error, the heartbeat timeout, the adaptive deadline)
plus the rendezvous that re-forms the group plus two rounds (the one in flight and the next),
with slack for a busy machine; never run.timeout_s. Every worker sleeps 0.1 s after each inner
step (no CPU used) so that rounds last long enough for a killed worker to restart and rejoin.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch

from frugaltrain.metrics.log import read_metrics
from frugaltrain.train import launch

GENTLE = ["outer.lr=0.5", "outer.momentum=0.5"]  # a calm outer step (test_ft_faults.py)
STRATEGIES = {
    "ddp": ["outer.strategy='ddp'"],
    "diloco": ["outer.strategy='diloco'", *GENTLE],
    "fgd": ["outer.strategy='fgd'", "outer.preset='GlobalM1LocalM2'", *GENTLE],
    "noloco": ["outer.strategy='noloco'", *GENTLE],
    "streaming": [
        "outer.strategy='streaming'", "outer.fragments=2", "outer.overlap=1", "model.n_layer=2",
        *GENTLE,
    ],
}  # fmt: skip
COMMON = [
    "run.workers=3",
    "outer.H=4",
    "model.n_embd=48",
    "run.eval_every=0",
    "run.eval_batches=4",
    "run.threads=1",
    "run.fault_tolerance=true",
    "run.timeout_s=300",
]
HB_S = 3.0  # the heartbeat timeout at the default run.timeout_s (comm/ft/heartbeat.py)
RENDEZVOUS_S = 7.0  # keep-alive expiry, polls and the last call of a re-forming round


def _run(cfg) -> tuple[Path, list[dict]]:
    run_dir = launch.new_run_dir(cfg)
    launch.run(cfg, run_dir)
    return run_dir, read_metrics(run_dir / "metrics.jsonl")


def _check_run(run_dir: Path, records: list[dict], rounds: int, detect_s: float) -> dict:
    """Every round logged, parameters finite, the worst stall within the bound; returns the
    membership events by kind."""
    logged = [r for r in records if r.get("kind") == "round"]
    assert [r["round"] for r in logged] == list(range(1, rounds + 1))
    walls = [r["time/wall_s"] for r in logged]
    gaps = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    stall, typical = max(gaps), statistics.median(gaps)
    assert stall < detect_s + RENDEZVOUS_S + 2 * typical + 6.0 < 300, (stall, typical, walls)
    assert sum(r["time/recovery_s"] for r in logged) > 0
    final = sorted((run_dir / "checkpoints").glob("round_*"))[-1]
    for path in final.glob("worker_*.pt"):
        model = torch.load(path, weights_only=False)["model"]
        assert all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point())
    events: dict[str, list[dict]] = {}
    for e in (r for r in records if r.get("kind") == "membership"):
        events.setdefault(e["event"], []).append(e)
    return events


def _faulted(config_factory, tmp_path: Path, strategy: str, steps: int, inject: str, **kw):
    """Run `strategy` for `steps` with the faults `inject` (every worker slowed; kw: `sets`,
    more config, and `detect_s`) and check the run (_check_run); returns the membership events
    by kind."""
    cfg = config_factory(
        tmp_path,
        *COMMON,
        *STRATEGIES[strategy],
        f"run.steps={steps}",
        f"run.inject='{inject};slow:seconds=0.1'",
        *kw.get("sets", ()),
    )
    run_dir, records = _run(cfg)
    return _check_run(run_dir, records, steps // 4, kw.get("detect_s", HB_S))


def _left(events: dict) -> list[int]:
    return [w for e in events.get("left", []) for w in e["workers"]]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_kill_rejoin_then_hang(config_factory, tmp_path: Path, strategy: str):
    # Worker 2 is killed mid-round 3, restarted, and rejoins from a peer; worker 1 then stops
    # (SIGSTOP, heartbeats included) mid-round 35 and is dropped by its silent heartbeat.
    inject = "kill:worker=2,round=3;hang:worker=1,round=35"
    events = _faulted(config_factory, tmp_path, strategy, 200, inject)
    assert _left(events) == [2, 1], events  # the two faulted workers, nobody healthy
    rejoined = events["rejoined"]
    assert [e["worker"] for e in rejoined] == [2] and rejoined[0]["match"], rejoined
    assert "no heartbeat" in events["left"][1]["reason"], events["left"]
    assert events["left"][1]["members"] == [0, 2]


def test_double_kill_in_one_round(config_factory, tmp_path: Path):
    # Two of three workers die in the same step: the survivor trains alone, both rejoin.
    inject = "kill:worker=1,round=3;kill:worker=2,round=3"
    events = _faulted(config_factory, tmp_path, "fgd", 160, inject)
    assert sorted(_left(events)) == [1, 2], events
    assert events["left"][-1]["members"] == [0]
    assert sorted(e["worker"] for e in events["rejoined"]) == [1, 2], events
    assert all(e["match"] for e in events["rejoined"])


def test_kill_during_recovery(config_factory, tmp_path: Path):
    # Worker 2 dies mid-round 3; worker 1 dies as it starts recovering from that: the rendezvous
    # that re-forms the group loses a participant and worker 0 goes on alone; both rejoin.
    inject = "kill:worker=2,round=3;kill:worker=1,round=3,at=recovery"
    events = _faulted(config_factory, tmp_path, "diloco", 160, inject)
    assert sorted(_left(events)) == [1, 2], events
    assert sorted(e["worker"] for e in events["rejoined"]) == [1, 2], events


def test_partition_in_a_blocking_strategy(config_factory, tmp_path: Path):
    # Worker 1 is cut off for 12 s mid-round 3 during DiLoCo's all-reduce rounds: dropped by its
    # silent heartbeat, it finds itself evicted when the partition heals, restarts and rejoins.
    inject = "partition:worker=1,round=3,seconds=12"
    events = _faulted(config_factory, tmp_path, "diloco", 200, inject)
    assert _left(events) == [1] and "no heartbeat" in events["left"][0]["reason"], events
    assert [e["worker"] for e in events["rejoined"]] == [1], events


def test_stalled_worker_meets_the_adaptive_deadline(config_factory, tmp_path: Path):
    # Worker 1's training stops for 12 s mid-round 8 while its heartbeats go on: only the
    # deadline can find it. It adapts to the rounds measured so far (run.deadline_factor x their
    # p90, floor run.deadline_floor_s = 2 s here), far below run.timeout_s = 300 s and below the
    # stall itself: the others go on without worker 1, which rejoins when its stall is over.
    # Detection within 6 s: 4 x rounds of about 0.45 s is below the 2 s floor; 3x slack for a
    # busy machine, where rounds run longer.
    inject, floor = "stall:worker=1,round=8,seconds=12", ["run.deadline_floor_s=2"]
    events = _faulted(config_factory, tmp_path, "diloco", 240, inject, sets=floor, detect_s=6)
    assert _left(events) == [1], events
    reason = events["left"][0]["reason"]
    assert "deadline" in reason and "p90 round" in reason, reason
    deadline = float(reason.split("(")[1].split(" s")[0])
    assert 2.0 <= deadline < 12 and math.isfinite(deadline)
    assert [e["worker"] for e in events["rejoined"]] == [1], events
