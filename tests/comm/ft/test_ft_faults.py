"""Fault tolerance on the real runtime: 3 gloo worker processes on loopback, faults injected.

Each run is kept short: a tiny model, and in the kill run every worker sleeps 0.1 s after each
inner step (an injected straggler on all workers: no CPU used), so the 110 steps after the kill
last at least 11 s and the killed worker has time to restart and rejoin before the run ends, even
on a busy 2-core machine (a sleep of 3x the step time, about 2 s in all, was not always enough).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.ft_records import members_per_round, membership

from frugaltrain.inject import Injector, parse
from frugaltrain.metrics.log import read_metrics
from frugaltrain.train import launch

COMMON = [
    "run.workers=3",
    "outer.strategy='fgd'",
    "outer.fgd.preset='GlobalM1'",
    "outer.H=4",
    "model.n_embd=48",
    "run.eval_every=40",
    "run.eval_batches=4",
    "run.threads=1",
]


def _run(cfg):
    run_dir = launch.new_run_dir(cfg)
    launch.run(cfg, run_dir)
    return run_dir, read_metrics(run_dir / "metrics.jsonl")


def _final_val(records: list[dict]) -> float:
    return [r for r in records if r.get("kind") == "round" and "loss/val" in r][-1]["loss/val"]


def test_ft_kill_and_rejoin(config_factory, tmp_path: Path):
    # A gentle outer step (lr 0.5, momentum 0.5): with DiLoCo's 0.7 / 0.9 Nesterov this tiny
    # model's 120-step trajectory is chaotic (fault-tolerant runs without a kill match the plain
    # run to 1e-5, yet losing worker 2 for a few rounds moved the final loss by -6% to +9%
    # depending on how fast it restarted). With it, 1 round away cost 0.1% and 15 rounds 1.0%.
    ckpt = ["run.steps=120", "run.checkpoint_every=6", "outer.lr=0.5", "outer.momentum=0.5"]
    reference = config_factory(tmp_path / "ref", *COMMON, *ckpt)
    _, ref_records = _run(reference)

    cfg = config_factory(
        tmp_path / "ft",
        *COMMON,
        *ckpt,
        "fault_tolerance.enabled=true",
        "run.timeout_s=20",
        "fault_tolerance.inject='kill:worker=2,round=3;slow:seconds=0.1'",
    )
    run_dir, records = _run(cfg)
    events = [r for r in records if r.get("kind") == "membership"]
    kinds = [e["event"] for e in events]
    assert kinds[:1] == ["left"] and events[0]["workers"] == [2], events
    assert events[0]["members"] == [0, 1]
    assert "joined" in kinds and "rejoined" in kinds, events
    rejoined = next(e for e in events if e["event"] == "rejoined")
    # The rejoined worker's model and outer parameters equal its donor's, bit for bit.
    assert rejoined["match"] and rejoined["params_digest"] == rejoined["donor_digest"]
    assert events[-1]["members"] == [0, 1, 2]

    # Training finished: every round was logged and the final round has every worker's state.
    rounds = [r["round"] for r in records if r.get("kind") == "round"]
    assert rounds == list(range(1, 31))
    # Every checkpoint is there and complete (absent workers get the state they would rejoin with).
    for k in range(6, 31, 6):
        d = run_dir / "checkpoints" / f"round_{k:06d}"
        assert json.loads((d / "COMPLETE").read_text())["round"] == k
        assert sorted(p.name for p in d.glob("worker_*.pt")) == [f"worker_{i}.pt" for i in range(3)]

    # Losing a worker for a few rounds costs little: within 5% of the undisturbed run.
    ref, got = _final_val(ref_records), _final_val(records)
    assert abs(got - ref) / ref < 0.05, (got, ref)


@pytest.mark.parametrize(
    "strategy, timeout_s, reason, left_in",
    [
        # fgd: worker 1 never sends its round-3 Mix1 message. The others finish that mix at the
        # end of round 4: they drop the message at the 1 s deadline, find worker 1's heartbeat
        # stopped (1 s at run.timeout_s = 3 s) and re-form at that round end. A round or more
        # later if worker 1 lagged behind them and its heartbeat still moved after they posted
        # their messages (a straggler is only skipped); but before the evaluation that ends
        # round 10, whose blocking wait would have found it without the Mix1 text in its reason.
        (
            ["outer.strategy='fgd'", "outer.fgd.preset='GlobalM1'"],
            3.0,
            "worker 1: no heartbeat for 1 s (late for Mix1 by 1 s)",
            range(4, 10),
        ),
        # diloco: the blocking all-reduce that ends round 3 sees the stopped heartbeat (3 s at
        # the default run.timeout_s = 300 s): the change is recorded with round 2, the last one
        # the others finished. A hung worker costs the heartbeat timeout, never a deadline.
        (
            ["outer.strategy='diloco'", "outer.fgd.preset=''"],
            300.0,
            "worker 1: no heartbeat for 3 s",
            (2,),
        ),
    ],
    ids=["fgd-mix1-deadline", "diloco-blocking-wait"],
)
def test_ft_silent_worker_does_not_hang_others(
    config_factory, tmp_path: Path, strategy, timeout_s, reason, left_in
):
    cfg = config_factory(
        tmp_path,
        *COMMON,
        *strategy,
        "run.steps=60",
        "fault_tolerance.enabled=true",
        f"run.timeout_s={timeout_s}",
        "fault_tolerance.mix1_deadline_s=1.0",
        "fault_tolerance.inject='hang:worker=1,round=3'",
    )
    _, records = _run(cfg)
    # One change, found by the mechanism expected: the heartbeat (behind the Mix1 deadline in
    # fgd), never run.timeout_s nor the adaptive deadline (60 s floor), whose reasons differ.
    # With run.timeout_s = 300 s a wait of run.timeout_s anywhere, recorded or not, also runs
    # past the suite's 120 s limit per test (pyproject.toml): no stopwatch needed here.
    events = membership(records)
    assert [(e["event"], e["workers"], e["reason"]) for e in events] == [("left", [1], reason)]
    left = events[0]["round"]
    assert left in left_in and events[0]["members"] == [0, 2], events
    rounds = [r for r in records if r.get("kind") == "round"]
    assert [r["round"] for r in rounds] == list(range(1, 16))
    # The others ran every round after that one without worker 1, to the end.
    members = [r["ft/members"] for r in rounds]
    assert members == members_per_round(records, 3) == [3] * left + [2] * (15 - left), members
    # fgd: worker 0 dropped a late Mix1 message in every round from the first one that waited
    # for a message worker 1 never sent (round 3's, finished in round 4) to the one that found it
    # silent. Other rounds are not checked: on a loaded machine a healthy worker's message may
    # be late too (the first round's, after an uneven start). diloco has no Mix1.
    late = {r["round"]: r["ft/mix1_late"] for r in rounds if r["ft/mix1_late"]}
    if "fgd" in strategy[0]:
        assert all(late.get(k, 0) >= 1 for k in range(4, left + 1)), (left, late)
    else:
        assert not late, late
    assert sum(r["time/recovery_s"] for r in rounds) > 0  # reported apart from blocking time


def _lag(records: list[dict]) -> list[tuple[int, int]]:
    """(worker 0's round, the slowest member's round then) before the final, synchronizing one."""
    rounds = [r for r in records if r.get("kind") == "round" and "ft/slowest_round" in r]
    return [(r["round"], r["ft/slowest_round"]) for r in rounds[:-1]]


def test_ft_straggler_delays_only_blocking_participants(config_factory, tmp_path: Path):
    # Worker 1 sleeps 0.2 s after every inner step: 0.8 s a round, whatever the machine's speed
    # (a straggler that is a multiple of the measured step time is not slow at all when steps
    # take a millisecond). The others' rounds are their own steps plus at most the 0.05 s Mix1
    # deadline. fgd GlobalM1 has no blocking step between evaluations: the others drop the
    # straggler's late Mix1 messages and run ahead. DiLoCo's all-reduce has every worker as a
    # participant: everybody runs at the straggler's pace.
    common = [
        *COMMON,
        "run.steps=64",
        "run.eval_every=0",
        "fault_tolerance.enabled=true",
        "run.timeout_s=60",
        "fault_tolerance.mix1_deadline_s=0.05",
        "fault_tolerance.inject='slow:worker=1,seconds=0.2'",
    ]
    _, fgd = _run(config_factory(tmp_path / "fgd", *common))
    _, diloco = _run(
        config_factory(
            tmp_path / "diloco", *common, "outer.strategy='diloco'", "outer.fgd.preset=''"
        )
    )

    for records in (fgd, diloco):  # nobody was dropped, every round was logged
        assert not [r for r in records if r.get("kind") == "membership"]
        assert [r["round"] for r in records if r.get("kind") == "round"] == list(range(1, 17))
    fgd_lag, diloco_lag = _lag(fgd), _lag(diloco)
    # fgd: worker 0 did not wait for the straggler: it dropped the straggler's late Mix1 message
    # in most rounds, and by its last round before the final (synchronizing) evaluation the
    # straggler had done at most three quarters of the rounds.
    assert sum(r.get("ft/mix1_late", 0) for r in fgd) >= 10, fgd_lag
    last, slowest = fgd_lag[-1]
    assert slowest <= 0.75 * last, fgd_lag
    # diloco: the all-reduce keeps everyone within a round of each other, and no message is late.
    assert all(own - slowest <= 1 for own, slowest in diloco_lag), diloco_lag
    assert not any(r.get("ft/mix1_late", 0) for r in diloco)


# Alone it takes 60-110 s here (when the healed worker's rejoin lands varies with the injected
# slowness), so the suite's 120 s hang guard is too close under a busy two-process suite.
@pytest.mark.timeout(300)
def test_ft_partitioned_worker_leaves_and_rejoins(config_factory, tmp_path: Path):
    # Worker 1 is cut off for 10 s mid-round 3: no heartbeat, no message, no rendezvous
    # keep-alive. The others drop it at their next Mix1 deadline; when the partition heals it
    # finds itself evicted, exits, and the launcher restarts it; it rejoins with a live peer's
    # state. Nobody hangs. The partition outlasts the others' agreement, which takes the Mix1
    # deadline + the heartbeat timeout (2 s) to report, then the rendezvous: the keep-alive
    # expiry (3 s, overlapping), a 1 s poll, the 2 s last call and a poll: about 6 s.
    cfg = config_factory(
        tmp_path,
        *COMMON,
        "run.steps=320",
        "fault_tolerance.enabled=true",
        "run.timeout_s=8",  # heartbeat timeout 2 s
        "fault_tolerance.mix1_deadline_s=0.5",
        "fault_tolerance.inject='partition:worker=1,round=3,seconds=10;slow:factor=10'",
    )
    _, records = _run(cfg)
    events = [r for r in records if r.get("kind") == "membership"]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "left" and events[0]["workers"] == [1], events
    assert "no heartbeat" in events[0]["reason"]
    assert "joined" in kinds and "rejoined" in kinds, events
    rejoined = next(e for e in events if e["event"] == "rejoined")
    assert rejoined["worker"] == 1 and rejoined["match"], rejoined
    assert events[-1]["members"] == [0, 1, 2]
    assert [r["round"] for r in records if r.get("kind") == "round"] == list(range(1, 81))


def test_ft_inject_specs():
    faults = parse("kill:worker=2,round=5; slow:worker=1,factor=3;drop:p=0.1")
    assert [f.kind for f in faults] == ["kill", "slow", "drop"]
    inj = Injector(faults, rank=2, H=4, first_incarnation=True, seed=0)
    assert inj.stops == {18: "kill"}  # halfway through round 5: (5 - 1) * 4 + 2
    cut = Injector(parse("partition:worker=1,round=2,seconds=4"), 1, 4, True, 0)
    assert cut.stops == {6: "partition"} and cut.partition_s == 4.0
    # a restarted worker keeps the schedule: it rejoins past the step that stopped it
    assert Injector(faults, 2, 4, first_incarnation=False, seed=0).stops == {18: "kill"}
    stuck = Injector(parse("stall:worker=1,round=2,seconds=9"), 1, 4, True, 0)
    assert stuck.stops == {6: "stall"} and stuck.stall_s == 9.0
    late_kill = Injector(parse("kill:worker=1,round=3,at=recovery"), 1, 4, True, 0)
    assert late_kill.stops == {} and not late_kill.dies_in_recovery(2)
    assert late_kill.dies_in_recovery(3) and late_kill.dies_in_recovery(4)
    assert not Injector(parse("kill:worker=1,round=3,at=recovery"), 1, 4, False, 0).recovery_kill
    late = Injector(parse("slow:worker=1,seconds=0.2;slow:factor=3"), 1, 4, True, 0)
    assert (late.slow, late.slow_s) == (3.0, 0.2)
    drops = [inj.dropped(0, seq, 0, 1) for seq in range(2000)]
    assert drops == [inj.dropped(0, seq, 0, 1) for seq in range(2000)]  # deterministic
    assert 0.08 < sum(drops) / len(drops) < 0.12
    bad_specs = (
        "kill:worker=2",
        "explode:worker=1",
        "drop:p=1.5",
        "slow:worker=1,factor=0.5",
        "stall:worker=1,round=2",
        "kill:worker=1,round=2,at=later",
        "slow:worker=1",
        "slow:worker=1,seconds=-1",
        "partition:worker=1,round=2",
        "partition:worker=1,round=2,seconds=0",
    )
    for bad in bad_specs:
        with pytest.raises(ValueError, match="fault_tolerance.inject"):
            parse(bad)


def test_ft_min_workers_members_wait_for_a_joiner(config_factory, tmp_path: Path):
    """run.min_workers = 3 of 3: after worker 2 dies the others finish the round in hand, then
    wait at its end until the restarted worker asks to join; no later round trains with 2."""
    cfg = config_factory(
        tmp_path,
        *COMMON,
        "run.steps=48",
        "run.min_workers=3",
        "fault_tolerance.enabled=true",
        "run.timeout_s=30",
        "fault_tolerance.inject='kill:worker=2,round=3'",
    )
    _, records = _run(cfg)
    rounds = [r for r in records if r.get("kind") == "round"]
    assert [r["round"] for r in rounds] == list(range(1, 13))
    short = [r["round"] for r in rounds if r["ft/members"] < 3]
    assert len(short) <= 1, short  # at most the round the kill struck in
    kinds = [e["event"] for e in membership(records)]
    assert kinds[0] == "left" and "rejoined" in kinds, kinds
