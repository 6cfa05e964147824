"""`frugaltrain train` under torchrun: one run directory for all ranks, checkpoints that resume
under torchrun, and the same parameters as the locally spawned run of the same config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from frugaltrain.config import to_toml
from frugaltrain.train import checkpoint
from frugaltrain.train.launch import new_run_dir, run


def _torchrun(*args: str, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "frugaltrain", "train", *args]
    # TMPDIR: torchrun keeps its log directory there; the test's own, not the machine's /tmp.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(cwd)}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _states(run_dir: Path) -> list[dict]:
    ckpt = checkpoint.latest_complete(run_dir)
    return [torch.load(ckpt / f"worker_{r}.pt", weights_only=False) for r in range(2)]


def test_torchrun_shares_one_run_dir_resumes_and_matches_local_spawn(make_config, tmp_path):
    sets = (
        "run.workers=2",
        "run.steps=24",
        "run.checkpoint_every=1",
        "run.deterministic_comm=true",
    )
    out = tmp_path / "torchrun"
    part = make_config(*sets, "run.name=tr", "run.stop_at_round=2", f"run.out_dir={str(out)!r}")
    config_file = tmp_path / "tr.toml"
    config_file.write_text(to_toml(part))

    _torchrun("--config", str(config_file), cwd=tmp_path)
    assert [p.name for p in out.iterdir()] == ["tr"]  # not one directory per rank
    run_dir = out / "tr"
    first = checkpoint.latest_complete(run_dir)
    assert first.name == "round_000002"
    files = ["COMPLETE", "worker_0.pt", "worker_0.pt.sha256", "worker_1.pt", "worker_1.pt.sha256"]
    assert sorted(p.name for p in first.iterdir()) == files
    checkpoint.verify(first)  # both workers' files are in the manifest, with their hashes

    _torchrun("--resume", str(run_dir), cwd=tmp_path)
    assert [p.name for p in out.iterdir()] == ["tr"]
    assert checkpoint.latest_complete(run_dir).name == "round_000004"

    local = make_config(*sets, "run.name=local")
    local_dir = new_run_dir(local)
    (local_dir / "config.toml").write_text(to_toml(local))
    run(local, local_dir)
    for a, b in zip(_states(local_dir), _states(run_dir), strict=True):
        assert a["step"] == b["step"] == 24
        for key, value in a["model"].items():
            assert torch.equal(value, b["model"][key]), key
