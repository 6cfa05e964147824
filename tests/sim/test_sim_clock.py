"""The virtual clock against the closed forms of research note b.6: DiLoCo U = 1 / (1 + r),
GlobalM1 U = 1 / max(1, r), DDP U = 1 / (1 + H r); Mix1 and Mix2 serialize on the link."""

from __future__ import annotations

import pytest

from frugaltrain.sim import SimSection, simulate


def _util(make_config, r: float, *sets: str, **sim) -> float:
    cfg = make_config("run.workers=4", "run.eval_every=0", *sets)
    return simulate(cfg, SimSection(ratio=r, **sim)).summary["util/compute"]


@pytest.mark.parametrize("r", [0.25, 0.887, 1.774, 4.0])
def test_diloco_and_globalm1_utilization(make_config, r):
    assert _util(make_config, r, "outer.strategy='diloco'") == pytest.approx(1 / (1 + r), rel=1e-9)
    fgd = _util(make_config, r, "outer.strategy='fgd'", "outer.fgd.preset='GlobalM1'")
    assert fgd == pytest.approx(1 / max(1.0, r), rel=1e-9)


def test_paper_points(make_config):
    diloco = [_util(make_config, r, "outer.strategy='diloco'") for r in (0.887, 1.774)]
    fgd = [
        _util(make_config, r, "outer.strategy='fgd'", "outer.fgd.preset='GlobalM1'")
        for r in (0.887, 1.774)
    ]
    assert [round(100 * u) for u in diloco] == [53, 36]
    assert [round(100 * u) for u in fgd] == [100, 56]


def test_ddp_pays_every_step(make_config):
    H = 6  # tiny_config's outer.H
    u = _util(make_config, 0.5, "outer.strategy='ddp'")
    assert u == pytest.approx(1 / (1 + H * 0.5), rel=1e-9)


def test_mix2_waits_behind_mix1_on_the_link(make_config):
    # GlobalM1 + full global Mix2 at r = 0.5: Mix1 takes 0.5 H c and is done when the round's
    # compute ends; Mix2 (same bytes) then blocks 0.5 H c: U = 1 / 1.5. At r = 2, Mix1 is still
    # on the link when Mix2 is posted, so Mix2 waits for it: blocked 2 H c + 2 H c - H c.
    sets = ("outer.strategy='fgd'", "outer.fgd.mix1='complete'", "outer.fgd.mix2='complete'")
    assert _util(make_config, 0.5, *sets) == pytest.approx(1 / 1.5, rel=1e-9)
    assert _util(make_config, 2.0, *sets) == pytest.approx(1 / 4.0, rel=1e-9)
