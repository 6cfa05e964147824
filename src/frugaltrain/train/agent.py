"""`frugaltrain join HOST:PORT --token FILE [--workers N]`: this machine's part of a run.

The agent proves the run token to the coordinator (comm/auth.py), receives the run's config and
its slots, checks the model and data here before anything starts, and runs one worker process
per slot (run.shards processes per slot with shards) on the fault-tolerant runtime. The
processes reach the run's store through a local forwarder over the authenticated channel
(comm/gateway.py's StoreTunnel); their gloo traffic goes machine to machine (docs/security.md).

It restarts only its own processes: a dead one is started again under the same slot and rejoins
from a live peer at a round end (comm/ft/admission.py); the other machines restart nothing.
Every PING_S it tells the coordinator it is alive, with the new lines of its metrics.jsonl (the
machine that holds slot 0 writes them) and the slots that finished. It leaves once all its
slots have finished, or the run has ended without them.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import tomllib
import torch.distributed as dist

from frugaltrain.comm.auth import Channel, connect, read_token
from frugaltrain.comm.ft import keys
from frugaltrain.comm.gateway import StoreTunnel
from frugaltrain.config import Config, ConfigError, build_config, to_dict, to_toml
from frugaltrain.train import supervisor
from frugaltrain.train.coordinator import LEASE_S, PING_S

MACHINE_FILE = "machine.json"  # this machine's id and slots, kept in its run directory


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


class Agent:
    """One machine's agent; see the module docstring."""

    def __init__(self, address: str, token: bytes, workers: int, run_dir: str | None) -> None:
        self.host, self.port = parse_address(address)
        self.token, self.workers, self.wanted_dir = token, workers, run_dir
        self.machine = uuid.uuid4().hex[:12]
        self.metrics_at = 0  # bytes of metrics.jsonl already sent

    # ---- joining
    def join(self) -> bool:
        """Prove the token, get the config and slots (waiting while none is free); False if
        the run ended first."""
        self.channel: Channel = connect(self.host, self.port, self.token)
        name = socket.gethostname()
        self.channel.send(
            {"want": "join", "workers": self.workers, "machine": self.machine, "name": name}
        )
        said = False
        while True:
            msg = self.channel.recv(timeout_s=LEASE_S * 4)
            if "wait" in msg:
                if not said:
                    print(f"[agent] waiting for a free slot: {msg['wait']}", flush=True)
                    said = True
                self.channel.send({"ping": True})
                continue
            if "over" in msg or "error" in msg:
                print(f"[agent] {msg.get('over') or msg.get('error')}", flush=True)
                return False
            break
        self.slots: list[int] = list(msg["slots"])
        self.cfg = self._here(build_config(Config, tomllib.loads(msg["config"])))
        self._prepare()
        return True

    def _here(self, cfg: Config) -> Config:
        """The run's config with this machine's cores shared out over its own processes
        (run.threads = 0 would divide them by every worker of the run)."""
        if cfg.run.threads:
            return cfg
        here = len(self.slots) * cfg.run.shards
        return build_config(Config, to_dict(cfg), [f"run.threads={max(1, cpus() // here)}"])

    def _prepare(self) -> None:
        """The checks a local run makes, on this machine's model and data, then the run dir."""
        from frugaltrain.train.launch import check_data, check_model, new_run_dir

        check_model(self.cfg)
        check_data(self.cfg)
        if self.wanted_dir:
            self.run_dir = Path(self.wanted_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.run_dir = new_run_dir(self.cfg)
        (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
        info = {"machine": self.machine, "slots": self.slots, "coordinator": self.address}
        (self.run_dir / MACHINE_FILE).write_text(json.dumps(info) + "\n")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ---- running this machine's slots
    def run(self) -> int:
        cfg, S = self.cfg, self.cfg.run.shards
        self.tunnel = StoreTunnel(self.host, self.port, self.token).start()
        timeout = timedelta(seconds=max(60.0, cfg.run.timeout_s))
        store = dist.TCPStore("127.0.0.1", self.tunnel.port, is_master=False, timeout=timeout)
        self.ft_store = dist.PrefixStore(keys.namespace(0, S), store) if S > 1 else store
        ranks = [slot * S + s for slot in self.slots for s in range(S)]
        print(
            f"[agent] slots {self.slots} of run {cfg.run.name} ({cfg.outer.strategy}); "
            f"run dir {self.run_dir}",
            flush=True,
        )
        try:
            with supervisor.environment(supervisor.worker_env(cfg)):
                self._supervise(ranks)
        finally:
            self.tunnel.close()
        return 0

    def _supervise(self, ranks: list[int]) -> None:
        cfg, S = self.cfg, self.cfg.run.shards
        ctx = mp.get_context("spawn")
        args = (to_toml(cfg), str(self.run_dir), "127.0.0.1", self.tunnel.port, None)
        args += (tuple(self.slots),)
        procs: dict[int, mp.Process] = {}
        restarts = dict.fromkeys(self.slots, 0)
        finished: set[int] = set()

        def start(rank: int) -> None:
            local = {"LOCAL_RANK": str(ranks.index(rank))}
            with supervisor.environment(local):
                procs[rank] = ctx.Process(target=supervisor.worker_process, args=(rank, *args))
                procs[rank].start()

        try:
            for rank in ranks:
                start(rank)
            while len(finished) < len(ranks):
                time.sleep(PING_S)
                failed = supervisor.exited(procs, finished, self.ft_store, cfg, self.run_dir)
                supervisor.restart_failed(failed, procs, start, restarts, cfg, self.run_dir)
                done = [x for x in self.slots if all(x * S + s in finished for s in range(S))]
                self._ping(done, leaving=len(finished) == len(ranks))
        finally:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
                p.join()

    def _ping(self, finished: list[int], leaving: bool) -> None:
        """Alive, with the new metrics lines and the finished slots."""
        msg = {"ping": True, "metrics": self._new_metrics(), "finished": finished}
        if leaving:
            msg["leaving"] = True
        self.channel.send(msg)
        self.channel.recv(timeout_s=LEASE_S)

    def _new_metrics(self) -> list[str]:
        """Complete lines appended to this machine's metrics.jsonl since the last ping."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        with open(path, "rb") as f:
            f.seek(self.metrics_at)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.metrics_at += end
        return [line for line in data[:end].decode().splitlines() if line.strip()]


def run_join(address: str, token_path: str, workers: int, run_dir: str | None = None) -> int:
    """`frugaltrain join`: every check (address, token, then the run's model and data on this
    machine) before any worker starts."""
    if workers < 1:
        raise ConfigError(f"--workers {workers}: give the number of slots to fill, at least 1")
    agent = Agent(address, read_token(token_path), workers, run_dir)
    if not agent.join():
        return 0
    code = agent.run()
    sys.stdout.flush()
    return code
