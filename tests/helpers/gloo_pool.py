"""One pool of gloo worker processes on localhost that runs several training jobs in turn
(spawning is the slow part: torch and transformers import once per process, not per job).

    finals = train_in_gloo_pool(jobs, world=4)   # jobs: [(name, cfg, run_dir)]
    finals[rank][name]                           # that worker's final parameters
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from frugaltrain.comm.torchdist import TorchDistComm
from frugaltrain.train.loop import train_worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs: list, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        results = {}
        for name, cfg, run_dir in jobs:
            comm = TorchDistComm(deterministic=cfg.run.deterministic_comm)
            model = train_worker(cfg, comm, Path(run_dir)).model
            results[name] = [p.detach().clone() for p in model.parameters()]
            dist.barrier()  # rank 0 writes the checkpoint marker after the others
        out[rank] = results
    finally:
        dist.destroy_process_group()


def train_in_gloo_pool(jobs: list, world: int) -> dict[int, dict[str, list[torch.Tensor]]]:
    """{rank: {job name: final parameters}} of every job, run by `world` gloo processes."""
    out = mp.Manager().dict()
    mp.start_processes(
        _worker, args=(world, free_port(), jobs, out), nprocs=world, start_method="spawn"
    )
    return dict(out)
