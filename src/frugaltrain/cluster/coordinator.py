"""`frugaltrain coordinator`: the one small process a run across machines needs.

    frugaltrain coordinator --new-token run.token          # once; copy the file to each machine
    frugaltrain coordinator --config my.toml --port 29400 --token run.token

It trains nothing, and it imports no torch: it holds the run's config and run directory, hosts
the run's store (cluster/store.py: a server torch's TCPStore clients talk to, where the
fault-tolerant runtime's rendezvous lives) on the loopback interface only, and
listens on `--bind`:`--port` behind the run token (cluster/gateway.py): a machine that proves the
token gets the config and free slots, and its processes reach the store through that channel;
nothing else reaches the store. It writes the run's metrics.jsonl from the lines the machines
relay (cluster/metrics_relay.py: one machine is the source, and the next takes over when it is
lost) and, at the end, its summary.

Slots, not ranks: a run has run.workers slots (a worker's rank: its data stream and its name
in the logs). `join` claims free slots for a machine; a machine whose control channel goes
silent for LEASE_S loses its slots, which the next machine to join takes (its processes rejoin
from a live peer, comm/ft/admission.py). The state file (COORDINATOR_STATE in the run
directory) records the port and which machine holds which slot, so `--resume` comes back the
same.

A lost coordinator does not stop the training. Each machine's store tunnel holds its processes'
store requests while it is away, and its agent keeps its workers; they finish the round in
hand and wait in their next store call. The store journals every write (STORE_JOURNAL), so
`--resume` reopens the same port with the store as it was, and the machines rejoin "live":
their held requests go through and the run goes on, nothing recomputed. A machine that does not
come back within LEASE_S loses its slots, as any silent machine. If no machine comes back live
within LIVE_GRACE_S (the coordinator was away past fault_tolerance.coordinator_wait_s, and every
machine stopped with its checkpoints), the store is cleared and the machines go on from the
newest round every one of them holds a checkpoint of.

A member may send anything, and write anything into the store through its tunnel; it must not
be able to crash or wedge the coordinator or another machine. So every field of a control frame
is checked for type and range before use (`_join_request`, `_ping`): a machine that sends a bad
one, or a frame with a bad MAC, is logged with its name and address and dropped, its slots
freed as a lost machine's are. A store value the coordinator reads is checked too; any member
may have written it, so a bad one is logged once, by its key, and ignored.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import reprlib
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from frugaltrain.cluster import keys
from frugaltrain.cluster.auth import Channel, Refused, RunToken, read_token
from frugaltrain.cluster.gateway import Gateway
from frugaltrain.cluster.metrics_relay import MetricsRelay
from frugaltrain.cluster.run_dir import new_run_dir
from frugaltrain.cluster.run_store import (
    close_rendezvous,
    forget,
    group0_store,
    refresh_rendezvous,
)
from frugaltrain.cluster.status import StatusWriter
from frugaltrain.cluster.store import PrefixView, Store, StoreServer
from frugaltrain.config import Config, ConfigError, build_config, load_config, read_toml, to_toml

# A machine silent this long loses its slots. Survivors do not wait for it: the runtime finds a
# dead peer within seconds (gloo errors, heartbeats). The lease only frees the slots for the next
# machine, and its control channel shares a slow link with the bulk gloo traffic, where a
# drop-tail queue can hold a small packet back for seconds (TCP backs off per retransmission).
LEASE_S = 15.0
PING_S = 1.0  # how often a machine's agent says it is alive
# After a restart, how long machines have to come back with their workers still running
# before the coordinator takes it that none will and goes on from checkpoints. Their agents
# try every PING_S, so a live machine is back within a couple of seconds of the port opening.
LIVE_GRACE_S = 5.0
COORDINATOR_STATE = "coordinator.json"
STORE_JOURNAL = "store.journal"  # the store's writes, which --resume brings back
MAX_INT = 2**63 - 1  # the largest round or step a machine may report (torch's int64)
_MACHINE_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")  # agents pick 12 hex digits
_VERSION = re.compile(r"[0-9A-Za-z.+_-]{1,64}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
# What every machine of a run must run alike: a joining machine says its versions, and one that
# differs from the coordinator's frugaltrain, or from the torch of the first machine that joined
# (the coordinator runs without torch), is refused in one line naming both.
VERSIONED = ("frugaltrain", "torch")
T = TypeVar("T")


def _show(value: object) -> str:
    """A member's value in a log line or an error: short, whatever it is."""
    try:
        return reprlib.repr(value)
    except ValueError:  # an int too long to print
        return f"<{type(value).__name__} too long to show>"


