"""ShmPool semantics with threads as producers and consumers (same code path as processes)."""

import random
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from frugaltrain.flow.pool import FREE, PoolClosed, ShmPool, decode_gva, encode_gva
from frugaltrain.flow.trace import Tracer


def make_pool(P: int = 1, C: int = 1, slots: int = 4, timeout_s: float = 30.0) -> ShmPool:
    return ShmPool(
        producers=P,
        consumers=C,
        slots=slots,
        max_tokens=8,
        dim=3,
        dtype=torch.float32,
        timeout_s=timeout_s,
        ctx=mp.get_context("spawn"),
    )


def emb(sid: int, n: int = 5) -> torch.Tensor:
    return torch.full((n, 3), float(sid))


def run_threads(fns) -> list[BaseException]:
    errors: list[BaseException] = []

    def wrap(f):
        try:
            f()
        except BaseException as e:  # reported to the test
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=(f,)) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a pool call hung"
    return errors


def test_gva_roundtrip() -> None:
    for seg, off in [(0, 0), (3, 12345), (65535, (1 << 40) - 1)]:
        assert decode_gva(encode_gva(seg, off)) == (seg, off)


@pytest.mark.timeout(60)
def test_exactly_once_with_concurrent_producers() -> None:
    P, C, N = 3, 2, 30
    pool = make_pool(P, C, slots=N)
    got: dict[int, list[int]] = {c: [] for c in range(C)}
    ids = {p: list(range(p, N * P, P)) for p in range(P)}

    def producer(p):
        end, r = pool.producer(p), random.Random(p)
        for sid in ids[p]:
            time.sleep(r.random() * 0.002)
            end.put(sid, 0, sid % C, emb(sid))

    def consumer(c):
        end = pool.consumer(c)
        for sid in sorted(s for p in ids for s in ids[p] if s % C == c):
            x = end.take(sid)
            assert torch.equal(x, emb(sid))  # the bytes written are the bytes read
            end.release(sid)
            got[c].append(sid)
        assert sorted(end.delivered) == sorted(got[c])

    assert (
        run_threads(
            [lambda p=p: producer(p) for p in range(P)]
            + [lambda c=c: consumer(c) for c in range(C)]
        )
        == []
    )
    assert sorted(got[0] + got[1]) == list(range(N * P))
    assert bool((pool.states() == FREE).all())  # no leaked slots


@pytest.mark.timeout(60)
def test_backpressure_and_starvation() -> None:
    pool, S = make_pool(slots=2), 2
    ptr, ctr = Tracer("producer0"), Tracer("consumer0")

    def producer(delay):
        end = pool.producer(0, ptr)
        for sid in range(8):
            time.sleep(delay)
            end.put(sid, 0, 0, emb(sid))

    def consumer(delay):
        end = pool.consumer(0, ctr)
        for sid in range(8):
            end.take(sid)
            time.sleep(delay)
            end.release(sid)

    # Slow consumer: the producer blocks on a full pool, which never holds more than S samples.
    assert run_threads([lambda: producer(0), lambda: consumer(0.01)]) == []
    assert sum(b - a for k, a, b, _ in ptr.events if k == "backpressure") > 0
    assert max(n for _, n in ptr.occupancy) <= S
    # Slow producer: the consumer starves.
    ctr.events.clear()
    assert run_threads([lambda: producer(0.01), lambda: consumer(0)]) == []
    assert sum(b - a for k, a, b, _ in ctr.events if k == "starvation") > 0


@pytest.mark.timeout(60)
def test_gradient_write_back() -> None:
    pool = make_pool()
    prod, cons = pool.producer(0), pool.consumer(0)
    prod.put(7, 0, 0, emb(7))
    cons.take(7)
    cons.give_grad(7, -emb(7))
    sid, g = prod.wait_grad()
    assert sid == 7 and torch.equal(g, -emb(7))
    assert bool((pool.states() == FREE).all())


@pytest.mark.timeout(60)
def test_close_unblocks_waiters_and_timeouts_raise() -> None:
    pool = make_pool(timeout_s=30)
    errors: list[BaseException] = []

    def waiter():
        try:
            pool.consumer(0).take(0)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    pool.close()  # e.g. a peer failed: blocked calls must raise, not hang
    t.join(10)
    assert not t.is_alive() and isinstance(errors[0], PoolClosed)
    with pytest.raises(TimeoutError, match="run.timeout_s"):
        make_pool(timeout_s=0.1).consumer(0).take(0)


def test_illegal_transition_is_caught() -> None:
    pool = make_pool()
    pool.producer(0).put(1, 0, 0, emb(1))
    cons = pool.consumer(0)
    cons.take(1)
    cons.release(1)
    with pytest.raises(KeyError):
        cons.release(1)  # released twice: the consumer no longer holds it
    with pytest.raises(AssertionError):
        pool._move(0, 0, 3, 0)  # LEASED -> FREE on a FREE slot
