"""Chaos across machines (`frugaltrain coordinator` and `frugaltrain join`, real processes in
netlab namespaces): a seeded random schedule of machine kills, joins, partitions and coordinator
restarts over --minutes of training, and what the run made of it. Root only (namespaces, tc and
cgroups).

The lab is machines.py's: the coordinator in namespace 0 (--coordinator-cpu cores), --machines
`join` agents in namespaces 1..M, two more namespaces idle for joiners, every link shaped to
--rate-mbit each way and every machine held to --machine-cpu cores (the defaults, 0.3 + 4 x 0.4,
fit two cores: at most M machines run at once, a joiner taking the place of a killed one). The
job is machines.py's tiny GPT on DiLoCo, fault tolerant, with a checkpoint every
--checkpoint-every rounds, no evaluation but at the end, and fault_tolerance.max_restarts = 100
(every partition restarts the cut-off machine's worker). Each run's token (and the coordinator's
key beside it) comes from `frugaltrain coordinator --new-token`, as a user makes them.

1. clean: --clean-rounds rounds, no events. The median round time (of rounds after a checkpoint
   and of the others, machines.baseline_of) is what each event's time lost is measured against,
   and the mean round time sizes the chaos run: rounds enough for 1.1 x --minutes of clean
   training, a multiple of --checkpoint-every.
2. chaos: the same job, and from its first round on, the events of `schedule(...)` at their
   times (an event waits until the run has recovered from the one before: every machine
   training logs a round past the newest at the check). The kinds:
   - kill: every process of one machine's namespace, SIGKILL at once; recovered once the
     coordinator has freed its slot and the others train on.
   - join: a new machine (`join` in an idle namespace) takes a freed slot; recovered once its
     worker is a member ("membership: rejoined") and logs rounds.
   - partition: one machine's link down (netlab `set_link`) for a few seconds, then up: its
     workers are cut off from the coordinator and the others; recovered once it trains again.
   - coordinator restart: the coordinator's namespace killed, and `coordinator --resume`
     started after a few seconds; recovered once every machine is back and training.
   The schedule keeps at least two machines training at all times (a kill or a partition only
   with three or more), so the model's state, which every member holds whole, always has a
   donor for the next joiner; a freed slot is filled again before the end, and the last
   --tail s hold no event, so the run ends with every slot held. An event is survived when the
   run recovers from it within --timeout; the first that is not stops the schedule, and so does
   the run's last two checkpoint intervals coming (those stay without events).
3. checks, after the run: every round logged once in the coordinator's metrics.jsonl; the
   final checkpoints of every member hold the same model (and outer state), bit for bit; and
   `frugaltrain train --resume` from the newest checkpoint before the end, the members'
   worker files put into one run directory, trains the last rounds into exactly the worker
   states (every tensor and counter) the chaos run ended with.

Time lost per event: the summed time of the rounds around it less the clean median of rounds
like them, as machines.py measures it, from each machine's own metrics log (a round's time is
the difference of two records of one worker's clock, `time/wall_s`; the median over the
machines that logged both, so a change of the run's metrics source changes no clock):
- kill and partition: from the round after the one in hand at the event to two rounds past the
  last membership change recorded until the run had recovered;
- join: the two rounds after the members admitted it (the survivors' cost of the admission);
- coordinator restart: from the round after the one in hand at the kill to two rounds past the
  newest round logged when it started again (the outage, the restart and the rejoin in it).

    python benchmarks/chaos.py                          # 4 machines, 15 minutes of events
    python benchmarks/chaos.py --minutes 3 --min-gap 20 --mean-gap 25 --start 20 --seed 1
                                                        # a smoke run: every kind in 3 minutes
    python benchmarks/chaos.py --show-schedule          # the events of a seed, nothing run
    python benchmarks/chaos.py --table                  # the table of --out
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import provenance
import torch
from machines import (
    JOB,
    POLL_S,
    Cluster,
    baseline_of,
    mechanism,
    round_times,
    time_lost_of,
    wait_for,
)

from frugaltrain.metrics.log import read_metrics
from frugaltrain.netlab import cpu
from frugaltrain.netlab.lab import NetLab, why_not_available
from frugaltrain.train import checkpoint

KINDS = ("kill", "join", "partition", "coordinator restart")
WEIGHTS = {"kill": 1.0, "join": 2.0, "partition": 1.0, "coordinator restart": 1.0}  # join: a
# freed slot is soon filled again, so the run spends most of its time at full strength
SPARE = 2  # namespaces beyond the first machines', for joiners (a killed one's is reused later)
MARGIN = 1.1  # the chaos run's rounds: this x --minutes of clean rounds (events only add time)
# What every member's state holds the same after a round (the rest of a worker's state is its
# own: its inner optimizer's moments, its random state, its place in its data)
SHARED = ("model", "outer", "step", "round")


# ---------------------------------------------------------------- the schedule (pure)


@dataclass(frozen=True)
class Event:
    """One event of a schedule.

    t: seconds after the chaos run's first round. machine: the schedule's number of the machine
    it acts on: 0..M-1 the first machines, M, M+1, ... each joiner in turn (a join's machine is
    the new one); -1 for a coordinator restart. hold_s: how long a partition cuts the link, or
    how long the coordinator stays away; 0 otherwise."""

    t: float
    kind: str
    machine: int
    hold_s: float = 0.0


def schedule(
    seed: int,
    machines: int,
    duration_s: float,
    *,
    start_s: float = 30.0,
    min_gap_s: float = 30.0,
    mean_gap_s: float = 45.0,
    tail_s: float = 30.0,
    cut_s: tuple[float, float] = (3.0, 8.0),
    away_s: tuple[float, float] = (1.0, 5.0),
) -> list[Event]:
    """The events of `duration_s` of training with `machines` machines, from `seed` alone.

    Gaps: `min_gap_s` (the time a run needs to recover from any one event) plus an exponential
    of mean `mean_gap_s - min_gap_s`; the first event comes that exponential after `start_s`
    (the run's first `start_s` are its clean start). Each kind is drawn among those allowed
    (WEIGHTS): a kill or a partition only while three or more machines train (so two always
    do), a join only while a slot is free. A partition cuts for a uniform time in `cut_s`, a
    coordinator stays away for one in `away_s`. The draws stop early enough that one join per
    free slot, `min_gap_s` apart, still ends `tail_s` before `duration_s`: the run ends with
    every slot held and a stretch without events."""
    if machines < 3:
        raise ValueError(f"--machines {machines}: use 3 or more (two keep training at all times)")
    if not 0 < min_gap_s < mean_gap_s:
        raise ValueError(f"--min-gap {min_gap_s:g}, --mean-gap {mean_gap_s:g}: need 0 < min < mean")
    rng = random.Random(seed)
    live, free, joiners = list(range(machines)), 0, 0
    last = duration_s - tail_s - (machines - 2) * min_gap_s  # room to fill every freed slot
    out: list[Event] = []
    t = start_s - min_gap_s
    while True:
        t += min_gap_s + rng.expovariate(1.0 / (mean_gap_s - min_gap_s))
        if t > last:
            break
        allowed = [k for k in KINDS if _allowed(k, len(live), free)]
        kind = rng.choices(allowed, weights=[WEIGHTS[k] for k in allowed])[0]
        if kind == "kill":
            m = rng.choice(live)
            live.remove(m)
            free += 1
            out.append(Event(round(t, 1), kind, m))
        elif kind == "join":
            m, joiners, free = machines + joiners, joiners + 1, free - 1
            live.append(m)
            out.append(Event(round(t, 1), kind, m))
        elif kind == "partition":
            out.append(Event(round(t, 1), kind, rng.choice(live), round(rng.uniform(*cut_s), 1)))
        else:
            out.append(Event(round(t, 1), kind, -1, round(rng.uniform(*away_s), 1)))
    t = out[-1].t if out else start_s
    for _ in range(free):  # every freed slot held again before the end
        t += min_gap_s
        out.append(Event(round(t, 1), "join", machines + joiners))
        joiners += 1
    return out


def _allowed(kind: str, live: int, free: int) -> bool:
    if kind in ("kill", "partition"):
        return live >= 3
    if kind == "join":
        return free > 0
    return True


def training(plan: list[Event], machines: int) -> list[tuple[float, int]]:
    """(time, machines training) after each event of `plan`: a partitioned machine does not
    train while it is cut off (the coordinator's outage stops no machine's training)."""
    live, out = machines, []
    for e in plan:
        live += {"kill": -1, "join": 1}.get(e.kind, 0)
        out.append((e.t, live - (e.kind == "partition")))
    return out


# ---------------------------------------------------------------- the figures (pure)


def merged_round_times(logs: list[list[dict]]) -> dict[int, float]:
    """Round r -> the median over the machines' metrics logs of its time in each (each log's
    times from one worker's clock: machines.round_times)."""
    per = [round_times(log) for log in logs]
    rounds = sorted(set().union(*per))
    return {r: statistics.median(p[r] for p in per if r in p) for r in rounds}


def window(event: dict, changes: list[dict]) -> list[int] | None:
    """The rounds an event's time lost is summed over (the module docstring), from `event`'s
    rounds (r_at: the newest logged when it began; r_ok: when the run had recovered; r_back:
    the newest when the coordinator started again) and the run's membership records; None for
    a join whose admission is not among them."""
    r_at, between = event["r_at"], _between(event, changes)
    if event["kind"] == "join":
        joined = [c["round"] for c in between if c["event"] == "joined"]
        return [joined[0] + 1, joined[0] + 2] if joined else None
    if event["kind"] == "coordinator restart":
        anchor = event["r_back"]
    else:
        anchor = max([r_at, *(c["round"] for c in between if c["event"] in ("left", "joined"))])
    return list(range(r_at + 1, anchor + 3))


def figures(
    plan: list[Event],
    done: list[dict],
    logs: list[list[dict]],
    records: list[dict],
    base: dict[str, float],
    extra: set[int],
    rounds: int,
) -> dict:
    """The figures of a chaos run. `done`: the events run, each with its kind, whether it was
    survived and its rounds (`window`); `logs`: every machine's metrics log; `records`: the
    run's own (the coordinator's) metrics log; `base`, `extra`: the clean baseline and the
    rounds followed by a checkpoint (machines.baseline_of); `rounds`: the run's rounds.
    Sets each event's "window" and "lost_s" (None where a round of it has no time)."""
    times = merged_round_times(logs)
    changes = [r for r in records if r.get("kind") == "membership"]
    for ev in done:
        ev["window"] = window(ev, changes) if ev.get("r_ok") is not None else None
        missing = ev["window"] is None or any(r not in times for r in ev["window"])
        ev["lost_s"] = None if missing else time_lost_of(times, extra, ev["window"], base)
        left = [c for c in _between(ev, changes) if c["event"] == "left"]
        if ev["kind"] in ("kill", "partition") and left:
            ev["detected_by"] = mechanism(left[0].get("reason", ""))
    by_kind = {}
    for kind in KINDS:
        ran = [ev for ev in done if ev["kind"] == kind]
        lost = [ev["lost_s"] for ev in ran if ev["survived"] and ev["lost_s"] is not None]
        by_kind[kind] = {
            "scheduled": sum(e.kind == kind for e in plan),
            "run": len(ran),
            "survived": sum(ev["survived"] for ev in ran),
            "lost_measured": len(lost),
            "lost_mean_s": statistics.mean(lost) if lost else None,
            "lost_worst_s": max(lost) if lost else None,
        }
    join_s = [ev["join_s"] for ev in done if ev["kind"] == "join" and ev.get("join_s")]
    logged = collections.Counter(r["round"] for r in records if r.get("kind") == "round")
    return {
        "by_kind": by_kind,
        "join_s": {
            "mean": statistics.mean(join_s) if join_s else None,
            "worst": max(join_s) if join_s else None,
        },
        "rounds": {
            "expected": rounds,
            "logged": len(logged),
            "logged_more_than_once": sum(n > 1 for n in logged.values()),
            "missing": len(set(range(1, rounds + 1)) - set(logged)),
        },
    }


def _between(ev: dict, changes: list[dict]) -> list[dict]:
    """The membership changes recorded from an event's start until the run recovered."""
    if ev.get("r_ok") is None:
        return []
    return [c for c in changes if ev["r_at"] <= c["round"] <= ev["r_ok"]]


def same(a, b) -> bool:
    """Bit for bit: tensors by dtype, shape and every element; dicts, lists and tuples
    element-wise; anything else by ==."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and (torch.equal(a, b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


# ---------------------------------------------------------------- the runs


def cli_token(path: Path) -> None:
    """The run's token (and the coordinator's key beside it), as a user makes them."""
    cmd = [sys.executable, "-m", "frugaltrain", "coordinator", "--new-token", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"coordinator --new-token failed: {done.stderr.strip()[-2000:]}")


def job(args: argparse.Namespace, rounds: int) -> list[str]:
    """Every override of a run of `rounds` rounds (machines.JOB, checkpoints every
    --checkpoint-every rounds, evaluated at the end only)."""
    sets = [s for s in JOB if not s.startswith("run.checkpoint_every=")]
    return [
        *sets,
        f"outer.H={args.H}",
        f"run.workers={args.machines}",
        f"run.steps={args.H * rounds}",
        "run.eval_every=0",
        f"run.checkpoint_every={args.checkpoint_every}",
        "fault_tolerance.max_restarts=100",  # each partition restarts a worker
        "run.name='c'",
    ]


def checkpointed(rounds: int, every: int) -> set[int]:
    """The rounds followed by a checkpoint (the next round carries it)."""
    return {r for r in range(1, rounds + 1) if r % every == 0}


class Rounds(threading.Thread):
    """The newest round record in each machine's metrics log, read as the log grows: only the
    bytes added since the last look (machines.Watch reads whole files, which a long run's logs
    outgrow). A log cut back (shorter than read) is read again from its start."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.paths: dict[str, Path] = {}
        self.offset: dict[str, int] = {}
        self.newest: dict[str, int] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()

    def add(self, name: str, path: Path) -> None:
        with self.lock:
            self.paths[name] = path

    def run(self) -> None:
        while not self.done.wait(2 * POLL_S):
            self.poll()

    def poll(self) -> None:
        with self.lock:
            paths = dict(self.paths)
        for name, path in paths.items():
            try:
                with open(path, "rb") as f:
                    at = self.offset.get(name, 0)
                    if os.fstat(f.fileno()).st_size < at:
                        at = 0
                        with self.lock:
                            self.newest[name] = 0
                    f.seek(at)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            found = [
                json.loads(line)["round"]
                for line in data[:end].splitlines()
                if b'"kind": "round"' in line
            ]
            with self.lock:
                self.offset[name] = at + end
                self.newest[name] = max([self.newest.get(name, 0), *found])

    def of(self, names: list[str]) -> int:
        """The newest round any of `names` has logged."""
        with self.lock:
            return max((self.newest.get(n, 0) for n in names), default=0)

    def each(self, names: list[str]) -> list[int]:
        with self.lock:
            return [self.newest.get(n, 0) for n in names]


