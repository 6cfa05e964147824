"""Simulated against real: a 4-process gloo run (deterministic all-reduce) and a 4-worker
simulation of the same config end with bitwise identical parameters, for DiLoCo and for Factored
Gossip DiLoCo (global Mix1 through an all-reduce, pairwise Mix2 through point-to-point, dense
and top-k with error feedback), and a coded average taken as a reduce-scatter then an
all-gather."""

from __future__ import annotations

import pytest
import torch
from helpers.gloo_pool import train_in_gloo_pool

from frugaltrain.config import to_toml
from frugaltrain.sim import SimSection, simulate
from frugaltrain.train.launch import new_run_dir

WORLD = 4
CASES = {
    "diloco": ("outer.strategy='diloco'",),
    "fgd": ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'"),
    "fgd-topk": (  # sparse Mix2: top-k selection would amplify any last-bit difference
        "outer.strategy='fgd'",
        "outer.fgd.preset='GlobalM1LocalM2'",
        "outer.codec='topk:0.1+2bit'",
    ),
    "diloco-e3m0-reduce-scatter": (  # coded chunks to their owners, coded means to all
        "outer.strategy='diloco'",
        "outer.codec='e3m0'",
        "outer.coded_average='reduce_scatter'",
    ),
    "fgd-globalm2-reduce-scatter-early": (  # the second phase starts at the round's end
        "outer.strategy='fgd'",
        "outer.fgd.preset='GlobalM2'",
        "outer.codec='int8'",
        "outer.coded_average='reduce_scatter'",
        "outer.fgd.mix2_delay=1",
    ),
    "fgd-ring": (
        "outer.strategy='fgd'",
        "outer.fgd.mix1='ring'",
        "outer.fgd.mix2='pairs'",
        "outer.fgd.mix2_params='embed+head'",
    ),
}


@pytest.fixture(scope="module")
def runs(config_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("simeq")
    jobs, sims = [], {}
    for name, sets in CASES.items():
        cfg = config_factory(
            root,
            *sets,
            f"run.workers={WORLD}",
            "run.deterministic_comm=true",
            f"run.name='{name}'",
            "run.threads=1",
        )
        run_dir = new_run_dir(cfg)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        jobs.append((name, cfg, str(run_dir)))
        sims[name] = simulate(cfg, SimSection(ratio=0.887), root / f"{name}-sim")
    return train_in_gloo_pool(jobs, WORLD), sims


@pytest.mark.parametrize("case", list(CASES))
def test_simulation_equals_real_gloo_run(runs, case):
    real, sims = runs
    for rank in range(WORLD):
        got = [p.detach() for p in sims[case].models[rank].parameters()]
        for a, b in zip(real[rank][case], got, strict=True):
            assert torch.equal(a, b), (case, rank, (a - b).abs().max())
    if case.startswith("fgd") and "globalm2" not in case:  # gossip leaves workers apart
        m0, m1 = sims[case].models[0], sims[case].models[1]
        assert any(
            not torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters(), strict=True)
        )
