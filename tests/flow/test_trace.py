"""Idle breakdown and throughput window on a synthetic trace (no timing involved)."""

import pytest

from frugaltrain.flow.trace import breakdown, summarize, window


def traces() -> list[dict]:
    producer = {
        "role": "producer0",
        "occupancy": [(1.0, 2), (2.0, 4)],
        "step_end": {0: 1.0, 1: 3.0},
        "events": [
            ("compute", 0.0, 1.0, 0),
            ("compute", 1.0, 2.0, 1),
            ("backpressure", 2.0, 3.0, 1),
        ],
    }
    consumer = {
        "role": "consumer0",
        "occupancy": [],
        "step_end": {0: 2.0, 1: 4.0},
        "events": [
            ("starvation", 0.0, 1.0, 0),
            ("compute", 1.0, 2.0, 0),
            ("compute", 2.0, 3.5, 1),
            ("optim", 3.5, 4.0, 1),
        ],
    }
    return [producer, consumer]


def test_window_starts_after_warmup_on_the_slowest_process() -> None:
    assert window(traces(), 1, 2) == (2.0, 4.0)
    assert window(traces(), 0, 2) == (0.0, 4.0)


def test_breakdown_separates_idle_kinds_and_the_finished_tail() -> None:
    p, c = (breakdown(t, 2.0, 4.0) for t in traces())
    assert p["backpressure"] == 1.0 and p["done"] == 1.0 and p["other"] == 0.0
    assert c["compute"] == 1.5 and c["optim"] == 0.5 and c["starvation"] == 0.0


def test_summarize_reports_rates_and_fractions() -> None:
    m = summarize(
        traces(),
        samples=10,
        tokens=100,
        warmup_steps=1,
        steps=2,
        model_flops=8.0,
        peak_flops=1.0,
        cores=2,
    )
    assert m["measured.samples_per_s"] == pytest.approx(5.0)
    assert m["measured.roles"]["consumer0"]["busy_frac"] == pytest.approx(1.0)
    assert m["measured.roles"]["producer0"]["backpressure_frac"] == pytest.approx(0.5)
    assert m["measured.pool_occupancy_max_slots"] == 4
    assert m["estimated.cpu_mfu_proxy"] == pytest.approx(8.0 / 2.0 / 2.0)
