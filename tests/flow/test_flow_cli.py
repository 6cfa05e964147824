"""`frugaltrain flow ...`: the command surface and one cheap end-to-end train."""

import json

from frugaltrain.flow.cli import _parser, main


def test_cli_surface_is_frozen() -> None:
    sub = next(a for a in _parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == ["plan", "train"]


def test_unknown_key_is_a_usage_error(capsys) -> None:
    assert main(["train", "--set", "run.bogus=1"]) == 2
    assert "unknown key run.bogus" in capsys.readouterr().err


def test_train_writes_metrics_and_timeline(tmp_path) -> None:
    rc = main(
        [
            "train",
            "--set",
            "run.mode='monolithic'",
            "--set",
            "run.steps=2",
            "--set",
            "data.global_batch=4",
            "--set",
            f"run.out_dir='{tmp_path}'",
        ]
    )
    assert rc == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["measured.samples_per_s"] > 0 and len(m["measured.loss"]) == 2
    assert (tmp_path / "timeline.png").stat().st_size > 0
