"""Faults in the simulator: message drops keep mixing rows stochastic, a crashed worker rejoins
with its neighbour's state (paying the transfer), a straggler delays exactly the participants of
a blocking operation, and all-reduce failures follow the retry or rollback policy."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from frugaltrain.comm.faulty import FaultyWire
from frugaltrain.config import ConfigError
from frugaltrain.inject import Injector, parse
from frugaltrain.sim import SimComm, SimSection, SimWorld, simulate
from frugaltrain.sim.network import Network


def _world(n: int, **sim) -> tuple[SimWorld, list[SimComm]]:
    world = SimWorld(n, Network([1000.0] * n, 0.0), SimSection(**sim))
    return world, [SimComm(world, i) for i in range(n)]


def _in_threads(n: int, fn) -> list:
    out = [None] * n
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _ring(n: int) -> np.ndarray:
    w = np.eye(n) / 3
    for i in range(n):
        w[i, (i - 1) % n] += 1 / 3
        w[i, (i + 1) % n] += 1 / 3
    return w


def test_dropped_message_leaves_row_stochastic():
    n = 5
    world, comms = _world(n, drop_prob=0.3, fault_seed=3)
    # Worker j holds 10^j: the digits of a mixed value are the weights it received.
    xs = [torch.full((3,), float(10**j), dtype=torch.float32) for j in range(n)]
    w = _ring(n)

    def mix(i):
        t = [xs[i].clone()]
        comms[i].mix_(t, w)
        return t[0][0].item()

    got = _in_threads(n, mix)
    assert world.counts["drops"] > 0
    lost_any = False
    for i in range(n):
        rest, weights = got[i], {}
        for j in sorted(range(n), reverse=True):
            weights[j] = round(rest / 10.0**j * 3) / 3
            rest -= weights[j] * 10.0**j
        assert sum(weights.values()) == pytest.approx(1.0)  # the row stays stochastic
        neighbours = {(i - 1) % n, (i + 1) % n}
        for j in range(n):
            if j not in neighbours | {i}:
                assert weights[j] == 0
        lost = [j for j in neighbours if weights[j] == 0]
        assert weights[i] == pytest.approx((1 + len(lost)) / 3)  # self absorbs the lost mass
        lost_any |= bool(lost)
    assert lost_any


def test_straggler_delays_exactly_its_blocking_partners():
    n = 4
    world, comms = _world(n)
    pairs = np.zeros((n, n))
    for a, b in ((0, 1), (2, 3)):
        pairs[a, a] = pairs[b, b] = pairs[a, b] = pairs[b, a] = 0.5
    for i in range(n):
        world.advance(i, 10.0 if i == 3 else 1.0)  # worker 3 straggles

    def mix(i):
        comms[i].mix_([torch.ones(250)], pairs)  # 1000 bytes at 1000 B/s: 1 s

    _in_threads(n, mix)
    assert world.clock[:2] == [2.0, 2.0]  # pair (0, 1) does not see the straggler
    assert world.clock[2] == world.clock[3] == 11.0  # 2 waits for 3's message
    assert world.blocking_s == [1.0, 1.0, 10.0, 1.0]

    # A blocking all-reduce: every participant waits for the straggler.
    world2, comms2 = _world(n)
    for i in range(n):
        world2.advance(i, 10.0 if i == 3 else 1.0)
    _in_threads(n, lambda i: comms2[i].all_reduce_mean_([torch.ones(250)]))
    end = 10.0 + 2 * 3 / 4 * 1000 / 1000
    assert world2.clock == [end] * n


def test_crashed_worker_rejoins_with_neighbour_state(make_config):
    cfg = make_config(
        "run.workers=4",
        "run.steps=36",
        "outer.strategy='fgd'",
        "outer.fgd.mix1='ring'",
        "outer.fgd.mix2='none'",
        "run.eval_every=0",
    )
    res = simulate(cfg, SimSection(ratio=0.5, crash_worker=2, crash_round=2, crash_rounds=2))
    events = {e["kind"]: e for e in res.summary["events"]}
    assert events["crash"]["round"] == 2 and events["rejoin"]["round"] == 4
    assert events["rejoin"]["from"] == 3 and events["rejoin"]["bytes"] > 0
    live = [r["live_workers"] for r in res.records]
    assert live == [4, 4, 3, 3, 4, 4]

    # Right after rejoining, worker 2 holds exactly worker 3's state: stop the run there.
    cfg2 = make_config(
        "run.workers=4",
        "run.steps=24",
        "outer.strategy='fgd'",
        "outer.fgd.mix1='ring'",
        "outer.fgd.mix2='none'",
        "run.eval_every=0",
    )
    res2 = simulate(cfg2, SimSection(ratio=0.5, crash_worker=2, crash_round=2, crash_rounds=2))
    for a, b in zip(res2.models[2].parameters(), res2.models[3].parameters(), strict=True):
        assert torch.equal(a, b)
    # It paid the transfer: its clock is past worker 3's.
    assert res2.world.clock[2] > res2.world.clock[3]


@pytest.mark.parametrize("policy", ["retry", "rollback"])
def test_allreduce_failure_policies(make_config, policy):
    cfg = make_config(
        "run.workers=4", "outer.strategy='diloco'", "run.eval_every=0", "run.steps=36"
    )
    clean = simulate(cfg, SimSection(ratio=1.0))
    faulty = simulate(
        cfg, SimSection(ratio=1.0, drop_prob=0.3, allreduce_policy=policy, fault_seed=1)
    )
    assert faulty.summary["faults"]["allreduce_failures"] > 0
    assert faulty.summary["util/compute"] < clean.summary["util/compute"]
    same = all(
        torch.equal(a, b)
        for a, b in zip(clean.models[0].parameters(), faulty.models[0].parameters(), strict=True)
    )
    if policy == "retry":
        assert same  # retries change the time, never the values
        # ...and every failed attempt sent its bytes too: one all-reduce per round, each moving
        # the clean run's per-round bytes once per attempt.
        rounds = cfg.run.steps // cfg.outer.H
        per_op = clean.summary["comm/bytes_sent_per_worker"] / rounds
        attempts = rounds + faulty.summary["faults"]["retries"]
        assert faulty.summary["comm/bytes_sent_per_worker"] == per_op * attempts
    else:
        assert faulty.summary["faults"]["rollbacks"] > 0 and not same


def test_injected_drops_take_the_injectors_decisions_and_renormalize_the_row():
    """fault_tolerance.inject's drop acts through the same wire as on the real runtimes: a
    message is lost exactly when Injector.dropped says so, and the row is renormalized over the
    messages taken (rows with no loss keep their weights bit for bit)."""
    n, seed = 6, 5
    world, comms = _world(n)
    injectors = [Injector(parse("drop:p=0.4"), i, 4, True, seed) for i in range(n)]
    for i, comm in enumerate(comms):
        comm.wire = FaultyWire(injectors[i], i, lambda: 0)
    xs = [torch.full((3,), float(10**j), dtype=torch.float64) for j in range(n)]

    def mix(i):
        t = [xs[i].clone()]
        comms[i].mix_(t, _ring(n))
        return t[0][0].item()

    got = _in_threads(n, mix)
    lost = 0
    for i in range(n):
        neighbours = [(i - 1) % n, (i + 1) % n]
        kept = [i] + [j for j in neighbours if not injectors[i].dropped(0, 0, j, i)]
        lost += 3 - len(kept)
        want = sum(10.0**j for j in kept) / len(kept)
        assert got[i] == pytest.approx(want, rel=1e-6), (i, kept)
    assert lost == sum(w.dropped for w in (c.wire for c in comms)) > 0


def test_simulated_corruption_is_rejected_in_its_round(make_config, tmp_path):
    """A corrupt worker in the simulator: the guard leaves it out in the round it sent garbage,
    and every worker ends finite."""
    cfg = make_config(
        "run.workers=3",
        "outer.H=4",
        "run.steps=16",
        "fault_tolerance.inject='corrupt:worker=1,round=2,value=nan'",
    )
    result = simulate(cfg, SimSection(), tmp_path / "sim")
    rejected = [r["comm/rejected"] for r in result.records]
    assert rejected == [0, 1, 0, 0], rejected
    assert all(torch.isfinite(p).all() for m in result.models for p in m.parameters())


def test_simulator_refuses_a_step_fault(make_config):
    cfg = make_config("run.workers=2", "fault_tolerance.inject='kill:worker=1,round=1'")
    with pytest.raises(ConfigError, match="fault_tolerance.inject = .*sim.crash_worker"):
        SimSection().check_against(cfg)
