"""A run across machines driven from a test: a coordinator and the machines that join it, as
processes (optionally each in a netlab namespace: a `prefix` such as `ip netns exec NS`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from frugaltrain.cluster.auth import new_token
from frugaltrain.config import to_toml
from helpers.gloo_pool import free_port


def machine_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "frugaltrain", *args]


_deadline = float("inf")  # the test's own end (`set_budget`): no wait may run past it


def set_budget(seconds: float) -> None:
    """Every wait from now on ends within `seconds` (a test's pytest timeout, less a margin),
    so a slow run fails naming what it waited for, not at pytest's kill."""
    global _deadline
    _deadline = time.monotonic() + seconds


def left(cap: float) -> float:
    """Seconds a wait may take: `cap`, or what is left of the test's budget if less."""
    return max(0.0, min(cap, _deadline - time.monotonic()))


def wait_for(predicate, what: str, timeout_s: float = 90.0, procs=()) -> None:
    """Poll until `predicate()`; fail naming `what` (or a process that died first)."""
    t0, timeout_s = time.monotonic(), left(timeout_s)
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode} before {what}"
        assert time.monotonic() - t0 < timeout_s, f"no {what} within {timeout_s:g} s"
        time.sleep(0.2)


class Run:
    """A coordinator on a free port and the machines that join it, each with its own output
    file and run directory under `root`."""

    def __init__(self, root: Path, cfg, bind: str = "127.0.0.1") -> None:
        self.root, self.bind = root, bind
        self.token = root / "run.token"
        new_token(self.token)
        self.config = root / "run.toml"
        self.config.write_text(to_toml(cfg))
        self.port = free_port()
        self.coord_dir = Path(cfg.run.out_dir) / cfg.run.name
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start_coordinator(
        self, prefix=(), resume: bool = False, name: str = "coordinator"
    ) -> subprocess.Popen:
        """The coordinator on the run's port; `resume`: again, from its run directory."""
        cmd = machine_cmd("coordinator", "--port", str(self.port), "--token", str(self.token))
        cmd += ["--bind", self.bind]
        cmd += ["--resume", str(self.coord_dir)] if resume else ["--config", str(self.config)]
        return self._start([*prefix, *cmd], name)

    def join(
        self,
        name: str,
        token: Path | None = None,
        prefix=(),
        host: str = "127.0.0.1",
        resume: bool = False,
    ) -> subprocess.Popen:
        """Machine `name` joins (run dir root/name); `resume`: again, from that run dir, its
        output then going to root/NAME-again.out."""
        cmd = machine_cmd("join", f"{host}:{self.port}", "--token", str(token or self.token))
        cmd += ["--resume" if resume else "--run-dir", str(self.root / name)]
        return self._start([*prefix, *cmd], f"{name}-again" if resume else name)

    def _start(self, cmd: list[str], name: str) -> subprocess.Popen:
        out = open(self.root / f"{name}.out", "w")
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(p)
        return p

    def output(self, name: str) -> str:
        return (self.root / f"{name}.out").read_text()

    def log(self) -> str:
        path = self.coord_dir / "coordinator.log"
        return path.read_text() if path.is_file() else ""

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def rounds_logged(run: Run) -> int:
    """Round records in the coordinator's metrics.jsonl so far."""
    path = run.coord_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"kind": "round"' in line)
