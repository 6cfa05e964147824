"""A pool of gloo processes on localhost that runs sharded training jobs in turn (spawning, with
torch and transformers imported, is the slow part). A job runs on the first
run.workers x run.shards ranks of the pool, laid out as the launcher lays them out
(train/sharding.py: rank = replica * shards + shard); the others wait for it.

    finals = train_sharded([(name, cfg, run_dir, resume_from)], world=4)
    finals[name][replica]      # that replica's final parameters, whole (fp32)
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from frugaltrain.comm import LocalComm
from frugaltrain.comm.torchdist import TorchDistComm
from frugaltrain.train.loop import train_worker
from frugaltrain.train.sharding import build_layout
from helpers.gloo_pool import free_port


def _whole(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter, gathered over the replica's shards (a collective of its processes)."""
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
    ]


def _job(cfg, run_dir: str, resume: str | None) -> tuple[int, list[torch.Tensor]] | None:
    """Run one job on this process if it is one of the job's; (replica, parameters) from the
    replica's shard 0, else None."""
    W, S = cfg.run.workers, cfg.run.shards
    resume_from = Path(resume) if resume else None
    if W * S == 1:  # one process: the launcher runs it in place, on LocalComm
        if dist.get_rank() != 0:
            return None
        return 0, _whole(train_worker(cfg, LocalComm(), Path(run_dir), resume_from).model)
    shards, group = build_layout(W, S, "cpu")
    if group is None:
        return None
    link = shards.link if S > 1 else None
    comm = TorchDistComm(group, shard_link=link)
    result = train_worker(cfg, comm, Path(run_dir), resume_from, shards if S > 1 else None)
    params = _whole(result.model)
    return (comm.rank, params) if S == 1 or shards.index == 0 else None


def _worker(rank: int, world: int, port: int, jobs: list, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        for name, cfg, run_dir, resume in jobs:
            got = _job(cfg, run_dir, resume)
            if got is not None:
                out[(name, got[0])] = got[1]
            dist.barrier()  # the next job starts when this one is over everywhere
    finally:
        dist.destroy_process_group()


def train_sharded(jobs: list, world: int) -> dict[str, dict[int, list[torch.Tensor]]]:
    """{job name: {replica: final parameters}} of every job, run by `world` gloo processes."""
    out = mp.Manager().dict()
    mp.start_processes(
        _worker, args=(world, free_port(), jobs, out), nprocs=world, start_method="spawn"
    )
    finals: dict[str, dict[int, list[torch.Tensor]]] = {}
    for (name, replica), params in out.items():
        finals.setdefault(name, {})[replica] = params
    return finals
