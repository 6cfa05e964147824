"""FORGE as the inner optimizer of simulated workers: the same updates as AdamW."""

from __future__ import annotations

from frugaltrain.sim import SimSection, simulate
from frugaltrain.sim.config import SimConfig


def test_forge_adamw_workers_match_adamw_workers(make_config):
    # 4 workers on 2 compute threads, so fused backwards of different workers run concurrently;
    # grad_clip 0.5 makes FORGE take its exact two-pass clipping path.
    sets = ("run.workers=4", "run.steps=12", "outer.strategy='fgd'", "outer.fgd.mix1='ring'")
    sets += ("run.eval_every=0", "optim.grad_clip=0.5")
    ref = simulate(make_config(*sets), SimSection(ratio=0.5, compute_threads=2))
    forge_cfg = make_config(*sets, "optim.name='forge-adamw'")
    SimConfig(**vars(forge_cfg), sim=SimSection(ratio=0.5))  # `simulate CONFIG` accepts it too
    got = simulate(forge_cfg, SimSection(ratio=0.5))
    for a, b in zip(ref.models, got.models, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            # fp32 FORGE equals torch AdamW to ~1e-6 relative per step (tests/forge); 12 steps
            # and 2 outer rounds of mixing keep the drift well under 1e-4.
            scale = p.abs().max().item()
            assert (p - q).abs().max().item() <= 1e-4 * scale, name
    assert abs(got.summary["loss/val"] - ref.summary["loss/val"]) <= 1e-4 * ref.summary["loss/val"]