def _printable(text: str, limit: int = 64) -> str:
    """A member's name for the log: one line of printable characters."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


@dataclass
class _JoinRequest:
    """A join request's fields, checked (`_join_request`)."""

    machine: str | None  # None: a new machine, which gets an id here
    name: str
    live: bool
    workers: int
    rounds: dict[int, int]  # its complete checkpoints: round -> step
    versions: dict[str, str]  # what it runs: frugaltrain, torch (VERSIONED)


def _join_request(request: dict) -> _JoinRequest:
    """The fields of a join request that the coordinator reads, each checked for type and
    range; ValueError naming the field and its value otherwise."""
    if request.get("want") != "join":  # the gateway took {"want": "store"}
        raise ValueError(f"want: {_show(request.get('want'))} is not 'join'")
    mid = request.get("machine")
    if mid is not None and not (type(mid) is str and _MACHINE_ID.fullmatch(mid)):
        raise ValueError(f"machine: {_show(mid)} is not 1 to 64 letters, digits, - or _")
    name = request.get("name")
    if name is not None and type(name) is not str:
        raise ValueError(f"name: {_show(name)} is not a string")
    live = request.get("live", False)
    if type(live) is not bool:
        raise ValueError(f"live: {_show(live)} is not true or false")
    workers = request.get("workers", 1)
    if type(workers) is not int or not 1 <= workers <= MAX_INT:
        raise ValueError(f"workers: {_show(workers)} is not a whole number from 1 to {MAX_INT}")
    rounds = request.get("rounds", [])
    if type(rounds) is not list:
        raise ValueError(f"rounds: {_show(rounds)} is not a list")
    for pair in rounds:  # JSON has no tuples: [round, step]
        if not (
            type(pair) is list
            and len(pair) == 2
            and all(type(x) is int and 0 <= x <= MAX_INT for x in pair)
        ):
            raise ValueError(f"rounds: {_show(pair)} is not [round, step] in [0, {MAX_INT}]")
    versions = request.get("versions", {})
    if type(versions) is not dict or any(
        type(v) is not str or not _VERSION.fullmatch(v) for v in versions.values()
    ):
        raise ValueError(f"versions: {_show(versions)} is not a table of version strings")
    got = {k: versions[k] for k in VERSIONED if k in versions}
    return _JoinRequest(mid, _printable(name or ""), live, workers, dict(rounds), got)


@dataclass
class _Ping:
    """A ping's fields, checked (`_ping`)."""

    metrics: list  # its lines, checked by MetricsRelay.add
    finished: list[int]
    leaving: bool
    data: str | None  # the digest of the data its workers train on (its first ping only)


def _ping(msg: dict, own: list[int]) -> _Ping:
    """The fields of a machine's ping, each checked for type and range (`own`: the slots the
    machine holds, the only ones it may say finished); ValueError naming the field otherwise."""
    metrics = msg.get("metrics", [])
    if type(metrics) is not list:
        raise ValueError(f"metrics: {_show(metrics)} is not a list")
    finished = msg.get("finished")
    finished = [] if finished is None else finished
    if type(finished) is not list or any(type(s) is not int or s not in own for s in finished):
        raise ValueError(f"finished: {_show(finished)} is not a list of its slots {own}")
    leaving = msg.get("leaving", False)
    if type(leaving) is not bool:
        raise ValueError(f"leaving: {_show(leaving)} is not true or false")
    data = msg.get("data")
    if data is not None and not (type(data) is str and _DIGEST.fullmatch(data)):
        raise ValueError(f"data: {_show(data)} is not a sha256 digest")
    return _Ping(metrics, finished, leaving, data)


