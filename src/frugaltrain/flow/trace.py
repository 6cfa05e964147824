"""Per-process event trace and the metrics derived from it.

Every worker records spans (kind, t0, t1, step) on `time.perf_counter()`, which on Linux is
CLOCK_MONOTONIC and so comparable across the processes of one host. Kinds:

    compute      encoder forward/backward or backbone forward+backward of a micro-batch
    copy         moving embeddings or gradients in or out of the pool
    optim        all-reduce of gradients and the optimizer step
    starvation   consumer waiting for a sample that is not READY (pool empty)
    backpressure producer waiting for a free slot (pool full)
    barrier      waiting at a batch barrier (handoff ack, gradient return, version barrier)

All figures derived here are measured on this machine.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

IDLE_KINDS = ("starvation", "backpressure", "barrier")
BUSY_KINDS = ("compute", "copy", "optim")


@dataclass
class Tracer:
    role: str
    """producer0, consumer1, mono, ..."""
    events: list[tuple[str, float, float, int]] = field(default_factory=list)
    occupancy: list[tuple[float, int]] = field(default_factory=list)
    """(time, slots in use) samples, recorded by producers."""
    step_end: dict[int, float] = field(default_factory=dict)
    """Wall time at which this process finished optimizer step k."""

    @contextmanager
    def span(self, kind: str, step: int = -1):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.events.append((kind, t0, time.perf_counter(), step))

    def add(self, kind: str, t0: float, t1: float, step: int = -1) -> None:
        if t1 > t0:
            self.events.append((kind, t0, t1, step))

    def to_dict(self) -> dict:
        return {
            "role": self.role,
            "events": self.events,
            "occupancy": self.occupancy,
            "step_end": self.step_end,
        }


def window(traces: list[dict], warmup_steps: int, steps: int) -> tuple[float, float]:
    """Measured window: from the end of the last warm-up step to the end of the last step,
    on the slowest process (a step is done when every process finished it)."""
    if warmup_steps == 0:
        t0 = min(e[1] for t in traces for e in t["events"])
    else:
        t0 = max(t["step_end"][warmup_steps - 1] for t in traces)
    t1 = max(t["step_end"][steps - 1] for t in traces)
    return t0, t1


def breakdown(trace: dict, t0: float, t1: float) -> dict[str, float]:
    """Seconds per kind inside [t0, t1], time after the process's last event ('done'), and the
    rest ('other': Python between spans, data preparation, descheduling outside spans)."""
    out = {k: 0.0 for k in BUSY_KINDS + IDLE_KINDS}
    for kind, a, b, _ in trace["events"]:
        a, b = max(a, t0), min(b, t1)
        if b > a:
            out[kind] = out.get(kind, 0.0) + b - a
    # A producer that ran ahead finishes before the window closes: that tail is "done", not idle.
    last = max((b for _, _, b, _ in trace["events"]), default=t0)
    out["done"] = max(0.0, t1 - max(last, t0))
    out["other"] = max(0.0, (t1 - t0) - sum(out.values()))
    return out


def summarize(
    traces: list[dict],
    *,
    samples: int,
    tokens: int,
    warmup_steps: int,
    steps: int,
    model_flops: float,
    peak_flops: float,
    cores: int,
) -> dict:
    """Throughput, busy fraction, idle breakdown, occupancy and the CPU MFU proxy (measured)."""
    t0, t1 = window(traces, warmup_steps, steps)
    wall = t1 - t0
    roles = {}
    for t in traces:
        b = breakdown(t, t0, t1)
        roles[t["role"]] = {
            "busy_frac": sum(b[k] for k in BUSY_KINDS) / wall,
            **{f"{k}_frac": b[k] / wall for k in IDLE_KINDS},
            "done_frac": b["done"] / wall,
            "other_frac": b["other"] / wall,
        }
    occ = [n for t in traces for (ts, n) in t["occupancy"] if t0 <= ts <= t1]
    out = {
        "measured.wall_s": wall,
        "measured.samples_per_s": samples / wall,
        "measured.tokens_per_s": tokens / wall,
        "measured.roles": roles,
        "measured.pool_occupancy_mean_slots": (sum(occ) / len(occ)) if occ else 0.0,
        "measured.pool_occupancy_max_slots": max(occ) if occ else 0,
    }
    if peak_flops > 0:
        # CPU MFU proxy: analytic model FLOPs/s over a calibrated matmul's FLOP/s on all cores.
        out["estimated.cpu_mfu_proxy"] = model_flops / wall / (peak_flops * cores)
    return out


def calibrate_matmul_flops(n: int = 256, reps: int = 20) -> float:
    """Sustained single-thread float32 GEMM FLOP/s on this machine (measured)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        return 2 * n**3 * reps / (time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)


def plot_timeline(traces: list[dict], path: str, title: str = "") -> None:
    """One row per process, one colour per event kind (a PNG of the measured trace)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "compute": "tab:blue",
        "copy": "tab:cyan",
        "optim": "tab:green",
        "starvation": "tab:red",
        "backpressure": "tab:orange",
        "barrier": "tab:purple",
    }
    start = min(e[1] for t in traces for e in t["events"])
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(traces)))
    for row, t in enumerate(traces):
        for kind, colour in colours.items():
            bars = [(a - start, b - a) for k, a, b, _ in t["events"] if k == kind]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=colour, label=kind if row == 0 else None)
    ax.set_yticks(range(len(traces)), [t["role"] for t in traces])
    ax.set_xlabel("seconds (measured)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.6))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
