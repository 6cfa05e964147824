"""cluster/gateway.py's StoreTunnel with hold_s: torch's TCPStore clients ride out a coordinator
restart (its gateway and its store, brought back from the store's journal on the same port): a
request issued while it is away is held and answered once it is back, a wait goes on across the
restart, and past hold_s the client gets an error, as it does at once without a hold."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.tokens import TOKEN

from frugaltrain.cluster.auth import Channel
from frugaltrain.cluster.gateway import Gateway, StoreTunnel
from frugaltrain.cluster.store import StoreServer


def _no_control(request: dict, channel: Channel) -> None:
    raise AssertionError(f"only store connections expected, got {request}")


class _LosesAReply(StoreServer):
    """Once `armed`, the next reply is not sent: the store has applied and journaled its query,
    then goes away as a coordinator killed before the reply left (its port closes, every
    connection ends), and says so through `gone`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.gone = threading.Event()

    def _reply(self, c, data: bytes) -> None:
        if not self.armed:
            return super()._reply(c, data)
        self.armed = False
        self._listener.shutdown(socket.SHUT_RDWR)  # closed alone, it would accept once more
        self._listener.close()
        for client in self._clients:
            client.sock.shutdown(socket.SHUT_RDWR)
        self.gone.set()


class _Coordinator:
    """What the coordinator hosts: a store with a journal behind a gateway; `before(store)` runs
    before the gateway opens."""

    def __init__(
        self,
        journal: Path,
        port: int = 0,
        store: type[StoreServer] = StoreServer,
        before: Callable[[StoreServer], None] | None = None,
    ) -> None:
        self.lines: list[str] = []
        self.store = store(self.lines.append, journal=journal).listen()
        if before is not None:
            before(self.store)
        store_addr = ("127.0.0.1", self.store.port)
        self.gateway = Gateway("127.0.0.1", port, TOKEN, store_addr, _no_control, self.lines.append)
        self.port = self.gateway.start().port

    def kill(self) -> None:
        """As a killed coordinator process: every connection to it ends."""
        self.gateway.close()
        self.store.close()


def _client(tunnel: StoreTunnel, timeout_s: float = 30.0) -> dist.TCPStore:
    t = timedelta(seconds=timeout_s)
    return dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=t)


