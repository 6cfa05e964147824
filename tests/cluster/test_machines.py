"""A run across machines as processes on this host: `frugaltrain coordinator` and two
`frugaltrain join` agents on 127.0.0.1 (tests/netlab/test_machines_netlab.py gives each machine a
network namespace of its own). With no faults the run equals, bit for bit, the same config
under the local launcher; a machine without the run's token is refused and gets nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.ft_records import membership
from helpers.machines_run import Run, left, rounds_logged, set_budget, wait_for

from frugaltrain.cluster.auth import new_token
from frugaltrain.metrics.log import read_metrics
from frugaltrain.train import checkpoint, launch

WAIT_S = 15  # fault_tolerance.coordinator_wait_s: how long running workers hold on without it
SETS = (
    "run.workers=2",
    "run.steps=240",  # 60 rounds of H = 4
    "outer.H=4",
    "model.n_embd=64",
    "run.checkpoint_every=1",
    "run.threads=1",
    "run.eval_every=8",
    "run.eval_batches=2",
    "run.progress=false",
    "fault_tolerance.enabled=true",
    "run.name='mach'",
)


def final_models(run_dirs: list[Path], workers: int) -> dict[int, dict]:
    """Each worker's model from the last checkpoint, wherever its file is."""
    out = {}
    for d in run_dirs:
        ckpt = checkpoint.latest_complete(d)
        for r in range(workers):
            path = ckpt / f"worker_{r}.pt"
            if r not in out and path.is_file():
                out[r] = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return out


@pytest.fixture(autouse=True)
def _budget(request) -> None:
    """Every wait of a test ends inside its own pytest timeout (func_only: fixtures apart), so
    a slow run under a loaded CPU fails naming what it waited for."""
    set_budget(request.node.get_closest_marker("timeout").args[0] - 15)


@pytest.fixture(scope="module")
def reference(config_factory, tmp_path_factory) -> Path:
    """The same config under the local launcher: what every machine run must equal."""
    cfg = config_factory(tmp_path_factory.mktemp("local"), *SETS)
    run_dir = launch.new_run_dir(cfg)
    launch.run(cfg, run_dir)
    return run_dir


