"""What machines that come and go cost a run across machines (`frugaltrain coordinator` and
`frugaltrain join`), with real processes in netlab namespaces. Root only (namespaces, tc and
cgroups).

The coordinator runs in namespace 0, one `join` agent per machine in namespaces 1..M (joining
at once; the coordinator's log says which holds which slot), and one namespace stays idle for a
late joiner. Every link is shaped to --rate-mbit each way; each machine's processes are held to
--machine-cpu cores and the coordinator's to --coordinator-cpu (netlab/cpu.py), so one machine
blocking does not speed up another's compute (the defaults, 3 x 0.45 + 0.5, fit two cores; the
late joiner's share is used only once a machine is gone). The job is a tiny GPT on DiLoCo with
fault tolerance and a checkpoint every round. Each repetition runs the same config four times
(the fourth without periodic checkpoints).
Events are timed on this script's clock by watching the files the processes write (every
0.05 s), and rounds by the round records' own clock (`time/wall_s`, kept by worker 0 from its
start: a round's time is the difference of two records, from the end of one round's inner steps
to the next's, so it holds the outer step, evaluation and checkpoint before it):

1. clean: no events. The reference: wall clock per round (median), final validation loss.
2. machine loss, then a join, in one run. After round --kill-round every process of the
   namespace of the machine holding the last slot is killed at once. The survivors' time lost
   = the summed time of the rounds from the kill to two rounds past the recorded membership
   change, less the clean run's median round time for each (of rounds like it: after an
   evaluation or not). The mechanism that found the loss is read from the membership record's
   reason; the survivors' outputs must hold no "restarting" line (none of their processes
   restarted). Three rounds after the change a new machine starts in the idle namespace and
   takes the freed slot: measured, from its agent's start to the line its worker prints once it
   holds the donor's state (its first round as a member), and the survivors' time lost at the
   admission (the two rounds after it, as above). The state the donor sends is counted:
   the state format's encoding of a worker state of this config (a checkpoint's, plus the three
   sequence counters admission adds).
3. coordinator restart. After round --kill-round the coordinator is killed and started again
   with --resume --delay s later; the machines keep their workers and rejoin it live. Time lost
   = the summed time of the rounds from the kill to one round past the first round logged after
   the restart, less the clean run's median round time for each (as above); it includes the
   outage (--delay plus the coordinator's own start at its CPU share and the agents' retry),
   less what the workers hid of it behind their inner steps. Rounds redone = rounds logged
   twice (none, when no machine went back to a checkpoint); worker processes restarted are
   counted from the agents' "restarting" lines.
4. coordinator gone. After round --kill-round the coordinator is killed and left away past
   fault_tolerance.coordinator_wait_s (--wait), in a run with no periodic checkpoints: every
   worker finishes the round in hand without the store, checkpoints it and stops, and each
   agent exits naming that round. Measured: the kill to the last agent's exit; rounds lost
   (the last round slot 0's machine logged less the round every machine checkpointed); then
   `coordinator --resume` and `join --resume` on every machine: their start to the first round
   trained after the resume.

The event runs' final validation loss is given against the clean run's (the runs see the
same data, so the ratio should be near 1). Figures: mean and min-max over --reps.

    python benchmarks/machines.py                      # 3 repetitions, a few minutes each
    python benchmarks/machines.py --reps 1             # a smoke run
    python benchmarks/machines.py --table              # the Markdown table from --out

The table (table_format.machines_table) is the one tables.py writes into docs/multihost.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import provenance
import torch
from table_format import machines_table as table  # shared with tables.py

from frugaltrain.cluster.auth import new_token
from frugaltrain.comm import state_format
from frugaltrain.config import Config, build_config, to_toml
from frugaltrain.metrics.log import read_metrics
from frugaltrain.netlab import cpu
from frugaltrain.netlab.lab import NetLab, why_not_available
from frugaltrain.train import checkpoint

JOB = [  # a tiny GPT on DiLoCo, a calm outer step (as benchmarks/faults.py), fault tolerant
    "data.seq_len=32",
    "data.batch_size=4",
    "data.max_bytes=1000000",
    "model.n_layer=1",
    "model.n_embd=64",
    "model.n_head=2",
    "outer.strategy='diloco'",
    "outer.lr=0.5",
    "outer.momentum=0.5",
    "optim.warmup_steps=2",
    "run.threads=1",
    "run.progress=false",
    "run.eval_batches=2",
    "run.checkpoint_every=1",
    "fault_tolerance.enabled=true",
]
PORT = 29400  # the coordinator's, inside its own namespace
POLL_S = 0.05
JOINED = re.compile(r"\(([\d.]+):\d+\) joined: slots \[(\d+)\]")  # coordinator.log's lines
MECHANISMS = (  # a membership record's reason -> what found the change (comm/ft/ texts)
    ("no heartbeat for", "heartbeat"),
    ("no answer within run.timeout_s", "run.timeout_s"),
    ("deadline (run.timeout_s =", "run.timeout_s"),
    ("no answer within the deadline", "deadline"),
    ("no keep-alive", "rendezvous"),
)


def mechanism(reason: str) -> str:
    """What found a membership change, by its record's reason ("gloo error" otherwise: gloo's
    own error, such as a killed peer's closed socket)."""
    return next((name for text, name in MECHANISMS if text in reason), "gloo error")


