"""`frugaltrain join HOST:PORT --token FILE [--workers N]`: this machine's part of a run.

The agent proves the run token to the coordinator (cluster/auth.py), receives the run's config and
its slots, checks the model and data here before anything starts, and runs one worker process
per slot (run.shards processes per slot with shards) on the fault-tolerant runtime. The
processes reach the run's store through a local forwarder over the authenticated channel
(cluster/gateway.py's StoreTunnel); their gloo traffic goes machine to machine (docs/security.md).

It restarts only its own processes: a dead one is started again under the same slot and rejoins
from a live peer at a round end (comm/ft/admission.py); the other machines restart nothing.
Every PING_S it tells the coordinator it is alive, with the new lines of its metrics.jsonl (written
by its lowest slot's worker; the coordinator merges the machines' logs, cluster/metrics_relay.py)
and the slots that finished. It leaves once all its slots have finished, or the run has ended
without them.

When the coordinator is lost, the workers go on: the tunnel holds their store requests (they
finish the round in hand and wait in their next store call) while the agent joins again, as a
machine whose workers run, every PING_S. Back within fault_tolerance.coordinator_wait_s, the
run goes on where it was. Past it, the tunnel stops holding: every worker finishes the round in
hand without the store (its gloo peers are still there), checkpoints it and stops
(comm/ft/runtime.py), and the agent exits with one line naming that checkpoint (`join
--resume` goes on from it once `coordinator --resume` runs).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import socket
import sys
import threading
import time
import uuid
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path

import tomllib
import torch
import torch.distributed as dist

from frugaltrain import processes
from frugaltrain.cluster import run_store
from frugaltrain.cluster.auth import Channel, Refused, RunToken, connect, read_token
from frugaltrain.cluster.coordinator import LEASE_S, PING_S
from frugaltrain.cluster.gateway import StoreTunnel
from frugaltrain.cluster.run_dir import new_run_dir
from frugaltrain.config import (
    Config,
    ConfigError,
    build_config,
    coordinator_wait_s,
    read_toml,
    to_dict,
    to_toml,
)
from frugaltrain.metrics.log import keep_until_step
from frugaltrain.train import checkpoint, supervisor

MACHINE_FILE = "machine.json"  # this machine's id and slots, kept in its run directory
VERSIONS = {
    "frugaltrain": importlib.metadata.version("frugaltrain"),
    "torch": torch.__version__.split("+")[0],
}
"""What this machine runs, which every machine of a run must run alike (the coordinator checks)."""
JOIN_WAIT_S = 300.0  # how long `join` waits for a coordinator not listening yet (--wait)


def cpus() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"join {address!r}: give HOST:PORT, the coordinator's address as this machine "
            "reaches it and its --port, e.g. frugaltrain join 10.0.0.1:29400 --token run.token"
        )
    return host, int(port)


class CoordinatorLost(Exception):
    """The coordinator stayed away past fault_tolerance.coordinator_wait_s (or the run ended
    while it was away): this machine's workers stop."""


class GoOnFrom(Exception):
    """Back in touch with the coordinator, this machine's workers must start again: from the
    checkpoint named in `msg` (the run goes on from checkpoints: no machine kept its workers),
    or, without one, as restarts that rejoin from a live peer (the others went on without this
    machine while it was cut off, and its slots were freed)."""

    def __init__(self, msg: dict) -> None:
        super().__init__("this machine's workers start again")
        self.msg = msg


