"""Machines that come and go, each a netlab namespace with its own address and shaped link: the
coordinator in one, a `join` agent in each of the others. Root only (namespaces and tc).

One run, three events: the machine holding slot 0 (the source of the run's log) is killed
whole (every process of its namespace): the others restart nothing, the coordinator frees its
slot and logs from the next machine; a new machine joins into that slot and is admitted at a
round end with its donor's state (equal digests); then a machine is cut off (its link down)
until the coordinator frees its slot, and once its link is back it joins again and rejoins from
a live peer. run.min_workers = 3 holds the others at a round end after each loss until the
slot is filled again, so the run cannot end before an event however slow this host is. Every
round is logged once, with the members the changes before it left.
"""

from __future__ import annotations

import os

import pytest
from helpers.ft_records import detected_by, members_per_round, membership
from helpers.machines_run import Run, rounds_logged, wait_for

from frugaltrain.metrics.log import read_metrics
from frugaltrain.netlab.lab import NetLab, why_not_available

REASON = why_not_available()
SETS = (
    "run.workers=3",
    "run.min_workers=3",  # a loss holds the others until the slot is filled: no race with the end
    "run.steps=120",  # 30 rounds of H = 4, each paced by the shaped links
    "run.timeout_s=120",  # the longest the others wait for a machine to come in
    "outer.H=4",
    "run.threads=1",
    "run.eval_every=0",
    "run.eval_batches=2",
    "run.progress=false",
    "model.n_embd=64",
    "run.name='nl'",
    # A member stuck in an operation is cut out after 10 s rather than the default 60: the
    # wait_for bounds below stay short whatever the runtime meets.
    "fault_tolerance.deadline_floor_s=10",
)
RATE_MBIT = 8.0


def machine(lab: NetLab, i: int) -> list[str]:
    """The prefix that runs a command as machine i: in its namespace, gloo on its link."""
    return [*lab.exec_args(i), "env", "GLOO_SOCKET_IFNAME=eth0"]


# Three machines starting, one of them twice, and the others held until each is in: about 2
# minutes under the full suite's load, over the default 120 s.
@pytest.mark.timeout(300)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_machines_killed_joining_and_cut_off(config_factory, tmp_path):
    cfg = config_factory(tmp_path / "coord", *SETS)
    lab = NetLab(5, RATE_MBIT, tag=f"m{os.getpid() % 10000}")
    with lab:
        run = Run(tmp_path, cfg, bind=lab.addr(0))
        try:
            coord = run.start_coordinator(prefix=machine(lab, 0))
            wait_for(lambda: "slots; machines join" in run.log(), "coordinator up", procs=[coord])
            agents = {}
            for i, name in ((1, "doomed"), (2, "a"), (3, "b")):
                agents[name] = run.join(name, prefix=machine(lab, i), host=lab.addr(0))
                line = f"joined: slots [{i - 1}]"
                wait_for(lambda line=line: line in run.log(), f"{name} joined", procs=[coord])
            wait_for(lambda: rounds_logged(run) >= 4, "round 4", procs=[coord])
            lab.kill(1)  # a machine lost whole
            wait_for(
                lambda: "lost (connection closed): slots [0]" in run.log(),
                "slot 0 freed",
                procs=[coord],
            )
            agents["late"] = run.join("late", prefix=machine(lab, 4), host=lab.addr(0))
            wait_for(lambda: run.log().count("joined: slots [0]") == 2, "late in", procs=[coord])
            at = rounds_logged(run)
            wait_for(lambda: rounds_logged(run) >= at + 3, "3 rounds with it", procs=[coord])
            lab.set_link(3, up=False)  # machine b cut off
            wait_for(lambda: "lost (silent): slots [2]" in run.log(), "slot 2 freed", procs=[coord])
            lab.set_link(3, up=True)
            wait_for(lambda: run.log().count("joined: slots [2]") == 2, "b back", procs=[coord])
            for name in ("a", "b", "late"):
                assert agents[name].wait(300) == 0, name
            assert coord.wait(60) == 0
        finally:
            run.close()
    log = run.log()
    assert "lost (connection closed): slots [0] are free" in log, log
    assert "lost (silent): slots [2] are free" in log, log
    for name in ("a", "late"):  # the machines that were never cut off restarted nothing
        assert "restarting" not in run.output(name), run.output(name)

    records = read_metrics(run.coord_dir / "metrics.jsonl")
    rounds = [r for r in records if r.get("kind") == "round"]
    assert [r["round"] for r in rounds] == list(range(1, 31))  # each round once
    assert [r["ft/members"] for r in rounds] == members_per_round(records, 3)
    events = membership(records)
    left = [e for e in events if "reason" in e]
    assert len(left) == 2 and all(detected_by(e["reason"]) != "run.timeout_s" for e in left)
    rejoined = [(e["worker"], e["match"]) for e in events if e["event"] == "rejoined"]
    assert rejoined == [(0, True), (2, True)], rejoined
    assert rounds[-1]["ft/members"] == 3  # all three slots trained together again