def run_sets(args: argparse.Namespace) -> list[str]:
    """Every override of each run (the first three runs of a repetition share them)."""
    every = max(1, args.rounds // args.evals)  # rounds between evaluations
    sets = [*JOB, f"outer.H={args.H}", f"run.workers={args.machines}", "run.name='c'"]
    return [*sets, f"run.steps={args.H * args.rounds}", f"run.eval_every={args.H * every}"]


class Watch(threading.Thread):
    """Polls files every POLL_S and keeps each new complete line with the time it was first
    seen (time.monotonic): a metrics log's records, a process's output lines."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.paths: dict[str, Path] = {}
        self.lines: list[tuple[float, str, str]] = []  # (seen, label, line)
        self.known: dict[str, set[str]] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()

    def add(self, label: str, path: Path) -> None:
        with self.lock:
            self.paths[label] = path

    def run(self) -> None:
        while not self.done.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        with self.lock:
            paths = dict(self.paths)
        for label, path in paths.items():
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            seen, known = time.monotonic(), self.known.setdefault(label, set())
            text = data[: data.rfind(b"\n") + 1].decode(errors="replace")
            new = [line for line in text.splitlines() if line.strip() and line not in known]
            known.update(new)
            with self.lock:
                self.lines += [(seen, label, line) for line in new]

    def records(self, label: str, kind: str, after: float = 0.0) -> list[tuple[float, dict]]:
        """The JSON records of `kind` in `label`'s file, first seen after `after`."""
        with self.lock:
            lines = [(t, line) for t, lab, line in self.lines if lab == label and t > after]
        recs = [(t, json.loads(line)) for t, line in lines if line.startswith("{")]
        return [(t, r) for t, r in recs if r.get("kind") == kind]

    def first(self, label: str, text: str) -> float | None:
        """When a line of `label` holding `text` was first seen."""
        with self.lock:
            return next((t for t, lab, line in self.lines if lab == label and text in line), None)

    def newest_round(self, label: str = "slot0") -> int:
        return max((r["round"] for _, r in self.records(label, "round")), default=0)


def wait_for(predicate, what: str, timeout_s: float, procs=()) -> None:
    """Poll until `predicate()`; raise naming `what` (or a process that exited first)."""
    t0 = time.monotonic()
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[-6:]} exited with {p.returncode} before {what}")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"no {what} within {timeout_s:g} s")
        time.sleep(POLL_S)