def clean_run(lab: NetLab, root: Path, args: argparse.Namespace) -> dict:
    """No events: the baseline round times and the mean round time."""
    M = args.machines
    c = Cluster(lab, root, job(args, args.clean_rounds), make_token=cli_token)
    try:
        c.up(M, args.timeout, follow=False)
        c.finish(["coordinator", *(f"m{i}" for i in range(1, M + 1))], args.timeout)
    finally:
        c.close()
    logs = [read_metrics(root / f"m{i}" / "metrics.jsonl") for i in range(1, M + 1)]
    times = merged_round_times(logs)
    base = baseline_of(times, checkpointed(args.clean_rounds, args.checkpoint_every))
    return {
        "rounds": args.clean_rounds,
        "round_s": base["plain"],
        "round_after_checkpoint_s": base["eval"],
        "mean_round_s": statistics.mean(times.values()),
        "baseline": base,
    }


class Chaos:
    """The chaos run's driver: a Cluster whose machines are named m1..mM (namespaces 1..M) and
    j1, j2, ... (joiners, each in the idle namespace freed longest ago), the schedule's events
    fired at their times, and what each did."""

    def __init__(
        self, c: Cluster, args: argparse.Namespace, plan: list[Event], rounds: int, round_s: float
    ) -> None:
        self.c, self.args, self.plan, self.rounds, self.round_s = c, args, plan, rounds, round_s
        M = args.machines
        self.name = {k: f"m{k + 1}" for k in range(M)}  # the schedule's machine -> name
        self.ns = {f"m{k}": k for k in range(1, M + 1)}
        self.idle = collections.deque(range(M + 1, M + 1 + SPARE))
        self.live = [f"m{k}" for k in range(1, M + 1)]
        self.coordinator = "coordinator"
        self.restarts = 0
        self.follow = Rounds()
        self.t0 = 0.0
        self.done: list[dict] = []

    def procs(self) -> list[subprocess.Popen]:
        return [self.c.procs[n] for n in (self.coordinator, *self.live)]

    def newest(self) -> int:
        return self.follow.of(self.live)

    def settle(self, what: str) -> int:
        """Wait until every live machine logs a round past the newest now: all of them train
        together again. Returns the newest round then."""
        r0, names = self.newest(), list(self.live)
        ok = lambda: all(r > r0 for r in self.follow.each(names))  # noqa: E731
        wait_for(ok, f"every machine training again after {what}", self.args.timeout, self.procs())
        return self.newest()

    def start(self) -> None:
        self.c.up(self.args.machines, self.args.timeout, follow=False)
        for n in self.live:
            self.follow.add(n, self.c.root / n / "metrics.jsonl")
        self.follow.start()
        wait_for(lambda: self.newest() >= 1, "the first round", self.args.timeout, self.procs())
        self.t0 = time.monotonic()

    def run(self) -> None:
        """Every event in turn, each once the run has recovered from the one before; stops at
        the first event the run does not survive, or once the run nears its end (`ending`)."""
        for i, e in enumerate(self.plan):
            target = self.t0 + e.t
            due = lambda target=target: time.monotonic() >= target or self.ending()  # noqa: E731
            wait_for(due, f"event {i} ({e.kind})", e.t + 10 * self.args.timeout, self.procs())
            if self.ending():
                print(f"  the run is ending: events {i}.. not run", flush=True)
                return
            ev = {"i": i, "kind": e.kind, "scheduled_s": e.t, "hold_s": e.hold_s}
            ev["t_s"] = round(time.monotonic() - self.t0, 2)
            ev["late_s"] = round(ev["t_s"] - e.t, 2)
            before = self.restarted()
            t = time.monotonic()
            try:
                getattr(self, e.kind.replace(" ", "_"))(e, ev)
                ev["survived"] = True
            except RuntimeError as err:
                ev["survived"], ev["error"] = False, str(err)
            ev["recovered_s"] = round(time.monotonic() - t, 2)
            ev["worker_restarts"] = self.restarted() - before
            self.done.append(ev)
            print(f"  {describe(ev)}", flush=True)
            if not ev["survived"]:
                return

    def ending(self) -> bool:
        """The run is in its last two checkpoint intervals, which stay without events (the
        resume check starts from the last checkpoint before the end)."""
        return self.newest() >= self.rounds - 2 * self.args.checkpoint_every

    def restarted(self) -> int:
        """Worker restarts so far, by the agents' "restarting" lines."""
        agents = [n for n in self.c.procs if not n.startswith("coordinator")]
        return sum(self.c.output(n).count("restarting") for n in agents)

    def kill(self, e: Event, ev: dict) -> None:
        name = self.name[e.machine]
        ev["machine"], ns = name, self.ns[name]
        ev["r_at"] = self.newest()
        lost = self.c.log().count(" lost (")
        self.c.lab.kill(ns)
        self.c.procs[name].wait()
        self.live.remove(name)
        freed = lambda: self.c.log().count(" lost (") > lost  # noqa: E731
        wait_for(freed, f"the coordinator freeing {name}'s slot", self.args.timeout, self.procs())
        ev["r_ok"] = self.settle(f"{name} killed")
        self.idle.append(ns)

    def join(self, e: Event, ev: dict) -> None:
        name = f"j{e.machine - self.args.machines + 1}"
        ns = self.idle.popleft()
        self.name[e.machine], self.ns[name] = name, ns
        ev["machine"], ev["r_at"] = name, self.newest()
        self.c.join(ns, name)
        self.follow.add(name, self.c.root / name / "metrics.jsonl")
        member = lambda: self.c.watch.first(name, "membership: rejoined")  # noqa: E731
        wait_for(lambda: member() is not None, f"{name} a member", self.args.timeout,
                 [*self.procs(), self.c.procs[name]])  # fmt: skip
        ev["join_s"] = round(member() - self.c.started[name], 2)
        self.live.append(name)
        ev["r_ok"] = self.settle(f"{name} joined")

    def partition(self, e: Event, ev: dict) -> None:
        name = self.name[e.machine]
        ev["machine"], ns = name, self.ns[name]
        ev["r_at"] = self.newest()
        self.c.lab.set_link(ns, up=False)
        try:
            time.sleep(e.hold_s)
        finally:
            self.c.lab.set_link(ns, up=True)
        ev["r_ok"] = self.settle(f"{name} cut off")

    def coordinator_restart(self, e: Event, ev: dict) -> None:
        ev["machine"], ev["r_at"] = "coordinator", self.newest()
        log = self.c.log()
        live, cold = log.count("its workers still running"), log.count(", from round ")
        self.c.lab.kill(0)
        self.c.procs[self.coordinator].wait()
        time.sleep(e.hold_s)
        ev["r_back"] = self.newest()  # the round in hand, finished while it was away
        self.restarts += 1
        self.coordinator = f"coordinator-{self.restarts}"
        self.c.coordinator(resume=True, name=self.coordinator)
        M = len(self.live)
        back = lambda: self.c.log().count("its workers still running") >= live + M  # noqa: E731
        went_cold = lambda: self.c.log().count(", from round ") > cold  # noqa: E731
        what = "every machine back"
        wait_for(lambda: back() or went_cold(), what, self.args.timeout, self.procs())
        ev["from_checkpoints"] = went_cold()
        ev["r_ok"] = self.settle("the coordinator restart")

    def finish(self) -> None:
        """Wait for the run's end: the coordinator and every live machine exit 0."""
        left = max(0, self.rounds - self.newest())
        limit = self.args.timeout + 3 * left * self.round_s
        self.c.finish([self.coordinator, *self.live], limit)


