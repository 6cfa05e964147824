"""Every training run records energy with its provenance label and the analytic FLOPs."""

from __future__ import annotations

import pytest

from frugaltrain.comm import LocalComm
from frugaltrain.config import to_toml
from frugaltrain.energy import transformer_train_flops
from frugaltrain.metrics.log import read_metrics
from frugaltrain.metrics.report import format_summary, report, summarize
from frugaltrain.train.launch import new_run_dir
from frugaltrain.train.loop import train_worker


def test_one_worker_run_records_energy_and_flops(make_config):
    cfg = make_config()
    run_dir = new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    train_worker(cfg, LocalComm(), run_dir)
    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert len(rounds) == cfg.run.steps // cfg.outer.H
    for r in rounds:
        # This machine has no readable RAPL, so the host meter estimates from CPU time; a meter
        # that cannot read gives "unavailable: ..." and no joules, never 0.
        assert r["energy/label"].split(" ", 1)[0].rstrip(":") in ("measured", "estimated")
        assert r["energy/joules"] > 0
        assert r["flops/label"].startswith("estimated")

    summary = report(run_dir, quiet=True)
    m, d = cfg.model, cfg.data
    tokens = cfg.run.steps * d.batch_size * d.seq_len
    flops = transformer_train_flops(m.n_layer, m.n_embd, m.n_head, d.seq_len, m.vocab_size, tokens)
    assert summary["flops/train"] == pytest.approx(flops, rel=1e-12) and flops > 0
    assert summary["energy/label"] == rounds[0]["energy/label"]
    assert summary["energy/joules"] == pytest.approx(sum(r["energy/joules"] for r in rounds))
    table = format_summary(summary)
    assert f"energy J ({summary['energy/label']})" in table
    assert "training FLOPs (estimated (analytic))" in table


def test_unavailable_energy_is_never_summed_as_zero():
    base = {"kind": "round", "round": 1, "step": 6, "tokens": 1, "loss/train": 1.0}
    base |= {"time/compute_s": 1.0, "time/blocking_s": 0.0}
    base |= {"comm/bytes_sent": 0, "comm/bytes_received": 0, "flops/train": 2.0}
    rounds = [
        base | {"energy/label": "estimated (CPU time x 10 W/core)", "energy/joules": 5.0},
        base | {"round": 2, "energy/label": "unavailable: no counter"},
    ]
    summary = summarize(rounds)
    assert summary["energy/label"] == "unavailable: no counter"
    assert "energy/joules" not in summary
    row = next(line for line in format_summary(summary).splitlines() if "energy J" in line)
    assert row.split() == ["energy", "J", "(unavailable:", "no", "counter)", "-"]
    assert summary["flops/train"] == 4.0
