"""First starts meet per world: with shards, each shard group has its own rendezvous, so its
first starts wait for the run.workers processes of that group, not for any run.workers of the
run's processes (then a slow replica would miss its group's first round and restart)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch.distributed as dist

from frugaltrain.cluster import keys
from frugaltrain.cluster.coordinator import Coordinator
from frugaltrain.cluster.store import PrefixView, StoreServer
from frugaltrain.comm.ft.elastic_world import ElasticWorld, Identity

W, S = 2, 2
TIMEOUT = timedelta(seconds=30)
OPTIONS = SimpleNamespace(mix1_deadline_s=5.0, deadline_factor=4.0, deadline_floor_s=60.0)


def test_first_starts_meet_per_shard_group(monkeypatch):
    root = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    passed: list[tuple[int, int]] = []  # (shard, replica) past the meeting, in order
    monkeypatch.setattr(
        ElasticWorld, "rendezvous", lambda self, purpose: passed.append((self.shard, self.rank))
    )

    def start(replica: int, shard: int) -> threading.Thread:
        me = Identity("127.0.0.1", root.port, replica, W, 1, keys.namespace(shard, S))
        client = dist.TCPStore("127.0.0.1", root.port, is_master=False, timeout=TIMEOUT)
        world = ElasticWorld(client, me, OPTIONS, timeout_s=30.0)  # a client each, as each process
        world.shard = shard
        t = threading.Thread(target=world.start, daemon=True)
        t.start()
        return t

    def counted(shard: int) -> int:
        key = f"{keys.namespace(shard, S)}/{keys.STARTED}"
        return int(root.get(key)) if root.check([key]) else 0

    def wait_counted(shard: int, n: int) -> None:
        root.wait([f"{keys.namespace(shard, S)}/{keys.STARTED}"])
        while counted(shard) < n:
            time.sleep(0.01)

    first = [start(0, 0), start(0, 1)]  # replica 0's two shards: W processes of the run
    wait_counted(0, 1)
    wait_counted(1, 1)
    for t in first:
        t.join(0.5)
    assert passed == []  # neither group has all its workers yet
    group0 = start(1, 0)
    group0.join(10)
    first[0].join(10)
    assert sorted(passed) == [(0, 0), (0, 1)] and first[1].is_alive()
    start(1, 1).join(10)
    first[1].join(10)
    assert sorted(passed) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_coordinator_counts_a_freed_slot_in_every_shard_group():
    """A resume without a machine counts its slot's processes in, one per shard group."""
    coord = Coordinator.__new__(Coordinator)
    coord.cfg = SimpleNamespace(run=SimpleNamespace(workers=W, shards=S))
    coord.store = StoreServer()
    coord._count_as_started(1)
    groups = [PrefixView(keys.namespace(s, S), coord.store) for s in range(S)]
    assert [int(g.get(keys.STARTED)) for g in groups] == [1, 1]
    assert not any(g.check([keys.ALL_STARTED]) for g in groups)
    for g in groups:
        keys.count_start(g, W)  # the slot that came back, in each group
    assert all(g.check([keys.ALL_STARTED]) for g in groups)
