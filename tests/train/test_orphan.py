"""A worker whose launcher is killed (SIGKILL: no chance to stop its workers) exits by itself
instead of beating its heartbeat and retrying the rendezvous for ever
(processes.py's exit_with_launcher). It is started as launchers start theirs, forked
from the fork server, which is its parent and lives on while it does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = """
import sys
import time

from frugaltrain.processes import exit_with_launcher, start


def worker(flag):
    exit_with_launcher()
    open(flag, "w").write("up")
    time.sleep(600)


if __name__ == "__main__":
    p = start(worker, (sys.argv[1],), ["frugaltrain.train.supervisor"])
    print(p.pid, flush=True)
    time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's new parent may not reap it at once)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.05)


def test_a_worker_exits_when_its_launcher_is_killed(tmp_path):
    script, flag = tmp_path / "launcher.py", tmp_path / "up"
    script.write_text(LAUNCHER)
    launcher = subprocess.Popen(
        [sys.executable, str(script), str(flag)], stdout=subprocess.PIPE, text=True
    )
    worker = None
    try:
        worker = int(launcher.stdout.readline())
        _until(flag.exists, "worker up")
        assert _running(worker)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        _until(lambda: not _running(worker), "worker exit")
    finally:
        launcher.kill()
        launcher.wait()
        if worker is not None and _running(worker):
            os.kill(worker, signal.SIGKILL)
