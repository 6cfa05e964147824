"""A worker whose own store reads were held up (the coordinator away, its requests held by the
machine's store tunnel) does not call its peers silent for it: nobody's heartbeat could reach
the store meanwhile. A peer whose heartbeat stops while the store answers is still found."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from frugaltrain.cluster import keys
from frugaltrain.comm.base import CommStats
from frugaltrain.comm.ft.operation_log import Op, OpLog

HB_TIMEOUT_S = 0.2


class HeldStore:
    """Worker 1's heartbeat count in a dict. The first `hold_s` > 0 read of it blocks that long
    (the coordinator away); after that the count moves only from the `moves_after`-th read on,
    as a peer's heartbeat does once its own held beat goes through."""

    def __init__(self, hold_s: float, moves_after: int | None) -> None:
        self.hold_s, self.moves_after = hold_s, moves_after
        self.reads = 0
        self.count = 5

    def check(self, names: list[str]) -> bool:
        return all(n == keys.heartbeat(1) for n in names)

    def get(self, name: str) -> bytes:
        self.reads += 1
        if self.hold_s:
            time.sleep(self.hold_s)
            self.hold_s = 0.0
        if self.moves_after is not None and self.reads > self.moves_after:
            self.count += 1
        return str(self.count).encode()


class Work:
    """A gloo work that completes once the store has been read `after` times."""

    def __init__(self, store: HeldStore, after: int) -> None:
        self.store, self.after = store, after

    def is_completed(self) -> bool:
        return self.store.reads >= self.after

    def wait(self) -> None:
        pass


def wait_on(store: HeldStore, completes_after: int) -> str | None:
    """OpLog._failure for an all-reduce of workers 0 and 1, seen from worker 0."""
    world = SimpleNamespace(
        rank=0,
        members=[0, 1],
        store=store,
        epoch=0,
        hb_timeout_s=HB_TIMEOUT_S,
        timeout_s=60.0,
        options=SimpleNamespace(deadline_floor_s=60.0, deadline_factor=4.0),
        has=lambda key: False,  # nobody marks the epoch broken
        store_lost=False,  # a held store, not a lost one (ElasticWorld.guarded)
        guarded=lambda call, default: call(),
    )
    log = OpLog(world, CommStats())
    op = Op(0, "sum", [torch.zeros(1)], epoch=0, members=[0, 1])
    op.works, op.outputs = [Work(store, completes_after)], torch.zeros(1)
    return log._failure(op, time.monotonic())


def test_a_held_store_read_does_not_make_a_peer_silent():
    # Held for 3 heartbeat timeouts, then the peer's count moves from the 4th read on, and the
    # operation completes at the 12th: no verdict of silence in between.
    store = HeldStore(hold_s=3 * HB_TIMEOUT_S, moves_after=4)
    assert wait_on(store, completes_after=12) is None


def test_a_peer_whose_heartbeat_stops_is_still_found():
    store = HeldStore(hold_s=0.0, moves_after=None)  # the store answers; the count never moves
    reason = wait_on(store, completes_after=10**9)
    assert reason == f"worker 1: no heartbeat for {HB_TIMEOUT_S:g} s"
