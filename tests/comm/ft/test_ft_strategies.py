"""Recovery in every strategy on the real runtime: 3 gloo worker processes, faults injected,
run.timeout_s left at its default (300 s) so that no recovery may lean on it.

What the runs' records must show (tests/helpers/ft_records.py): each membership change was found
by the mechanism expected for its fault (a killed peer's gloo error, the heartbeat timeout, the
adaptive deadline), never by run.timeout_s, in the round the fault struck; every round was logged,
with as many members as the changes recorded before it. In ddp and diloco, whose members all
step with one mean, the last checkpoint holds one model for every worker, bit for bit. A wait
of run.timeout_s (300 s) that no record names would also run past the suite's 120 s limit per
test (pyproject.toml). Every worker sleeps 0.1 s after each inner step (no CPU used) so that
rounds last long enough for a killed worker to restart and rejoin.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers.ft_records import detected_by, members_per_round, membership

from frugaltrain.metrics.log import read_metrics
from frugaltrain.train import launch

GENTLE = ["outer.lr=0.5", "outer.momentum=0.5"]  # a calm outer step (test_ft_faults.py)
STRATEGIES = {
    "ddp": ["outer.strategy='ddp'"],
    "diloco": ["outer.strategy='diloco'", *GENTLE],
    "fgd": ["outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'", *GENTLE],
    "noloco": ["outer.strategy='noloco'", *GENTLE],
    "streaming": [
        "outer.strategy='streaming'",
        "outer.streaming.fragments=2",
        "outer.streaming.overlap=1",
        "model.n_layer=2",
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
    "fault_tolerance.enabled=true",
    "run.timeout_s=300",
]
HB_S = 3.0  # the heartbeat timeout at the default run.timeout_s (comm/ft/heartbeat.py)
REPLICATED = ("ddp", "diloco")  # every member steps with the same mean: one model at round ends


def _run(cfg) -> tuple[Path, list[dict]]:
    run_dir = launch.new_run_dir(cfg)
    launch.run(cfg, run_dir)
    return run_dir, read_metrics(run_dir / "metrics.jsonl")


def _check_run(run_dir: Path, records: list[dict], rounds: int) -> dict:
    """Every round logged with the members the changes before it left, none found by
    run.timeout_s, recovery reported, parameters finite; returns the membership events by
    kind."""
    logged = [r for r in records if r.get("kind") == "round"]
    assert [r["round"] for r in logged] == list(range(1, rounds + 1))
    members = [r["ft/members"] for r in logged]
    assert members == members_per_round(records, 3), members
    found = [(e["round"], detected_by(e["reason"])) for e in membership(records) if "reason" in e]
    assert all(how != "run.timeout_s" for _, how in found), found
    assert sum(r["time/recovery_s"] for r in logged) > 0
    final = sorted((run_dir / "checkpoints").glob("round_*"))[-1]
    for path in final.glob("worker_*.pt"):
        model = torch.load(path, weights_only=False)["model"]
        assert all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point())
    events: dict[str, list[dict]] = {}
    for e in membership(records):
        events.setdefault(e["event"], []).append(e)
    return events


def _faulted(config_factory, tmp_path: Path, strategy: str, steps: int, inject: str, sets=()):
    """Run `strategy` for `steps` with the faults `inject` (every worker slowed; `sets`: more
    config) and check the run (_check_run); returns the membership events by kind."""
    cfg = config_factory(
        tmp_path,
        *COMMON,
        *STRATEGIES[strategy],
        f"run.steps={steps}",
        f"fault_tolerance.inject='{inject};slow:seconds=0.1'",
        *sets,
    )
    run_dir, records = _run(cfg)
    events = _check_run(run_dir, records, steps // 4)
    if strategy in REPLICATED:  # whatever left, failed or rejoined, the members did not split
        _same_models(run_dir)
    return events


def _same_models(run_dir: Path) -> None:
    """Every worker file of the last checkpoint holds the same model, bit for bit (an absent
    worker's is the stand-in its rejoin would take)."""
    final = sorted((run_dir / "checkpoints").glob("round_*"))[-1]
    models = [torch.load(p, weights_only=False)["model"] for p in sorted(final.glob("worker_*.pt"))]
    assert len(models) == 3
    for model in models[1:]:
        assert all(torch.equal(model[k], models[0][k]) for k in models[0]), final


def _left(events: dict) -> list[int]:
    return [w for e in events.get("left", []) for w in e["workers"]]


def _found(event: dict, workers: list[int], in_round: int, how: str) -> None:
    """`event` took `workers` out, in `in_round` (the last round the others finished), found by
    `how` (ft_records.detected_by)."""
    got = (event["workers"], event["round"], detected_by(event["reason"]))
    assert got == (workers, in_round, how), event


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_kill_rejoin_then_hang(config_factory, tmp_path: Path, strategy: str):
    # Worker 2 is killed mid-round 3, restarted, and rejoins from a peer; worker 1 then stops
    # (SIGSTOP, heartbeats included) mid-round 35 and is dropped by its silent heartbeat. Each is
    # found in the others' blocking operation of the round it struck (recorded with the round
    # before, the last one they finished): the kill by its closed socket, the hang by the
    # heartbeat timeout.
    inject = "kill:worker=2,round=3;hang:worker=1,round=35"
    events = _faulted(config_factory, tmp_path, strategy, 200, inject)
    assert _left(events) == [2, 1], events  # the two faulted workers, nobody healthy
    kill, hang = events["left"]
    _found(kill, [2], 2, "gloo error")
    _found(hang, [1], 34, "heartbeat")
    assert hang["reason"] == f"worker 1: no heartbeat for {HB_S:g} s", hang
    assert hang["members"] == [0, 2]
    rejoined = events["rejoined"]
    assert [e["worker"] for e in rejoined] == [2] and rejoined[0]["match"], rejoined
    # Worker 2 was admitted at a round end between the two faults.
    assert [e["workers"] for e in events["joined"]] == [[2]], events
    assert 2 < events["joined"][0]["round"] == rejoined[0]["round"] < 34, events


def test_double_kill_in_one_round(config_factory, tmp_path: Path):
    # Two of three workers die in the same step: the survivor trains alone, both rejoin. The
    # survivor's round-3 operation fails on their closed sockets.
    inject = "kill:worker=1,round=3;kill:worker=2,round=3"
    events = _faulted(config_factory, tmp_path, "fgd", 160, inject)
    assert sorted(_left(events)) == [1, 2], events
    for e in events["left"]:
        _found(e, e["workers"], 2, "gloo error")
    assert events["left"][-1]["members"] == [0]
    assert sorted(e["worker"] for e in events["rejoined"]) == [1, 2], events
    assert all(e["match"] for e in events["rejoined"])


def test_kill_during_recovery(config_factory, tmp_path: Path):
    # Worker 2 dies mid-round 3; worker 1 dies as it starts recovering from that: the rendezvous
    # that re-forms the group loses a participant and worker 0 goes on alone; both rejoin. The
    # change is the one the first failure started (its reason: worker 2's closed socket).
    inject = "kill:worker=2,round=3;kill:worker=1,round=3,at=recovery"
    events = _faulted(config_factory, tmp_path, "diloco", 160, inject)
    assert sorted(_left(events)) == [1, 2], events
    for e in events["left"]:
        _found(e, e["workers"], 2, "gloo error")
    assert sorted(e["worker"] for e in events["rejoined"]) == [1, 2], events


def test_partition_in_a_blocking_strategy(config_factory, tmp_path: Path):
    # Worker 1 is cut off for 12 s mid-round 3 during DiLoCo's all-reduce rounds: dropped by its
    # silent heartbeat in the others' round-3 all-reduce, it finds itself evicted when the
    # partition heals, restarts and rejoins.
    inject = "partition:worker=1,round=3,seconds=12"
    events = _faulted(config_factory, tmp_path, "diloco", 200, inject)
    assert _left(events) == [1], events
    _found(events["left"][0], [1], 2, "heartbeat")
    assert events["left"][0]["reason"] == f"worker 1: no heartbeat for {HB_S:g} s", events
    assert [e["worker"] for e in events["rejoined"]] == [1], events
    assert events["joined"][0]["round"] > 2, events


def test_stalled_worker_meets_the_adaptive_deadline(config_factory, tmp_path: Path):
    # Worker 1's training stops for 12 s mid-round 8 while its heartbeats go on: only the
    # deadline can find it, in the others' round-8 all-reduce. It adapts to the rounds measured
    # so far (fault_tolerance.deadline_factor = 4 x their p90, floor
    # fault_tolerance.deadline_floor_s = 2 s here), far below run.timeout_s = 300 s and below
    # the stall itself: the others go on without worker 1, which rejoins when its stall is over.
    inject, floor = "stall:worker=1,round=8,seconds=12", ["fault_tolerance.deadline_floor_s=2"]
    events = _faulted(config_factory, tmp_path, "diloco", 240, inject, sets=floor)
    assert _left(events) == [1], events
    _found(events["left"][0], [1], 7, "deadline")
    reason = events["left"][0]["reason"]
    assert reason.startswith("workers [1]: no answer within the deadline ("), reason
    # The deadline the runtime reports, and the p90 round it derived it from.
    deadline = float(reason.split("(")[1].split(" s")[0])
    p90 = float(reason.split("p90 round ")[1].split(" s")[0])
    assert abs(deadline - max(2.0, 4 * p90)) < 0.1, reason  # printed to 0.1 s and 0.01 s
    # Not the cap (run.timeout_s), and below the stall: the recorded deadline is why worker 1
    # was found while it was still stalled. These compare the runtime's own figures, not a
    # stopwatch of the test.
    assert 2.0 <= deadline < 12 and math.isfinite(deadline), reason
    assert [e["worker"] for e in events["rejoined"]] == [1], events
    assert events["joined"][0]["round"] > 7, events