def _raise_open_files_limit() -> str:
    """Raise this process's soft limit on open files to its hard limit: every machine's channel,
    every store client through the gateway (twice: its side and the store's) and every
    connection waiting for its handshake holds a descriptor. Returns the line to log."""
    try:
        import resource  # Unix only

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError) as e:
        return f"open files: could not raise the limit ({e}); it stays as it was"
    return f"open files: up to {'unlimited' if soft == resource.RLIM_INFINITY else soft}"


@dataclass
class Machine:
    """A joined machine: its id (chosen by its agent, kept across reconnects), name, address
    and slots."""

    id: str
    name: str
    peer: str
    slots: list[int] = field(default_factory=list)


class Slots:
    """Which machine holds each slot; every method under one lock (each channel is a thread)."""

    def __init__(self, n: int, owners: list[str | None] | None = None) -> None:
        self.owner: list[str | None] = list(owners) if owners else [None] * n
        self.finished: set[int] = set()
        self.lock = threading.Lock()

    def claim(self, machine: str, n: int) -> list[int]:
        """Up to `n` slots for `machine`: those it held before (a reconnect), then free ones."""
        with self.lock:
            mine = [s for s, o in enumerate(self.owner) if o == machine]
            free = [s for s, o in enumerate(self.owner) if o is None and s not in self.finished]
            for s in free[: max(0, n - len(mine))]:
                self.owner[s] = machine
                mine.append(s)
            return sorted(mine)

    def release(self, machine: str) -> list[int]:
        """Free `machine`'s slots that have not finished; returns them."""
        with self.lock:
            gone = [s for s, o in enumerate(self.owner) if o == machine]
            for s in gone:
                if s not in self.finished:
                    self.owner[s] = None
            return [s for s in gone if s not in self.finished]

    def finish(self, slots: list[int]) -> None:
        with self.lock:
            self.finished.update(slots)

    def of(self, machine: str) -> list[int]:
        """The slots `machine` holds."""
        with self.lock:
            return [s for s, o in enumerate(self.owner) if o == machine]

    def holders(self) -> list[str]:
        """The machines holding slots, the one with the lowest slot first."""
        with self.lock:
            return list(dict.fromkeys(o for o in self.owner if o is not None))