def assert_equal_to(reference: Path, run: Run, machine_dirs: list[Path]) -> None:
    """Bit for bit: every worker's final model, and every round logged once with the same
    losses."""
    mine, theirs = final_models(machine_dirs, 2), final_models([reference], 2)
    assert sorted(mine) == [0, 1]
    for r in range(2):
        for name, t in theirs[r].items():
            assert torch.equal(mine[r][name], t), (r, name)
    ours = [r for r in read_metrics(run.coord_dir / "metrics.jsonl") if r["kind"] == "round"]
    ref = [r for r in read_metrics(reference / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["round"] for r in ours] == [r["round"] for r in ref] == list(range(1, 61))
    assert [r["loss/train"] for r in ours] == [r["loss/train"] for r in ref]
    assert [r.get("loss/val") for r in ours] == [r.get("loss/val") for r in ref]


@pytest.mark.timeout(300, func_only=True)
def test_machines_equal_the_local_launcher_and_refuse_a_wrong_token(
    config_factory, tmp_path, reference
):
    run = Run(tmp_path, config_factory(tmp_path / "coord", *SETS))
    try:
        coord = run.start_coordinator()
        wait_for(lambda: "slots; machines join" in run.log(), "coordinator up", procs=[coord])
        stranger = tmp_path / "other.token"  # another run's: its pin is not this coordinator
        new_token(stranger)
        refused = run.join("stranger", token=stranger)
        assert refused.wait(left(60)) == 2
        assert "certificate the token file does not pin" in run.output("stranger")
        guesser = tmp_path / "guess.token"  # this coordinator's pin, a guessed secret
        pin = run.token.read_text().split()[1]
        fd = os.open(guesser, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, f"{'ab' * 32}\n{pin}\n".encode())
        os.close(fd)
        refused = run.join("guesser", token=guesser)
        assert refused.wait(left(60)) == 2
        assert "wrong token" in run.output("guesser")
        a, b = run.join("a"), run.join("b")  # at once: they claim slots side by side
        for p in (a, b, coord):
            assert p.wait(left(240)) == 0, p.args
    finally:
        run.close()
    assert run.log().count(": wrong token") == 1  # the stranger left after TLS: "no token"
    assert not (tmp_path / "stranger").exists()  # no config, so nothing made
    assert not (tmp_path / "guesser").exists()
    assert_equal_to(reference, run, [tmp_path / "a", tmp_path / "b"])
    assert (run.coord_dir / "summary.json").is_file()


@pytest.mark.timeout(600, func_only=True)
def test_the_coordinator_lost_twice_the_run_goes_on_exactly(config_factory, tmp_path, reference):
    """Killed and restarted at once: the machines keep their workers (none restarts) and go on
    from the store as it was. Killed again and left away past
    fault_tolerance.coordinator_wait_s: every worker finishes the round in hand without the
    store and checkpoints it (no periodic checkpoints here), and each machine exits with one
    line naming that round, the last one it trained; `coordinator --resume` and `join
    --resume` everywhere go on from it (one machine's before the coordinator is back: it keeps
    trying). Every round is logged once, and the end equals the uninterrupted run bit for
    bit."""
    sets = (*SETS, f"fault_tolerance.coordinator_wait_s={WAIT_S}", "run.checkpoint_every=0")
    run = Run(tmp_path, config_factory(tmp_path / "coord", *sets))
    try:
        a, b = two_machines_lose_the_coordinator(run)
        again = run.start_coordinator(resume=True, name="coordinator-2")
        live = lambda: run.log().count("its workers still running") == 2  # noqa: E731
        wait_for(live, "both back, live", procs=[again, a, b])
        at = rounds_logged(run)
        wait_for(lambda: rounds_logged(run) >= at + 3, "3 more rounds", procs=[again, a, b])
        assert ", from round" not in run.log()  # nothing went back to a checkpoint
        kill(again)  # and it stays away
        assert a.wait(left(60)) == 1 and b.wait(left(60)) == 1  # each says where its checkpoint is
        assert "join 127.0.0.1:" in run.output("a") and "--resume" in run.output("a")
        assert not any("restarting" in run.output(m) for m in "ab")  # no worker restarted
        stopped = {m: newest_checkpoint(run.output(m)) for m in "ab"}
        trained = last_round(tmp_path / "a" / "metrics.jsonl")
        assert stopped == {"a": trained, "b": trained}, (stopped, trained)  # nothing lost
        a = run.join("a", resume=True)  # before the coordinator: it tries until it is back
        wait_for(
            lambda: "waiting for the coordinator" in run.output("a-again"), "a trying", procs=[a]
        )
        last = run.start_coordinator(resume=True, name="coordinator-3")
        up = lambda: run.log().count("slots; machines join") == 3  # noqa: E731
        wait_for(up, "the third coordinator up", procs=[last])
        b = run.join("b", resume=True)
        for p in (a, b, last):
            assert p.wait(left(240)) == 0, p.args
    finally:
        run.close()
    assert run.log().count("going on from checkpoints") == 1
    assert run.log().count(f", from round {trained}") == 2  # both machines, from that round
    assert_equal_to(reference, run, [tmp_path / "a", tmp_path / "b"])


# The 15 s lease and b starting again: over the default 120 s under the full suite's load.
@pytest.mark.timeout(300, func_only=True)
def test_a_machine_lost_with_the_coordinator_frees_its_slot(config_factory, tmp_path):
    """The coordinator and one machine lost together: the machine that stayed keeps its workers;
    once `coordinator --resume` is back it finds the other gone and, alone, waits at a round end
    (run.min_workers = 2, so it cannot finish the run first however slow this host is). The lost
    machine's slot is freed after LEASE_S, and back later, it joins as a new machine, from a
    live peer. No worker of the machine that stayed restarts, every round is logged once, and
    both machines finish."""
    sets = (
        *SETS,
        f"fault_tolerance.coordinator_wait_s={WAIT_S}",
        "run.min_workers=2",
        "run.timeout_s=120",  # the longest a alone waits: LEASE_S, then b starting again
    )
    run = Run(tmp_path, config_factory(tmp_path / "coord", *sets))
    try:
        a, b = two_machines_lose_the_coordinator(run)
        kill(b)  # the machine is gone: its workers exit with their agent
        again = run.start_coordinator(resume=True, name="coordinator-2")
        freed = lambda: "not back within" in run.log()  # noqa: E731
        wait_for(freed, "b's slot freed", procs=[again, a])
        assert "its workers still running" in run.log() and "slots [1] are free" in run.log()
        b = run.join("b", resume=True)
        wait_for(lambda: run.log().count("joined: slots [1]") == 2, "b back", procs=[again, b])
        for p in (a, b, again):
            assert p.wait(left(240)) == 0, p.args
    finally:
        run.close()
    log = run.log()
    assert ", from round" not in log and "restarting" not in run.output("a")
    records = read_metrics(run.coord_dir / "metrics.jsonl")
    rounds = [r for r in records if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == list(range(1, 61))
    changes = [(e["event"], e["members"]) for e in membership(records) if e["event"] != "rejoined"]
    assert changes == [("left", [0]), ("joined", [0, 1])], changes  # a alone, then b in again
    assert rounds[-1]["ft/members"] == 2
    assert sorted(final_models([tmp_path / "a", tmp_path / "b"], 2)) == [0, 1]


def two_machines_lose_the_coordinator(run: Run):
    """Machines a (slot 0) and b (slot 1) train 3 rounds; then the coordinator is killed and
    both wait for it. Returns their agents."""
    coord = run.start_coordinator()
    wait_for(lambda: "slots; machines join" in run.log(), "coordinator up", procs=[coord])
    a = run.join("a")
    wait_for(lambda: "joined: slots [0]" in run.log(), "machine a joined", procs=[a])
    b = run.join("b")
    wait_for(lambda: rounds_logged(run) >= 3, "round 3", procs=[coord, a, b])
    kill(coord)
    wait_for(
        lambda: all("lost the coordinator" in run.output(m) for m in "ab"),
        "both machines waiting for the coordinator",
        procs=[a, b],
    )
    return a, b


def newest_checkpoint(output: str) -> int:
    """The round an agent's give-up line names as its newest checkpoint."""
    line = next(x for x in output.splitlines() if "newest checkpoint: round " in x)
    return int(line.split("newest checkpoint: round ")[1].split()[0])


def last_round(metrics: Path) -> int:
    return max(r["round"] for r in read_metrics(metrics) if r["kind"] == "round")


def kill(coord) -> None:
    coord.kill()
    coord.wait()
