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
    out = tmp_path / "cmp"
    assert main(["compare", *args, "--methods", "diloco,GlobalM1", "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "simulated" in md and "| GlobalM1 | 1 |" in md
    for png in ("loss_vs_tokens", "loss_vs_time", "utilization", "bytes", "consensus", "pareto"):
        assert (out / f"{png}.png").stat().st_size > 0
    assert main(["simulate", "--set", "sim.drop_prob=2"]) == 2
    assert "sim.drop_prob = 2" in capsys.readouterr().err