class Coordinator:
    """See the module docstring. `start` opens the store and the gateway; `wait` returns when
    every slot's workers have finished training."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        token: RunToken,
        bind: str,
        port: int,
        resume: bool = False,
    ) -> None:
        self.cfg, self.run_dir, self.token = cfg, run_dir, token
        self.bind, self.port = bind, port
        saved = self._saved_owners() if resume else None
        self.slots = Slots(cfg.run.workers, saved)
        self.machines: dict[str, Machine] = {}
        # --resume: machines back with live workers go on from the store as it was ("live").
        # If none is back live within LIVE_GRACE_S ("cold"), the machines that held the slots
        # go on from the newest round every one of them has a checkpoint of; those not back
        # within fault_tolerance.resume_wait_s are gone on without, and back later, each joins
        # as new.
        self.mode: str | None = None if resume else "fresh"  # then "live" or "cold"
        self.resuming = False  # the cold resume is under way
        self.reports: dict[str, dict[int, int]] = {}  # machine -> its checkpoints' round: step
        self.resumed: set[str] = set()  # machines told where to go on from
        self.resume_from: int | None = None  # that round, once decided
        self.resumers: set[str] = set()  # the machines it was decided for
        self.saved = {o for o in saved or [] if o}  # the machines that held slots before
        self.resume_lock = threading.Lock()
        self.started = time.monotonic()
        self.session = uuid.uuid4().hex[:12]
        self.log_lock, self.state_lock = threading.Lock(), threading.Lock()
        self.done = threading.Event()
        self.connected = 0  # machines whose control channel is open
        self.metrics = MetricsRelay(run_dir / "metrics.jsonl")
        self.ignored: set[str] = set()  # store keys whose bad values were logged (once each)
        # What the run's machines run and train on, as the first to say it said (name first).
        own = importlib.metadata.version("frugaltrain")
        self.versions: dict[str, list[str]] = {"frugaltrain": [own, "the coordinator"]}
        self.data: list[str] | None = None  # [digest, machine name]
        if resume:
            self.versions |= self._saved("versions") or {}
            self.data = self._saved("data")
        self.unlogged = 0  # lines that could not be written to coordinator.log
        self.status: StatusWriter | None = None  # status.html and metrics.prom, from start()

    def start(self) -> Coordinator:
        journal = self.run_dir / STORE_JOURNAL
        try:
            self.store = StoreServer(log=self.say, journal=journal)
        except ValueError as e:  # a damaged journal: the run can still go on from checkpoints
            raise ConfigError(
                f"{e}; move {journal} aside and --resume again: the machines then go on from "
                "their checkpoints"
            ) from None
        self.say(_raise_open_files_limit())  # after the journal: a bad one writes nothing
        if self.mode is None:  # nobody's keep-alive reached the store while it was away
            self._try(keys.RENDEZVOUS, lambda: refresh_rendezvous(self.store, self.cfg))
        # No port of its own: only the gateway's authenticated connections reach the store.
        self.store.start()
        self.gateway = Gateway(
            self.bind, self.port, self.token, self._store_connection, self.serve, self.say
        )
        self.gateway.start()
        self.port = self.gateway.port
        self._save_state()
        self.status = StatusWriter(self.run_dir, self.say).start()  # status.html, metrics.prom
        return self

    def _store_connection(self) -> socket.socket:
        """One end of a new socket pair, the other handed to the store."""
        ours, theirs = socket.socketpair()
        self.store.adopt(theirs)
        return ours

    def say(self, line: str) -> None:
        """A line of the coordinator's log: printed and kept in RUN_DIR/coordinator.log. It
        never raises: its callers hold sockets (the gateway's refusal among them) that must
        be closed after it even when the log cannot be written (a full disk, no descriptor
        left); such a line is counted in `unlogged` and told on stderr."""
        stamp = time.strftime("%H:%M:%S")
        with self.log_lock:
            try:
                print(f"[coordinator] {line}", flush=True)
            except (OSError, ValueError):  # stdout broken or closed: the file still has it
                pass
            try:
                with open(self.run_dir / "coordinator.log", "a") as f:
                    f.write(f"{stamp} {line}\n")
            except OSError as e:
                self.unlogged += 1
                try:
                    print(f"[coordinator] coordinator.log: {e}", file=sys.stderr, flush=True)
                except (OSError, ValueError):
                    pass

    # ---- one machine's control channel
    def serve(self, request: dict, channel: Channel) -> None:
        """One authenticated connection's control channel (the gateway's `serve`): a machine
        joins, gets its slots, then pings until it leaves."""
        try:
            ask = _join_request(request)
        except ValueError as e:
            self._refuse(request, channel, e)
            return
        if why := self._unlike(ask.name or channel.peer, "runs", self.versions, ask.versions):
            self._turn_away(ask.name, channel, why)
            return
        machine = self._machine(ask, channel.peer)
        if not self._await_mode(ask.live, channel):
            return
        held = machine.id in self.slots.holders()  # False: its slots were freed meanwhile
        slots = self._slots_for(machine, ask.workers, channel)
        if not slots:
            return
        machine.slots = slots
        self._save_state()
        reply = {"config": to_toml(self.cfg), "slots": slots, "session": self.session}
        if ask.live and not held:  # the others went on without its workers
            reply["fresh"] = True
        if self.resuming and machine.id not in self.resumed:
            ok, reply["resume"] = self._resume_round(machine, ask.rounds, channel)
            if not ok:
                return
            if reply["resume"] is None:  # back after the others went on: joins as new
                del reply["resume"]
            else:
                self.resumed.add(machine.id)
        where = f", from round {reply['resume']}" if "resume" in reply else ""
        if ask.live and "resume" not in reply:
            where = ", its workers " + ("to start again" if not held else "still running")
        self.say(f"machine {machine.name} ({machine.peer}) joined: slots {slots}{where}")
        channel.send(reply)
        with self.log_lock:
            self.connected += 1
        try:
            self._follow(machine, channel)
        finally:
            with self.log_lock:
                self.connected -= 1

    def _unlike(self, who: str, verb: str, run: dict[str, list[str]], mine: dict[str, str]) -> str:
        """Why `who` cannot take part ("" if it can): a value of `mine` that differs from the
        run's (`run`: name -> [value, who said it first]); a value the run has none of yet
        becomes the run's."""
        with self.state_lock:
            for name, value in mine.items():
                theirs = run.setdefault(name, [value, who])
                if theirs[0] != value:
                    return f"{who} {verb} {name} {value}; {theirs[1]} {verb} {name} {theirs[0]}"
        return ""

    def _unlike_data(self, machine: Machine, digest: str) -> str:
        """Why a machine's data is not the run's ("" if it is: the first machine's sets it)."""
        run = {"data": self.data} if self.data else {}
        why = self._unlike(machine.name, "trains on", run, {"data": digest})
        if not why and self.data is None:
            self.data = run["data"]
            self._save_state()
        return why.replace(" data ", " data with sha256 ")

    def _turn_away(self, name: str, channel: Channel, why: str) -> None:
        """A machine that cannot take part: logged, and told why in one line."""
        self.say(f"refused machine {name} ({channel.peer}): {why}")
        try:
            channel.send({"error": why})
        except OSError:
            pass  # it is gone: nothing more to tell it

    def _refuse(self, request: dict, channel: Channel, error: ValueError) -> None:
        """A request with a bad field: logged with its sender, who is told why; a machine known
        by its id is dropped (its slots freed, as a lost machine's)."""
        mid = request.get("machine")
        known = self.machines.get(mid) if type(mid) is str else None
        who = f"machine {known.name} ({channel.peer})" if known else channel.peer
        self.say(f"refused a request from {who}: {error}")
        if known is not None:
            self._release(known.id, f"machine {known.name} dropped")
        try:
            channel.send({"error": f"bad request: {error}"})
        except OSError:
            pass  # it is gone: nothing more to tell it

    def _await_mode(self, live: bool, channel: Channel) -> bool:
        """After --resume: the first machine back with live workers makes the resume live;
        with none back live within LIVE_GRACE_S it is cold (the store is cleared: the run goes
        on from checkpoints). A machine waits until that is decided; False if it left."""
        while True:
            with self.resume_lock:
                if self.mode is None and live:
                    self._go_live()
                elif self.mode is None and time.monotonic() - self.started >= LIVE_GRACE_S:
                    self._go_cold()
                if self.mode is not None:
                    return True
            if not self._hold(channel, "resuming: waiting for machines with live workers"):
                return False

    def _go_live(self) -> None:
        self.mode = "live"
        self.say("a machine is back with its workers running: the run goes on as it was")
        threading.Thread(target=self._free_absent, daemon=True, name="lease").start()

    def _go_cold(self) -> None:
        self.mode, self.resuming = "cold", True
        self.store.clear()
        self.say("no machine is back with live workers: going on from checkpoints")

    def _free_absent(self) -> None:
        """A live resume: the slots of machines not back within LEASE_S are freed, as a
        silent machine's are."""
        time.sleep(LEASE_S)
        for gone in sorted(self.saved - set(self.machines)):
            self._release(gone, f"machine id {gone} not back within {LEASE_S:g} s")

    def _resume_round(
        self, machine: Machine, rounds: dict[int, int], channel: Channel
    ) -> tuple[bool, int | None]:
        """(True, the round this machine goes on from): the newest round every slot's machine
        that is back holds a checkpoint of, decided once all are back, or once
        fault_tolerance.resume_wait_s has passed and those back hold run.min_workers slots
        (the others' slots are freed). (True, None): it came back after that, and joins as a
        new machine, from a live peer. (False, None): it left meanwhile, or there is no such
        round (it is told why). `rounds`: its checkpoints, round -> step."""
        self.reports[machine.id] = rounds
        while True:
            with self.resume_lock:
                if self.resume_from is None:
                    self._decide_resume()
                if self.resume_from is not None:
                    break
            missing = [s for s, o in enumerate(self.slots.owner) if o and o not in self.reports]
            if not self._hold(channel, f"resuming: the machines of slots {missing} are not back"):
                return False, None
        if self.resume_from < 0:
            channel.send({"error": "no checkpoint round that every slot's machine holds"})
            return False, None
        if machine.id not in self.resumers:
            return True, None
        self.metrics.cut(self.reports[machine.id][self.resume_from])  # logged again after it
        return True, self.resume_from

    def _decide_resume(self) -> None:
        """Set resume_from (-1: no common round) if every slot's machine is back, or if the
        wait is over and those back are enough; free the slots of those not back."""
        owners = {o for o in self.slots.owner if o in self.saved}
        back = owners & set(self.reports)
        if back != owners:
            waited = time.monotonic() - self.started >= self.cfg.fault_tolerance.resume_wait_s
            held = sum(o in back for o in self.slots.owner)
            if not waited or held < self.cfg.run.min_workers:
                return
            for gone in sorted(owners - back):
                freed = self._release(gone, f"resuming without machine id {gone}: not back")
                self._count_as_started(len(freed))
        common = set.intersection(*(set(self.reports[o]) for o in back)) if back else set()
        self.resume_from, self.resumers = (max(common) if common else -1), back

    def _count_as_started(self, slots: int) -> None:
        """The first starts of each shard group meet before their first round
        (comm/ft/elastic_world.py): count the processes of `slots` freed slots in, as each would
        count itself, so those back do not wait for them."""
        S = self.cfg.run.shards
        for shard in range(S):
            world = PrefixView(keys.namespace(shard, S), self.store) if S > 1 else self.store
            for _ in range(slots):  # a STARTED that holds no integer: ValueError, logged
                self._try(keys.STARTED, lambda w=world: keys.count_start(w, self.cfg.run.workers))

    def _machine(self, ask: _JoinRequest, peer: str) -> Machine:
        mid = ask.machine or uuid.uuid4().hex[:12]
        self.machines[mid] = Machine(mid, ask.name or peer, peer)
        return self.machines[mid]

    def _slots_for(self, machine: Machine, n: int, channel: Channel) -> list[int]:
        """Claim up to `n` slots; while none is free the machine waits (told so every LEASE_S)."""
        while not self.done.is_set():
            slots = self.slots.claim(machine.id, n)
            if slots:
                return slots
            if not self._hold(channel, f"all {self.cfg.run.workers} slots are taken"):
                return []
        channel.send({"over": "the run has ended"})
        return []

    def _hold(self, channel: Channel, why: str) -> bool:
        """Tell a waiting machine why and hear its ping (a silent one is dropped: False)."""
        channel.send({"wait": why})
        try:
            channel.recv(timeout_s=LEASE_S)  # what the ping holds is not read
        except (OSError, Refused) as e:  # Refused: a bad MAC, or a frame that is not JSON
            if isinstance(e, Refused):
                self.say(f"dropped a waiting machine ({channel.peer}): {e}")
            return False
        time.sleep(PING_S)
        return True

    def _follow(self, machine: Machine, channel: Channel) -> None:
        """The machine's pings (with its metrics lines and finished slots) until it leaves; a
        machine silent for LEASE_S, whose connection drops, or that sends a frame with a bad
        MAC or a bad field loses its unfinished slots."""
        while True:
            try:
                msg = channel.recv(timeout_s=LEASE_S)
                beat = _ping(msg, self.slots.of(machine.id))
                if beat.data is not None and (why := self._unlike_data(machine, beat.data)):
                    self._turn_away(machine.name, channel, why)
                    self._drop(machine, f"machine {machine.name} dropped")
                    return
                # Every line is checked before any is kept (ValueError).
                self.metrics.add(machine.id, beat.metrics, self.slots.holders())
                self.slots.finish(beat.finished)
                channel.send({"ok": True, "done": self.done.is_set()})  # wait() keeps it
            except (Refused, ValueError) as e:
                self.say(f"machine {machine.name} ({machine.peer}) sent a bad frame: {e}")
                self._drop(machine, f"machine {machine.name} dropped")
                return
            except OSError as e:  # ConnectionError and TimeoutError among them
                why = "silent" if isinstance(e, TimeoutError) else "connection closed"
                self._drop(machine, f"machine {machine.name} lost ({why})")
                return
            if beat.leaving:
                self.say(f"machine {machine.name} finished its slots {machine.slots}")
                return

    def _drop(self, machine: Machine, why: str) -> None:
        """Free the slots of `machine`, whose channel ends; not if it has joined again on a new
        channel, which holds its slots now."""
        if self.machines.get(machine.id) is machine:
            self._release(machine.id, why)

    def _release(self, machine: str, why: str) -> list[int]:
        """Free `machine`'s unfinished slots, and tell the rendezvous their processes are gone
        (the survivors need not wait out their keep-alives). Returns the slots freed."""
        freed = self.slots.release(machine)
        self._save_state()
        if freed:
            self.say(f"{why}: slots {freed} are free")
        S = self.cfg.run.shards
        for slot in freed:
            for shard in range(S):
                # forget logs a bad state itself; KeyError: a member deleted it meanwhile
                self._try(
                    keys.RENDEZVOUS, lambda r=slot * S + shard: forget(self.store, self.cfg, r)
                )
        return freed

    # ---- the store's values: any member may have written them
    def _try(self, key: str, change: Callable[[], object]) -> None:
        """Run `change`, which reads the store's `key`; a bad value there is logged and
        ignored (nobody to drop: the store is shared)."""
        try:
            change()
        except (ValueError, KeyError) as e:  # rendezvous_json.StateError is a ValueError
            self._ignore(key, e)

    def _read(self, store: Store, key: str, parse: Callable[[bytes], T]) -> T | None:
        """`key`'s value, checked by `parse`; None when it is missing or bad (logged)."""
        try:
            return parse(store.get(key))
        except KeyError:  # deleted since it was checked
            return None
        except ValueError as e:
            self._ignore(key, e)
            return None

    def _ignore(self, key: str, error: Exception) -> None:
        """Log a bad store value, once per key (the coordinator polls: not every half second)."""
        if key not in self.ignored:
            self.ignored.add(key)
            self.say(f"ignored the store's {key}: {str(error)[:200]}")

    def _run_over(self) -> bool:
        """Whether training is over: the members of some worker's last epoch have all
        finished. Then the rendezvous closes (a process still waiting to join exits)."""
        if not self.done.is_set() and self._training_over():
            self._try(keys.RENDEZVOUS, lambda: close_rendezvous(self.store, self.cfg))
            self.done.set()
        return self.done.is_set()

    def _training_over(self) -> bool:
        store = group0_store(self.store, self.cfg)
        if not store.check([keys.DONE]):
            return False
        W = self.cfg.run.workers
        for r in range(W):
            if store.check([keys.final_members(r)]):
                final = self._read(store, keys.final_members(r), lambda v: keys.parse_members(v, W))
                if final is not None:  # else another worker's may be well-formed
                    return all(store.check([keys.finished(m)]) for m in final)
        return False

    def wait(self, poll_s: float = 0.5) -> None:
        """Until training is over and every machine still connected has left (it sends its
        last metrics lines as it goes), at most LEASE_S more."""
        while not self._run_over():
            time.sleep(poll_s)
        deadline = time.monotonic() + LEASE_S
        while self.connected and time.monotonic() < deadline:
            time.sleep(poll_s / 5)

    def close(self) -> None:
        self.gateway.close()
        self.store.close()
        if self.status is not None:
            self.status.stop()

    # ---- the state file: what --resume brings back
    def _save_state(self) -> None:
        """Written whole and renamed, under the lock: machines join on threads of their own."""
        with self.state_lock:
            state = {"port": self.port, "bind": self.bind, "slots": list(self.slots.owner)}
            state |= {"versions": self.versions, "data": self.data}
            tmp = self.run_dir / f"{COORDINATOR_STATE}.tmp"
            tmp.write_text(json.dumps(state) + "\n")
            tmp.replace(self.run_dir / COORDINATOR_STATE)

    def _saved_owners(self) -> list[str | None] | None:
        return self._saved("slots")

    def _saved(self, key: str):
        """A field of the state file, or None (written by this coordinator: trusted)."""
        path = self.run_dir / COORDINATOR_STATE
        return json.loads(path.read_text()).get(key) if path.is_file() else None


