"""Shared fixtures: a small text corpus made by the test, and a tiny config builder."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from frugaltrain.config import Config, build_config

# Tests that start processes (gloo workers, launchers, agents, netlab namespaces) and watch real
# clocks (heartbeats, deadlines): one at a time on one pytest-xdist worker, as in a serial run,
# while the in-process tests run beside them on the other.
SERIAL = (
    "tests/ft/",
    "tests/flow/test_dist_pool.py",
    "tests/flow/test_modes.py",
    "tests/flow/test_pool.py",
    "tests/data/test_data_cli.py",
    "tests/forge/test_forge_triton_interpret.py",
    "tests/sim/test_sim_equality.py",
    "tests/test_golden.py",
    "tests/test_hf_models.py",
    "tests/test_launch_torchrun.py",
    "tests/test_machines.py",
    "tests/test_mixing.py",
    "tests/test_multihost.py",
    "tests/test_observability.py",
    "tests/test_outer.py",
    "tests/test_outer_loop.py",
    "tests/test_sharding.py",
    "tests/test_checkpoint.py",
    "tests/test_diloco.py",
    "tests/test_plan.py",
    "tests/test_sparse.py",
    "tests/test_train_energy.py",
    "tests/test_train_forge.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.xdist_group("processes"))


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """~200 KB of pseudo-English in 40 files: enough documents for a split and 4 shards."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = [
        "the",
        "worker",
        "gossip",
        "round",
        "mixes",
        "outer",
        "inner",
        "step",
        "loss",
        "falls",
        "slowly",
        "while",
        "links",
        "are",
        "slow",
        "and",
        "cheap",
        "compute",
    ]
    for i in range(40):
        lines = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(400)]
        (root / f"doc_{i:02d}.txt").write_text("\n".join(lines))
    return root


@pytest.fixture
def make_config(text_dir: Path, tmp_path: Path):
    """Build a tiny, fast config over the test corpus; extra `key=value` strings override it."""
    return lambda *sets: tiny_config(text_dir, tmp_path, *sets)


@pytest.fixture(scope="session")
def config_factory(text_dir: Path):
    """Like make_config, for module-scoped fixtures: config_factory(out_dir, *sets)."""
    return lambda out_dir, *sets: tiny_config(text_dir, out_dir, *sets)


def tiny_config(text_dir: Path, tmp_path: Path, *sets: str) -> Config:
    base = [
        f"data.path={str(text_dir)!r}",
        "data.seq_len=32",
        "data.batch_size=4",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "run.steps=12",
        "run.eval_every=6",
        "run.eval_batches=2",
        "run.progress=false",
        f"run.out_dir={str(tmp_path)!r}",
        "outer.H=6",
        "optim.warmup_steps=2",
        "run.timeout_s=60",
    ]
    return build_config(Config, {}, base + list(sets))


@pytest.fixture
def finished_run(make_config) -> Path:
    """A finished one-worker run with checkpoints at rounds 1 and 2."""
    from frugaltrain.comm import LocalComm
    from frugaltrain.config import to_toml
    from frugaltrain.train.launch import new_run_dir
    from frugaltrain.train.loop import train_worker

    cfg = make_config("run.steps=12", "run.checkpoint_every=1")
    run_dir = new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    train_worker(cfg, LocalComm(), run_dir)
    return run_dir
