"""What every Comm counts, the same way for every strategy and runtime (the simulator's too):

- `bytes_sent` / `bytes_received` per worker, from the algorithm's traffic model (ring all-reduce
  sends and receives 2(M-1)/M * S for a payload of S bytes); gathers and point-to-point
  exchanges count the encoded bytes of every copy sent or received.
- `blocking_s`: wall-clock seconds the worker spent blocked (inside `Handle.wait()` or the
  guard's norm exchange), less the time the fault-tolerant runtime spent recovering in them
  (`recovery_s`); `blocking_by_op` splits it by the name a strategy gives each operation
  (`op="mix2"`). The simulator's blocking_s is its virtual clock, moved by its own waits:
  `timed` takes the change, whoever made it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class CommStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    blocking_s: float = 0.0
    recovery_s: float = 0.0  # fault-tolerant runtime: detecting a failure and re-forming
    blocking_by_op: dict[str, float] = field(default_factory=dict)  # op name -> seconds
    current_op: str = "outer"  # the operation being started (Handles take it as their name)

    def copy(self) -> CommStats:
        out = CommStats(self.bytes_sent, self.bytes_received, self.blocking_s, self.recovery_s)
        out.blocking_by_op = dict(self.blocking_by_op)
        return out

    def minus(self, other: CommStats) -> CommStats:
        out = CommStats(
            self.bytes_sent - other.bytes_sent,
            self.bytes_received - other.bytes_received,
            self.blocking_s - other.blocking_s,
            self.recovery_s - other.recovery_s,
        )
        before = other.blocking_by_op
        out.blocking_by_op = {k: v - before.get(k, 0.0) for k, v in self.blocking_by_op.items()}
        return out

    def count(self, sent: int, received: int) -> None:
        """Bytes this worker put on and took off its links."""
        self.bytes_sent += sent
        self.bytes_received += received

    def timed(
        self, fn: Callable[[], None], op: str, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        """Run `fn`, counting the time it took as blocking time of `op`."""
        t0, recovering, blocked = clock(), self.recovery_s, self.blocking_s
        fn()
        spent = clock() - t0
        self.blocking_s += spent - (self.recovery_s - recovering)
        by_op = self.blocking_by_op
        by_op[op] = by_op.get(op, 0.0) + self.blocking_s - blocked


def ring_allreduce_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of `payload_bytes`."""
    return 2 * (world_size - 1) * payload_bytes // world_size


def payload_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
