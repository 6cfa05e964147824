"""The rendezvous state kept as JSON (comm/rendezvous.py): what the store holds is JSON
and never a pickle, a full state round-trips exactly, compare-and-set behaves like torch's c10d
backend, and a pickle an attacker writes into the store is refused without running it."""

from __future__ import annotations

import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from frugaltrain.cluster import keys, rendezvous_json
from frugaltrain.cluster.store import StoreServer
from frugaltrain.comm.rendezvous import JsonBackend, StateError, from_json, to_json


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    yield dist.PrefixStore("rdzv", server)


def _state(round_idx: int = 3) -> _RendezvousState:
    t0 = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    a, b, c, d = (_NodeDesc(f"worker{i}", 1000 + i, i) for i in range(4))
    s = _RendezvousState()
    s.round, s.complete, s.closed = round_idx, True, False
    s.deadline = t0 + timedelta(seconds=2)
    s.participants = {b: 0, a: 1}
    s.wait_list = {c}
    s.redundancy_list = {d}
    s.last_heartbeats = {a: t0, b: t0 - timedelta(microseconds=1), c: t0, d: t0}
    return s


def _same(a: _RendezvousState, b: _RendezvousState) -> bool:
    return vars(a) == vars(b) and list(a.participants) == list(b.participants)


def test_the_store_holds_json_and_no_pickle(store):
    backend = JsonBackend(store, "run")
    assert backend.get_state() is None  # no state yet
    bits, token, ok = backend.set_state(pickle.dumps(_state()))
    assert ok
    raw = store.get("frugaltrain.rendezvous.json.run")
    assert raw == token
    doc = json.loads(raw)
    assert doc["round"] == 3 and len(doc["participants"]) == 2
    assert raw.isascii() and not raw.startswith(b"\x80")  # no pickle protocol 2+ header
    with pytest.raises(pickle.UnpicklingError):  # and no pickle of protocol 0 or 1 either
        pickle.loads(raw)


def test_a_full_state_round_trips_exactly(store):
    state = _state()
    assert _same(from_json(to_json(pickle.dumps(state))), state)
    backend = JsonBackend(store, "run")
    backend.set_state(pickle.dumps(state))
    bits, _ = backend.get_state()
    assert _same(pickle.loads(bits), state)
    naive = _state()
    naive.deadline, naive.complete = datetime(2024, 5, 6, 7, 8, 9), False
    assert _same(from_json(to_json(pickle.dumps(naive))), naive)


def test_compare_and_set_conflicts_like_the_c10d_backend(store):
    first, second = JsonBackend(store, "run"), JsonBackend(store, "run")
    _, token1, ok = first.set_state(pickle.dumps(_state(1)))
    assert ok
    # No token: written only while there is no state yet; else the current one comes back.
    bits, token, ok = second.set_state(pickle.dumps(_state(9)))
    assert not ok and token == token1 and pickle.loads(bits).round == 1
    _, token2, ok = first.set_state(pickle.dumps(_state(2)), token1)
    assert ok and token2 != token1
    bits, token, ok = second.set_state(pickle.dumps(_state(7)), token1)  # a stale token
    assert not ok and token == token2 and pickle.loads(bits).round == 2
    bits, token, ok = second.set_state(pickle.dumps(_state(7)), token2)
    assert ok and pickle.loads(bits).round == 7
    assert pickle.loads(first.get_state()[0]).round == 7
    bits, token, ok = second.set_state(pickle.dumps(_state(8)), "not bytes")
    assert not ok and pickle.loads(bits).round == 7


class _Bomb:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "ran"))


def test_a_pickle_written_into_the_store_is_refused(store, tmp_path):
    backend = JsonBackend(store, "run")
    store.set("frugaltrain.rendezvous.json.run", pickle.dumps(_Bomb(tmp_path / "pwned")))
    with pytest.raises(RendezvousStateError, match="rendezvous state: not JSON"):
        backend.get_state()
    assert not (tmp_path / "pwned").exists()
    bad = {
        "fields": b'{"round": 1}',
        "type": json.dumps({**json.loads(to_json(pickle.dumps(_state()))), "round": "1"}),
        "node": json.dumps(
            {**json.loads(to_json(pickle.dumps(_state()))), "wait_list": [["x", -1, 0]]}
        ),
        "huge": b" " * (8 << 20),
    }
    for name, raw in bad.items():
        store.set("frugaltrain.rendezvous.json.run", raw)
        with pytest.raises(StateError) as err:
            backend.get_state()
        assert "\n" not in str(err.value) and isinstance(err.value, ValueError), name