def describe(ev: dict) -> str:
    what = ev["kind"] + (f" {ev['machine']}" if ev.get("machine") else "")
    hold = f" for {ev['hold_s']:g} s" if ev["hold_s"] else ""
    if not ev["survived"]:
        return f"[{ev['t_s']:7.1f} s] {what}{hold}: NOT survived: {ev['error'][:300]}"
    extra = f", a member {ev['join_s']:.1f} s after its start" if "join_s" in ev else ""
    extra += ", from checkpoints" if ev.get("from_checkpoints") else ""
    return (
        f"[{ev['t_s']:7.1f} s] {what}{hold}: survived, rounds {ev['r_at']}->{ev['r_ok']}, "
        f"recovered in {ev['recovered_s']:.1f} s{extra}, {ev['worker_restarts']} worker restarts"
    )


# ---------------------------------------------------------------- the checks after the run


def holders(dirs: list[Path]) -> dict[int, Path]:
    """Slot -> the run directory of the machine holding it (machine.json)."""
    out = {}
    for d in dirs:
        for slot in json.loads((d / "machine.json").read_text())["slots"]:
            out[slot] = d
    return out


def final_models(dirs: list[Path], slots: int) -> dict:
    """Every member's final checkpoint: its round, and whether every worker's SHARED state
    equals slot 0's, bit for bit."""
    held = holders(dirs)
    states, rounds = {}, {}
    for slot in range(slots):
        ckpt = checkpoint.latest_complete(held[slot])
        rounds[slot] = int(ckpt.name.removeprefix("round_"))
        states[slot] = torch.load(ckpt / f"worker_{slot}.pt", map_location="cpu", weights_only=True)
    differ = [
        s for s in range(1, slots) if not all(same(states[s][k], states[0][k]) for k in SHARED)
    ]
    return {
        "members": slots,
        "rounds": sorted(set(rounds.values())),
        "equal": not differ and len(set(rounds.values())) == 1,
        "differ_from_slot0": differ,
    }


