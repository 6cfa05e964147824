"""Run metrics as JSON lines: one record per inner step ("step") and per outer round ("round").

Keys are namespaced and carry units (`loss/train`, `time/compute_s`, `comm/bytes_sent`). Every
record names where its time figures come from in `clock`: "measured" (wall clock of real
processes) or "simulated" (the simulator's virtual clock). Values that were not measured are
left out, never written as zero.

Every record written also goes to the log's sinks (metrics/sinks.py: TensorBoard, wandb).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from frugaltrain.metrics.sinks import Sink


class MetricsLog:
    """Append-only JSONL writer; only worker 0 writes (others pass `enabled=False`). `sinks`
    receive every record written (metrics.sinks.open_sinks; only for the writing process)."""

    def __init__(
        self,
        path: Path,
        enabled: bool = True,
        truncate_after_step: int | None = None,
        sinks: Sequence[Sink] = (),
    ):
        self.path = Path(path)
        self.enabled = enabled
        self.sinks = list(sinks) if enabled else []
        if enabled and truncate_after_step is not None:
            keep_until_step(self.path, truncate_after_step)
        self._f = open(self.path, "a") if enabled else None  # noqa: SIM115

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record) + "\n")
            for sink in self.sinks:
                sink.write(record)

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()
            for sink in self.sinks:
                sink.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
            for sink in self.sinks:
                sink.close()


def keep_until_step(path: Path, step: int) -> None:
    """Resuming: keep the records up to the checkpoint's step, so the log continues seamlessly
    (every round once)."""
    if not Path(path).exists():
        return
    kept = [
        line
        for line in Path(path).read_text().splitlines()
        if line and json.loads(line).get("step", 0) <= step
    ]
    Path(path).write_text("".join(line + "\n" for line in kept))


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
