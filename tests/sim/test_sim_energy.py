"""Every simulated run records the simulated cluster's estimated energy (with its label) and the
analytic FLOPs; the estimate equals its closed form on the simulated clock."""

from __future__ import annotations

import pytest

from frugaltrain.comm.base import ring_allreduce_bytes
from frugaltrain.config import ConfigError
from frugaltrain.energy import transformer_train_flops
from frugaltrain.sim import SimSection, simulate
from frugaltrain.sim.config import build_sim

PARTS = ("energy/compute_j", "energy/idle_j", "energy/comm_j")


def test_energy_is_the_closed_form_of_the_simulated_clock(make_config):
    # DiLoCo at r = 0.5 (tiny_config: H = 6, 12 steps, step_s = 1): every worker computes 12 s
    # and blocks r * H * step_s per round (research note b.6, pinned in test_sim_clock.py), and
    # sends one ring all-reduce of the fp32 parameters per round.
    M, r, H, steps, rounds = 4, 0.5, 6, 12, 2
    cfg = make_config(f"run.workers={M}", "run.eval_every=0", "outer.strategy='diloco'")
    sim = SimSection(ratio=r, compute_w=300.0, idle_w=50.0, link_j_per_byte=1e-6)
    res = simulate(cfg, sim)
    s, recs = res.summary, res.records

    assert s["energy/compute_j"] == pytest.approx(M * steps * 1.0 * 300.0, rel=1e-9)
    assert s["energy/idle_j"] == pytest.approx(M * rounds * r * H * 1.0 * 50.0, rel=1e-9)
    sent = rounds * M * ring_allreduce_bytes(4 * s["num_params"], M)
    assert s["energy/comm_j"] == pytest.approx(sent * 1e-6, rel=1e-12) and sent > 0
    assert s["energy/joules"] == pytest.approx(sum(s[k] for k in PARTS), rel=1e-12)
    label = s["energy/label"]
    assert label.startswith("estimated (simulated clock:")
    assert "300 W" in label and "50 W" in label and "1e-06 J/B" in label
    assert "placeholder" not in label  # the per-byte figure was set, not the default

    # Per round, from the round's own simulated seconds (means over the live workers).
    for rec in recs:
        n = rec["live_workers"]
        assert rec["energy/compute_j"] == pytest.approx(rec["time/compute_s"] * n * 300.0)
        assert rec["energy/idle_j"] == pytest.approx(rec["time/blocking_s"] * n * 50.0)
        assert rec["energy/label"] == label
    for k in (*PARTS, "energy/joules", "flops/train"):
        assert s[k] == pytest.approx(sum(rec[k] for rec in recs), rel=1e-12)

    m, d = cfg.model, cfg.data
    tokens = steps * d.batch_size * d.seq_len * M  # every worker ran every step
    flops = transformer_train_flops(m.n_layer, m.n_embd, m.n_head, d.seq_len, m.vocab_size, tokens)
    assert s["flops/train"] == pytest.approx(flops, rel=1e-12) and flops > 0
    assert s["flops/label"] == "estimated (analytic)"
    # What simulating cost this host is reported apart, with its own label.
    assert s["energy/host_label"].split(" ", 1)[0].rstrip(":") in ("measured", "estimated")


def test_one_worker_sends_nothing_and_pays_no_comm_energy(make_config):
    res = simulate(make_config("run.workers=1", "run.eval_every=0"), SimSection())
    s = res.summary
    assert s["comm/bytes_sent_per_worker"] == 0
    assert s["energy/comm_j"] == 0.0 and s["energy/idle_j"] == 0.0
    assert s["energy/joules"] == s["energy/compute_j"] == 12 * 1.0 * 700.0  # the default 700 W
    assert "J/B placeholder" in s["energy/label"]  # the default per-byte figure is no measurement


def test_negative_power_is_refused(make_config):
    with pytest.raises(ConfigError, match="sim.idle_w"):
        build_sim({}, ["idle_w=-1"], make_config())