def resume_check(dirs: list[Path], records: list[dict], work: Path, timeout: float) -> dict:
    """`frugaltrain train --resume` from the newest checkpoint before the end that holds every
    slot, its worker files gathered from the members into one run directory; the states it
    ends with against the chaos run's own, bit for bit. Not comparable where the membership
    changed after that checkpoint (the resumed run has every worker throughout)."""
    held = holders(dirs)
    slots = len(held)
    end = max(int(checkpoint.latest_complete(d).name.removeprefix("round_")) for d in dirs)
    have = collections.defaultdict(set)
    for d in dirs:
        for ckpt in checkpoint.completed(d):
            r = int(ckpt.name.removeprefix("round_"))
            have[r] |= {s for s in range(slots) if (ckpt / f"worker_{s}.pt").is_file()}
    starts = [r for r, s in have.items() if r < end and len(s) == slots]
    if not starts:
        return {"comparable": False, "why": "no checkpoint before the end holds every slot"}
    start = max(starts)
    changed = [c for c in records if c.get("kind") == "membership" and c["round"] >= start]
    if changed:
        return {"comparable": False, "why": f"membership changed after round {start}"}
    run_dir = work / "resumed"
    into = checkpoint.round_dir(run_dir, start)
    into.mkdir(parents=True)
    shutil.copy(dirs[0] / "config.toml", run_dir / "config.toml")
    for d in dirs:
        src = checkpoint.round_dir(d, start)
        for f in src.glob("worker_*.pt*"):
            shutil.copy(f, into / f.name)
    shutil.copy(checkpoint.round_dir(dirs[0], start) / "COMPLETE", into / "COMPLETE")
    cmd = [sys.executable, "-m", "frugaltrain", "train", "--resume", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(work / "resumed.out", "w") as out:
        try:
            code = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"comparable": False, "why": f"the resumed run took over {timeout:g} s"}
    if code.returncode != 0:
        tail = _redact((work / "resumed.out").read_text()[-1500:], work)
        return {"comparable": False, "why": f"the resumed run exited {code.returncode}: {tail}"}
    differ = {}
    for slot in range(slots):
        mine = checkpoint.round_dir(run_dir, end) / f"worker_{slot}.pt"
        theirs = checkpoint.round_dir(held[slot], end) / f"worker_{slot}.pt"
        a, b = (torch.load(p, map_location="cpu", weights_only=False) for p in (mine, theirs))
        keys = sorted(k for k in a.keys() | b.keys() if not same(a.get(k), b.get(k)))
        if keys:
            differ[slot] = keys
    return {
        "comparable": True,
        "from_round": start,
        "to_round": end,
        "equal": not differ,
        "differ": differ,
    }