class Cluster:
    """One run: the coordinator in namespace 0 and machines m1..mM in namespaces 1..M, each with
    its output file and run directory under `root`; a Watch over every output and over the
    metrics log of worker 0 (slot 0's machine writes it)."""

    def __init__(self, lab: NetLab, root: Path, sets: list[str], make_token=new_token) -> None:
        """`make_token(path)` writes the run's token file (and whatever goes beside it)."""
        root.mkdir(parents=True)
        self.lab, self.root = lab, root
        self.cfg = build_config(Config, {}, [*sets, f"run.out_dir={str(root)!r}"])
        self.config = root / "run.toml"
        self.config.write_text(to_toml(self.cfg))
        self.token = root / "run.token"
        make_token(self.token)
        self.coord_dir = root / "c"
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.holder: dict[int, int] = {}  # slot -> the namespace of the machine holding it
        self.watch = Watch()
        self.watch.start()

    def _start(self, i: int, name: str, args: list[str]) -> subprocess.Popen:
        prefix = [*self.lab.exec_args(i), "env", "GLOO_SOCKET_IFNAME=eth0"]
        out = open(self.root / f"{name}.out", "w")  # noqa: SIM115  (the process holds it)
        self.watch.add(name, self.root / f"{name}.out")
        self.started[name] = time.monotonic()
        cmd = [*prefix, sys.executable, "-m", "frugaltrain", *args]
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        out.close()
        return self.procs[name]

    def coordinator(self, resume: bool = False, name: str = "coordinator") -> subprocess.Popen:
        args = ["coordinator", "--port", str(PORT), "--token", str(self.token)]
        args += ["--bind", self.lab.addr(0)]
        args += ["--resume", str(self.coord_dir)] if resume else ["--config", str(self.config)]
        return self._start(0, name, args)

    def join(self, i: int, name: str, resume: str = "") -> subprocess.Popen:
        """Machine i's agent; `resume`: the name it had, to go on from its run directory."""
        args = ["join", f"{self.lab.addr(0)}:{PORT}", "--token", str(self.token)]
        where = (
            ["--resume", str(self.root / resume)]
            if resume
            else ["--run-dir", str(self.root / name)]
        )
        return self._start(i, name, [*args, *where])

    def log(self) -> str:
        path = self.coord_dir / "coordinator.log"
        return path.read_text() if path.is_file() else ""

    def output(self, name: str) -> str:
        return (self.root / f"{name}.out").read_text()

    def up(self, machines: int, timeout_s: float, follow: bool = True) -> None:
        """The coordinator, then machines 1..M at once; `holder` says which holds each slot
        (by the addresses in the coordinator's log), and with `follow` the watch follows slot
        0's log (a long run follows the machines' logs its own way: chaos.py)."""
        coord = self.coordinator()
        wait_for(lambda: "slots; machines join" in self.log(), "coordinator", timeout_s, [coord])
        agents = [self.join(i, f"m{i}") for i in range(1, machines + 1)]
        joined = lambda: JOINED.findall(self.log())  # noqa: E731
        wait_for(lambda: len(joined()) >= machines, "every machine joined", timeout_s, agents)
        where = {self.lab.addr(i): i for i in range(self.lab.workers)}
        self.holder = {int(slot): where[addr] for addr, slot in joined()}
        if follow:
            self.watch.add("slot0", self.root / f"m{self.holder[0]}" / "metrics.jsonl")

    def wait_round(self, r: int, timeout_s: float, names: list[str]) -> None:
        procs = [self.procs[n] for n in names]
        wait_for(lambda: self.watch.newest_round() >= r, f"round {r}", timeout_s, procs)

    def finish(self, names: list[str], timeout_s: float) -> None:
        """Wait for the named processes to end; each must exit 0."""
        for name in names:
            code = self.procs[name].wait(timeout_s)
            if code != 0:
                raise RuntimeError(f"{name} exited with {code}:\n{self.output(name)[-2000:]}")

    def records(self) -> list[dict]:
        return read_metrics(self.coord_dir / "metrics.jsonl")

    def close(self) -> None:
        """Stop the watch and every process left in the lab's namespaces (a failed run's)."""
        self.watch.done.set()
        for i in range(self.lab.workers):
            self.lab.kill(i)
        for p in self.procs.values():
            p.wait()


