"""An operation that a dying member left finished on some survivors and failed on others
(comm/ft/operation_log.py, `settle`): every survivor ends with the same result.

A member killed in an all-reduce can leave it finished on the members that already had all
they needed from it and failed on another (4 gloo processes, the last SIGKILLed in a 16 MB
all-reduce: in 1 of 30 tries one survivor finished with the sum over 4 and two failed). Those
that finished have stepped with their result; the others ran it again over the survivors and
stepped with another mean, and the members' models stayed apart to the end (seen across
machines, benchmarks/chaos.py seed 1: `consensus/total` 0.021 at the end). They must take the
result the others have.

Real OpLogs over real ElasticWorlds, each worker a thread with its own store client and gloo
groups; only torch elastic's rendezvous is played by the test (round 0: all four start; round
1: the three survivors), and worker 2's wait is handed the gloo error it would have seen.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from frugaltrain.comm.accounting import CommStats
from frugaltrain.comm.ft.elastic_world import ElasticWorld, Identity
from frugaltrain.comm.ft.operation_log import OpLog

W, DEAD, FAILED = 4, 3, 2  # worker 3 dies in operation 0, which fails on worker 2 only
TIMEOUT_S = 30.0
OPTIONS = SimpleNamespace(mix1_deadline_s=5.0, deadline_factor=4.0, deadline_floor_s=60.0)
RUNS = itertools.count()  # each run's namespace in the module's store


class _Over(BaseException):
    """A worker that would exit, or a round the test did not plan (not an Exception: the
    world's rendezvous loop retries on those)."""


class _Rounds:
    """torch elastic's rendezvous as the test plays it: round k closes once the workers in
    rounds[k] have all asked; each gets its rank in worker order and the round's own store."""

    def __init__(self, rounds: list[list[int]]) -> None:
        self.rounds, self.index, self.arrived = rounds, 0, 0
        self.cond = threading.Condition()

    def join(self, worker: int, client: dist.Store) -> SimpleNamespace:
        with self.cond:
            if not self.cond.wait_for(lambda: worker in self._open(), TIMEOUT_S):
                raise _Over(f"worker {worker} asked for a round the test did not plan")
            index, workers = self.index, self.rounds[self.index]
            self.arrived += 1
            if self.arrived == len(workers):
                self.index, self.arrived = index + 1, 0
                self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.index > index, TIMEOUT_S):
                raise _Over(f"round {index} never filled")
        return SimpleNamespace(
            store=dist.PrefixStore(f"round{index}", client),
            rank=workers.index(worker),
            world_size=len(workers),
        )

    def _open(self) -> list[int]:
        return self.rounds[self.index] if self.index < len(self.rounds) else []


class _ClosedByPeer:
    """The gloo work of worker 2's operation 0 as it ended there: the killed worker's socket
    closed before it had what it needed."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")


@pytest.fixture(scope="module")
def master() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _world(port: int, namespace: str, rank: int, rounds: _Rounds) -> ElasticWorld:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    me = Identity("127.0.0.1", port, rank, W, namespace=namespace)
    world = ElasticWorld(client, me, OPTIONS, timeout_s=TIMEOUT_S)
    world.exit = _exit
    own = world.membership.client
    world.membership.handler = SimpleNamespace(
        next_rendezvous=lambda: rounds.join(rank, own), num_nodes_waiting=lambda: 0
    )
    return world


def _exit(code: int) -> None:
    raise _Over(f"the worker exited with code {code}")


def _inputs(rank: int) -> list[torch.Tensor]:
    """Worker `rank`'s inputs (a pseudo-gradient; for a gather also a coded part): values whose
    means over three and four workers differ."""
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(1000, generator=g),
        torch.randint(0, 255, (40,), dtype=torch.uint8, generator=g),
    ]


def _worker(world: ElasticWorld, kind: str, finished: threading.Barrier, out: dict) -> None:
    """Worker `world.rank`: the round's operation `kind` over four, then one more.
    `finished`: workers 0 and 1 have finished the first before worker 2 sees it fail."""
    rank = world.rank
    world.rendezvous("start")
    log = OpLog(world, CommStats())
    op = log.post(kind, _inputs(rank)[: 1 if kind == "sum" else 2])
    if rank == DEAD:  # its part goes out, then it is gone: no heartbeat, no more operations
        for work in op.works:
            work.wait()
        world.heartbeat.stop()
        return
    if rank == FAILED:
        finished.wait(TIMEOUT_S)
        op.works = [_ClosedByPeer()]
    result = log.wait(op)  # workers 0 and 1: finished; worker 2: recovers first
    if rank != FAILED:
        finished.wait(TIMEOUT_S)
        # Worker 2 marks the epoch broken; workers 0 and 1 find it as they post the next
        # operation (not in it: the test leaves no operation pending in a group it drops).
        t0 = time.monotonic()
        while not world.is_broken() and time.monotonic() - t0 < TIMEOUT_S:
            time.sleep(0.01)
    after, n = log.wait(log.post("sum", [torch.ones(3)]))  # the next one: over the survivors
    out[rank] = {"result": result, "next": (after.tolist(), n), "members": world.members}


@pytest.mark.parametrize("kind", ["sum", "gather"], ids=["all-reduce", "gather"])
def test_an_operation_finished_on_some_survivors_is_taken_by_the_others(master, kind):
    namespace = f"settle{next(RUNS)}"
    rounds = _Rounds([[0, 1, 2, 3], [0, 1, 2]])
    worlds = [_world(master.port, namespace, r, rounds) for r in range(W)]
    finished = threading.Barrier(3)
    out: dict[int, dict] = {}
    errors: list[BaseException] = []

    def guarded(world: ElasticWorld) -> None:
        try:
            _worker(world, kind, finished, out)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in worlds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    for w in worlds:
        w.heartbeat.stop()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a worker hung"
    survivors = [0, 1, FAILED]
    assert sorted(out) == survivors and all(out[r]["members"] == survivors for r in survivors)
    # The first operation holds all four workers' inputs, bit for bit the same on every
    # survivor: worker 2 took worker 0's result instead of running it again over three.
    if kind == "sum":
        expected = sum(_inputs(r)[0] for r in range(W))
        for r in survivors:
            total, n = out[r]["result"]
            assert n == W, (r, n)
            assert torch.equal(total, out[0]["result"][0]), r
        torch.testing.assert_close(out[0]["result"][0], expected)
    else:
        for r in survivors:
            got = out[r]["result"]
            assert sorted(got) == list(range(W)), (r, sorted(got))
            for m in range(W):
                assert all(torch.equal(a, b) for a, b in zip(got[m], _inputs(m), strict=True))
    assert all(out[r]["next"] == ([3.0, 3.0, 3.0], 3) for r in survivors)