# ---------------------------------------------------------------- the table


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(result: dict) -> str:
    a, f, checks = result["args"], result["figures"], result["checks"]
    chaos = result["chaos"]
    lines = [
        f"{a['machines']} machines at {a['rate_mbit']:g} Mbit/s, {a['machine_cpu']:g} core each "
        f"(the coordinator {a['coordinator_cpu']:g}); H = {a['H']}, a clean round "
        f"{result['clean']['round_s']:.3f} s; {a['minutes']:g} minutes of events, seed "
        f"{a['seed']}; the run: {chaos['rounds']} rounds in {chaos['wall_s'] / 60:.1f} min",
        "",
        "| event | scheduled | run | survived | time lost, mean (s) | worst (s) |",
        "|---|---|---|---|---|---|",
    ]
    for kind, k in f["by_kind"].items():
        lines.append(
            f"| {kind} | {k['scheduled']} | {k['run']} | {k['survived']} "
            f"| {_s(k['lost_mean_s'])} | {_s(k['lost_worst_s'])} |"
        )
    r, m, res = f["rounds"], checks["final_models"], checks["resume"]
    js = f["join_s"]
    resumed = (
        f"{'yes' if res['equal'] else 'NO'} (rounds {res['from_round']}->{res['to_round']}, "
        "every worker's whole state)"
        if res.get("comparable")
        else f"not compared: {res.get('why', '')}"
    )
    models = "not compared: the run failed"
    if m:
        differ = m["differ_from_slot0"]
        models = (
            f"yes ({m['members']} members)"
            if m["equal"]
            else (f"NO: slots {differ} differ from slot 0 (rounds {m['rounds']})")
        )
    lines += [
        "",
        "| check | result |",
        "|---|---|",
        f"| rounds logged more than once | {r['logged_more_than_once']} (of {r['expected']}; "
        f"{r['missing']} missing) |",
        f"| final models equal across members, bit for bit | {models} |",
        f"| `--resume` exact | {resumed} |",
        f"| a joiner's start to its first round as a member, s | mean {_s(js['mean'])}, "
        f"worst {_s(js['worst'])} |",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--machines", type=int, default=4, help="machines of the run, a slot each")
    ap.add_argument("--minutes", type=float, default=15.0, help="of training under events")
    ap.add_argument("--seed", type=int, default=0, help="the schedule's")
    ap.add_argument("--min-gap", type=float, default=30.0, help="s between events, at least")
    ap.add_argument("--mean-gap", type=float, default=45.0, help="s between events, on average")
    ap.add_argument("--start", type=float, default=30.0, help="s of training before any event")
    ap.add_argument("--tail", type=float, default=30.0, help="s without events at the end")
    ap.add_argument("--H", type=int, default=8, help="inner steps per round")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="rounds")
    ap.add_argument("--clean-rounds", type=int, default=60, help="rounds of the clean run")
    ap.add_argument("--rate-mbit", type=float, default=20.0)
    ap.add_argument("--machine-cpu", type=float, default=0.4, help="cores per machine")
    ap.add_argument("--coordinator-cpu", type=float, default=0.3, help="the coordinator's cores")
    ap.add_argument("--timeout", type=float, default=180.0, help="s for any one wait")
    ap.add_argument("--work", help="keep the runs' directories here (default: a temporary one)")
    ap.add_argument("--out", default="benchmarks/results/chaos.json")
    ap.add_argument("--table", action="store_true", help="print the table of --out and exit")
    ap.add_argument("--show-schedule", action="store_true", help="print the events and exit")
    args = ap.parse_args(argv)
    try:
        plan_of(args)
    except ValueError as e:
        ap.error(str(e))
    cores = args.coordinator_cpu + args.machines * args.machine_cpu
    if cores > (os.cpu_count() or 1):
        ap.error(
            f"--coordinator-cpu + --machines x --machine-cpu = {cores:g} cores, more than this "
            f"machine's {os.cpu_count()}: lower --machine-cpu"
        )
    if args.clean_rounds < 2 * args.checkpoint_every:
        ap.error(
            f"--clean-rounds {args.clean_rounds}: at least two --checkpoint-every intervals "
            f"({2 * args.checkpoint_every})"
        )
    return args