def round_times(records: list[dict]) -> dict[int, float]:
    """Round r -> its wall time: worker 0's `time/wall_s` at r less at r - 1, where both come
    from one process (a resumed worker's clock starts again)."""
    rounds = {r["round"]: r for r in records if r.get("kind") == "round"}
    out = {}
    for r, rec in rounds.items():
        prev = rounds.get(r - 1)
        if prev is not None and rec["time/wall_s"] > prev["time/wall_s"]:
            out[r] = rec["time/wall_s"] - prev["time/wall_s"]
    return out


def evaluated(records: list[dict]) -> set[int]:
    return {r["round"] for r in records if r.get("kind") == "round" and "loss/val" in r}


def final_loss(records: list[dict]) -> float:
    return [r["loss/val"] for r in records if r.get("kind") == "round" and "loss/val" in r][-1]


def baseline(records: list[dict]) -> dict[str, float]:
    """The clean run's median round time, of rounds after an evaluation ("eval": those carry
    it) and of the others ("plain")."""
    return baseline_of(round_times(records), evaluated(records))


def baseline_of(times: dict[int, float], extra: set[int]) -> dict[str, float]:
    """`baseline` from round times, with `extra` the rounds whose next round carries more work
    (an evaluation, a checkpoint)."""
    plain = [t for r, t in times.items() if r - 1 not in extra]
    after = [t for r, t in times.items() if r - 1 in extra]
    median = statistics.median(plain)
    return {"plain": median, "eval": statistics.median(after) if after else median}


def time_lost(records: list[dict], window: list[int], base: dict[str, float]) -> float:
    """The rounds of `window` took this much longer than clean rounds like them."""
    return time_lost_of(round_times(records), evaluated(records), window, base)


def time_lost_of(
    times: dict[int, float], extra: set[int], window: list[int], base: dict[str, float]
) -> float:
    """`time_lost` from round times, with `extra` as in `baseline_of`."""
    missing = [r for r in window if r not in times]
    if missing:
        raise RuntimeError(f"no round time for rounds {missing} of the window {window}")
    return sum(times[r] - base["eval" if r - 1 in extra else "plain"] for r in window)


def state_bytes(run_dir: Path) -> int:
    """The bytes of a donor's state on the wire (comm/state_format.py): a worker's state from its
    newest checkpoint, with the three sequence counters admission adds."""
    ckpt = checkpoint.latest_complete(run_dir)
    state = torch.load(ckpt / "worker_0.pt", map_location="cpu", weights_only=True)
    state["ft_seq"] = (0, 0, 0)
    return len(state_format.encode(state))


class PeakMemory(threading.Thread):
    """The peak resident and private memory (MB) of one process, read from its
    /proc/PID/smaps_rollup every 0.5 s until it exits or `done` is set."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.path, self.done = Path(f"/proc/{pid}/smaps_rollup"), threading.Event()
        self.rss_mb = self.private_mb = 0.0

    def run(self) -> None:
        while not self.done.wait(0.5):
            try:
                text = self.path.read_text()
            except OSError:  # it has exited
                return
            kb = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M)}
            self.rss_mb = max(self.rss_mb, kb["Rss"] / 1024)
            private = (kb["Private_Clean"] + kb["Private_Dirty"]) / 1024
            self.private_mb = max(self.private_mb, private)


def clean_run(lab: NetLab, root: Path, args: argparse.Namespace) -> dict:
    """No events: the reference (its records give the baseline round times), and the
    coordinator's peak memory while it runs."""
    c = Cluster(lab, root, run_sets(args))
    try:
        c.up(args.machines, args.timeout)
        memory = PeakMemory(c.procs["coordinator"].pid)  # ip netns exec, sh and env all exec
        memory.start()
        c.finish(["coordinator", *(f"m{i}" for i in range(1, args.machines + 1))], args.timeout)
        memory.done.set()
        memory.join()
    finally:
        c.close()
    records = c.records()
    base = baseline(records)
    return {
        "round_s": base["plain"],
        "round_after_eval_s": base["eval"],
        "rounds": sum(1 for r in records if r.get("kind") == "round"),
        "wall_s": [r["time/wall_s"] for r in records if r.get("kind") == "round"][-1],
        "loss_val": final_loss(records),
        "bytes_sent_per_round": statistics.median(
            r["comm/bytes_sent"] for r in records if r.get("kind") == "round"
        ),
        "state_bytes": state_bytes(root / f"m{c.holder[0]}"),
        "baseline": base,
        "coordinator_rss_mb": memory.rss_mb,
        "coordinator_private_mb": memory.private_mb,
    }


