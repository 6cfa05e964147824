"""Run things inside a NetLab: a raw TCP transfer (to check the shaping) and a training job whose
workers each live in their own namespace and meet over the shaped links (torch.distributed env://
rendezvous at worker 0's address; gloo bound to eth0)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from frugaltrain.netlab.lab import NetLab

PORT = 29500  # fixed is safe: the port lives in a private namespace the lab just created

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""

_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
buf = bytes(1 << 20); left = int(sys.argv[3])
while left > 0:
    c.sendall(buf[: min(left, len(buf))]); left -= len(buf)
c.close()
"""


def measure_rate_mbit(lab: NetLab, src: int, dst: int, nbytes: int = 8_000_000) -> float:
    """Goodput in Mbit/s of one TCP stream from worker `src` to worker `dst` (measured at the
    receiver, from its first byte to the last)."""
    sink = subprocess.Popen(
        [*lab.exec_args(dst), sys.executable, "-c", _SINK, str(PORT + 1)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout.readline().strip() == "ready"
        subprocess.run(
            [*lab.exec_args(src), sys.executable, "-c", _SOURCE, lab.addr(dst), str(PORT + 1),
             str(nbytes)],
            check=True,
            timeout=120,
        )  # fmt: skip
        n, seconds = sink.stdout.readline().split()
        sink.wait(timeout=30)
    finally:
        if sink.poll() is None:
            sink.kill()
    return int(n) * 8 / float(seconds) / 1e6


def train(lab: NetLab, config_path: Path, run_dir: Path, timeout_s: float = 3600) -> None:
    """Run one worker process per namespace on `config_path` into `run_dir`; kill them all if
    one fails or on Ctrl-C."""
    _run_all(lab, ["-m", "frugaltrain.netlab.worker", str(config_path), str(run_dir)], timeout_s)


def probe(lab: NetLab, nbytes: int, repeats: int, out: Path, timeout_s: float = 600) -> dict:
    """Measured gloo all-reduce and pair-exchange times of `nbytes` over the lab's links."""
    _run_all(
        lab, ["-m", "frugaltrain.netlab.probe", str(nbytes), str(repeats), str(out)], timeout_s
    )
    return json.loads(Path(out).read_text())


def _run_all(lab: NetLab, argv: list[str], timeout_s: float) -> None:
    procs = []
    try:
        for i in range(lab.workers):
            env = [
                "env",
                f"RANK={i}",
                f"WORLD_SIZE={lab.workers}",
                f"LOCAL_RANK={i}",
                f"MASTER_ADDR={lab.addr(0)}",
                f"MASTER_PORT={PORT}",
                "GLOO_SOCKET_IFNAME=eth0",
            ]
            procs.append(subprocess.Popen([*lab.exec_args(i), *env, sys.executable, *argv]))
        t0 = time.monotonic()
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"netlab worker(s) {failed} failed; see their output above")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"netlab job ran past {timeout_s:g} s")
            time.sleep(0.2)
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"netlab worker(s) {failed} failed; see their output above")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