def coordinator_config(config_path: str | None, overrides: list[str], resume: str | None):
    """The run's config (fault tolerance on: machines come and go) and its run directory,
    checked before the port opens."""
    if resume:
        saved = Path(resume) / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"--resume {resume}: no config.toml there; pass the run directory")
        return build_config(Config, read_toml(saved), overrides), Path(resume)
    cfg = load_config(config_path, [*overrides, "fault_tolerance.enabled=true"])
    if cfg.outer.strategy == "auto":
        raise ConfigError(
            "outer.strategy = 'auto': the coordinator does not train, so it cannot probe the "
            "step time; run `frugaltrain plan --config FILE` on a training machine and set "
            "outer.strategy to its pick"
        )
    if cfg.fault_tolerance.inject:
        raise ConfigError(
            "fault_tolerance.inject: injected faults are for local runs; across machines, "
            "stop a machine instead"
        )
    check_model_apart(cfg)
    run_dir = new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return cfg, run_dir


_CHECK = """
import sys, tomllib
from frugaltrain.config import Config, ConfigError, build_config
from frugaltrain.train.launch import check_model
try:
    check_model(build_config(Config, tomllib.loads(sys.stdin.read()), []))
except ConfigError as e:
    sys.exit(str(e))
"""


def check_model_apart(cfg: Config) -> None:
    """launch.check_model (the model builds as configured, its named parts exist) in a child
    process: it imports torch and transformers, which would stay in the coordinator's memory
    for the whole run. Its error comes back as this process's ConfigError."""
    done = subprocess.run(
        [sys.executable, "-c", _CHECK], input=to_toml(cfg), capture_output=True, text=True
    )
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise ConfigError(lines[-1])


