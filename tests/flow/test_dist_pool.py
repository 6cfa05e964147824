"""DistPool semantics with real gloo processes on localhost.

Each test starts 2-3 worker processes, forked from a forkserver that has torch preloaded. The
TCPStore listens on port 0 (the OS picks a free port), every blocking call has a timeout, and
the launcher terminates only the processes it started, by handle.

What DistPool documents, and so what is tested here:

- exactly once, in order: each (producer, consumer) pair is an ordered stream; every sample
  arrives once with the bytes that were written;
- capacity: a producer has `slots` slots; a slot is free again once its isend has completed,
  and with gloo a send completes only after the consumer has posted the matching receive. So
  while the consumer does not read, at most `slots` puts return and the next one blocks, and
  after `timeout_s` it raises instead of blocking for ever;
- failure: there is no shared `closed` flag (unlike ShmPool). A producer that fails reaches
  the consumer as a gloo error: at once if its process exits (the connection closes), or after
  `timeout_s` if the failed process lingers.
"""

from __future__ import annotations

import os
import queue
import random
import time
import traceback
from datetime import timedelta

import pytest
import torch

from frugaltrain.flow.pool import DistPool
from frugaltrain.flow.trace import Tracer

D, T = 3, 8  # embedding width and slot length (tokens)
STORE_TIMEOUT_S = 20.0  # rendezvous and control-plane waits
DEADLINE_S = 25.0  # the launcher gives up on a silent worker after this


def emb(sid: int) -> torch.Tensor:
    """A payload that identifies its sample: 1..4 rows, value = sample id."""
    return torch.full((1 + sid % 4, D), float(sid))


def pool_kw(world: int, producers: int, slots: int, timeout_s: float) -> dict:
    return dict(
        producers=producers,
        consumers=world - producers,
        slots=slots,
        max_tokens=T,
        dim=D,
        dtype=torch.float32,
        timeout_s=timeout_s,
        train_encoder=False,
    )


def _entry(role, rank, world, port, kw, args, linger_s, q) -> None:
    """Child process: join the gloo group, run `role`, report ("ok"|"error", rank, payload)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        td = timedelta(seconds=STORE_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=td)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=td)
        out = role(rank, DistPool(**kw), store, *args)
        q.put(("ok", rank, out))
        dist.destroy_process_group()
    except BaseException as e:
        err = {"type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()}
        q.put(("error", rank, err))
        time.sleep(linger_s)  # a failed worker that does not go away (stuck teardown)


def launch(roles: list[tuple], kw: dict, linger_s: dict | None = None) -> dict:
    """Run roles[rank] = (fn, args) in one worker process each; rank -> (status, payload)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # forkserver, not spawn: the server imports torch once per test session and forks each
    # worker from it, so a worker starts in well under a second even on a loaded 2-core machine
    # (spawn re-imports torch in every worker: 10-25 s per test here under load).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "frugaltrain.flow.pool"])
    td = timedelta(seconds=STORE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=td)
    q = ctx.Queue()
    linger_s = linger_s or {}
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, len(roles), store.port, kw, args, linger_s.get(r, 0.0), q),
            daemon=True,
        )
        for r, (fn, args) in enumerate(roles)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(results) < len(procs):
            left = deadline - time.monotonic()
            assert left > 0, f"hang: ranks {sorted(set(range(len(procs))) - set(results))} silent"
            try:
                status, rank, payload = q.get(timeout=min(0.2, left))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode not in (None, 0):
                        results[r] = ("died", p.exitcode)
                continue
            results[rank] = (status, payload)
        for r, p in enumerate(procs):  # a clean worker exits by itself; a failed one may not
            p.join(5 if results[r][0] == "ok" else 0)
    finally:
        for p in procs:  # only what this call started, by handle
            if p.is_alive():
                p.terminate()
                p.join(5)
        del store
    return results


def ok(results: dict, rank: int):
    status, payload = results[rank]
    assert status == "ok", (rank, status, payload)
    return payload


# ---------------------------------------------------------------- roles (run in the children)


