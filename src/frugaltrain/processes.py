"""Worker processes started from one import of torch: multiprocessing's fork server.

A process started with "spawn" imports torch and frugaltrain before it trains: about 4 s of CPU
(torch 2.3 s; torch._dynamo 1.5 s, which the first optimizer built imports), more when the
cores are shared. A launcher paid it for each of its workers, and again for each restart after
a fault, which a restarted worker's peers wait out at their next round end. Here the first
start in a process has the fork server import them once (`preload`: the training launcher's
and the flow launcher's name what their workers import); every worker is a fork of it, ready in
milliseconds.

A forked worker does not inherit its launcher's environment (the fork server's is the
launcher's when the server started): `start` sends it along, with `env` added, and the worker
takes it before it runs anything. glibc reads its MALLOC_ variables once, as a process starts,
so the worker sets the mmap threshold (train/supervisor.py's worker_env) with mallopt.

A worker's parent is the fork server, which lives as long as any of its workers: a worker
watches the process that started it (`exit_with_launcher`) by its pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import select
import threading
import time
from collections.abc import Callable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_launcher: int | None = None  # in a started process: the pid of the process that started it


def context(preload: list[str]) -> BaseContext:
    """The fork server's context, which imports the modules `preload` names when it starts (the
    first start in this process decides them); spawn where a platform has no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


def start(
    target: Callable, args: tuple, preload: list[str], env: dict[str, str] | None = None
) -> BaseProcess:
    """Start `target(*args)` in a new process (`context(preload)`) whose environment is this
    one's with `env` added (this process's own is unchanged)."""
    ctx = context(preload)
    env = {**os.environ, **(env or {})}
    process = ctx.Process(target=_enter, args=(target, args, env, os.getpid()))
    process.start()
    return process


def _enter(target: Callable, args: tuple, env: dict[str, str], launcher: int) -> None:
    global _launcher
    _launcher = launcher
    os.environ.clear()
    os.environ.update(env)
    threshold = env.get("MALLOC_MMAP_THRESHOLD_")
    if threshold and hasattr(ctypes.CDLL(None), "mallopt"):  # glibc
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(threshold))
    target(*args)


def exit_with_launcher() -> None:
    """End this process once the process that started it (the launcher, or a machine's agent)
    is gone, killed without stopping its workers: an orphaned worker would go on beating its
    heartbeat and retrying the rendezvous for a slot its machine no longer holds."""
    launcher = _launcher if _launcher is not None else os.getppid()

    def watch() -> None:
        if hasattr(os, "pidfd_open"):  # Linux: readable once the launcher has exited
            with contextlib.suppress(ProcessLookupError):
                select.select([os.pidfd_open(launcher)], [], [])
        else:
            while _alive(launcher):
                time.sleep(1.0)
        print(f"[worker] its launcher (pid {launcher}) is gone; exiting", flush=True)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