def plan_of(args: argparse.Namespace) -> list[Event]:
    return schedule(
        args.seed,
        args.machines,
        args.minutes * 60,
        start_s=args.start,
        min_gap_s=args.min_gap,
        mean_gap_s=args.mean_gap,
        tail_s=args.tail,
    )


def measure(args: argparse.Namespace, work: Path) -> dict:
    M, plan = args.machines, plan_of(args)
    result = provenance.start("measured", variants={"clean": job(args, args.clean_rounds)})
    result |= {"args": {k: v for k, v in vars(args).items() if k != "work"}}
    result["lab"] = {
        "namespaces": f"coordinator in 0, machines in 1..{M}, joiners in {M + 1}..{M + SPARE} "
        "and in those of killed machines",
        "cpu_shares": [args.coordinator_cpu, *[args.machine_cpu] * (M + SPARE)],
        "rate_mbit": args.rate_mbit,
    }
    result["schedule"] = [asdict(e) for e in plan]
    shares, tag = result["lab"]["cpu_shares"], f"ch{os.getpid() % 10000}"
    with NetLab(M + 1 + SPARE, args.rate_mbit, tag=tag, cpu_shares=shares) as lab:
        print(f"clean run: {args.clean_rounds} rounds", flush=True)
        clean = clean_run(lab, work / "clean", args)
        result["clean"] = clean
        print(f"  {clean['round_s']:.3f} s/round (median), {clean['mean_round_s']:.3f} (mean)")
        every = args.checkpoint_every
        rounds = every * math.ceil(MARGIN * args.minutes * 60 / clean["mean_round_s"] / every)
        result["variants"]["chaos"] = job(args, rounds)
        print(f"chaos run: {rounds} rounds, {len(plan)} events", flush=True)
        root = work / "chaos"
        c = Cluster(lab, root, job(args, rounds), make_token=cli_token)
        chaos = Chaos(c, args, plan, rounds, clean["mean_round_s"])
        t0 = time.monotonic()
        error = None
        try:
            chaos.start()
            chaos.run()
            chaos.finish()
        except RuntimeError as e:
            error = str(e)
            print(f"  the run failed: {error[:500]}", flush=True)
        finally:
            chaos.follow.done.set()
            c.close()
        wall_s = time.monotonic() - t0
    tidy(tag)
    names = sorted(chaos.ns, key=lambda n: (n[0] != "m", int(n[1:])))
    paths = [root / n / "metrics.jsonl" for n in names]
    logs = [read_metrics(p) for p in paths if p.is_file()]
    records = c.records() if (c.coord_dir / "metrics.jsonl").is_file() else []
    extra = checkpointed(rounds, every)
    result["chaos"] = {
        "rounds": rounds,
        "wall_s": wall_s,
        "error": _redact(error, work),
        "events": chaos.done,
        "machines_at_end": chaos.live,
    }
    for ev in chaos.done:
        if "error" in ev:
            ev["error"] = _redact(ev["error"], work)
    result["figures"] = figures(plan, chaos.done, logs, records, clean["baseline"], extra, rounds)
    dirs = [root / n for n in chaos.live]
    result["checks"] = {"final_models": {}, "resume": {"comparable": False, "why": "run failed"}}
    if error is None:
        result["checks"]["final_models"] = final_models(dirs, M)
        print("resume check: `frugaltrain train --resume` of the last checkpoint", flush=True)
        resume = resume_check(dirs, records, work, args.timeout * 3)
        result["checks"]["resume"] = resume
    return result


