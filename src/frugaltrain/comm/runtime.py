"""`Runtime`: the training loop's side of a communication runtime, held next to the `Comm`.

A strategy sees only the `Comm` (collectives, members, byte counts, rejections). The loop needs
more, and gets it here: reductions of logging scalars and diagnostic tensors (never counted as
algorithm traffic), the step hook, the round end and a restarted worker's rejoin. This class is
the plain runtime (one process, torch.distributed, the simulator's workers): members never
change, so its hooks do nothing. The fault-tolerant runtime (comm/ft/runtime.py) overrides them.

The round end is one call each way:

    late = runtime.end_round(round_idx, scalars, close)
        the runtime collects its fields for worker 0's record and the events of the round,
        posts the round's logging scalars (their means arrive later, `RoundEnd.means`), and
        calls `close(RoundEnd)` once: the loop logs the round and writes a checkpoint when one
        is due, and returns this worker's state function. Then the runtime admits workers
        waiting to join (the fault-tolerant one; the donor sends them that state) and returns
        the events that produced, for the log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from frugaltrain.comm.base import Comm, flatten, unflatten_into

StateFn = Callable[[], dict]


class MeansUnavailable(Exception):
    """A round's means cannot be had now; its record waits for them (the fault-tolerant
    runtime: the store was lost while they were read, and the last round end gathers them)."""


class Means:
    """The workers' means of one round's logging scalars, in flight. Call it for the values;
    `ready()` says whether waiting would return at once (plain runtimes: never sure, so the
    log writes a record once the next round has started)."""

    def __init__(self, result: Callable[[], list[float]], ready: Callable[[], bool] | None):
        self._result, self.ready = result, ready

    def __call__(self) -> list[float]:
        return self._result()


@dataclass
class RoundEnd:
    """What the runtime hands the loop at a round end (see the module docstring)."""

    fields: dict  # runtime fields of worker 0's round record (membership, late messages)
    events: list[dict]  # records of the round for worker 0's log (rejections, membership)
    means: Means  # the workers' means of the scalars the loop posted


class Runtime:
    """The plain runtime around `comm`: a fixed set of members."""

    stopping = False  # the fault-tolerant runtime's last round end: the loop checkpoints, stops

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._round = 0

    @property
    def round(self) -> int:
        """The last finished round."""
        return self._round

    # ---- reductions for logging and diagnostics (not algorithm traffic)
    def metric_mean(self, values: list[float]) -> list[float]:
        """Mean of a few logging scalars over the members."""
        if self.comm.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self.comm._metric_sum(t)
        return (t / len(self.comm.members)).tolist()

    def metric_mean_async(self, values: list[float]) -> Means:
        """Start `metric_mean` without waiting. Lets the loop log round t while round t + 1
        runs, so logging adds no synchronization point."""
        if self.comm.world_size == 1:
            return Means(lambda: list(values), None)
        t = torch.tensor(values, dtype=torch.float64)
        wait = self.comm._metric_sum_async(t)
        n = len(self.comm.members)

        def result() -> list[float]:
            wait()
            return (t / n).tolist()

        return Means(result, None)

    def metric_max(self, values: list[float]) -> list[float]:
        """Max of a few logging scalars over the members."""
        if self.comm.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self.comm._metric_max(t)
        return t.tolist()

    def metric_mean_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Mean of `tensors` over the members, for diagnostics (consensus distance, the averaged
        model); returns new fp32 tensors."""
        flat = flatten(tensors).double()
        if self.comm.world_size > 1:
            self.comm._metric_sum(flat)
            flat /= len(self.comm.members)
        out = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
        unflatten_into(flat.float(), out)
        return out

    def barrier(self) -> None:
        """Every member reaches this point (a checkpoint's files are all written)."""
        if self.comm.world_size > 1:
            self.comm._metric_sum(torch.zeros(1))

    # ---- the loop's hooks
    def on_step(self, step: int, compute_s: float) -> None:
        """After inner step `step` took `compute_s` seconds of compute."""

    def end_round(
        self, round_idx: int, scalars: list[float], close: Callable[[RoundEnd], StateFn]
    ) -> list[dict]:
        """The round end (module docstring); returns the events of the admission."""
        self._round = round_idx
        fields = self._round_fields()
        events = self._drain_events()
        state_fn = close(RoundEnd(fields, events, self.metric_mean_async(scalars)))
        self._admit(round_idx, state_fn)
        return self._drain_events()

    def rejoin(self, load: Callable[[dict], None], state_fn: StateFn) -> bool:
        """On a restarted worker: take a live peer's state through `load`. False: first start."""
        return False

    def writes_metrics(self, worker: int, shard: int) -> bool:
        """Whether this process writes the run's metrics log and shows progress: worker 0's
        first shard."""
        return worker == 0 and shard == 0

    def writes_markers(self, local_rank: int) -> bool:
        """Whether this worker writes the COMPLETE marker of a checkpoint: one per machine (its
        workers' files are there, so a machine without a shared file system can resume)."""
        return local_rank == 0

    # ---- what a fault needs to act like a real one (comm/faulty.py). A plain runtime has no
    # heartbeat and never recovers: a silent worker is only late, as in a stall.
    def silence(self, on: bool) -> None:
        """While `on`, this worker is cut off as behind a partition."""

    def stop_heartbeat(self) -> None:
        """This worker's heartbeat stops (it hangs)."""

    def at_recovery(self, hook: Callable[[], None]) -> None:
        """Call `hook` whenever this worker starts recovering from a failure."""

    # ---- what the fault-tolerant runtime overrides
    def _round_fields(self) -> dict:
        return {}

    def _drain_events(self) -> list[dict]:
        return self.comm.drain_rejections()

    def _admit(self, round_idx: int, state_fn: StateFn) -> None:
        """Admit workers waiting to join at this round end (none here)."""