def drive_machine_loss(c: Cluster, args: argparse.Namespace) -> dict:
    """Kill machine M whole after round --kill-round; once the survivors have gone on without
    it, start a new machine in the idle namespace. Returns the times and rounds seen."""
    M, t = args.machines, args.timeout
    c.up(M, t)
    doomed = c.holder[M - 1]  # never slot 0's machine: it relays the metrics
    survivors = [f"m{i}" for i in range(1, M + 1) if i != doomed]
    c.wait_round(args.kill_round, t, ["coordinator", *survivors])
    at_kill = c.watch.newest_round()
    c.lab.kill(doomed)
    procs = [c.procs[n] for n in ("coordinator", *survivors)]
    wait_for(lambda: "lost (" in c.log(), "the coordinator freeing the slot", t, procs)

    def left() -> list:
        return [r for _, r in c.watch.records("slot0", "membership") if r["event"] == "left"]

    wait_for(lambda: left(), "a membership record of the loss", t, procs)
    c.wait_round(left()[0]["round"] + 3, t, ["coordinator", *survivors])  # the loss is behind
    late = c.join(M + 1, "late")
    seen = lambda: c.watch.first("late", "membership: rejoined")  # noqa: E731
    what = "the late machine's rejoin (more --rounds?)"
    wait_for(lambda: seen() is not None, what, t, [*procs, late])
    joined_s = seen() - c.started["late"]
    asked_s = seen() - c.watch.first("late", "asking to rejoin")  # its processes were up
    c.finish(["coordinator", *survivors, "late"], t)
    restarts = {n: c.output(n).count("restarting") for n in survivors}
    return {"at_kill": at_kill, "join_s": joined_s, "asked_s": asked_s, "restarts": restarts}


def driven(lab: NetLab, root: Path, sets: list[str], drive, args) -> tuple[dict, list[dict]]:
    """`drive(cluster, args)` on a fresh cluster: what it returns, and the run's records."""
    c = Cluster(lab, root, sets)
    try:
        out = drive(c, args)
    finally:
        c.close()
    return out, c.records()


def machine_run(lab: NetLab, root: Path, args: argparse.Namespace, clean: dict) -> dict:
    """Machine loss, then a join into the freed slot (see the module docstring)."""
    seen, records = driven(lab, root, run_sets(args), drive_machine_loss, args)
    events = [r for r in records if r.get("kind") == "membership"]
    i = next(k for k, e in enumerate(events) if e["event"] == "left")
    left = events[i]
    joined = next(e for e in events[i:] if e["event"] == "joined")
    rejoined = [e for e in events if e["event"] == "rejoined"]
    r0 = seen["at_kill"]
    loss_window = list(range(r0 + 1, max(left["round"], r0) + 3))
    join_window = [joined["round"] + 1, joined["round"] + 2]
    base, times, evals = clean["baseline"], round_times(records), evaluated(records)
    between = range(loss_window[-1] + 1, joined["round"] + 1)  # one machine fewer
    without = [times[r] for r in between if r in times and r - 1 not in evals]
    return {
        "machine_loss": {
            "killed_after_round": r0,
            "left_round": left["round"],
            "reason": left.get("reason", ""),
            "detected_by": mechanism(left.get("reason", "")),
            "window": loss_window,
            "lost_s": time_lost(records, loss_window, base),
            "round_s_without": statistics.median(without) if without else None,
            "survivor_restarts": sum(seen["restarts"].values()),
        },
        "join": {
            "join_s": seen["join_s"],
            "asked_s": seen["asked_s"],
            "admitted_round": joined["round"],
            "match": [e.get("match") for e in rejoined],
            "window": join_window,
            "lost_s": time_lost(records, join_window, base),
            "state_bytes": clean["state_bytes"],
        },
        "loss_val": final_loss(records),
        "loss_ratio": final_loss(records) / clean["loss_val"],
    }


