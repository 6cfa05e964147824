"""`frugaltrain energy` verbs end to end on small inputs, and the frozen CLI surface."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from frugaltrain.energy import cli
from frugaltrain.energy.records import derive, normalize


def _synthetic_records(path: Path, n: int = 80) -> None:
    rng = np.random.default_rng(0)
    with path.open("w") as fh:
        for i in range(n):
            rec = normalize({
                "n_layer": int(rng.choice([2, 4, 6])), "n_embd": int(rng.choice([128, 256, 512])),
                "n_head": int(rng.choice([2, 4, 8])), "seq_len": int(rng.choice([64, 128])),
                "batch_size": 8, "vocab_size": 256, "steps": 20, "hardware": "sim",
                "seconds": 0.0, "group": f"g{i % 16}",
            })  # fmt: skip
            f = derive(rec)
            t = f["F"] / 5e12 + f["Q"] / 2e11 + 0.002 * rec["steps"]
            rec.update(seconds=t * float(np.exp(rng.normal(0, 0.03))))
            rec.update(energy_j=70.0 * rec["seconds"] * float(np.exp(rng.normal(0, 0.02))))
            rec.update(energy_label="measured (simulated for the test)")
            fh.write(json.dumps(rec) + "\n")


def test_fit_then_predict(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, fit, png = tmp_path / "recs.jsonl", tmp_path / "fit.json", tmp_path / "pv.png"
    _synthetic_records(data)
    assert cli.main(["fit", str(data), "--out", str(fit), "--plot", str(png), "--splits", "2"]) == 0
    out = capsys.readouterr().out
    assert "energy roofline, predicted T (pre-run)" in out and png.stat().st_size > 0
    assert json.loads(fit.read_text())["energy"]["named"]["sim"]["P_static_W"] > 0
    cfg = tmp_path / "run.toml"
    cfg.write_text("[run]\nsteps = 20\n[model]\nn_layer = 4\nn_embd = 256\nn_head = 4\n"
                   "[data]\nseq_len = 128\nbatch_size = 8\n")  # fmt: skip
    assert cli.main(["predict", "--model", str(fit), "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "(predicted, pre-run)" in out and "at 95%" in out


def test_fit_refuses_estimates(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "est.jsonl"
    _synthetic_records(data, n=20)
    lines = [json.loads(x) for x in data.read_text().splitlines()]
    for r in lines:
        r["energy_label"] = "estimated (CPU time x 10 W/core)"
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert cli.main(["fit", str(data)]) == 2
    assert "not a fitting target" in capsys.readouterr().err


def test_measure_labels_and_appends(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "m.jsonl"
    rc = cli.main(["measure", "--append", str(out), "--tag", "n_layer=2", "--",
                   sys.executable, "-c", "pass"])  # fmt: skip
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["n_layer"] == 2 and rec["energy_label"].split(" ")[0] in ("estimated", "unavailable")
    assert "energy_J" in capsys.readouterr().out
    assert cli.main(["measure", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_cli_surface_is_frozen() -> None:
    """Adding or renaming an option is a deliberate change: update this list with it."""
    parser = cli._parser()
    sub = next(a for a in parser._actions if a.dest == "verb")
    surface = {
        verb: sorted(opt for a in p._actions for opt in a.option_strings)
        for verb, p in sub.choices.items()
    }
    assert surface == {
        "measure": sorted(["--append", "--device", "--tag", "--watts-per-core", "-h", "--help"]),
        "fit": sorted(["--allow-estimates", "--out", "--plot", "--splits", "-h", "--help"]),
        "predict": sorted(["--arch", "--config", "--hardware", "--model", "-h", "--help"]),
    }
