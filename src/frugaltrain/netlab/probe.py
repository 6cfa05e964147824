"""Measure what a netlab link really delivers to gloo: the time of a ring all-reduce and of a pair
exchange of S bytes between the workers, with nothing else running. Started in every namespace
like a netlab worker (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):

    python -m frugaltrain.netlab.probe BYTES REPEATS OUT_JSON      (worker 0 writes OUT_JSON)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main(nbytes: int, repeats: int, out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.ones(nbytes // 4)
    ar, pair = [], []
    for _ in range(repeats + 1):  # the first one opens the connections: not counted
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        ar.append(time.perf_counter() - t0)
    peer = rank ^ 1  # pairs (0,1), (2,3): each worker sends and receives S at once
    buf = torch.empty_like(x)
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.isend(x, peer), dist.irecv(buf, peer)]
        for w in works:
            w.wait()
        pair.append(time.perf_counter() - t0)
    times = torch.tensor([statistics.median(ar[1:]), statistics.median(pair[1:])])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        t_ar, t_pair = times.tolist()
        with open(out, "w") as f:
            json.dump(
                {
                    "bytes": nbytes,
                    "workers": n,
                    "allreduce_s_measured": t_ar,
                    "pair_exchange_s_measured": t_pair,
                    "allreduce_effective_bps": 2 * (n - 1) / n * nbytes * 8 / t_ar,
                    "pair_effective_bps": nbytes * 8 / t_pair,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