def test_the_handler_pickle_is_read_with_only_the_state_classes(tmp_path):
    with pytest.raises(StateError, match="refusing to build"):
        to_json(pickle.dumps(_Bomb(tmp_path / "pwned")))
    assert not (tmp_path / "pwned").exists()


def _run_state(server: dist.Store) -> JsonBackend:
    """The state the workers' handlers keep in the run's store (comm/rendezvous.py)."""
    return JsonBackend(dist.PrefixStore(keys.RENDEZVOUS, server), rendezvous_json.RUN_ID)


def test_expire_dates_back_only_the_chosen_nodes():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    backend = _run_state(server)
    assert rendezvous_json.expire(server, "worker1") == 0  # no state yet: nothing to mark
    backend.set_state(pickle.dumps(_state()))
    before = pickle.loads(backend.get_state()[0])
    assert rendezvous_json.expire(server, "worker1", pid=1001) == 1
    after = pickle.loads(backend.get_state()[0])
    gone = _NodeDesc("worker1", 1001, 1)
    assert after.last_heartbeats[gone] == datetime(1970, 1, 1, tzinfo=timezone.utc)
    assert {n: t for n, t in after.last_heartbeats.items() if n != gone} == {
        n: t for n, t in before.last_heartbeats.items() if n != gone
    }
    assert after.participants == before.participants  # the handler drops it, not expire
    assert rendezvous_json.expire(server, "worker7") == 0
    assert rendezvous_json.expire(server, "worker1", pid=1002) == 0  # another process


def test_refresh_dates_every_heartbeat_and_nothing_else():
    """A store restored from its journal: every node's heartbeat dated to the restart, so the
    first handler to sync does not drop the others, whose keep-alives could not reach it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    backend = _run_state(server)
    backend.set_state(pickle.dumps(_state()))
    before = pickle.loads(backend.get_state()[0])
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert rendezvous_json.refresh(server, now=now) == 4
    after = pickle.loads(backend.get_state()[0])
    assert after.last_heartbeats == dict.fromkeys(before.last_heartbeats, now)
    after.last_heartbeats = before.last_heartbeats
    assert _same(after, before)


def test_close_sets_only_closed():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    backend = _run_state(server)
    rendezvous_json.close(server)  # nobody joined yet: a closed empty state
    assert vars(pickle.loads(backend.get_state()[0])) == vars(_closed(_RendezvousState()))
    server.set(f"{keys.RENDEZVOUS}/{rendezvous_json.state_key(rendezvous_json.RUN_ID)}", "null")
    backend.set_state(pickle.dumps(_state()))
    rendezvous_json.close(server)
    assert _same(pickle.loads(backend.get_state()[0]), _closed(_state()))
    token = backend.get_state()[1]
    rendezvous_json.close(server)  # closed already: nothing written
    assert backend.get_state()[1] == token


def _closed(state: _RendezvousState) -> _RendezvousState:
    state.closed = True
    return state


def test_an_expired_member_is_dropped_at_the_next_sync():
    """Two members form a round on the coordinator's store (cluster/store.py, no torch); the
    second is then known to be gone. Marked with rendezvous_json.expire, the first drops it at
    its next sync; unmarked, its keep-alive would keep it in until its keep-alive expires (30 s
    here, so a slow machine cannot flake the test). Closed, a process asking to join is told
    so."""
    from frugaltrain.comm import rendezvous

    server = StoreServer().listen()
    made = [
        rendezvous._handler("127.0.0.1", server.port, 2, f"worker{w}", 10.0, 30.0) for w in (0, 1)
    ]
    handlers = [h for h, _, _ in made]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: h.next_rendezvous(), handlers))
    handlers[1]._stop_heartbeats()  # it is gone: no more keep-alives
    holder = handlers[0]._state_holder
    holder._cache_duration = 0  # every sync reads the store (the handler caches it for 1 s)

    def names() -> set[str]:
        holder.sync()
        return {n.addr for n in holder.state.participants}

    assert names() == {"worker0", "worker1"}  # fresh keep-alives: nobody dropped
    assert rendezvous_json.expire(server, "worker1", pid=os.getpid() + 1) == 0  # another process
    assert names() == {"worker0", "worker1"}
    assert rendezvous_json.expire(server, "worker1") == 1
    assert names() == {"worker0"}
    rendezvous_json.close(server)
    late, _, _ = rendezvous._handler("127.0.0.1", server.port, 2, "worker1", 10.0, 30.0)
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()
    for h in [*handlers, late]:
        h.shutdown()
    server.close()
