"""`frugaltrain join` started before its coordinator listens: it waits, bounded and said
(--wait), then gives up in one line; bad input is refused before any wait."""

from __future__ import annotations

import subprocess
import sys

from helpers.gloo_pool import free_port

from frugaltrain.cluster.auth import new_token


def _join(tmp_path, *args: str) -> subprocess.CompletedProcess:
    token = tmp_path / "run.token"
    if not token.exists():
        new_token(token)
    cmd = [sys.executable, "-m", "frugaltrain", "join", f"127.0.0.1:{free_port()}"]
    cmd += ["--token", str(token), "--run-dir", str(tmp_path / "m"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def test_join_waits_for_a_coordinator_then_says_why_it_gave_up(tmp_path):
    done = _join(tmp_path, "--wait", "1")
    assert done.returncode == 1, done.stderr
    said = [line for line in done.stdout.splitlines() if "waiting for the coordinator" in line]
    assert said and said[0].endswith(", 0 s of 1"), done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no coordinator at 127.0.0.1:" in lines[0], done.stderr
    assert "within 1 s" in lines[0] and "--wait" in lines[0]


def test_a_bad_wait_is_refused_before_any_wait(tmp_path):
    done = _join(tmp_path, "--wait", "nan")
    assert done.returncode == 2 and "--wait nan" in done.stderr, done.stderr
    assert "waiting for the coordinator" not in done.stdout