def drive_coordinator_restart(c: Cluster, args: argparse.Namespace) -> dict:
    """Kill the coordinator after round --kill-round; start it again with --resume --delay s
    later. Returns the rounds seen around it."""
    M, t = args.machines, args.timeout
    machines = [f"m{i}" for i in range(1, M + 1)]
    c.up(M, t)
    c.wait_round(args.kill_round, t, ["coordinator", *machines])
    at_kill = c.watch.newest_round()
    c.lab.kill(0)
    c.procs["coordinator"].wait()
    time.sleep(args.delay)
    last = c.watch.newest_round()  # the round in hand, finished while it was away
    again = c.coordinator(resume=True, name="coordinator-again")
    procs = [again, *(c.procs[n] for n in machines)]
    back = lambda: c.log().count("its workers still running") == M  # noqa: E731
    wait_for(lambda: back() or "from round" in c.log(), "the machines back", t, procs)
    if not back():
        raise RuntimeError("a machine went back to a checkpoint: see coordinator.log")
    c.wait_round(last + 2, t, ["coordinator-again", *machines])
    c.finish(["coordinator-again", *machines], t)
    restarts = sum(c.output(n).count("restarting") for n in machines)
    return {"at_kill": at_kill, "last_before": last, "worker_restarts": restarts}


def coordinator_run(lab: NetLab, root: Path, args: argparse.Namespace, clean: dict) -> dict:
    out, records = driven(lab, root, run_sets(args), drive_coordinator_restart, args)
    logged = [r["round"] for r in records if r.get("kind") == "round"]
    window = list(range(out["at_kill"] + 1, out["last_before"] + 3))
    loss = final_loss(records)
    return {
        **out,
        "window": window,
        "lost_s": time_lost(records, window, clean["baseline"]),
        "rounds_redone": len(logged) - len(set(logged)),
        "loss_val": loss,
        "loss_ratio": loss / clean["loss_val"],
    }


def drive_coordinator_gone(c: Cluster, args: argparse.Namespace) -> dict:
    """Kill the coordinator after round --kill-round and leave it away until every machine has
    stopped; then resume everywhere. Returns the times and rounds seen."""
    M, t = args.machines, args.timeout
    machines = [f"m{i}" for i in range(1, M + 1)]
    c.up(M, t)
    c.wait_round(args.kill_round, t, ["coordinator", *machines])
    t0 = time.monotonic()
    c.lab.kill(0)
    c.procs["coordinator"].wait()
    codes = [c.procs[n].wait(t) for n in machines]
    stopped_s = time.monotonic() - t0
    trained = c.watch.newest_round()
    saved = [newest_checkpoint(c.output(n)) for n in machines]
    again = c.coordinator(resume=True, name="coordinator-again")
    up = lambda: c.log().count("slots; machines join") == 2  # noqa: E731
    wait_for(up, "the coordinator back", t, [again])
    t1 = time.monotonic()
    agents = [c.join(i, f"m{i}-again", resume=f"m{i}") for i in range(1, M + 1)]
    resumed = lambda: c.watch.newest_round() > trained  # noqa: E731
    wait_for(resumed, "a round after the resume", t, [again, *agents])
    resume_s = time.monotonic() - t1
    c.finish(["coordinator-again", *(f"m{i}-again" for i in range(1, M + 1))], t)
    return {
        "exit_codes": codes,
        "stopped_s": stopped_s,
        "last_trained": trained,
        "checkpointed": saved,
        "rounds_lost": trained - min(saved),
        "resume_s": resume_s,
    }


def newest_checkpoint(output: str) -> int:
    """The round an agent's give-up line names as its newest checkpoint (-1: none)."""
    found = re.findall(r"newest checkpoint: round (\d+)", output)
    return int(found[-1]) if found else -1


