"""Flow and sync against monolithic: identical parameters after several steps.

Every case runs float64 with one thread per process, the same plan and the same per-sample kernel
shapes in every mode, so with one producer and one consumer the arithmetic is the same sequence
of operations and we demand bitwise equality. With 2+2 workers the all-reduce re-associates the
gradient sums, so that case uses allclose at 1e-12 relative (float64 round-off of a few adds)
and SGD: AdamW would turn round-off in a gradient that is truly 0 (the key bias) into lr-sized
steps of either sign.
"""

import multiprocessing
from functools import lru_cache

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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,role", [("shm", "producer0"), ("dist", "consumer0")])
def test_worker_failure_surfaces(backend: str, role: str) -> None:
    with pytest.raises(FlowWorkerError, match="injected fault"):
        run(
            cfg("run.mode='flow'", f"run.backend='{backend}'", "run.train_encoder=true"),
            fault=(role, 1),
        )
