"""The metrics log of a run, written by worker 0 (across machines, each machine's first worker:
Runtime.writes_metrics): step records, round records completed with every worker's
means, membership events, and the progress bar.

A round's record needs the workers' means of a few scalars (loss, compute and blocking seconds,
bytes, energy) and of each worker's own figures (metrics/peers.py: bytes, seconds, blocking per
operation), `RoundScalars`. They are posted without waiting (the runtime's round end,
comm/runtime.py) and the record is
written once they are in: under the fault-tolerant runtime once every member has posted (a
straggler never holds a worker back), else once the next round has started. A checkpoint or the
end waits for all of them. Every worker keeps a RoundLog; only the writer's writes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import astuple, dataclass, field, fields
from pathlib import Path

from frugaltrain.comm.runtime import MeansUnavailable
from frugaltrain.metrics.log import MetricsLog
from frugaltrain.metrics.peers import count_events, fields_from_means
from frugaltrain.metrics.sinks import Sink


@dataclass
class RoundScalars:
    """One worker's logging scalars of a round; the workers' mean of them completes worker 0's
    record. Every worker packs them in the same order, so the mean lines up."""

    loss: float
    compute_s: float
    blocking_s: float
    sent: float  # bytes
    received: float  # bytes
    recovery_s: float
    val: float = 0.0  # validation loss, 0 when the round did not evaluate
    joules: float = 0.0  # this worker's energy, 0 when its meter does not count (loop.py)
    no_meter: float = 0.0  # 1: its meter counts but gave no reading
    peers: list[float] = field(default_factory=list)  # metrics.peers.post_vector

    def pack(self) -> list[float]:
        return [float(v) for v in astuple(self)[:-1]] + list(self.peers)

    @classmethod
    def unpack(cls, values: list[float]) -> RoundScalars:
        n = len(fields(cls)) - 1
        return cls(*values[:n], peers=list(values[n:]))


class RoundLog:
    def __init__(
        self,
        path: Path,
        *,
        enabled: bool,
        resumed_at: int | None,
        workers: int,
        bar,
        ops: tuple[str, ...],
        sinks: list[Sink] | None = None,
    ):
        """`ops`: the operation names of the per-op blocking split (metrics.peers.blocking_ops);
        `sinks`: where records also go (metrics.sinks.open_sinks, worker 0 only)."""
        self.log = MetricsLog(
            path, enabled=enabled, truncate_after_step=resumed_at, sinks=sinks or ()
        )
        self.workers = workers
        self.bar = bar
        self.ops = ops
        self._events: list[dict] = []  # since the last round record: counted in the next one
        self._steps: list[tuple[int, float, float]] = []
        self._pending: deque[tuple[dict, Callable[[], list[float]], bool]] = deque()

    @property
    def enabled(self) -> bool:
        """Whether this process writes the log (Runtime.writes_metrics)."""
        return self.log.enabled

    def step(self, step: int, loss: float, lr: float) -> None:
        """Buffer a step record (written at the round end: no per-step file write)."""
        if self.log.enabled:
            self._steps.append((step, loss, lr))
        if self.bar is not None:
            self.bar.update(1)

    def write_steps(self) -> None:
        for step, loss, lr in self._steps:
            self.log.write({"kind": "step", "step": step, "loss/train": loss, "lr": lr})
        self._steps.clear()

    def round(self, record: dict, means: Callable[[], list[float]], has_val: bool) -> None:
        """Queue a round record; `means()` gives the workers' mean of their packed
        RoundScalars. The event records logged since the last round record are counted in this
        one (comm/rejected, comm/membership_changes)."""
        record.update(count_events(self._events))
        self._events = []
        self._pending.append((record, means, has_val))
        self.flush()

    def flush(self, everything: bool = False) -> None:
        """Write the queued round records whose means are in (`everything`: all of them)."""
        while self._pending:
            record, means, has_val = self._pending[0]
            ready = getattr(means, "ready", None)  # comm.runtime.Means
            if not everything and not (ready() if ready else len(self._pending) > 1):
                return
            try:
                values = means()
            except MeansUnavailable:
                return  # kept, in order, until they can be had
            self._pending.popleft()
            self._write_round(record, values, has_val)

    def events(self, records: list[dict]) -> None:
        self._events += records
        for rec in records:
            self.log.write(rec)

    def close(self) -> None:
        self.flush(everything=True)
        if self.bar is not None:
            self.bar.close()
        self.log.close()

    def _write_round(self, record: dict, means: list[float], has_val: bool) -> None:
        mean = RoundScalars.unpack(means)
        compute, blocking = mean.compute_s, mean.blocking_s
        record.update(
            {
                "loss/train": mean.loss,
                "time/compute_s": compute,
                "time/blocking_s": blocking,
                "util/compute": compute / (compute + blocking) if compute + blocking > 0 else None,
                "comm/bytes_sent": int(mean.sent),
                "comm/bytes_received": int(mean.received),
                "time/recovery_s": mean.recovery_s,
            }
        )
        record.update(fields_from_means(mean.peers, self.workers, self.ops))
        if mean.no_meter > 0:  # a reporting worker's meter gave no reading: no total, no zero
            if not record["energy/label"].startswith("unavailable"):
                missing = int(round(mean.no_meter * self.workers))
                record["energy/label"] = f"unavailable: {missing} worker meter(s)"
        else:
            record["energy/joules"] = mean.joules * self.workers  # the reporting workers' sum
        if has_val:
            record["loss/val"] = mean.val
            if self.bar is not None:
                self.bar.set_postfix(val=f"{mean.val:.3f}")
        self.log.write(record)
        self.log.flush()