def gone_sets(args: argparse.Namespace) -> list[str]:
    """The coordinator-gone run: no periodic checkpoints, a short wait for the coordinator."""
    return [
        *run_sets(args),
        "run.checkpoint_every=0",
        f"fault_tolerance.coordinator_wait_s={args.wait:g}",
    ]


def coordinator_gone_run(lab: NetLab, root: Path, args: argparse.Namespace, clean: dict) -> dict:
    out, records = driven(lab, root, gone_sets(args), drive_coordinator_gone, args)
    logged = [r["round"] for r in records if r.get("kind") == "round"]
    loss = final_loss(records)
    return {
        **out,
        "rounds_logged_twice": len(logged) - len(set(logged)),
        "loss_val": loss,
        "loss_ratio": loss / clean["loss_val"],
    }


FIGURES = (  # (key in a repetition, event, what it is, format); all measured but COUNTED
    ("clean.round_s", "clean run", "wall clock per round, s", ".3f"),
    ("clean.loss_val", "clean run", "final validation loss", ".4f"),
    ("clean.coordinator_rss_mb", "clean run", "coordinator's peak resident memory, MB", ".0f"),
    ("clean.coordinator_private_mb", "clean run", "coordinator's peak private memory, MB", ".0f"),
    ("machine_loss.lost_s", "machine loss", "survivors' time lost, s", ".2f"),
    ("machine_loss.survivor_restarts", "machine loss", "survivor processes restarted", "d"),
    ("join.join_s", "join", "agent start to its first round as a member, s", ".1f"),
    ("join.asked_s", "join", "its worker up and asking to join, to a member, s", ".2f"),
    ("join.lost_s", "join", "survivors' time lost at the admission, s", ".2f"),
    ("join.state_bytes", "join", "state transfer, bytes", ",d"),
    ("coordinator_restart.lost_s", "coordinator restart", "time lost, the outage in it, s", ".1f"),
    ("coordinator_restart.rounds_redone", "coordinator restart", "rounds redone", "d"),
    ("coordinator_restart.worker_restarts", "coordinator restart", "workers restarted", "d"),
    ("machine_loss_run.loss_ratio", "machine loss + join", "final val loss / clean run's", ".4f"),
    ("coordinator_restart.loss_ratio", "coordinator restart", "final val loss / clean's", ".4f"),
    ("coordinator_gone.stopped_s", "coordinator gone", "kill to every machine stopped, s", ".1f"),
    ("coordinator_gone.rounds_lost", "coordinator gone", "rounds trained, not checkpointed", "d"),
    ("coordinator_gone.resume_s", "coordinator gone", "resume to its first new round, s", ".1f"),
    ("coordinator_gone.loss_ratio", "coordinator gone", "final val loss / clean's", ".4f"),
)
COUNTED = {"join.state_bytes"}


def repetition(lab: NetLab, root: Path, args: argparse.Namespace) -> dict:
    """The four runs of one repetition, each in a fresh directory under `root`."""
    clean = clean_run(lab, root / "clean", args)
    print(f"  clean: {clean['round_s']:.3f} s/round, loss {clean['loss_val']:.4f}", flush=True)
    machine = machine_run(lab, root / "machine", args, clean)
    loss, join = machine["machine_loss"], machine["join"]
    print(
        f"  machine loss: {loss['lost_s']:.2f} s lost (rounds {loss['window']}), found by "
        f"{loss['detected_by']}, {loss['survivor_restarts']} survivor restarts; join: "
        f"{join['join_s']:.1f} s to a member, {join['lost_s']:.2f} s lost; "
        f"loss x{machine['loss_ratio']:.4f}",
        flush=True,
    )
    coord = coordinator_run(lab, root / "coordinator", args, clean)
    print(
        f"  coordinator restart: {coord['lost_s']:.1f} s lost, the {args.delay:g} s delay "
        f"in it (rounds {coord['window']}), {coord['rounds_redone']} rounds redone, "
        f"{coord['worker_restarts']} workers restarted; loss x{coord['loss_ratio']:.4f}",
        flush=True,
    )
    gone = coordinator_gone_run(lab, root / "gone", args, clean)
    print(
        f"  coordinator gone: every machine stopped {gone['stopped_s']:.1f} s after the kill "
        f"({args.wait:g} s wait), rounds {gone['checkpointed']} checkpointed of "
        f"{gone['last_trained']} trained; resumed in {gone['resume_s']:.1f} s; "
        f"loss x{gone['loss_ratio']:.4f}",
        flush=True,
    )
    return {
        "clean": clean,
        "machine_loss": loss,
        "join": join,
        "machine_loss_run": {k: machine[k] for k in ("loss_val", "loss_ratio")},
        "coordinator_restart": coord,
        "coordinator_gone": gone,
    }


