"""`frugaltrain simulate` and `frugaltrain compare` end to end on a tiny config."""

from __future__ import annotations

import json

from frugaltrain.cli import main


def test_simulate_and_compare(text_dir, tmp_path, capsys):
    sets = [
        f"data.path={str(text_dir)!r}",
        "data.seq_len=16",
        "data.batch_size=2",
        "model.n_layer=1",
        "model.n_embd=16",
        "model.n_head=2",
        "run.steps=8",
        "outer.H=4",
        "run.eval_every=4",
        "run.eval_batches=1",
        "run.workers=2",
        "sim.ratio=2.0",
    ]
    args = [x for s in sets for x in ("--set", s)]
    assert main(["simulate", *args, "--out", str(tmp_path / "one")]) == 0
    rec = json.loads((tmp_path / "one" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["clock"] == "simulated" and rec["util/compute"] == 1 / 3
    assert rec["energy/label"].startswith("estimated (simulated clock:")
    assert rec["energy/comm_j"] > 0 and rec["flops/label"] == "estimated (analytic)"
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["energy/joules"] > 0 and summary["flops/train"] > 0
    printed = capsys.readouterr().out
    # `report` re-renders a simulated run too, and keeps the simulator's own summary.json.
    before = (tmp_path / "one" / "summary.json").read_text()
    assert main(["report", str(tmp_path / "one")]) == 0
    assert (tmp_path / "one" / "summary.json").read_text() == before
    assert "compute utilization (simulated)" in capsys.readouterr().out
    assert f"energy (simulated cluster) {summary['energy/joules'] / 1e3:.4g} kJ" in printed
    assert summary["energy/label"] in printed and "training FLOPs" in printed
    out = tmp_path / "cmp"
    assert main(["compare", *args, "--methods", "diloco,GlobalM1", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "simulated" in md and "| GlobalM1 | 1 |" in md
    assert "| energy (est., sim. kJ) | comm share of energy (%) |" in md
    assert f"`{summary['energy/label']}`: an estimate on the simulated clock" in md
    row = next(line for line in md.splitlines() if line.startswith("| diloco | 1 |"))
    # The diloco run has the same clock and bytes as "one", so the same energy.
    assert row.split(" | ")[7] == f"{summary['energy/joules'] / 1e3:.4g}"
    for png in ("loss_vs_tokens", "loss_vs_time", "utilization", "bytes", "consensus", "pareto"):
        assert (out / f"{png}.png").stat().st_size > 0
    assert main(["simulate", "--set", "sim.drop_prob=2"]) == 2
    assert "sim.drop_prob = 2" in capsys.readouterr().err
    sets = ["--set", "sim.drop_prob=0.1", "--set", "outer.coded_average='reduce_scatter'"]
    assert main(["simulate", *sets]) == 2
    assert "sim.drop_prob = 0.1: the simulator stands a worker's own value in" in (
        capsys.readouterr().err
    )
