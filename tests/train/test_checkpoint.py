"""Checkpoints you can trust: every file's SHA-256 in the manifest, verified on resume with a
fallback to the newest intact checkpoint; writes that fail half way leave nothing behind; and
the rule for --config with --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from frugaltrain.config import ConfigError, to_toml
from frugaltrain.train import checkpoint
from frugaltrain.train.launch import prepare


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_holds_the_hash_of_every_file(finished_run):
    latest = checkpoint.latest_complete(finished_run)
    meta = json.loads((latest / "COMPLETE").read_text())
    assert list(meta["files"]) == ["worker_0.pt"]
    import hashlib

    assert (
        meta["files"]["worker_0.pt"]
        == hashlib.sha256((latest / "worker_0.pt").read_bytes()).hexdigest()
    )
    checkpoint.verify(latest)


def test_a_flipped_bit_falls_back_to_the_newest_intact_checkpoint(finished_run):
    rounds = checkpoint.completed(finished_run)
    assert [p.name for p in rounds] == ["round_000001", "round_000002"]
    _flip_a_bit(rounds[-1] / "worker_0.pt")
    with pytest.raises(ConfigError, match="worker_0.pt does not match its SHA-256"):
        checkpoint.verify(rounds[-1])
    with pytest.warns(UserWarning, match="falling back to the previous checkpoint"):
        _, _, ckpt = prepare(None, [], str(finished_run))
    assert ckpt == rounds[0]
    _flip_a_bit(rounds[0] / "worker_0.pt")
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="no intact checkpoint"):
        prepare(None, [], str(finished_run))


def test_a_write_that_fails_half_way_leaves_nothing_behind(finished_run, monkeypatch):
    before = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}

    def full_disk(state, f):
        f.write(b"x" * 1000)  # part of the file is out, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_worker(finished_run, 3, 0, {"step": 0})
    assert not list(finished_run.rglob("*.tmp"))
    assert not (checkpoint.round_dir(finished_run, 3) / "worker_0.pt").exists()
    after = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    assert after == before  # earlier checkpoints untouched


def test_config_with_resume_may_change_only_how_long_and_how_it_reports(
    finished_run, make_config, tmp_path
):
    same = tmp_path / "same.toml"
    same.write_text(to_toml(make_config("run.steps=24", "run.checkpoint_every=1")))
    cfg, _, _ = prepare(str(same), [], str(finished_run))
    assert cfg.run.steps == 24  # an allowed change is taken
    other = tmp_path / "other.toml"
    other.write_text(to_toml(make_config("run.steps=12", "outer.lr=0.5", "model.n_layer=2")))
    with pytest.raises(ConfigError, match=r"differs from .* in model.n_layer, outer.lr"):
        prepare(str(other), [], str(finished_run))


def test_a_foreign_state_is_refused_by_name(finished_run, make_config):
    latest = checkpoint.latest_complete(finished_run)
    torch.save({"model": {}}, latest / "worker_0.pt")
    with pytest.raises(ConfigError, match="lacks inner, outer, rng, round, schedule, step"):
        checkpoint.load_worker(latest, 0, make_config("run.steps=12", "run.checkpoint_every=1"))