def _producer(rank, pool, store, ids, seed):
    tr, r = Tracer(f"producer{rank}"), random.Random(seed)
    end = pool.producer(rank, tr)
    for sid in ids:
        time.sleep(r.random() * 0.003)
        end.put(sid, sid // 8, 0, emb(sid))
    end.flush()
    return {"max_in_flight": max(n for _, n in tr.occupancy), "pending": len(end.pending)}


def _consumer(rank, pool, store, order, producers):
    end = pool.consumer(0, lambda sid: sid % producers)
    for sid in order:
        x = end.take(sid)
        assert torch.equal(x, emb(sid)), sid  # the bytes written are the bytes read
        end.release(sid)
    return {"delivered": list(end.delivered), "held": len(end.held)}


def _producer_signals(rank, pool, store, n, slots):
    """Put n samples; tell the consumer when the first `slots` puts have returned."""
    tr = Tracer("producer0")
    end = pool.producer(rank, tr)
    returned = []
    for sid in range(n):
        end.put(sid, 0, 0, emb(sid))
        returned.append(time.time())
        if sid == slots - 1:
            store.set("filled", str(time.time()))
    end.flush()
    backpressure = sum(b - a for k, a, b, _ in tr.events if k == "backpressure")
    return {
        "returned": returned,
        "backpressure_s": backpressure,
        "max_in_flight": max(n for _, n in tr.occupancy),
    }


def _consumer_late(rank, pool, store, n, hold_s):
    """Read nothing until the producer has filled its slots, then hold_s more, then read all."""
    store.wait(["filled"], timedelta(seconds=STORE_TIMEOUT_S))
    time.sleep(hold_s)
    t_read = time.time()
    end = pool.consumer(0, lambda sid: 0)
    for sid in range(n):
        assert torch.equal(end.take(sid), emb(sid))
        end.release(sid)
    return {"t_read": t_read}


def _producer_overfills(rank, pool, store, slots):
    end = pool.producer(rank)
    for sid in range(slots):
        end.put(sid, 0, 0, emb(sid))
    t = time.time()
    try:
        end.put(slots, 0, 0, emb(slots))  # the consumer never reads: no slot frees up
    except RuntimeError as e:
        return {"raised_after_s": time.time() - t, "msg": str(e)}
    finally:
        store.set("producer_done", "1")
    return {"raised_after_s": None}


def _consumer_never_reads(rank, pool, store):
    store.wait(["producer_done"], timedelta(seconds=STORE_TIMEOUT_S))
    return {}


def _producer_fails(rank, pool, store, good):
    end = pool.producer(rank)
    for sid in range(good):
        end.put(sid, 0, 0, emb(sid))
    end.flush()  # the consumer has these
    raise RuntimeError("injected producer failure")


def _consumer_of_failing(rank, pool, store, n):
    end = pool.consumer(0, lambda sid: 0)
    got = []
    t = time.time()
    try:
        for sid in range(n):
            end.take(sid)
            end.release(sid)
            got.append(sid)
            t = time.time()
    except BaseException as e:  # report what the consumer saw, and when
        raise RuntimeError(
            f"consumer got {got}, then {type(e).__name__} after {time.time() - t:.2f}s: {e}"
        ) from e
    return {"got": got}


# ---------------------------------------------------------------------------- tests


@pytest.mark.timeout(30)
def test_exactly_once_in_order_with_two_producers() -> None:
    """2 producers, 1 consumer, 2 slots each, random delays, a consume order that interleaves
    the producers and reads out of send order within a batch: every sample exactly once, with
    its bytes, and each producer's samples in its send order."""
    P, S, N = 2, 2, 24
    ids = {p: list(range(p, N, P)) for p in range(P)}
    r = random.Random(0)
    order = []
    for k in range(N // 8):  # batches of 8, shuffled inside the batch
        batch = list(range(8 * k, 8 * k + 8))
        r.shuffle(batch)
        order += batch
    res = launch(
        [(_producer, (ids[0], 0)), (_producer, (ids[1], 1)), (_consumer, (order, P))],
        pool_kw(3, P, S, timeout_s=15),
    )
    got = ok(res, 2)
    delivered = got["delivered"]
    assert sorted(delivered) == list(range(N))  # exactly once: nothing lost, nothing twice
    assert got["held"] == 0
    for p in range(P):
        assert [s for s in delivered if s % P == p] == ids[p]  # each stream is in send order
        out = ok(res, p)
        assert out["pending"] == 0 and 1 <= out["max_in_flight"] <= S


@pytest.mark.timeout(30)
def test_backpressure_put_blocks_until_the_consumer_reads() -> None:
    """While the consumer reads nothing, exactly `slots` puts return; put slots+1 returns only
    after the consumer has started reading."""
    S, N, HOLD = 2, 5, 1.0
    res = launch(
        [(_producer_signals, (N, S)), (_consumer_late, (N, HOLD))],
        pool_kw(2, 1, S, timeout_s=15),
    )
    prod, cons = ok(res, 0), ok(res, 1)
    t_read = cons["t_read"]
    assert all(t < t_read for t in prod["returned"][:S])
    assert prod["returned"][S] >= t_read, (prod["returned"], t_read)  # it had to wait
    assert prod["backpressure_s"] >= 0.5 * HOLD  # traced as producer backpressure
    assert prod["max_in_flight"] == S  # never more than `slots` un-received samples


@pytest.mark.timeout(30)
def test_full_pool_times_out_instead_of_hanging() -> None:
    S, TIMEOUT = 2, 1.5
    res = launch(
        [(_producer_overfills, (S,)), (_consumer_never_reads, ())],
        pool_kw(2, 1, S, timeout_s=TIMEOUT),
    )
    out = ok(res, 0)
    assert out["raised_after_s"] is not None, "put on a full pool returned"
    assert 0.8 * TIMEOUT <= out["raised_after_s"] < TIMEOUT + 8, out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("linger", [False, True], ids=["producer-exits", "producer-lingers"])
def test_producer_failure_reaches_the_consumer(linger: bool) -> None:
    """The producer delivers 2 samples and raises. The consumer, waiting for the third, gets an
    error: at once when the failed process exits, after the pool timeout when it lingers."""
    GOOD, N = 2, 6
    timeout = 3.0 if linger else 15.0
    res = launch(
        [(_producer_fails, (GOOD,)), (_consumer_of_failing, (N,))],
        pool_kw(2, 1, 4, timeout_s=timeout),
        linger_s={0: 12.0} if linger else None,
    )
    status, prod = res[0]
    assert status == "error" and "injected producer failure" in prod["msg"]
    status, cons = res[1]
    assert status == "error", (status, cons)  # an error, not a hang and not a silent success
    assert f"consumer got {list(range(GOOD))}, then" in cons["msg"], cons["msg"]
    waited = float(cons["msg"].split(" after ")[1].split("s:")[0])
    if linger:
        assert 0.8 * timeout <= waited < timeout + 8, cons["msg"]
    else:
        assert waited < 0.8 * timeout, cons["msg"]  # the closed connection, not the timeout
