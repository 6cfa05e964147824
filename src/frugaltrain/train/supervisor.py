"""Run N workers as local processes and watch them until the run ends.

The supervisor hosts the run's TCPStore on a free port (so it outlives any worker) and spawns one
process per worker. Each process builds its communication runtime and runs the worker loop:

    plain              TorchDistComm over a gloo (or NCCL) group on that store. A worker that
                       fails stops the run: the others are stopped and the launcher says which.
    fault tolerance    ElasticComm (comm/elastic.py). A worker that dies (SIGKILL, a crash, or
                       exit code 75 after the others declared it dead) is started again with the
                       same arguments and rejoins from a live peer; the others never restart. A
                       worker still stopped when every live worker has finished is killed.

Ctrl-C stops every worker it started.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import tomllib
import torch
import torch.distributed as dist

from frugaltrain.comm import rendezvous
from frugaltrain.comm.guard import guard_of
from frugaltrain.config import Config, build_config, to_toml
from frugaltrain.train.failures import BAD_INPUT_EXIT, WorkerFailed, failure_of, report_failure
from frugaltrain.train.loop import train_worker


def worker_threads(cfg: Config) -> int:
    """torch threads per worker: run.threads, or the cores shared out (at least 1)."""
    return cfg.run.threads or max(1, (os.cpu_count() or 1) // cfg.run.workers)


def backend(cfg: Config) -> str:
    if cfg.run.backend != "auto":
        return cfg.run.backend
    return "nccl" if cfg.run.device == "cuda" else "gloo"


def _store_timeout(cfg: Config) -> timedelta:
    return timedelta(seconds=max(60.0, cfg.run.timeout_s))


def run_local(cfg: Config, run_dir: Path, resume_from: Path | None = None, host: str = "127.0.0.1"):
    """Run cfg.run.workers worker processes on this machine until the run finishes. Returns the
    number of restarts of each worker."""
    store = dist.TCPStore(
        host,
        0,
        cfg.run.workers,
        is_master=True,
        wait_for_workers=False,
        timeout=_store_timeout(cfg),
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
            for rank in _exited(procs, finished, store, cfg, run_dir):
                if restarts[rank] >= cfg.run.max_restarts:
                    failed = failure_of(run_dir, rank, procs[rank].exitcode)
                    raise WorkerFailed(f"{failed} after {restarts[rank]} restarts")
                restarts[rank] += 1
                print(
                    f"[launcher] worker {rank} exited with code {procs[rank].exitcode}; restarting "
                    f"it (restart {restarts[rank]} of at most {cfg.run.max_restarts})",
                    flush=True,
                )
                start(rank)
            if cfg.run.fault_tolerance:
                _stop_stragglers_at_the_end(procs, finished, store, host, cfg.run.workers)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()
    return restarts


def _exited(procs: dict, finished: set[int], store, cfg: Config, run_dir: Path) -> list[int]:
    """Workers that exited since the last look and must be restarted; the ones that finished
    are added to `finished`. Without fault tolerance, or for bad input, a failed worker ends the
    run (WorkerFailed)."""
    failed = []
    for rank, p in list(procs.items()):
        if rank in finished or p.is_alive():
            continue
        if p.exitcode == 0:
            finished.add(rank)
        elif not cfg.run.fault_tolerance or p.exitcode == BAD_INPUT_EXIT:
            raise failure_of(run_dir, rank, p.exitcode)
        elif store.check(["ft/done"]):
            finished.add(rank)  # died after training ended: nothing to rejoin
        else:
            failed.append(rank)
    return failed


def _stop_stragglers_at_the_end(procs, finished, store, host: str, workers: int) -> None:
    """Once the last epoch's members have all finished, close the rendezvous (a restarted worker
    still waiting to join exits) and stop any worker that never came back."""
    final = _final_members(store, finished)
    if final is None:
        return
    rendezvous.close(host, store.port, workers)
    _join_for(procs, finished, seconds=3.0)
    for rank, p in procs.items():
        if rank not in finished and rank not in final and p.is_alive():
            print(f"[launcher] worker {rank} never came back; stopping it", flush=True)
            p.kill()
            p.join()
            finished.add(rank)


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


def _worker(rank: int, cfg_toml: str, run_dir: str, host: str, port: int, resume: str | None):
    """Entry of one worker process (a first start or, with fault tolerance, a restart)."""
    cfg = build_config(Config, tomllib.loads(cfg_toml))
    torch.set_num_threads(worker_threads(cfg))
    store = dist.TCPStore(host, port, is_master=False, timeout=_store_timeout(cfg))
    try:
        if cfg.run.fault_tolerance:
            _elastic_worker(cfg, rank, store, run_dir, host, port, resume)
        else:
            _plain_worker(cfg, rank, store, run_dir, resume)
    except Exception as e:  # one line for the launcher, the traceback in the run directory
        sys.exit(report_failure(run_dir, rank, e))


def _plain_worker(cfg: Config, rank: int, store, run_dir: str, resume: str | None) -> None:
    from frugaltrain.comm.torchdist import TorchDistComm

    timeout = timedelta(seconds=cfg.run.timeout_s)
    world = cfg.run.workers
    dist.init_process_group(backend(cfg), store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        comm = TorchDistComm(deterministic=cfg.run.deterministic_comm, guard=guard_of(cfg.run))
        train_worker(cfg, comm, Path(run_dir), Path(resume) if resume else None)
    finally:
        dist.destroy_process_group()


def _elastic_worker(cfg: Config, rank: int, store, run_dir: str, host: str, port: int, resume):
    """A fault-tolerant worker: ElasticComm with this worker's injected faults; a restarted
    worker (incarnation > 1) rejoins from a live peer instead of the checkpoint."""
    from frugaltrain.comm.elastic import ElasticComm
    from frugaltrain.faults import Injector, parse

    incarnation = store.add(f"ft/incarnation/{rank}", 1)
    injector = Injector(parse(cfg.run.inject), rank, cfg.outer.H, incarnation == 1, cfg.run.seed)
    comm = ElasticComm(
        store,
        rank,
        cfg.run.workers,
        timeout_s=cfg.run.timeout_s,
        mix1_deadline_s=cfg.run.mix1_deadline_s,
        deadline_factor=cfg.run.deadline_factor,
        deadline_floor_s=cfg.run.deadline_floor_s,
        injector=injector,
        host=host,
        port=port,
        incarnation=incarnation,
        guard=guard_of(cfg.run),
    )
    resume_path = Path(resume) if resume and incarnation == 1 else None
    train_worker(cfg, comm, Path(run_dir), resume_path)
    comm.close()
    # Leave without running destructors: gloo groups of abandoned epochs may still hold threads
    # blocked on a dead peer, and tearing those down aborts the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