class Agent:
    """One machine's agent; see the module docstring. `run_dir`: where this machine keeps its
    logs and checkpoints; with `resume`, a run directory this machine had (its machine id and
    slots come back from it, and its workers from its checkpoints)."""

    def __init__(
        self, address: str, token: RunToken, workers: int, run_dir: str | None, resume: bool = False
    ) -> None:
        self.host, self.port = parse_address(address)
        self.token, self.workers = token, workers
        self.machine, self.slots, self.session = uuid.uuid4().hex[:12], [], ""
        self.run_dir: Path | None = Path(run_dir) if run_dir else None
        self.metrics_at = 0  # bytes of metrics.jsonl the coordinator has acknowledged
        if resume:
            info = json.loads((self.run_dir / MACHINE_FILE).read_text())
            self.machine, self.slots = info["machine"], info["slots"]
            self.metrics_at = info.get("relayed", 0)
        self.cfg: Config | None = None
        self.run_over = False  # the coordinator said training is over

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ---- talking to the coordinator
    def join(self, live: bool = False) -> dict | None:
        """Prove the token and ask for slots (those this machine held, if any, and the rounds
        it has checkpoints of; `live`: its workers are running); wait while none is free or
        the others are not back. Returns the coordinator's answer, or None if the run ended
        first."""
        self.channel: Channel = connect(self.host, self.port, self.token)
        request = {"want": "join", "workers": self.workers, "machine": self.machine}
        request |= {"name": socket.gethostname(), "slots": self.slots, "rounds": self._rounds()}
        request |= {"live": live, "versions": VERSIONS}
        self.channel.send(request)
        said = False
        while True:
            msg = self.channel.recv(timeout_s=LEASE_S * 4)
            if "wait" not in msg:
                break
            if not said:
                print(f"[agent] waiting: {msg['wait']}", flush=True)
                said = True
            self.channel.send({"ping": True})
        if "error" in msg:  # refused: its versions or its request
            raise Refused(f"the coordinator refused this machine: {msg['error']}")
        if "over" in msg:
            print(f"[agent] {msg['over']}", flush=True)
            return None
        return msg

    def _rounds(self) -> list[tuple[int, int]]:
        """(round, step) of the complete checkpoints this machine holds, oldest first."""
        if self.run_dir is None:
            return []
        metas = [
            json.loads((d / "COMPLETE").read_text()) for d in checkpoint.completed(self.run_dir)
        ]
        return [(m["round"], m["step"]) for m in metas]

    def _take(self, msg: dict) -> Path | None:
        """The coordinator's answer: the config (checked here the first time), this machine's
        slots, and the checkpoint its workers start from (None: a fresh start, or a rejoin)."""
        self.slots, self.session = list(msg["slots"]), msg["session"]
        if self.cfg is None:
            self.cfg = self._here(build_config(Config, tomllib.loads(msg["config"])))
            self._prepare()
        self._save_machine()
        if msg.get("resume") is None:
            return None
        ckpt = checkpoint.round_dir(self.run_dir, int(msg["resume"]))
        checkpoint.verify(ckpt)
        step = json.loads((ckpt / "COMPLETE").read_text())["step"]
        keep_until_step(self.run_dir / "metrics.jsonl", step)  # those rounds are logged again
        # Lines up to the checkpoint that never reached the coordinator are still to send.
        self.metrics_at = min(self.metrics_at, _size(self.run_dir / "metrics.jsonl"))
        self._save_machine()
        return ckpt

    def _save_machine(self) -> None:
        """This machine's id, slots and relayed metrics, for `join --resume`."""
        info = {"machine": self.machine, "slots": self.slots, "coordinator": self.address}
        info["relayed"] = self.metrics_at
        tmp = self.run_dir / f"{MACHINE_FILE}.tmp"
        tmp.write_text(json.dumps(info) + "\n")
        tmp.replace(self.run_dir / MACHINE_FILE)

    def _here(self, cfg: Config) -> Config:
        """The run's config with this machine's cores shared out over its own processes
        (run.threads = 0 would divide them by every worker of the run)."""
        if cfg.run.threads:
            return cfg
        here = len(self.slots) * cfg.run.shards
        return build_config(Config, to_dict(cfg), [f"run.threads={max(1, cpus() // here)}"])

    def _prepare(self) -> None:
        """The checks a local run makes, on this machine's model and data, then the run dir.
        They may take longer than LEASE_S on a loaded machine (building the model, hashing
        the data), so the agent pings meanwhile: a machine that is checking is not silent."""
        from frugaltrain.train.launch import check_data, check_model

        checked: dict = {}

        def check() -> None:
            try:
                check_model(self.cfg)
                checked["digest"] = check_data(self.cfg)
            except BaseException as e:  # noqa: BLE001 (raised again on the agent's thread)
                checked["error"] = e

        checking = threading.Thread(target=check, daemon=True, name="checks")
        checking.start()
        while checking.join(PING_S) or checking.is_alive():
            self.channel.send({"ping": True, "metrics": [], "finished": []})
            self.channel.recv(timeout_s=LEASE_S)
        if "error" in checked:
            raise checked["error"]
        self.channel.send({"ping": True, "data": checked["digest"]})  # the run's data, or refused
        answer = self.channel.recv(timeout_s=LEASE_S)
        if "error" in answer:
            raise Refused(f"the coordinator refused this machine: {answer['error']}")
        if self.run_dir is None:
            self.run_dir = new_run_dir(self.cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(self.cfg))

    # ---- running this machine's slots
    def run(self, msg: dict) -> int:
        """Run this machine's slots until they finish. Through a lost coordinator the workers
        go on (their store requests held by the tunnel) while the agent joins again, for at
        most fault_tolerance.coordinator_wait_s; past it they stop, with one line."""
        resume = self._take(msg)
        hold_s = coordinator_wait_s(self.cfg)
        say = functools.partial(print, flush=True)
        self.tunnel = StoreTunnel(self.host, self.port, self.token, log=say, hold_s=hold_s).start()
        try:
            while True:
                print(
                    f"[agent] slots {self.slots} of run {self.cfg.run.name} "
                    f"({self.cfg.outer.strategy}); run dir {self.run_dir}",
                    flush=True,
                )
                try:
                    self._supervise(resume)
                    return 0
                except GoOnFrom as e:
                    resume = self._take(e.msg)
                except CoordinatorLost:
                    if self.run_over:  # it ended the run and left before this machine did
                        print("[agent] the run is over", flush=True)
                        return 0
                    self._give_up()
                    return 1
        finally:
            self.tunnel.close()

    def _rejoin(self, why: str) -> dict:
        """The coordinator is away: join again every PING_S, as a machine whose workers run,
        for at most coordinator_wait_s; its answer, or CoordinatorLost."""
        wait_s = coordinator_wait_s(self.cfg)
        print(
            f"[agent] lost the coordinator at {self.address} ({why}); this machine's workers "
            f"go on, their store requests held; waiting up to {wait_s:g} s for it to come back",
            flush=True,
        )
        t0 = self.tunnel.away_since or time.monotonic()
        while time.monotonic() - t0 < wait_s:
            try:
                msg = self.join(live=True)
            except (ConnectionError, OSError, TimeoutError, Refused):
                time.sleep(PING_S)
                continue
            if msg is None:
                self.run_over = True
                raise CoordinatorLost("the run is over")
            print("[agent] the coordinator is back", flush=True)
            return msg
        raise CoordinatorLost(f"it did not come back within {wait_s:g} s")

    def _give_up(self) -> None:
        """One line: why this machine stopped, where its checkpoints are, how to go on."""
        wait_s = coordinator_wait_s(self.cfg)
        rounds = self._rounds()
        where = f"round {rounds[-1][0]} in {self.run_dir}" if rounds else "none yet"
        print(
            f"[agent] the coordinator did not come back within {wait_s:g} s "
            f"(fault_tolerance.coordinator_wait_s); this machine's workers stopped; its "
            f"newest checkpoint: {where}; go on with `frugaltrain join {self.address} --token FILE "
            f"--resume {self.run_dir}` once `frugaltrain coordinator --resume` runs",
            flush=True,
        )

    def _supervise(self, resume: Path | None) -> None:
        """This machine's processes until all have finished; through a lost coordinator they
        go on (`_away`). GoOnFrom: every process is stopped; CoordinatorLost: each is given
        time to checkpoint the round in hand first."""
        cfg, S = self.cfg, self.cfg.run.shards
        timeout = timedelta(seconds=max(60.0, cfg.run.timeout_s))
        store = dist.TCPStore("127.0.0.1", self.tunnel.port, is_master=False, timeout=timeout)
        ft_store = run_store.group0_store(store, cfg)
        ranks = [slot * S + s for slot in self.slots for s in range(S)]
        args = (to_toml(cfg), str(self.run_dir), "127.0.0.1", self.tunnel.port)
        env = supervisor.worker_env(cfg)
        procs: dict[int, BaseProcess] = {}
        restarts = dict.fromkeys(self.slots, 0)
        finished: set[int] = set()

        def start(rank: int, ckpt: Path | None = None) -> None:
            at = str(ckpt) if ckpt else None
            procs[rank] = processes.start(
                supervisor.worker_process,
                (rank, *args, at, tuple(self.slots)),
                supervisor.PRELOAD,
                {**env, "LOCAL_RANK": str(ranks.index(rank))},
            )

        try:
            for rank in ranks:
                start(rank, resume)
            while True:
                time.sleep(PING_S)
                if self.tunnel.away_since is not None:  # before the store, which holds us
                    self._away("the run's store is unreachable")
                try:
                    failed = supervisor.exited(procs, finished, ft_store, cfg, self.run_dir)
                except RuntimeError as e:  # the tunnel gave up holding: it stayed away
                    raise CoordinatorLost(f"the run's store: {short(e)}") from e
                done = [x for x in self.slots if all(x * S + s in finished for s in range(S))]
                leaving = len(finished) == len(ranks)
                try:
                    self._ping(done, leaving)  # before any restart: not into a lost run
                except ConnectionError as e:
                    self._away(short(e))
                    continue  # look at the processes again before any restart
                if leaving:
                    return
                supervisor.restart_failed(failed, procs, start, restarts, cfg, self.run_dir, store)
        except CoordinatorLost:
            if not self.run_over:
                self._let_workers_stop(procs)
            raise
        finally:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
                p.join()

    def _let_workers_stop(self, procs: dict[int, BaseProcess]) -> None:
        """The coordinator stayed away: the tunnel no longer holds, so each worker finishes
        the round in hand on gloo alone, checkpoints it and exits. Wait for that, at most
        run.timeout_s (its gloo deadline); the caller kills any still running."""
        print(
            "[agent] the workers finish the round in hand without the coordinator, checkpoint "
            f"it and stop (waiting up to run.timeout_s = {self.cfg.run.timeout_s:g} s)",
            flush=True,
        )
        deadline = time.monotonic() + self.cfg.run.timeout_s
        for p in procs.values():
            p.join(max(0.0, deadline - time.monotonic()))

    def _away(self, why: str) -> None:
        """The coordinator is away: join again (`_rejoin`); on its answer the workers go on
        (the same slots, a new session), or start again (GoOnFrom): from its checkpoint, or
        at once if the others went on without them (a cut-off machine's workers would find
        that out only when their stalled connections retransmit)."""
        if self.run_over:  # it ended the run and left before this machine did
            raise CoordinatorLost("the run is over")
        msg = self._rejoin(why)
        if msg.get("resume") is not None or msg.get("fresh"):
            raise GoOnFrom(msg)
        self.slots, self.session = list(msg["slots"]), msg["session"]
        self._save_machine()

    def _ping(self, finished: list[int], leaving: bool) -> None:
        """Alive, with the new metrics lines and the finished slots; ConnectionError if the
        coordinator does not answer within LEASE_S (or answers with a bad MAC)."""
        lines, upto = self._new_metrics()
        msg = {"ping": True, "metrics": lines, "finished": finished}
        if leaving:
            msg["leaving"] = True
        try:
            self.channel.send(msg)
            self.run_over = self.channel.recv(timeout_s=LEASE_S).get("done", False)
        except (ConnectionError, OSError, TimeoutError, Refused) as e:  # Refused: a bad MAC
            raise ConnectionError(f"the control channel: {short(e)}") from e
        if upto != self.metrics_at:  # acknowledged: kept for a `join --resume`
            self.metrics_at = upto
            self._save_machine()

    def _new_metrics(self) -> tuple[list[str], int]:
        """Complete lines appended to this machine's metrics.jsonl since the last
        acknowledged ping, and the offset after them."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return [], self.metrics_at
        with open(path, "rb") as f:
            f.seek(self.metrics_at)
            data = f.read()
        end = data.rfind(b"\n") + 1
        lines = [line for line in data[:end].decode().splitlines() if line.strip()]
        return lines, self.metrics_at + end


def _join_waiting(agent: Agent, wait_s: float, hint: str) -> dict | None:
    """Join, trying again every PING_S while nothing listens at the coordinator's address (not
    up yet, or restarting), for at most `wait_s`, with a line now and then; then give up with
    one line ending in `hint`. Machines started together with their coordinator (one script, a
    scheduler) thus join in any order, as torchrun's nodes wait for their rendezvous. A refused
    token or a bad answer ends it at once: waiting would not change them."""
    t0, said = time.monotonic(), -1.0
    while True:
        try:
            return agent.join()
        except (ConnectionError, TimeoutError) as e:  # refused or reset: not up yet
            waited = time.monotonic() - t0
            if waited >= wait_s:
                raise ConnectionError(
                    f"no coordinator at {agent.address} within {wait_s:g} s: {short(e)}; {hint}"
                ) from e
            if said < 0 or waited - said >= 10:  # a line now and then, not every try
                print(
                    f"[agent] waiting for the coordinator at {agent.address}, "
                    f"{waited:.0f} s of {wait_s:g}",
                    flush=True,
                )
                said = waited
            time.sleep(PING_S)


def short(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:160]


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def run_join(
    address: str,
    token_path: str,
    workers: int,
    run_dir: str | None = None,
    resume: str = "",
    wait_s: float = JOIN_WAIT_S,
) -> int:
    """`frugaltrain join`: every check (address, token, then the run's model and data on this
    machine) before any worker starts. `resume`: this machine's run directory of the same run
    (after the coordinator was away past fault_tolerance.coordinator_wait_s). `wait_s`: how long
    to wait for a coordinator that does not listen yet (with `resume`, at least the run's
    run.timeout_s)."""
    if workers < 1:
        raise ConfigError(f"--workers {workers}: give the number of slots to fill, at least 1")
    if resume and not (Path(resume) / MACHINE_FILE).is_file():
        raise ConfigError(
            f"--resume {resume}: no {MACHINE_FILE} there; pass the run directory this machine "
            "had in the run (its --run-dir)"
        )
    if not wait_s >= 0:
        raise ConfigError(f"--wait {wait_s}: give the seconds to wait for the coordinator, >= 0")
    agent = Agent(address, read_token(token_path), workers, resume or run_dir, bool(resume))
    if resume:  # a coordinator restarted on a loaded host may take run.timeout_s to listen
        cfg = build_config(Config, read_toml(Path(resume) / "config.toml"))
        hint = "start `frugaltrain coordinator --resume RUN_DIR` there, then join again"
        msg = _join_waiting(agent, max(wait_s, cfg.run.timeout_s), hint)
    else:
        msg = _join_waiting(agent, wait_s, "start `frugaltrain coordinator` there, or pass --wait")
    code = 0 if msg is None else agent.run(msg)
    sys.stdout.flush()
    return code