def run_coordinator(
    config_path: str | None,
    overrides: list[str],
    token_path: str,
    port: int | None,
    bind: str = "0.0.0.0",
    resume: str | None = None,
) -> int:
    """`frugaltrain coordinator`: serve the run until training is over, then write its
    summary. Every check (token, config) comes before the port opens. With `resume` (the
    coordinator's run directory), the port and the slots' machines come from its state file."""
    token = read_token(token_path)
    token.server_context()  # its key file, checked before anything starts
    cfg, run_dir = coordinator_config(config_path, overrides, resume)
    state = run_dir / COORDINATOR_STATE
    if port is None:
        port = json.loads(state.read_text())["port"] if resume and state.is_file() else 29400
    coord = Coordinator(cfg, run_dir, token, bind, port, resume=bool(resume)).start()
    again = " (resumed: the machines go on as they were, or from checkpoints)" if resume else ""
    coord.say(
        f"run {cfg.run.name}: {cfg.outer.strategy}, {cfg.run.workers} slots; machines join "
        f"with `frugaltrain join HOST:{coord.port} --token FILE` (run dir {run_dir}){again}"
    )
    if not cfg.run.checkpoint_every:
        coord.say(
            "note: run.checkpoint_every = 0 writes a checkpoint only at the end and when the "
            "coordinator stays away past fault_tolerance.coordinator_wait_s; a machine lost "
            "while it is away then leaves no round to go on from; "
            "run.checkpoint_every = 1 loses at most a round"
        )
    try:
        coord.wait()
    finally:
        coord.close()
    coord.say("training is over")
    coord.status.stop()  # once more: the last status.html and metrics.prom, with the end
    # The summary and its plot in a child process too: matplotlib would double this one's size.
    subprocess.run([sys.executable, "-m", "frugaltrain", "report", str(run_dir)], check=False)
    return 0
