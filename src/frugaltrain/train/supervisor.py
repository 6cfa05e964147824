"""Run N workers as local processes and watch them until the run ends.

The supervisor hosts the run's TCPStore on a free port (so it outlives any worker) and starts one
process per worker (processes.py), or with run.shards = S a replica of S processes per
worker (ranks replica * S + shard; train/sharding.py). Each process builds its communication
runtime and runs the worker loop:

    plain              TorchDistComm over a gloo (or NCCL) group on that store (with shards, over
                       its shard group, FSDP2 over its replica group). A process that fails stops
                       the run: the others are stopped and the launcher says which.
    fault tolerance    ElasticRuntime (comm/ft/), one fault-tolerant world per shard index, with
                       the injected faults of fault_tolerance.inject as a layer around it
                       (comm/faulty.py). A replica that loses a process (SIGKILL, a crash,
                       or exit code 75 after the others declared it dead) is stopped whole
                       and started again with the same arguments; it rejoins from a live
                       peer replica, shard by shard; the other replicas never restart. A
                       replica still stopped when every live one has finished is killed.

Ctrl-C stops every process it started.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path

import tomllib
import torch
import torch.distributed as dist

from frugaltrain import processes
from frugaltrain.cluster import keys
from frugaltrain.cluster.run_store import close_rendezvous, forget, group0_store
from frugaltrain.comm.faulty import FaultyRuntime
from frugaltrain.comm.guard import guard_of
from frugaltrain.comm.pacing import pacer_of
from frugaltrain.comm.runtime import Runtime
from frugaltrain.config import Config, build_config, to_toml
from frugaltrain.step import worker_threads
from frugaltrain.train.loop import train_worker, worker_device
from frugaltrain.train.sharding import build_layout, shards_of
from frugaltrain.train.worker_errors import BAD_INPUT_EXIT, WorkerFailed, failure_of, report_failure

# What the fork server imports once for the workers (processes.py): torch, and everything a worker
# imports to train (torch._dynamo with its first optimizer).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "frugaltrain.train.supervisor"]
MMAP_THRESHOLD = "131072"  # bytes: glibc returns every freed block this large to the system


def worker_env(cfg: Config) -> dict[str, str]:
    """What the launcher adds to its workers' environment. A sharded replica on CPU gets a fixed
    glibc mmap threshold: glibc otherwise raises it as large blocks are freed and keeps FSDP2's
    freed buffers in its heap (docs/sharding.md: peaks 0.55x and 0.32x of S = 1 at S = 2 and
    4 with it, 0.63x and 0.39x without). A value the user exported is kept."""
    if cfg.run.shards > 1 and cfg.run.device == "cpu":
        return {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)}
    return {}


def backend(cfg: Config) -> str:
    if cfg.run.backend != "auto":
        return cfg.run.backend
    return "nccl" if cfg.run.device == "cuda" else "gloo"


def _store_timeout(cfg: Config) -> timedelta:
    return timedelta(seconds=max(60.0, cfg.run.timeout_s))


def run_local(cfg: Config, run_dir: Path, resume_from: Path | None = None, host: str = "127.0.0.1"):
    """Run the cfg.run.workers x cfg.run.shards processes on this machine until the run
    finishes. Returns the number of restarts of each worker (replica)."""
    W, S = cfg.run.workers, cfg.run.shards
    store = dist.TCPStore(
        host, 0, W * S, is_master=True, wait_for_workers=False, timeout=_store_timeout(cfg)
    )
    ft_store = group0_store(store, cfg)
    args = (to_toml(cfg), str(run_dir), host, store.port, str(resume_from) if resume_from else None)
    env = worker_env(cfg)
    procs: dict[int, BaseProcess] = {}
    restarts = dict.fromkeys(range(W), 0)
    finished: set[int] = set()

    def start(rank: int) -> None:
        procs[rank] = processes.start(worker_process, (rank, *args), PRELOAD, env)

    try:
        for rank in range(W * S):
            start(rank)
        while len(finished) < W * S:
            time.sleep(0.1)
            failed = exited(procs, finished, ft_store, cfg, run_dir)
            restart_failed(failed, procs, start, restarts, cfg, run_dir, store)
            if cfg.fault_tolerance.enabled:
                _stop_stragglers_at_the_end(procs, finished, store, cfg)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()
    return restarts


def restart_failed(
    failed: list[int],
    procs: dict,
    start,
    restarts: dict[int, int],
    cfg: Config,
    run_dir: Path,
    store: dist.Store,
) -> None:
    """Start the replicas of `failed` processes again, each at most
    fault_tolerance.max_restarts times (then WorkerFailed: a worker that keeps dying is more
    likely a bug than a fault to ride out). `store`: the run's, where the rendezvous is told
    that the old processes are gone."""
    S = cfg.run.shards
    for replica in sorted({rank // S for rank in failed}):
        if restarts[replica] >= cfg.fault_tolerance.max_restarts:
            rank = min(r for r in failed if r // S == replica)
            failure = failure_of(run_dir, rank, procs[rank].exitcode)
            raise WorkerFailed(f"{failure} after {restarts[replica]} restarts")
        restarts[replica] += 1
        _restart(replica, failed, procs, start, restarts[replica], cfg, store)


def _restart(
    replica: int, failed: list[int], procs: dict, start, count: int, cfg: Config, store
) -> None:
    """Start a worker again: with shards, its whole replica (the siblings of a failed process
    are stopped first: a replica is trained by all its processes or by none)."""
    S = cfg.run.shards
    ranks = range(replica * S, (replica + 1) * S)
    rank = min(r for r in failed if r // S == replica)
    what = f"worker {rank}" if S == 1 else f"replica {replica} (process {rank})"
    again = "it" if S == 1 else f"its {S} processes"
    print(
        f"[launcher] {what} exited with code {procs[rank].exitcode}; restarting {again} "
        f"(restart {count} of at most {cfg.fault_tolerance.max_restarts})",
        flush=True,
    )
    for r in ranks:
        if procs[r].is_alive():
            procs[r].kill()
        procs[r].join()
        forget(store, cfg, r, procs[r].pid)
    for r in ranks:
        start(r)


def exited(procs: dict, finished: set[int], store, cfg: Config, run_dir: Path) -> list[int]:
    """Processes that exited since the last look and must be restarted; the ones that finished
    are added to `finished`. Without fault tolerance, or for bad input, a failed process ends
    the run (WorkerFailed)."""
    failed = []
    for rank, p in list(procs.items()):
        if rank in finished or p.is_alive():
            continue
        if p.exitcode == 0:
            finished.add(rank)
        elif not cfg.fault_tolerance.enabled or p.exitcode == BAD_INPUT_EXIT:
            raise failure_of(run_dir, rank, p.exitcode)
        elif store.check([keys.DONE]):
            finished.add(rank)  # died after training ended: nothing to rejoin
        else:
            failed.append(rank)
    return failed


def _stop_stragglers_at_the_end(procs, finished, store, cfg: Config) -> None:
    """Once the last epoch's members have all finished, close the rendezvous (of every shard
    group: a restarted process still waiting to join exits) and stop any worker that never
    came back."""
    W, S = cfg.run.workers, cfg.run.shards
    done = {r for r in range(W) if all(r * S + s in finished for s in range(S))}
    final = _final_members(group0_store(store, cfg), done, cfg.run.workers)
    if final is None:
        return
    close_rendezvous(store, cfg)
    _join_for(procs, finished, seconds=3.0)
    for rank, p in procs.items():
        if rank not in finished and rank // S not in final and p.is_alive():
            print(f"[launcher] worker {rank // S} never came back; stopping it", flush=True)
            p.kill()
            p.join()
            finished.add(rank)


def _join_for(procs: dict[int, BaseProcess], finished: set[int], seconds: float) -> None:
    """Give the workers that are not done `seconds` to exit on their own."""
    t0 = time.monotonic()
    for rank, p in procs.items():
        if rank not in finished:
            p.join(max(0.0, seconds - (time.monotonic() - t0)))
            if not p.is_alive():
                finished.add(rank)


def _final_members(store: dist.Store, done: set[int], workers: int) -> set[int] | None:
    """The last epoch's members once all of them have finished; None while training goes on
    (a value that is no list of members is skipped, as the coordinator skips it)."""
    for rank in done:
        key = keys.final_members(rank)
        if store.check([key]):
            try:
                final = set(keys.parse_members(store.get(key), workers))
            except ValueError:
                continue
            return final if final <= done else None
    return None


def worker_process(
    rank: int,
    cfg_toml: str,
    run_dir: str,
    host: str,
    port: int,
    resume: str | None,
    local: tuple[int, ...] | None = None,
):
    """Entry of one worker process (a first start or, with fault tolerance, a restart)."""
    processes.exit_with_launcher()
    cfg = build_config(Config, tomllib.loads(cfg_toml))
    torch.set_num_threads(worker_threads(cfg))
    store = dist.TCPStore(host, port, is_master=False, timeout=_store_timeout(cfg))
    try:
        if cfg.fault_tolerance.enabled:
            _elastic_worker(cfg, rank, store, run_dir, host, port, resume, local)
        else:
            _plain_worker(cfg, rank, store, run_dir, resume)
    except Exception as e:  # one line for the launcher, the traceback in the run directory
        sys.exit(report_failure(run_dir, rank, e))


def _plain_worker(cfg: Config, rank: int, store, run_dir: str, resume: str | None) -> None:
    timeout = timedelta(seconds=cfg.run.timeout_s)
    world = cfg.run.workers * cfg.run.shards
    dist.init_process_group(backend(cfg), store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        comm, shards = plain_comm(cfg, rank)
        runtime = Runtime(comm)
        if cfg.fault_tolerance.inject:  # the same layer as under fault tolerance, no restarts
            replica, shard = divmod(rank, cfg.run.shards)
            runtime = FaultyRuntime(runtime, _injector(cfg, replica, shard, incarnation=1))
        train_worker(cfg, runtime, Path(run_dir), Path(resume) if resume else None, shards)
    finally:
        dist.destroy_process_group()


def plain_comm(cfg: Config, rank: int) -> tuple:
    """(comm, shards) of process `rank` once the default group holds the run's processes: a
    TorchDistComm over all of them, or with run.shards > 1 over its shard group, with its
    place in its replica (train/sharding.py), paced to its worker's emulated link when
    run.link_mbit is set. Every process calls this."""
    from frugaltrain.comm.torchdist import TorchDistComm

    kwargs = {"deterministic": cfg.run.deterministic_comm, "guard": guard_of(cfg.run)}
    if cfg.run.shards == 1:
        comm, shards = TorchDistComm(**kwargs), None
    else:
        worker_device(cfg, rank)  # a GPU is chosen before its groups are made
        shards, group = build_layout(cfg.run.workers, cfg.run.shards, cfg.run.device)
        comm = TorchDistComm(group, shard_link=shards.link, **kwargs)
    comm.pacer = pacer_of(cfg.run.link_mbit, rank // cfg.run.shards, cfg.run.shards)
    return comm, shards


def _elastic_worker(
    cfg: Config, rank: int, store, run_dir: str, host: str, port: int, resume, local=None
):
    """A fault-tolerant process: ElasticRuntime, with this worker's injected faults around it;
    a restarted worker (incarnation > 1) rejoins from a live peer instead of the checkpoint.
    With shards, process `rank` is shard s of replica r: its replica's processes form the
    default group (FSDP2), fresh at every start of the replica, and its ElasticComm is shard
    group s's. `local`: the workers on this machine when the run spans machines (train/agent.py)."""
    from frugaltrain.comm.ft.comm import ElasticComm
    from frugaltrain.comm.ft.elastic_world import STOPPED_EXIT, Identity
    from frugaltrain.comm.ft.runtime import ElasticRuntime

    S = cfg.run.shards
    replica, shard = divmod(rank, S)
    ns = keys.namespace(shard, S)
    ft_store = dist.PrefixStore(ns, store) if ns else store
    incarnation = ft_store.add(keys.incarnation(replica), 1)
    shards = None
    if S > 1:
        worker_device(cfg, rank)
        own = dist.PrefixStore(keys.replica_group(replica, incarnation), store)
        timeout = timedelta(seconds=cfg.run.timeout_s)
        dist.init_process_group(backend(cfg), store=own, rank=shard, world_size=S, timeout=timeout)
        shards = shards_of(dist.group.WORLD, cfg.run.device)
    me = Identity(host, port, replica, cfg.run.workers, incarnation, ns, local is not None)
    link = shards.link if shards else None
    options, timeout_s = cfg.fault_tolerance, cfg.run.timeout_s
    comm = ElasticComm(
        store, me, options, timeout_s=timeout_s, guard=guard_of(cfg.run), shard_link=link
    )
    comm.pacer = pacer_of(cfg.run.link_mbit, replica, S)
    runtime = ElasticRuntime(comm, cfg.run.min_workers, local)
    faults = _injector(cfg, replica, shard, incarnation) if cfg.fault_tolerance.inject else None
    resume_path = Path(resume) if resume and incarnation == 1 else None
    loop_runtime = FaultyRuntime(runtime, faults) if faults else runtime
    result = train_worker(cfg, loop_runtime, Path(run_dir), resume_path, shards)
    runtime.close(finished=not runtime.stopping)
    if runtime.stopping:
        print(
            f"[worker {replica}] the run's store is gone: round {result.round} is checkpointed; "
            "stopping",
            flush=True,
        )
    # Leave without running destructors: gloo groups of abandoned epochs may still hold threads
    # blocked on a dead peer, and tearing those down aborts the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STOPPED_EXIT if runtime.stopping else 0)


def _injector(cfg: Config, replica: int, shard: int, incarnation: int):
    """The faults of worker `replica` that act in this process. A fault that stops a process
    (kill, hang, partition, stall) acts on the replica's shard 0 only: its siblings go down
    with it, as they would after any process of theirs died; the rest act on every shard."""
    from frugaltrain.inject import Injector, parse

    process_faults = ("kill", "hang", "partition", "stall")
    faults = [
        f for f in parse(cfg.fault_tolerance.inject) if shard == 0 or f.kind not in process_faults
    ]
    return Injector(faults, replica, cfg.outer.H, incarnation == 1, cfg.run.seed)
