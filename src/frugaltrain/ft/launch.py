"""Local launcher for fault-tolerant runs (run.fault_tolerance = true).

It hosts the run's TCPStore (so the rendezvous outlives any worker), spawns one process per
worker, and watches them: a worker that dies (SIGKILL, a crash, or exit code 75 after the others
declared it dead) is started again with the same arguments and rejoins from a live peer; the
others never restart. A worker that stops answering and is still stopped when every live worker
has finished is killed. Ctrl-C stops every worker it started.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from frugaltrain.config import Config, build_config, to_toml
from frugaltrain.ft import rendezvous

MAX_RESTARTS = 3  # per worker; a worker that keeps dying is a bug, not a fault to ride out


def _worker(rank: int, cfg_toml: str, run_dir: str, host: str, port: int, resume: str | None):
    """Entry of one worker process (a first start or a restart)."""
    import tomllib

    from frugaltrain.ft.comm import ElasticComm
    from frugaltrain.ft.inject import Injector, parse
    from frugaltrain.train.launch import _threads
    from frugaltrain.train.loop import train_worker

    cfg = build_config(Config, tomllib.loads(cfg_toml))
    torch.set_num_threads(_threads(cfg))
    store = dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=max(60.0, cfg.run.timeout_s))
    )
    incarnation = store.add(f"ft/incarnation/{rank}", 1)
    injector = Injector(parse(cfg.run.inject), rank, cfg.outer.H, incarnation == 1, cfg.run.seed)
    comm = ElasticComm(
        store,
        rank,
        cfg.run.workers,
        timeout_s=cfg.run.timeout_s,
        mix1_deadline_s=cfg.run.mix1_deadline_s,
        injector=injector,
        host=host,
        port=port,
        incarnation=incarnation,
    )
    resume_path = Path(resume) if resume and incarnation == 1 else None
    train_worker(cfg, comm, Path(run_dir), resume_path)
    comm.close()
    # Leave without running destructors: gloo groups of abandoned epochs may still hold threads
    # blocked on a dead peer, and tearing those down aborts the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(cfg: Config, run_dir: Path, resume_from: Path | None = None, host: str = "127.0.0.1"):
    """Run cfg.run.workers fault-tolerant workers on this machine until the run finishes."""
    store = dist.TCPStore(
        host,
        0,
        cfg.run.workers,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=max(60.0, cfg.run.timeout_s)),
    )
    ctx = mp.get_context("spawn")
    args = (to_toml(cfg), str(run_dir), host, store.port, str(resume_from) if resume_from else None)
    procs: dict[int, mp.Process] = {}
    restarts = dict.fromkeys(range(cfg.run.workers), 0)
    finished: set[int] = set()

    def start(rank: int) -> None:
        procs[rank] = ctx.Process(target=_worker, args=(rank, *args), daemon=False)
        procs[rank].start()

    try:
        for rank in range(cfg.run.workers):
            start(rank)
        while len(finished) < cfg.run.workers:
            time.sleep(0.1)
            for rank, p in list(procs.items()):
                if rank in finished or p.is_alive():
                    continue
                if p.exitcode == 0:
                    finished.add(rank)
                    continue
                if store.check(["ft/done"]):
                    finished.add(rank)  # died after training ended: nothing to rejoin
                    continue
                if restarts[rank] >= MAX_RESTARTS:
                    raise RuntimeError(
                        f"worker {rank} exited with code {p.exitcode} after {restarts[rank]} "
                        "restarts; see its output above"
                    )
                restarts[rank] += 1
                print(
                    f"[launcher] worker {rank} exited with code {p.exitcode}; restarting it "
                    f"(restart {restarts[rank]} of at most {MAX_RESTARTS})",
                    flush=True,
                )
                start(rank)
            final = _final_members(store, finished)
            if final is not None:
                rendezvous.close(host, store.port, cfg.run.workers)  # joiners still waiting exit
                _join_for(procs, finished, seconds=3.0)
                for rank, p in procs.items():
                    if rank not in finished and rank not in final and p.is_alive():
                        print(f"[launcher] worker {rank} never came back; stopping it", flush=True)
                        p.kill()
                        p.join()
                        finished.add(rank)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()
    return restarts


def _join_for(procs: dict[int, mp.Process], finished: set[int], seconds: float) -> None:
    """Give the workers that are not done `seconds` to exit on their own."""
    t0 = time.monotonic()
    for rank, p in procs.items():
        if rank not in finished:
            p.join(max(0.0, seconds - (time.monotonic() - t0)))
            if not p.is_alive():
                finished.add(rank)


def _final_members(store: dist.TCPStore, finished: set[int]) -> set[int] | None:
    """The last epoch's members once all of them have finished; None while training goes on."""
    for rank in finished:
        key = f"ft/final_members/{rank}"
        if store.check([key]):
            final = set(json.loads(store.get(key)))
            return final if final <= finished else None
    return None