def _until(ready, timeout_s: float = 10.0) -> None:
    """Wait for `ready()` (an upper bound only, so that a bug fails instead of hanging)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.01)


@pytest.fixture
def run(tmp_path):
    """A coordinator and a list of every one started on its port (the last one is current)."""
    started = [_Coordinator(tmp_path / "store.journal")]
    yield started
    started[-1].kill()  # again if a test killed it: no harm


def _tunnel(run: list[_Coordinator], hold_s: float, lines: list[str]) -> StoreTunnel:
    return StoreTunnel("127.0.0.1", run[0].port, TOKEN, log=lines.append, hold_s=hold_s).start()


@pytest.fixture
def lossy(tmp_path):
    """As `run`, its first store a _LosesAReply."""
    started = [_Coordinator(tmp_path / "store.journal", store=_LosesAReply)]
    yield started
    started[-1].kill()


def _restart(run: list[_Coordinator], tmp_path: Path, before=None) -> None:
    run.append(_Coordinator(tmp_path / "store.journal", run[0].port, before=before))


def _session(store: dist.Store) -> list:
    """Every query kind, with the answers a caller sees."""
    store.set("a", "1")
    out = [store.get("a"), store.add("n", 3), store.add("n", -1), store.check(["a", "x"])]
    out += [store.compare_set("k", "", "v"), store.compare_set("k", "x", "w")]
    store.multi_set(["m1", "m2"], ["x", b"\x00\xff"])
    store.append("a", "2")
    out += [store.multi_get(["m1", "m2", "a"]), store.num_keys()]
    out += [store.delete_key("m1"), store.delete_key("m1"), store.check(["m2"])]
    with pytest.raises(dist.DistStoreError):  # times out: the client cancels its wait
        store.wait(["never"], timedelta(milliseconds=100))
    big = bytes(range(256)) * 4096
    store.set("big", big)
    out.append(store.get("big") == big)
    return out


def test_a_held_tunnel_answers_as_the_store_does(run, tmp_path):
    lines: list[str] = []
    tunnel = _tunnel(run, hold_s=10, lines=lines)
    plain = StoreServer().listen()
    try:
        direct = dist.TCPStore("127.0.0.1", plain.port, is_master=False)
        assert _session(_client(tunnel)) == _session(direct)
        sets = _client(tunnel)
        for i in range(40):  # no replies: the relay's own PING after each 16 shows them applied
            sets.set(f"s{i}", str(i))
        _until(lambda: tunnel.held == 40 - 2 * 16)
        assert sets.get("s39") == b"39" and tunnel.held == 0  # a reply: all before it applied
        waiter, writer = _client(tunnel), _client(tunnel)
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(waiter.wait, ["late"], timedelta(seconds=30))
            _until(lambda: tunnel.held == 1)  # the WAIT, unanswered
            writer.set("late", "x")
            assert done.result(timeout=30) is None
    finally:
        tunnel.close()
        plain.close()
    assert lines == [] and tunnel.away_since is None


def test_requests_issued_while_away_are_answered_once_it_is_back(run, tmp_path):
    lines: list[str] = []
    tunnel = _tunnel(run, hold_s=10, lines=lines)
    try:
        c = _client(tunnel)
        c.set("a", "1")
        assert c.add("n", 1) == 1
        run[-1].kill()
        _until(lambda: tunnel.away_since is not None)
        comeback = threading.Timer(1.0, _restart, (run, tmp_path))
        comeback.start()
        assert c.get("a") == b"1"  # from the journal
        assert c.add("n", 2) == 3  # sent while away: applied once
        c.set("b", "x")
        assert c.get("b") == b"x"
        comeback.join()
        assert len(run) == 2 and run[-1].store.get("n") == b"3"
        assert tunnel.away_since is None and tunnel.held == 0
    finally:
        tunnel.close()
    where = f"the coordinator at 127.0.0.1:{run[0].port}"
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"store tunnel: lost {where}; holding ")
    assert lines[1].startswith(f"store tunnel: {where} is back after ")


def test_a_wait_goes_on_across_a_restart(run, tmp_path):
    tunnel = _tunnel(run, hold_s=10, lines=[])
    try:
        waiter = _client(tunnel)
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(waiter.wait, ["k"], timedelta(seconds=30))
            _until(lambda: tunnel.held == 1)  # the WAIT is out at the store
            run[-1].kill()
            _until(lambda: tunnel.away_since is not None)
            assert tunnel.held == 1
            _restart(run, tmp_path)
            _until(lambda: tunnel.away_since is None)
            assert not done.done()  # k is still missing on the new store: the wait was replayed
            _client(tunnel).set("k", "v")
            assert done.result(timeout=30) is None
    finally:
        tunnel.close()


@pytest.mark.parametrize(
    ("hold_s", "said"),
    [(1, "did not come back within 1 s"), (0, None)],  # past hold_s; no hold: today's splice
)
def test_the_client_errors_once_the_tunnel_stops_holding(run, hold_s, said):
    """The client's own timeout is 30 s: the error comes from the tunnel closing its
    connection, at once without a hold."""
    lines: list[str] = []
    tunnel = _tunnel(run, hold_s=hold_s, lines=lines)
    try:
        c = _client(tunnel)
        c.set("a", "1")
        assert c.get("a") == b"1"
        run[-1].kill()
        with pytest.raises(dist.DistError):
            c.get("a")
    finally:
        tunnel.close()
    if said:
        assert any(said in line for line in lines), lines
    else:
        assert not any("holding" in line for line in lines), lines


def _lose_a_reply(run: list[_Coordinator], tmp_path: Path, call, before=None):
    """`call()` on a pool thread while the store loses its next reply and is restarted from its
    journal (`before(store)` first): what `call` returns."""
    lossy = run[-1].store
    lossy.armed = True
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(call)
        assert lossy.gone.wait(10)
        run[-1].kill()
        _restart(run, tmp_path, before)
        return done.result(timeout=30)


@pytest.mark.parametrize(
    ("call", "reply", "key", "after"),
    [  # the call whose reply is lost (applied, journaled); what it returns; the key after (None:
        # gone)
        (lambda c: c.add("n", 2), 3, "n", b"3"),
        (lambda c: (c.append("a", "x"), c.get("a"))[1], b"1x", "a", b"1x"),  # the get's reply
        (lambda c: c.delete_key("d"), True, "d", None),
    ],
    ids=["add", "append", "delete_key"],
)
def test_a_mutation_whose_reply_was_lost_is_applied_once(lossy, tmp_path, call, reply, key, after):
    tunnel = _tunnel(lossy, hold_s=10, lines=[])
    try:
        c = _client(tunnel)
        c.set("a", "1")
        c.set("d", "x")
        assert c.add("n", 1) == 1  # answered: all three applied
        assert _lose_a_reply(lossy, tmp_path, lambda: call(c)) == reply
        assert tunnel.held == 0
    finally:
        tunnel.close()
    store = lossy[-1].store
    assert (store.get(key) if store.check([key]) else None) == after


def test_a_replayed_set_does_not_undo_a_later_write(lossy, tmp_path):
    """c's SET is applied and journaled, but the reply to its next query is lost; another
    client sets the key on the restarted store before c's relay replays both."""

    def other(store: StoreServer) -> None:
        direct = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        direct.set("k", "theirs")

    tunnel = _tunnel(lossy, hold_s=10, lines=[])
    try:
        c = _client(tunnel)

        def set_then_get():
            c.set("k", "mine")
            return c.get("k")

        assert _lose_a_reply(lossy, tmp_path, set_then_get, before=other) == b"theirs"
    finally:
        tunnel.close()
    assert lossy[-1].store.get("k") == b"theirs"


def test_a_request_the_store_refuses_is_not_replayed_forever(run):
    """The store closes a connection on an ADD past int64, so each replay of it is closed too:
    after _FRUITLESS connections in a row with it held and nothing answered, the tunnel closes
    the client's connection (as a store without a hold would at once), and the key keeps its
    value."""
    lines: list[str] = []
    tunnel = _tunnel(run, hold_s=30, lines=lines)
    try:
        c = _client(tunnel)
        c.add("n", 2**63 - 2)
        with pytest.raises(dist.DistError):
            c.add("n", 5)
        assert _client(tunnel).add("n", 0) == 2**63 - 2
    finally:
        tunnel.close()
    gave_up = [x for x in lines if "without answering the client's next request" in x]
    assert len(gave_up) == 1 and "closed 3 connections in a row" in gave_up[0], lines
    refused = [x for x in run[-1].lines if "past int64" in x]
    assert len(refused) == 1 + 3, run[-1].lines  # sent, then replayed on three connections
