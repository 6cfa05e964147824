"""Flow and sync against monolithic: identical parameters after several steps.

Every case runs float64 with one thread per process, the same plan and the same per-sample kernel
shapes in every mode, so with one producer and one consumer the arithmetic is the same sequence
of operations and we demand bitwise equality. With 2+2 workers the all-reduce re-associates the
gradient sums, so that case uses allclose at 1e-12 relative (float64 round-off of a few adds)
and SGD: AdamW would turn round-off in a gradient that is truly 0 (the key bias) into lr-sized
steps of either sign.
"""

import multiprocessing
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from frugaltrain.flow import FlowWorkerError, load_flow_config, run

BASE = [
    "run.dtype='float64'",
    "run.steps=3",
    "run.mono_threads=1",
    "run.timeout_s=60",
    "data.global_batch=8",
    "pool.slots=8",
]


def cfg(*sets: str):
    return load_flow_config(None, BASE + list(sets))


@lru_cache(maxsize=4)
def monolithic(train: bool, consumers: int = 1, optimizer: str = "adamw"):
    return run(
        cfg(
            "run.mode='monolithic'",
            f"run.train_encoder={str(train).lower()}",
            f"run.consumers={consumers}",
            f"run.producers={consumers}",
            f"run.optimizer='{optimizer}'",
        )
    )


def assert_same(a: dict, b: dict, exact: bool) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-14, msg=k)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "train,backend,mode",
    [
        (False, "shm", "flow"),
        (False, "dist", "flow"),
        (True, "shm", "flow"),
        (True, "dist", "flow"),
        (True, "shm", "sync"),
        (False, "dist", "sync"),
    ],
)
def test_matches_monolithic(train: bool, backend: str, mode: str) -> None:
    ref = monolithic(train)
    got = run(
        cfg(
            f"run.mode='{mode}'",
            f"run.backend='{backend}'",
            f"run.train_encoder={str(train).lower()}",
        )
    )
    assert got.losses == ref.losses
    assert_same(got.cons_state, ref.cons_state, exact=True)
    assert_same(got.enc_state, ref.enc_state, exact=True)
    if not train:  # a frozen encoder never moves
        assert_same(got.enc_state, monolithic(False).enc_state, exact=True)


@pytest.mark.timeout(150)
def test_data_parallel_modules_match_and_deliver_exactly_once() -> None:
    """Two encoder replicas and two backbone replicas over the torch.distributed pool."""
    ref = monolithic(True, consumers=2, optimizer="sgd")
    got = run(
        cfg(
            "run.mode='flow'",
            "run.backend='dist'",
            "run.train_encoder=true",
            "run.producers=2",
            "run.consumers=2",
            "run.optimizer='sgd'",
        )
    )
    assert_same(got.cons_state, ref.cons_state, exact=False)
    assert_same(got.enc_state, ref.enc_state, exact=False)
    delivered = sorted(s for ids in got.delivered.values() for s in ids)
    assert delivered == list(range(3 * 8))  # every sample of 3 batches, once
    assert multiprocessing.active_children() == []  # clean shutdown: every worker joined


@pytest.mark.timeout(120)
def test_staleness_changes_the_result_but_still_learns() -> None:
    """Staleness 1 is not equivalent by design; it must still reduce the loss."""
    c = [
        "run.mode='flow'",
        "run.train_encoder=true",
        "run.staleness=1",
        "run.steps=4",
        "run.lr=3e-3",
    ]
    got = run(cfg(*c))
    assert got.losses[-1] < got.losses[0]
    ref = run(
        cfg(*[x for x in c if "staleness" not in x and "mode" not in x], "run.mode='monolithic'")
    )
    assert not all(torch.equal(got.enc_state[k], ref.enc_state[k]) for k in ref.enc_state)


