"""Measured inputs of the simulator's clock: a point-to-point bandwidth ratio
(sim.p2p_bandwidth_ratio) and a replayed per-round compute trace (sim.compute = "trace"),
against closed forms."""

from __future__ import annotations

import pytest

from frugaltrain.config import ConfigError
from frugaltrain.models import build_model
from frugaltrain.sim import SimSection, simulate
from frugaltrain.sim.config import build_sim
from frugaltrain.sim.network import Network

GLOBALM1 = ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1'")
LOCALM2 = ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'")


def test_p2p_ratio_scales_point_to_point_only():
    S, B, lat = 3.0e6, 1.0e6, 0.01
    full, half = Network([B] * 4, lat), Network([B] * 4, lat, p2p_ratio=0.5)
    assert half.pair_s(S, 0, 1) - lat == pytest.approx(2 * (full.pair_s(S, 0, 1) - lat))
    assert half.send_s(S, 2) - lat == pytest.approx(2 * (full.send_s(S, 2) - lat))
    assert half.ring_allreduce_s(S, [0, 1, 2, 3]) == full.ring_allreduce_s(S, [0, 1, 2, 3])
    assert half.allgather_s(S, [0, 1, 2, 3]) == full.allgather_s(S, [0, 1, 2, 3])
    assert full.B_p2p == full.B  # the default multiplies by 1.0: exact


def _run(make_config, *sets: str, **sim):
    cfg = make_config("run.workers=4", "run.eval_every=0", *sets)
    return simulate(cfg, SimSection(**sim))


@pytest.mark.parametrize("r", [0.5, 2.0])
def test_p2p_ratio_doubles_the_pair_exchange(make_config, r):
    # GlobalM1LocalM2, M = 4: Mix2 is a blocking pair exchange of S = all fp32 parameters, at
    # S / (p B) = T_AR / (1.5 p) with T_AR = r H c; it waits behind Mix1 when r > 1. So per round
    # blocking = max(0, r - 1) H c + r H c / (1.5 p), and U = 1 / (1 + max(0, r-1) + r / (1.5 p)).
    for p in (1.0, 0.5):
        u = _run(make_config, *LOCALM2, ratio=r, p2p_bandwidth_ratio=p).summary["util/compute"]
        assert u == pytest.approx(1 / (1 + max(0.0, r - 1) + r / (1.5 * p)), rel=1e-9)
    # The all-reduce keeps the link's full bandwidth: DiLoCo is unchanged, bit for bit.
    diloco = [
        _run(make_config, "outer.strategy='diloco'", ratio=r, p2p_bandwidth_ratio=p).summary[
            "util/compute"
        ]
        for p in (1.0, 0.5)
    ]
    assert diloco[0] == diloco[1] == pytest.approx(1 / (1 + r), rel=1e-9)


def test_compute_trace_replays_rounds_and_the_max_per_round(make_config):
    # GlobalM1 blocks max(0, T_AR - C_t) in round t. With T_AR = 0.95 s and rounds of
    # 0.6, 1.5, 0.9 s (mean 1.0 s), per round blocking is 0.35, 0, 0.05: U = 3 / 3.4, while a
    # fixed step time at the mean predicts full overlap (U = 1).
    cfg = make_config("run.workers=4", "run.eval_every=0", "run.steps=18", *GLOBALM1)
    H, S = cfg.outer.H, 4 * build_model(cfg).num_params()
    t_ar, trace = 0.95, [0.6, 1.5, 0.9]
    bps = 8 * 1.5 * S / t_ar  # ring all-reduce of S bytes over 4 workers: 1.5 S / B
    res = simulate(cfg, SimSection(compute="trace", compute_trace_s=trace, bandwidth_bps=[bps]))
    rounds = [r for r in res.records if r["kind"] == "round"]
    assert [r["time/compute_s"] for r in rounds] == pytest.approx(trace, rel=1e-12)
    expect = [max(0.0, t_ar - c) for c in trace]
    assert [r["time/blocking_s"] for r in rounds] == pytest.approx(expect, rel=1e-9, abs=1e-12)
    assert res.summary["util/compute"] == pytest.approx(3.0 / 3.4, rel=1e-9)
    mean = simulate(cfg, SimSection(step_s=sum(trace) / len(trace) / H, bandwidth_bps=[bps]))
    assert mean.summary["util/compute"] == pytest.approx(1.0, rel=1e-12)


def test_compute_trace_wraps_around(make_config):
    cfg = make_config(
        "run.workers=2", "run.eval_every=0", "run.steps=18", "outer.strategy='diloco'"
    )
    res = simulate(cfg, SimSection(compute="trace", compute_trace_s=[1.2, 0.3]))
    rounds = [r["time/compute_s"] for r in res.records if r["kind"] == "round"]
    assert rounds == pytest.approx([1.2, 0.3, 1.2], rel=1e-12)


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"compute": "trace"}, "compute_trace_s"),
        ({"compute_trace_s": [1.0]}, "compute_trace_s"),  # set but not read: refused
        ({"compute": "trace", "compute_trace_s": [1.0, 0.0]}, "compute_trace_s"),
        ({"p2p_bandwidth_ratio": 0.0}, "p2p_bandwidth_ratio"),
    ],
)
def test_new_keys_are_validated(make_config, raw, key):
    with pytest.raises(ConfigError, match=f"sim.{key}"):
        build_sim(raw, [], make_config())
