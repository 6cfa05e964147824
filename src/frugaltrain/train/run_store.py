"""The run's store as the processes that watch a run use it: the local launcher, each machine's
agent and the coordinator. Kept apart from the launcher (train/supervisor.py) so the
coordinator, which trains nothing, does not import the training loop (torch's DCP, DTensor and
sympy with it: about 50 MB and a second of start at its CPU share).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousError

from frugaltrain.comm import rendezvous
from frugaltrain.comm.ft import keys
from frugaltrain.config import Config


def group0_store(store: dist.Store, cfg: Config) -> dist.Store:
    """Shard group 0's fault-tolerant world in the run's store: where the run's end is kept."""
    S = cfg.run.shards
    return dist.PrefixStore(keys.namespace(0, S), store) if S > 1 else store


def close_rendezvous(host: str, port: int, cfg: Config) -> None:
    """Close every shard group's rendezvous: training is over, a process still waiting to
    join exits."""
    for s in range(cfg.run.shards):
        rendezvous.close(host, port, cfg.run.workers, keys.namespace(s, cfg.run.shards))


def forget(store: dist.Store, cfg: Config, rank: int, pid: int | None = None) -> None:
    """Tell the rendezvous that process `rank` (only its start `pid`, if given) is gone, so the
    survivors drop it at their next sync instead of after its keep-alive expires. Best effort:
    if the store cannot be reached, the keep-alive still expires."""
    S = cfg.run.shards
    replica, shard = divmod(rank, S)
    name = rendezvous.node_name(replica)
    try:
        rendezvous.expire(store, name, pid, keys.namespace(shard, S))
    except RendezvousError as e:
        print(f"[rendezvous] could not mark {name} gone: {e}", flush=True)
