"""cluster/run_store.py's `forget`: a process that exited is marked gone in its own shard group's
rendezvous, under its replica's name, and only that start of it (its pid)."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from frugaltrain.cluster import keys, rendezvous_json
from frugaltrain.cluster.run_store import forget
from frugaltrain.comm.rendezvous import JsonBackend, from_json
from frugaltrain.config import Config, build_config

NOW = datetime(2026, 1, 2, tzinfo=timezone.utc)
EXPIRED = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _group(store: dist.Store, shard: int, shards: int) -> JsonBackend:
    """Shard group `shard`'s rendezvous state, as the workers' handlers keep it."""
    space = keys.namespace(shard, shards)
    scoped = dist.PrefixStore(space, store) if space else store
    return JsonBackend(dist.PrefixStore(keys.RENDEZVOUS, scoped), rendezvous_json.RUN_ID)


def _beats(backend: JsonBackend) -> dict[tuple[str, int], datetime]:
    raw = backend._call_store("get", backend._key)
    return {(n.addr, n.pid): t for n, t in from_json(raw).last_heartbeats.items()}


def test_forget_marks_only_that_process_in_its_shard_group():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    cfg = build_config(Config, {}, ["run.workers=2", "run.shards=2"])
    groups = [_group(store, s, 2) for s in range(2)]
    for g in groups:  # every replica's process of that shard, and an old start of replica 1
        state = _RendezvousState()
        nodes = [_NodeDesc("worker0", 100, 0), _NodeDesc("worker1", 101, 0)]
        nodes.append(_NodeDesc("worker1", 99, 0))
        state.last_heartbeats = dict.fromkeys(nodes, NOW)
        g.set_state(pickle.dumps(state))
    forget(store, cfg, rank=3, pid=101)  # rank 3 = replica 1, shard 1
    assert _beats(groups[1]) == {
        ("worker0", 100): NOW,
        ("worker1", 101): EXPIRED,
        ("worker1", 99): NOW,
    }
    assert set(_beats(groups[0]).values()) == {NOW}  # shard 0's group untouched
    forget(store, cfg, rank=2)  # no pid: every start of replica 1 in shard 0's group
    assert _beats(groups[0])[("worker1", 101)] == _beats(groups[0])[("worker1", 99)] == EXPIRED
    assert _beats(groups[0])[("worker0", 100)] == NOW