def tidy(tag: str) -> None:
    """Remove the lab's CPU groups that NetLab's teardown left because a killed process was
    still in them (a machine's workers exit a moment after their SIGKILL)."""
    for _ in range(50):
        found = cpu.controller_dir()
        if found is None or not list(found[0].glob(f"ftl-{tag}-w*")):
            return
        cpu.cleanup(f"{tag}-w")
        time.sleep(0.1)


def _redact(text: str | None, work: Path) -> str | None:
    """No path of this machine in the result file."""
    if text is None:
        return None
    return text.replace(str(work), "$WORK").replace(sys.executable, "python")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return 0
    if args.show_schedule:
        plan = plan_of(args)
        alive = training(plan, args.machines)
        for e, (_, n) in zip(plan, alive, strict=True):
            what = "the coordinator" if e.machine < 0 else f"machine {e.machine}"
            hold = f" for {e.hold_s:g} s" if e.hold_s else ""
            print(f"{e.t:7.1f} s  {e.kind:<20} {what}{hold}  ({n} training)")
        return 0
    why = why_not_available() or cpu.why_not_available()
    if why:
        print(f"chaos.py: {why}", file=sys.stderr)
        return 2
    if args.work:
        result = measure(args, Path(args.work))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = measure(args, Path(tmp))
    provenance.save(provenance.finish(result), args.out)
    print(table(result))
    print(f"wrote {args.out}", file=sys.stderr)
    ok = all(ev["survived"] for ev in result["chaos"]["events"]) and not result["chaos"]["error"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