def figures(reps: list[dict]) -> list[dict]:
    """Each figure of FIGURES over the repetitions: every value, the mean, min and max."""
    out = []
    for key, event, what, fmt in FIGURES:
        part, name = key.split(".")
        values = [rep[part][name] for rep in reps]
        kind = "counted" if key in COUNTED else "measured"
        out.append({"event": event, "key": key, "figure": what, "kind": kind, "format": fmt})
        out[-1] |= {"values": values, "mean": statistics.mean(values)}
        out[-1] |= {"min": min(values), "max": max(values)}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--machines", type=int, default=3, help="machines of the run, a slot each")
    ap.add_argument("--rounds", type=int, default=80, help="rounds per run")
    ap.add_argument("--H", type=int, default=8, help="inner steps per round")
    ap.add_argument("--evals", type=int, default=4, help="evaluations per run")
    ap.add_argument("--kill-round", type=int, default=6, help="the events come after it")
    ap.add_argument("--delay", type=float, default=2.0, help="s before the coordinator restarts")
    ap.add_argument("--wait", type=float, default=5.0, help="coordinator_wait_s of the 4th run")
    ap.add_argument("--rate-mbit", type=float, default=20.0)
    ap.add_argument("--machine-cpu", type=float, default=0.45, help="cores per machine")
    ap.add_argument("--coordinator-cpu", type=float, default=0.5, help="the coordinator's cores")
    ap.add_argument("--timeout", type=float, default=180.0, help="s for any one wait")
    ap.add_argument("--work", help="keep the runs' directories here (default: a temporary one)")
    ap.add_argument("--out", default="benchmarks/results/machines.json")
    ap.add_argument("--table", action="store_true", help="print the table of --out and exit")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace, work: Path) -> None:
    sets = run_sets(args)
    names = ("clean", "machine-loss-join", "coordinator-restart")
    variants = dict.fromkeys(names, sets) | {"coordinator-gone": gone_sets(args)}
    result = provenance.start("measured", variants=variants)
    M = args.machines
    kept = {k: v for k, v in vars(args).items() if k != "work"}  # no paths of this machine
    result |= {"clock": "measured", "args": kept, "reps": []}
    result["lab"] = {
        "namespaces": f"coordinator in 0, machines in 1..{M}, the late joiner in {M + 1}",
        "cpu_shares": [args.coordinator_cpu, *[args.machine_cpu] * (M + 1)],
        "rate_mbit": args.rate_mbit,
    }
    shares = result["lab"]["cpu_shares"]
    with NetLab(M + 2, args.rate_mbit, tag=f"mb{os.getpid() % 10000}", cpu_shares=shares) as lab:
        for rep in range(args.reps):
            print(f"repetition {rep + 1} of {args.reps}", flush=True)
            result["reps"].append(repetition(lab, work / f"rep{rep}", args))
            result["figures"] = figures(result["reps"])
            provenance.save(provenance.finish(result), args.out)  # kept if a later one fails
    print(table(result))
    print(f"wrote {args.out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return 0
    why = why_not_available() or cpu.why_not_available()
    if why:
        print(f"machines.py: {why}", file=sys.stderr)
        return 2
    if args.work:
        measure(args, Path(args.work))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            measure(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
