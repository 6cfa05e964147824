"""The communication interface every outer strategy is written against.

A strategy sees one worker's view: its rank, the world size, and collective operations on lists
of tensors that may be started asynchronously and waited on later. Two runtimes implement it:
`LocalComm` (one worker: every operation is the identity, nothing is sent) and `TorchDistComm`
(torch.distributed); the simulator implements the same methods on a virtual clock.

Accounting lives here so every strategy reports it the same way:
- `bytes_sent` / `bytes_received` per worker, from the algorithm's traffic model (ring all-reduce
  sends and receives 2(M-1)/M * S for a payload of S bytes); point-to-point ops count exactly.
- `blocking_s`: wall-clock seconds the worker spent inside `Handle.wait()`, i.e. blocked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class CommStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    blocking_s: float = 0.0

    def copy(self) -> CommStats:
        return CommStats(self.bytes_sent, self.bytes_received, self.blocking_s)

    def minus(self, other: CommStats) -> CommStats:
        return CommStats(
            self.bytes_sent - other.bytes_sent,
            self.bytes_received - other.bytes_received,
            self.blocking_s - other.blocking_s,
        )


class Handle:
    """An operation in flight. `wait()` blocks until it is done (timed as blocking) and runs the
    completion step (e.g. divide by M, copy back into the caller's tensors) exactly once."""

    def __init__(
        self,
        stats: CommStats,
        wait_fn: Callable[[], None] | None = None,
        done_fn: Callable[[], bool] | None = None,
    ) -> None:
        self._stats = stats
        self._wait_fn = wait_fn
        self._done_fn = done_fn
        self._finished = wait_fn is None

    def is_completed(self) -> bool:
        return self._finished or (self._done_fn is not None and self._done_fn())

    def wait(self) -> None:
        if self._finished:
            return
        t0 = time.perf_counter()
        self._wait_fn()
        self._stats.blocking_s += time.perf_counter() - t0
        self._finished = True


def ring_allreduce_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of `payload_bytes`."""
    return 2 * (world_size - 1) * payload_bytes // world_size


def payload_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Comm:
    """One worker's communication endpoint. Subclasses implement `_all_reduce_sum`."""

    rank: int = 0
    world_size: int = 1

    def __init__(self) -> None:
        self.stats = CommStats()

    def all_reduce_mean_(self, tensors: list[torch.Tensor], *, blocking: bool = True) -> Handle:
        """Average `tensors` in place across all workers. With blocking=False the caller must
        `wait()` the handle before reading them."""
        if self.world_size == 1 or not tensors:
            return Handle(self.stats)
        nbytes = ring_allreduce_bytes(payload_bytes(tensors), self.world_size)
        self.stats.bytes_sent += nbytes
        self.stats.bytes_received += nbytes
        handle = self._all_reduce_sum(tensors, scale=1.0 / self.world_size)
        if blocking:
            handle.wait()
        return handle

    def metric_mean(self, values: list[float]) -> list[float]:
        """Mean of a few logging scalars over workers. Not counted as algorithm traffic."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self._metric_sum(t)
        return (t / self.world_size).tolist()

    def metric_max(self, values: list[float]) -> list[float]:
        """Max of a few logging scalars over workers. Not counted as algorithm traffic."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self._metric_max(t)
        return t.tolist()

    def barrier(self) -> None:
        pass

    # Runtime-specific parts.
    def _all_reduce_sum(self, tensors: list[torch.Tensor], scale: float) -> Handle:
        raise NotImplementedError

    def _metric_sum(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def _metric_max(self, t: torch.Tensor) -> None:
        raise NotImplementedError


class LocalComm(Comm):
    """A world of one: every collective is the identity and moves no bytes."""
