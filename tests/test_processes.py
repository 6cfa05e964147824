"""Workers forked from the fork server (processes.py): each gets its launcher's
environment as it is when the worker starts, with what the launcher adds, and glibc's mmap
threshold set as MALLOC_MMAP_THRESHOLD_ asks, though glibc read the variable only when the fork
server started."""

from __future__ import annotations

import ctypes
import json
import os
import sys

import pytest

from frugaltrain import processes
from frugaltrain.train.supervisor import PRELOAD

MB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        .split()
    ]  # fmt: skip


def _mmapped_again(size: int) -> bool:
    """Whether glibc serves a block of `size` bytes from mmap after one was freed. With the
    dynamic threshold (glibc's default) the free raises the threshold above `size`, and the
    next block comes from the heap; a fixed threshold below `size` keeps it mmapped."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo2
    libc.free(libc.malloc(size))
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    grew = libc.mallinfo2().hblkhd - before
    libc.free(block)
    return grew >= size


def _report(path: str) -> None:
    keys = ("FRUGALTRAIN_TEST_LATE", "FRUGALTRAIN_TEST_ADDED", "MALLOC_MMAP_THRESHOLD_")
    seen = {k: os.environ.get(k) for k in keys}
    with open(path, "w") as f:
        json.dump({"env": seen, "mmapped": _mmapped_again(MB)}, f)


def _run(tmp_path, name: str, env: dict[str, str] | None = None) -> dict:
    out = tmp_path / f"{name}.json"
    process = processes.start(_report, (str(out),), PRELOAD, env)
    process.join(60)
    assert process.exitcode == 0, process.exitcode
    return json.loads(out.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_a_worker_gets_the_launchers_environment_of_the_moment_and_the_mmap_threshold(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    first = _run(tmp_path, "first")  # the fork server is running from here on
    assert first["env"] == dict.fromkeys(first["env"]) and not first["mmapped"], first
    monkeypatch.setenv("FRUGALTRAIN_TEST_LATE", "set after the fork server started")
    added = {"FRUGALTRAIN_TEST_ADDED": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    second = _run(tmp_path, "second", added)
    assert second["env"] == {"FRUGALTRAIN_TEST_LATE": "set after the fork server started", **added}
    assert second["mmapped"], second  # 1 MiB is over the fixed 128 KiB threshold
    assert "FRUGALTRAIN_TEST_ADDED" not in os.environ  # the launcher's own is as it was
