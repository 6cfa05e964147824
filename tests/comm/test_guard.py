"""Bad updates contained (comm/guard.py): the verdict rule against a brute-force reading of it,
and the guard inside real exchanges (simulated workers on threads): a rejected contribution is
left out of every average and mix, its sender takes its peers' values and is told, and a clean
exchange is bitwise the same as with no guard at all."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from frugaltrain.comm.guard import Guard, guarded_weights, verdict
from frugaltrain.sim import SimComm, SimSection, SimWorld
from frugaltrain.sim.network import Network


def test_verdict_rejects_non_finite_and_outliers_and_nothing_else():
    rng = np.random.default_rng(0)
    for _ in range(200):
        norms = rng.uniform(1, 3, rng.integers(2, 9))
        bad = rng.random(len(norms)) < 0.3
        if bad.sum() * 2 >= len(norms):  # a majority of bad workers moves the median: no claim
            continue
        kinds = rng.choice([np.nan, np.inf, 1e30], size=len(norms))
        norms = np.where(bad, kinds, norms)
        v = verdict(norms, Guard("reject", 10.0))
        assert list(np.flatnonzero(~v.accepted)) == list(np.flatnonzero(bad))
        finite = norms[np.isfinite(norms)]
        assert v.median == pytest.approx(np.median(finite))


def test_clip_scales_outliers_to_the_limit_and_off_rejects_only_non_finite():
    norms = np.array([1.0, 2.0, 3.0, 100.0, math.nan])
    clip = verdict(norms, Guard("clip", 10.0))
    assert clip.rejected == [4] and clip.clipped == [3]
    assert clip.scale[3] * 100.0 == pytest.approx(10.0 * np.median([1, 2, 3, 100]))
    off = verdict(norms, Guard("off", 10.0))
    assert off.rejected == [4] and off.clipped == [] and (off.scale == 1).all()


def test_guarded_weights_drop_columns_and_keep_rows_stochastic():
    w = np.full((4, 4), 0.25)
    v = verdict(np.array([1.0, 1.0, np.nan, 1.0]), Guard())
    g = guarded_weights(w, v)
    assert (g[:, 2] == 0).all() and np.allclose(g.sum(1), 1.0)
    assert np.allclose(g[2], [1 / 3, 1 / 3, 0, 1 / 3])  # the bad worker takes its peers' mean


GUARD = Guard()  # reject, factor 10: the defaults of run.guard and run.guard_factor


def _run(n: int, fn, guard: Guard | None = GUARD) -> tuple[list, list[SimComm]]:
    world = SimWorld(n, Network([1e9] * n, 0.0), SimSection())
    comms = [SimComm(world, i, guard) for i in range(n)]
    out = [None] * n
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, fn(comms[i], i))) for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, comms


@pytest.mark.parametrize("value", [math.nan, math.inf, 1e30])
def test_a_poisoned_all_reduce_is_the_mean_of_the_others(value):
    def average(comm, i):
        t = [torch.full((5,), value if i == 2 else float(i))]
        comm.all_reduce_mean_(t)
        return t[0]

    got, comms = _run(4, average)
    for t in got:  # every worker, the bad one included, holds the mean of 0, 1 and 3
        assert torch.equal(t, torch.full((5,), 4 / 3))
    told = [c.take_rejection() for c in comms]
    assert told == [False, False, True, False]
    events = comms[0].drain_rejections()
    assert [e["workers"] for e in events] == [[2]] and events[0]["kind"] == "rejected"


def test_a_poisoned_gossip_row_is_renormalized():
    w = np.full((4, 4), 0.0)  # pairs (0, 1) and (2, 3)
    for a, b in ((0, 1), (2, 3)):
        w[a, a] = w[a, b] = w[b, a] = w[b, b] = 0.5

    def mix(comm, i):
        t = [torch.full((3,), 1e30 if i == 3 else float(i + 1))]
        comm.mix_(t, w)
        return t[0][0].item()

    got, _ = _run(4, mix)
    assert got == [1.5, 1.5, 3.0, 3.0]  # worker 3 takes worker 2's value, 2 keeps its own


def test_a_clean_exchange_is_bitwise_the_same_with_and_without_the_guard():
    def exchange(comm, i):
        g = torch.Generator().manual_seed(i)
        t = [torch.randn(17, generator=g), torch.randn(3, 4, generator=g)]
        comm.all_reduce_mean_(t)
        comm.mix_(t, np.full((3, 3), 1 / 3))
        return t

    guarded, _ = _run(3, exchange)
    plain, _ = _run(3, exchange, guard=None)
    for a, b in zip(guarded, plain, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
