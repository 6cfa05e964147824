"""What a link really delivers to torch.distributed: the time of a ring all-reduce and of a pair
exchange of S bytes between the workers of the default process group, with nothing else running.
The pair exchange is the runtime's own (`TorchDistComm._exchange`, receives posted first); the
same exchange with the sends posted first, as plain gloo code usually writes it, is timed beside
it for comparison. Every rank calls `measure` and gets the slowest worker's times.

Used by `frugaltrain netlab probe` (netlab/probe.py: shaped links between namespaces) and by
`frugaltrain plan` under torchrun (sim/plan.py: the workers' own links).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from frugaltrain.comm.torchdist import TorchDistComm

# What the probe times: name -> (seconds key, effective bits/s key) of its JSON.
TRANSFERS = {
    "all-reduce": ("allreduce_s_measured", "allreduce_effective_bps"),
    "pair exchange (runtime)": ("pair_exchange_s_measured", "pair_effective_bps"),
    "pair exchange, sends first": (
        "pair_exchange_send_first_s_measured",
        "pair_send_first_effective_bps",
    ),
}


def _timed(fn, repeats: int) -> float:
    """Median seconds of `fn` after a first call that opens the connections (not counted)."""
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure(nbytes: int, repeats: int) -> dict:
    """The probe's JSON (keys of TRANSFERS, in seconds and effective bits/s) for `nbytes`,
    the median of `repeats` timed runs of each transfer, the slowest worker's. Needs an even
    world size: workers pair up as (0, 1), (2, 3), ..."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.ones(nbytes // 4)
    peer = rank ^ 1  # pairs (0,1), (2,3): each worker sends and receives S at once
    buf = torch.empty_like(x)
    comm = TorchDistComm()
    seq = iter(range(1 << 20))

    def send_first() -> None:
        for w in [dist.isend(x, peer), dist.irecv(buf, peer)]:
            w.wait()

    times = torch.tensor(
        [
            _timed(lambda: dist.all_reduce(x), repeats),
            _timed(lambda: comm._exchange([x], [peer], [peer], next(seq)).wait_all(), repeats),
            _timed(send_first, repeats),
        ]
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest worker's
    t_ar, t_pair, t_send_first = times.tolist()
    return {
        "bytes": nbytes,
        "workers": n,
        "allreduce_s_measured": t_ar,
        "pair_exchange_s_measured": t_pair,
        "allreduce_effective_bps": 2 * (n - 1) / n * nbytes * 8 / t_ar,
        "pair_effective_bps": nbytes * 8 / t_pair,
        "pair_exchange_send_first_s_measured": t_send_first,
        "pair_send_first_effective_bps": nbytes * 8 / t_send_first,
    }
