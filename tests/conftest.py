"""Shared fixtures: a small text corpus made by the test, and a tiny config builder."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _pytest.nodes import Node

from frugaltrain.config import Config, build_config

# Tests that watch real clocks (heartbeats, deadlines, leases) across the processes they start:
# the tests of one group run one after another on one pytest-xdist worker, so two of them never
# share the cores; the other worker runs everything else beside them.
GROUPS = {
    "ft": (
        "tests/comm/ft/test_ft_faults.py",
        "tests/comm/ft/test_ft_strategies.py",
        "tests/comm/ft/test_ft_sharded.py",
        "tests/train/test_orphan.py",
    ),
    "machines": (
        "tests/netlab/test_machines_netlab.py",
        "tests/cluster/test_machines.py",
        "tests/train/test_multihost.py",
    ),
}

# Module-scoped fixtures that train reference jobs (20-60 s each): the tests that use one run on
# one worker, so its jobs run once instead of once on each worker.
SHARED_JOBS = {
    "tests/train/test_sharding.py": ("runs",),
    "tests/outer/test_outer.py": ("gloo_runs",),
    "tests/test_outer_loop.py": ("gloo_runs",),
    "tests/models/test_hf_models.py": ("runs",),
    "tests/metrics/test_observability.py": ("real_run", "sim_run"),
    "tests/sim/test_sim_equality.py": ("runs",),
    "tests/comm/ft/test_ft_poisoning.py": ("clean",),
}


def pytest_configure(config) -> None:
    # pytest-xdist moves a test to its group by writing "@group" into the item's _nodeid; a
    # pytest whose items keep their id elsewhere ignores that, and the groups run on both workers.
    if config.getoption("dist", "no") == "loadgroup" and "_nodeid" not in Node.__slots__:
        raise pytest.UsageError(
            "this pytest ignores pytest-xdist's groups (tests/conftest.py GROUPS); install the "
            "test extra's pytest with `make test`"
        )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook of this name reads the marks
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        for group, paths in GROUPS.items():
            if item.nodeid.startswith(paths):
                item.add_marker(pytest.mark.xdist_group(group))
        path = item.nodeid.split("::")[0]
        if set(SHARED_JOBS.get(path, ())) & _fixtures_asked_for(item):
            item.add_marker(pytest.mark.xdist_group(path))


def _fixtures_asked_for(item) -> set[str]:
    """The fixtures a test takes as arguments or names in its parameters (getfixturevalue)."""
    params = getattr(item, "callspec", None)
    named = {v for v in params.params.values() if isinstance(v, str)} if params else set()
    return set(item.fixturenames) | named


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
