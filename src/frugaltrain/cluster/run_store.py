"""The run's store as the processes that watch a run use it: the local launcher, each machine's
agent and the coordinator. Kept apart from the launcher (train/supervisor.py), and free of
torch, so the coordinator, which trains nothing, stays a small process: its store is
cluster/store.py's server, the others' a torch TCPStore; both have the calls used here.
"""

from __future__ import annotations

from frugaltrain.cluster import keys, rendezvous_json
from frugaltrain.cluster.store import PrefixView, Store
from frugaltrain.config import Config


def group0_store(store: Store, cfg: Config) -> Store:
    """Shard group 0's fault-tolerant world in the run's store: where the run's end is kept."""
    S = cfg.run.shards
    return PrefixView(keys.namespace(0, S), store) if S > 1 else store


def close_rendezvous(store: Store, cfg: Config) -> None:
    """Close every shard group's rendezvous: training is over, a process still waiting to
    join exits."""
    for s in range(cfg.run.shards):
        rendezvous_json.close(store, keys.namespace(s, cfg.run.shards))


def refresh_rendezvous(store: Store, cfg: Config) -> int:
    """Date every shard group's rendezvous heartbeats to now (the store came back from its
    journal: cluster/rendezvous_json.py's `refresh`). Returns how many nodes were dated."""
    S = cfg.run.shards
    return sum(rendezvous_json.refresh(store, keys.namespace(s, S)) for s in range(S))


def forget(store: Store, cfg: Config, rank: int, pid: int | None = None) -> None:
    """Tell the rendezvous that process `rank` (only its start `pid`, if given) is gone, so the
    survivors drop it at their next sync instead of after its keep-alive expires. Best effort:
    if the store cannot be reached, the keep-alive still expires."""
    S = cfg.run.shards
    replica, shard = divmod(rank, S)
    name = rendezvous_json.node_name(replica)
    try:
        rendezvous_json.expire(store, name, pid, keys.namespace(shard, S))
    except (RuntimeError, OSError, ValueError) as e:  # torch's store errors, a bad state
        print(f"[rendezvous] could not mark {name} gone: {e}", flush=True)
