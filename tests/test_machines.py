"""A run across machines as processes on this host: `frugaltrain coordinator` and two
`frugaltrain join` agents on 127.0.0.1 (tests/ft/test_machines_netlab.py gives each machine a
network namespace of its own). With no faults the run equals, bit for bit, the same config
under the local launcher; a machine without the run's token is refused and gets nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from gloo_pool import free_port

from frugaltrain.comm.auth import new_token
from frugaltrain.config import to_toml
from frugaltrain.metrics.log import read_metrics
from frugaltrain.train import checkpoint, launch

SETS = (
    "run.workers=2",
    "run.steps=24",  # 6 rounds of H = 4
    "outer.H=4",
    "run.threads=1",
    "run.eval_every=8",
    "run.eval_batches=2",
    "run.progress=false",
    "fault_tolerance.enabled=true",
    "run.name='mach'",
)


def machine_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "frugaltrain", *args]


def wait_for(predicate, what: str, timeout_s: float = 90.0, procs=()) -> None:
    """Poll until `predicate()`; fail naming `what` (or a process that died first)."""
    t0 = time.monotonic()
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

    def start_coordinator(self, prefix: list[str] = ()) -> subprocess.Popen:
        cmd = machine_cmd("coordinator", "--config", str(self.config), "--port", str(self.port))
        cmd += ["--token", str(self.token), "--bind", self.bind]
        return self._start([*prefix, *cmd], "coordinator")

    def join(self, name: str, token: Path | None = None, prefix=(), host: str = "127.0.0.1"):
        cmd = machine_cmd("join", f"{host}:{self.port}", "--token", str(token or self.token))
        cmd += ["--run-dir", str(self.root / name)]
        return self._start([*prefix, *cmd], name)

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


def test_machines_equal_the_local_launcher_and_refuse_a_wrong_token(config_factory, tmp_path):
    local = config_factory(tmp_path / "local", *SETS)
    local_dir = launch.new_run_dir(local)
    launch.run(local, local_dir)

    run = Run(tmp_path, config_factory(tmp_path / "coord", *SETS))
    try:
        coord = run.start_coordinator()
        wait_for(lambda: "slots; machines join" in run.log(), "coordinator up", procs=[coord])
        stranger = tmp_path / "other.token"
        new_token(stranger)
        refused = run.join("stranger", token=stranger)
        assert refused.wait(60) == 2
        assert "wrong token" in run.output("stranger")
        a = run.join("a")
        wait_for(lambda: "joined: slots [0]" in run.log(), "machine a joined", procs=[a])
        b = run.join("b")
        for p in (a, b, coord):
            assert p.wait(240) == 0, p.args
    finally:
        run.close()
    assert run.log().count("refused") == 1 and "wrong token" in run.log()
    assert not (tmp_path / "stranger").exists()  # it got no config, so it made nothing

    mine = final_models([tmp_path / "a", tmp_path / "b"], 2)
    theirs = final_models([local_dir], 2)
    assert sorted(mine) == [0, 1]
    for r in range(2):
        for name, t in theirs[r].items():
            assert torch.equal(mine[r][name], t), (r, name)
    ours = [r for r in read_metrics(run.coord_dir / "metrics.jsonl") if r["kind"] == "round"]
    ref = [r for r in read_metrics(local_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["round"] for r in ours] == [r["round"] for r in ref] == list(range(1, 7))
    assert [r["loss/train"] for r in ours] == [r["loss/train"] for r in ref]
    assert [r.get("loss/val") for r in ours] == [r.get("loss/val") for r in ref]
    assert (run.coord_dir / "summary.json").is_file()
