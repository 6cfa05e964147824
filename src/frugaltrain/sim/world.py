"""Virtual workers' meeting point: `SimWorld` holds the clocks and the operations in flight,
`SimComm` is one virtual worker's `Comm` (comm/base.py) on top of it.

Strategies call the public `Comm` operations exactly as in real runs; only the runtime hooks
(`_all_reduce_sum`, `_all_gather`, `_exchange`, `_metric_*`) are implemented here. Every
algorithm operation gets the next number of the worker's own counter; since all live workers
issue collectives in the same order, operation k of every worker is the same collective. An
operation is *posted* with the worker's virtual time and payload and *completes* when all live
workers have posted it; then its simulated end time per worker is computed from the network
model (sim/network.py) and the results from the stacked payloads with comm.base.weighted_sum,
the same fp64 rank-order reduction the real runtime uses, so both agree bit for bit.

Waiting (`Handle.wait()`) advances the worker's clock to the operation's end if it is later and
books the difference as simulated blocking time. A blocking operation is waited on at once, so
it ends at the latest participant's arrival plus the transfer; a non-blocking one is waited on
later and costs only what is left. Real (wall-clock) waiting between threads costs nothing.

Faults (sim.SimSection): per-message drops in gossip (the receiver uses its own value for a lost
message: the row's missing mass moves to the self weight, so the row stays stochastic), and
all-reduce failures with retry-after-timeout or rollback (the engine restores the round).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from frugaltrain.comm.base import (
    Comm,
    CommStats,
    Exchange,
    Handle,
    flatten,
    payload_bytes,
    ring_allreduce_bytes,
    unflatten_into,
    weighted_sum,
)
from frugaltrain.comm.guard import Guard
from frugaltrain.sim.config import SimSection
from frugaltrain.sim.network import Network

_WAIT_S = 600.0  # real seconds a thread waits for the others before declaring a deadlock


@dataclass
class _Op:
    key: tuple
    kind: str  # allreduce, gather, exchange, metric_sum, metric_max
    members: list[int]
    posts: dict = field(default_factory=dict)  # rank -> (payload, t_post, send_to, recv_from, wire)
    ready: bool = False
    end: dict = field(default_factory=dict)  # rank -> simulated completion time
    result: object = None
    dropped: dict = field(default_factory=dict)  # rank -> [senders lost]
    waited: set = field(default_factory=set)
    resends: int = 0  # failed attempts sent again (retry policy): their bytes moved too


class SimWorld:
    """Clocks, links and operations of M virtual workers (thread-safe)."""

    def __init__(self, num_workers: int, network: Network, sim: SimSection) -> None:
        self.M = num_workers
        self.net = network
        self.sim = sim
        self.clock = [0.0] * num_workers  # simulated seconds, per worker
        self.link_free = [0.0] * num_workers
        self.compute_s = [0.0] * num_workers
        self.blocking_s = [0.0] * num_workers
        self.members = list(range(num_workers))
        self.counts = {"drops": 0, "allreduce_failures": 0, "retries": 0}
        self.round_failed = False
        self.events: list[dict] = []
        self._ops: dict[tuple, _Op] = {}
        self._cond = threading.Condition()
        self._aborted: BaseException | None = None
        self._aside: dict[int, list[float]] = {}  # rank -> [latest end waited on aside]

    # ---- clock
    def advance(self, rank: int, seconds: float) -> None:
        """Worker `rank` computed for `seconds` (only its own thread calls this)."""
        self.clock[rank] += seconds
        self.compute_s[rank] += seconds

    def abort(self, exc: BaseException) -> None:
        with self._cond:
            self._aborted = exc
            self._cond.notify_all()

    @contextmanager
    def aside(self, rank: int) -> Iterator[list[float]]:
        """Waits of `rank` inside do not move its clock: what a runtime does in a background
        thread. Yields [the latest end among them] (0 if none)."""
        ended = self._aside[rank] = [0.0]
        try:
            yield ended
        finally:
            del self._aside[rank]

    # ---- operations
    def post(
        self, rank: int, key: tuple, kind: str, payload, at: float | None = None, **meta
    ) -> _Op:
        """Post `rank`'s part of operation `key` at its clock, or at simulated time `at` (what
        a background thread posted when the operations it waited on ended)."""
        with self._cond:
            op = self._ops.get(key)
            if op is None:
                op = self._ops[key] = _Op(key, kind, list(self.members))
            if rank not in op.members or op.kind != kind:
                raise RuntimeError(
                    f"[sim worker {rank}] operation {key} is a {op.kind} over {op.members}, but "
                    f"this worker posted a {kind}: workers issued collectives in different orders"
                )
            op.posts[rank] = (payload, self.clock[rank] if at is None else at, meta)
            if len(op.posts) == len(op.members):
                self._complete(op)
                self._cond.notify_all()
            return op

    def wait(self, rank: int, op: _Op):
        with self._cond:
            ok = self._cond.wait_for(lambda: op.ready or self._aborted is not None, _WAIT_S)
            if self._aborted is not None:
                raise RuntimeError(f"[sim worker {rank}] aborted: {self._aborted!r}")
            if not ok:
                missing = sorted(set(op.members) - set(op.posts))
                raise RuntimeError(
                    f"[sim worker {rank}] operation {op.key} ({op.kind}) never completed: "
                    f"workers {missing} did not post it"
                )
            if op.kind.startswith("metric"):
                result = op.result
            else:
                if rank in self._aside:
                    self._aside[rank][0] = max(self._aside[rank][0], op.end[rank])
                else:
                    blocked = max(0.0, op.end[rank] - self.clock[rank])
                    self.clock[rank] += blocked
                    self.blocking_s[rank] += blocked
                result = op.result[rank] if op.kind == "exchange" else op.result
            op.waited.add(rank)
            if len(op.waited) == len(op.members):
                del self._ops[op.key]
            return result

    def is_done(self, rank: int, op: _Op) -> bool:
        with self._cond:
            return op.ready and op.end.get(rank, 0.0) <= self.clock[rank]

    # ---- completion: timing, faults and results (called under the lock)
    def _start(self, rank: int, op: _Op) -> float:
        return max(op.posts[rank][1], self.link_free[rank])

    def _draw(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.sim.fault_seed, *key])

    def _complete(self, op: _Op) -> None:
        ranks = op.members
        if op.kind.startswith("metric"):
            ts = [op.posts[r][0] for r in ranks]
            if op.kind == "metric_sum":
                acc = torch.zeros_like(ts[0], dtype=torch.float64)
                for t in ts:
                    acc += t.double()
                op.result = acc.to(ts[0].dtype)
            else:
                op.result = torch.stack(ts).amax(0)
        elif op.kind in ("allreduce", "gather"):
            self._complete_collective(op, ranks)
        else:
            self._complete_exchange(op, ranks)
        op.ready = True

    def _complete_collective(self, op: _Op, ranks: list[int]) -> None:
        nbytes = op.posts[ranks[0]][2]["nbytes"]
        if op.kind == "allreduce":
            transfer = self.net.ring_allreduce_s(nbytes, ranks)
            scale = op.posts[ranks[0]][2]["scale"]
            op.result = weighted_sum([scale] * len(ranks), [op.posts[r][0] for r in ranks])
        else:
            transfer = self.net.allgather_s(nbytes, ranks)
            op.result = {r: op.posts[r][0] for r in ranks}
        start = max(self._start(r, op) for r in ranks)
        end = start + transfer
        q = self.sim.drop_prob
        if q > 0 and len(ranks) > 1:
            # One message per ring link per attempt: the attempt fails if any of n links drops.
            p_fail = 1 - (1 - q) ** len(ranks)
            rng = self._draw(op.key[1], 1)
            timeout = self.sim.timeout_s or 2 * transfer
            fails = 0
            while fails < self.sim.max_retries and rng.random() < p_fail:
                fails += 1
                if self.sim.allreduce_policy == "rollback":
                    break
            if fails:
                self.counts["allreduce_failures"] += 1
                self.events.append(
                    {
                        "op": op.key[1],
                        "kind": op.kind,
                        "failed_attempts": fails,
                        "policy": self.sim.allreduce_policy,
                    }
                )
                if self.sim.allreduce_policy == "rollback":
                    end = start + timeout  # failure detected; the engine discards the round
                    self.round_failed = True
                else:
                    self.counts["retries"] += fails
                    op.resends = fails
                    end = start + fails * timeout + transfer
        for r in ranks:
            op.end[r] = end
            self.link_free[r] = end

    def _complete_exchange(self, op: _Op, ranks: list[int]) -> None:
        starts = {r: self._start(r, op) for r in ranks}
        send_done = {}
        for r in ranks:
            meta = op.posts[r][2]
            send_done[r] = starts[r] + self.net.send_s(meta["wire"] * len(meta["send_to"]), r)
        q = self.sim.drop_prob
        op.result = {}
        for r in ranks:
            payload, _, meta = op.posts[r]
            wire, recv_from = meta["wire"], meta["recv_from"]
            lost = [j for j in recv_from if q > 0 and self._draw(op.key[1], j, r, 2).random() < q]
            if lost:
                self.counts["drops"] += len(lost)
                op.dropped[r] = lost
            d = max(len(meta["send_to"]), len(recv_from))
            own_part = starts[r] + (self.net.send_s(d * wire, r) if d else 0.0)
            arrivals = [send_done[j] for j in recv_from if j not in lost]
            op.end[r] = max([own_part, *arrivals])
            # A lost message is replaced by the receiver's own encoded value (row stays
            # stochastic: its weight moves to the self term).
            op.result[r] = {j: (payload if j in lost else op.posts[j][0]) for j in recv_from}
        for r in ranks:
            self.link_free[r] = op.end[r]


class _SimStats(CommStats):
    """CommStats whose blocking_s is the simulated blocking time of the worker; the wall-clock
    time Handle.wait() adds (threads meeting) is dropped."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        self._world, self._rank = world, rank
        super().__init__()

    @property
    def blocking_s(self) -> float:
        return self._world.blocking_s[self._rank]

    @blocking_s.setter
    def blocking_s(self, value: float) -> None:
        pass


