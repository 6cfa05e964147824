"""Checkpoints you can trust: every file's SHA-256 in the manifest, verified on resume with a
fallback to the newest intact checkpoint; writes that fail half way leave nothing behind; and
the rule for --config with --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from frugaltrain.comm import LocalComm
from frugaltrain.config import ConfigError, to_toml
from frugaltrain.train import checkpoint
from frugaltrain.train.launch import new_run_dir, prepare
from frugaltrain.train.loop import train_worker


@pytest.fixture
def run_dir(make_config) -> Path:
    """A finished one-worker run with a checkpoint at rounds 1 and 2."""
    cfg = make_config("run.steps=12", "run.checkpoint_every=1")
    path = new_run_dir(cfg)
    (path / "config.toml").write_text(to_toml(cfg))
    train_worker(cfg, LocalComm(), path)
    return path


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_holds_the_hash_of_every_file(run_dir):
    latest = checkpoint.latest_complete(run_dir)
    meta = json.loads((latest / "COMPLETE").read_text())
    assert list(meta["files"]) == ["worker_0.pt"]
    import hashlib

    assert (
        meta["files"]["worker_0.pt"]
        == hashlib.sha256((latest / "worker_0.pt").read_bytes()).hexdigest()
    )
    checkpoint.verify(latest)


def test_a_flipped_bit_falls_back_to_the_newest_intact_checkpoint(run_dir):
    rounds = checkpoint.completed(run_dir)
    assert [p.name for p in rounds] == ["round_000001", "round_000002"]
    _flip_a_bit(rounds[-1] / "worker_0.pt")
    with pytest.raises(ConfigError, match="worker_0.pt does not match its SHA-256"):
        checkpoint.verify(rounds[-1])
    with pytest.warns(UserWarning, match="falling back to the previous checkpoint"):
        _, _, ckpt = prepare(None, [], str(run_dir))
    assert ckpt == rounds[0]
    _flip_a_bit(rounds[0] / "worker_0.pt")
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="no intact checkpoint"):
        prepare(None, [], str(run_dir))


def test_a_write_that_fails_half_way_leaves_nothing_behind(run_dir, monkeypatch):
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    def full_disk(state, f):
        f.write(b"x" * 1000)  # part of the file is out, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_worker(run_dir, 3, 0, {"step": 0})
    assert not list(run_dir.rglob("*.tmp"))
    assert not (checkpoint.round_dir(run_dir, 3) / "worker_0.pt").exists()
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # earlier checkpoints untouched


def test_config_with_resume_may_change_only_how_long_and_how_it_reports(
    run_dir, make_config, tmp_path
):
    same = tmp_path / "same.toml"
    same.write_text(to_toml(make_config("run.steps=24", "run.checkpoint_every=1")))
    cfg, _, _ = prepare(str(same), [], str(run_dir))
    assert cfg.run.steps == 24  # an allowed change is taken
    other = tmp_path / "other.toml"
    other.write_text(to_toml(make_config("run.steps=12", "outer.lr=0.5", "model.n_layer=2")))
    with pytest.raises(ConfigError, match=r"differs from .* in model.n_layer, outer.lr"):
        prepare(str(other), [], str(run_dir))


def test_a_foreign_state_is_refused_by_name(run_dir, make_config):
    latest = checkpoint.latest_complete(run_dir)
    torch.save({"model": {}}, latest / "worker_0.pt")
    with pytest.raises(ConfigError, match="lacks inner, outer, rng, round, schedule, step"):
        checkpoint.load_worker(latest, 0, make_config("run.steps=12", "run.checkpoint_every=1"))