@pytest.fixture
def kept_logs(tmp_path, monkeypatch) -> Path:
    """A failed run keeps its workers' logs in a temporary directory for its error to name:
    here under the test's own tmp_path, so failure tests leave nothing behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,role", [("shm", "producer0"), ("dist", "consumer0")])
def test_worker_failure_surfaces(backend: str, role: str, kept_logs: Path) -> None:
    with pytest.raises(FlowWorkerError, match="injected fault"):
        run(
            cfg("run.mode='flow'", f"run.backend='{backend}'", "run.train_encoder=true"),
            fault=(role, 1),
        )
    (logs,) = kept_logs.glob("frugaltrain-flow-*")  # kept, one log per worker
    assert sorted(f.name for f in logs.iterdir()) == [f"worker{r}.log" for r in range(2)]


# The transformers modules: a ViT tower and a Llama backbone on generated scenes, small enough to
# build in a second. The packed micro-batches hold samples of several image sides.
TRANSFORMERS = [
    "data.source='shapes'",
    "data.patch=16",
    "data.global_batch=6",
    "run.steps=2",
    "model.encoder='vit'",
    "model.backbone='llama'",
    "model.enc_dim=32",
    "model.enc_layers=1",
    "model.lm_dim=32",
    "model.lm_layers=1",
    "model.lm_kv_heads=2",
    "sched.capacity=256",
    "run.train_encoder=true",
]


@pytest.mark.timeout(120)
def test_transformers_modules_flow_matches_monolithic() -> None:
    """Trainable ViT + Llama through the pool: bitwise the lockstep run (float64, one thread)."""
    ref = run(cfg("run.mode='monolithic'", *TRANSFORMERS))
    got = run(cfg("run.mode='flow'", *TRANSFORMERS))
    assert got.losses == ref.losses
    assert_same(got.cons_state, ref.cons_state, exact=True)
    assert_same(got.enc_state, ref.enc_state, exact=True)
    assert "model.embeddings.cls_token" in ref.enc_state  # the transformers ViT


@pytest.mark.timeout(120)
def test_monolithic_data_parallel_matches_one_process() -> None:
    """The fair baseline: 2 whole-model replicas, each on its rank's micro-batches, gradients
    all-reduced, equal one process running both ranks' micro-batches (SGD: see the module
    docstring; 1e-12 relative: the all-reduce re-associates the sums)."""
    ref = monolithic(True, consumers=2, optimizer="sgd")  # the plan deals to 2 ranks
    got = run(cfg("run.mode='monolithic_dp'", "run.train_encoder=true", "run.optimizer='sgd'"))
    assert [t["role"] for t in got.traces] == ["replica0", "replica1"]
    assert got.losses == pytest.approx(ref.losses, rel=1e-12)
    assert_same(got.cons_state, ref.cons_state, exact=False)
    assert_same(got.enc_state, ref.enc_state, exact=False)


class _Unimportable(tuple):
    """A fault hook the launcher can pickle but a spawned worker cannot rebuild, as with a
    class defined in an interactive session: its module exists only in this process."""


_Unimportable.__module__ = "module_only_in_the_launcher"


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_rebuild_the_run_reports_its_traceback(
    monkeypatch, kept_logs: Path
) -> None:
    import sys
    import types

    monkeypatch.setitem(sys.modules, _Unimportable.__module__, types.ModuleType("m"))
    sys.modules[_Unimportable.__module__]._Unimportable = _Unimportable
    fault = _Unimportable(("producer0", 99))
    with pytest.raises(FlowWorkerError, match="No module named 'module_only_in_the_launcher'"):
        run(cfg("run.mode='flow'"), fault=fault)


@pytest.mark.timeout(60)
def test_a_worker_that_crashes_leaves_its_stack_in_the_error(kept_logs: Path) -> None:
    """A crash in native code raises no Python exception: the launcher still reports the
    signal and the Python stack the worker wrote to its log."""
    with pytest.raises(FlowWorkerError, match="(?s)killed by SIGABRT.*Fatal Python error.*_inject"):
        run(cfg("run.mode='flow'"), fault=("consumer0", 0, "crash"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
def test_flow_on_one_gpu_matches_monolithic_on_it() -> None:
    """Encoder and backbone as two processes on one GPU, the pool in pinned host memory."""
    sets = ["run.device='cuda'", "run.train_encoder=true"]
    ref = run(cfg("run.mode='monolithic'", *sets))
    got = run(cfg("run.mode='flow'", *sets))
    assert got.losses == ref.losses
    assert_same(got.cons_state, ref.cons_state, exact=True)
    assert_same(got.enc_state, ref.enc_state, exact=True)