class SimComm(Comm):
    """Virtual worker `rank`'s endpoint in `world`."""

    def __init__(self, world: SimWorld, rank: int, guard: Guard | None = None) -> None:
        super().__init__(deterministic=False, guard=guard)
        self.world = world
        self.rank = rank
        self.world_size = world.M
        self.members = list(world.members)
        self.stats = _SimStats(world, rank)
        self.seq = 0  # algorithm operations issued (the rendezvous key)
        self.metric_seq = 0

    def _next(self) -> tuple:
        self.seq += 1
        return ("op", self.seq)

    def _all_reduce_sum(self, tensors: list[torch.Tensor], scale: float) -> Handle:
        flat = flatten(tensors)
        op = self.world.post(
            self.rank, self._next(), "allreduce", flat, nbytes=payload_bytes(tensors), scale=scale
        )

        def finish() -> None:
            unflatten_into(self.world.wait(self.rank, op), tensors)
            self._count_resends(op, ring_allreduce_bytes(payload_bytes(tensors), len(op.members)))

        return Handle(self.stats, finish, lambda: self.world.is_done(self.rank, op))

    def _all_gather(self, parts: list[torch.Tensor], seq: int) -> Exchange:
        wire = sum(p.numel() * p.element_size() for p in parts)
        op = self.world.post(self.rank, self._next(), "gather", parts, nbytes=wire)

        def wait() -> dict:
            received = self.world.wait(self.rank, op)
            self._count_resends(op, wire * (len(op.members) - 1))
            return received

        return Exchange(wait, lambda: self.world.is_done(self.rank, op))

    def _count_resends(self, op, nbytes: int) -> None:
        """A retried collective sent (and received) its bytes once per failed attempt too."""
        self.stats.count(op.resends * nbytes, op.resends * nbytes)

    def _exchange(
        self, parts: list[torch.Tensor], send_to: list[int], recv_from: list[int], seq: int
    ) -> Exchange:
        wire = sum(p.numel() * p.element_size() for p in parts)
        op = self.world.post(
            self.rank,
            self._next(),
            "exchange",
            parts,
            wire=wire,
            send_to=send_to,
            recv_from=recv_from,
        )

        def wait_all() -> dict[int, list[torch.Tensor]]:
            received = self.world.wait(self.rank, op)
            # A lost message never arrived: do not count its bytes as received.
            self.stats.bytes_received -= wire * len(op.dropped.get(self.rank, ()))
            return received

        return Exchange(wait_all, lambda: self.world.is_done(self.rank, op))

    def _send_all_later(self, parts: Callable[[], list[torch.Tensor]], seq: int) -> Exchange:
        """As TorchDistComm moves it, in the background: posted at the simulated time its
        first phase ended for this worker, a point-to-point exchange with every peer."""

        def wait_all() -> dict[int, list[torch.Tensor]]:
            with self.world.aside(self.rank) as ended:
                own = parts()
            peers = [r for r in self.members if r != self.rank]
            meta = {"wire": sum(p.numel() * p.element_size() for p in own), "at": ended[0]}
            op = self.world.post(
                self.rank, self._next(), "exchange", own, send_to=peers, recv_from=peers, **meta
            )
            return {**self.world.wait(self.rank, op), self.rank: own}

        return Exchange(wait_all, lambda: False)

    def _metric(self, t: torch.Tensor, kind: str) -> None:
        self.metric_seq += 1
        op = self.world.post(self.rank, ("metric", self.metric_seq), kind, t.clone())
        t.copy_(self.world.wait(self.rank, op))

    def _metric_sum(self, t: torch.Tensor) -> None:
        self._metric(t, "metric_sum")

    def _metric_max(self, t: torch.Tensor) -> None:
        self._metric(t, "metric_max")
