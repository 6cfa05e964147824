"""cluster/store.py: torch's TCPStore client gets from our server exactly what torch's own server
answers, waits end when the last key is written, a client that breaks the protocol is cut off
while the others go on, and gloo forms a group over it."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from frugaltrain.cluster.store import (
    INT64_MAX,
    INT64_MIN,
    JOURNAL_HEADER,
    MAGIC,
    MAX_KEY,
    PrefixView,
    ProtocolError,
    Query,
    StoreServer,
)


def _client(port: int, timeout_s: float = 10.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))


@pytest.fixture
def server():
    s = StoreServer().listen()
    yield s
    s.close()


def _session(store: dist.Store) -> list:
    """Every query the server serves, with the answers a caller sees."""
    out = []
    store.set("a", "1")
    out.append(store.get("a"))
    out += [store.add("n", 3), store.add("n", -5), store.get("n")]
    out += [store.check(["a"]), store.check(["a", "nothing"])]
    out += [
        store.compare_set("k", "", "v"),  # missing, nothing expected: set
        store.compare_set("k", "x", "w"),  # present, not as expected: kept
        store.compare_set("k", "v", "w"),  # as expected: set
        store.compare_set("gone", "e", "d"),  # missing, something expected: that comes back
        store.check(["gone"]),
    ]
    store.multi_set(["m1", "m2"], ["x", b"\x00\xff"])
    out.append(store.multi_get(["m1", "m2", "a"]))
    store.append("a", "23")
    store.append("fresh", "z")
    out += [store.get("a"), store.get("fresh")]
    out += [store.num_keys(), store.delete_key("m1"), store.delete_key("m1"), store.num_keys()]
    big = bytes(range(256)) * 4096  # 1 MiB
    store.set("big", big)
    out.append(store.get("big") == big)
    return out


def test_answers_equal_torchs_own_server(server):
    theirs = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    assert _session(_client(server.port)) == _session(_client(theirs.port))


def test_in_process_calls_see_what_clients_wrote(server):
    c = _client(server.port)
    c.set("x/y", "1")
    assert c.get("x/y") == b"1"  # answered: the server has applied the set (which has no reply)
    assert server.get("x/y") == b"1" and server.check(["x/y"]) and not server.check(["y"])
    view = PrefixView("x", server)
    assert view.get("y") == b"1"
    view.set("z", b"2")
    assert dist.PrefixStore("x", c).get("z") == b"2"
    assert view.compare_set("z", "2", "3") == b"3" and c.get("x/z") == b"3"
    assert view.add("count", 4) == 4 and c.add("x/count", 1) == 5
    with pytest.raises(KeyError):
        server.get("missing")


def test_a_wait_ends_when_its_last_key_is_written(server):
    waiter, writer = _client(server.port), _client(server.port)
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(waiter.wait, ["p", "q"], timedelta(seconds=30))
        writer.set("p", "1")
        assert not done.done()  # q is still missing
        server.set("q", "2")  # a write in process wakes a client's wait too
        assert done.result(timeout=30) is None
    with pytest.raises(dist.DistStoreError):  # timed out: the client cancels its wait
        waiter.wait(["never"], timedelta(milliseconds=200))
    assert waiter.get("p") == b"1"  # and the connection still answers in order


def _raw(port: int, data: bytes) -> bytes:
    """Send `data` on a fresh connection; what comes back before the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return b"".join(iter(lambda: s.recv(4096), b""))


def test_a_client_that_breaks_the_protocol_is_cut_off(server):
    good = _client(server.port)
    hello = bytes([Query.VALIDATE]) + struct.pack("<I", MAGIC)
    get_x = bytes([Query.GET]) + struct.pack("<Q", 1) + b"x"
    assert _raw(server.port, bytes([Query.VALIDATE]) + struct.pack("<I", 1) + get_x) == b""
    long_key = bytes([Query.SET]) + struct.pack("<Q", MAX_KEY + 1)
    assert _raw(server.port, hello + long_key) == b""
    assert _raw(server.port, hello + bytes([Query.BARRIER])) == b""
    assert _raw(server.port, hello + bytes([Query.PING]) + b"abcd") == b"abcd"
    assert [d.split(",")[0] for d in server.dropped] == [
        "the connection did not open with TCPStore's magic number",
        f"a {MAX_KEY + 1}-byte key or value",
        "query BARRIER is not served by this store",
    ]
    good.set("still", "here")
    assert good.get("still") == b"here"


def test_gloo_forms_a_group_over_it(server):
    def member(rank: int) -> torch.Tensor:
        store = dist.PrefixStore("group", _client(server.port))
        pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
        t = torch.tensor([float(rank + 1)])
        pg.allreduce([t]).wait()
        return t

    results: list[torch.Tensor] = [torch.zeros(1)] * 2

    def run(r: int) -> None:
        results[r] = member(r)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [t.item() for t in results] == [3.0, 3.0]


# ---- the journal: a restarted store has what the old one had
def _mutate(server: StoreServer) -> None:
    """Every kind of mutation, over the network and in process."""
    c = _client(server.port)
    c.set("a", "1")
    c.add("n", 5)
    c.add("n", -2)
    c.compare_set("k", "", "v")
    c.compare_set("k", "v", b"\x00\xff")
    c.compare_set("k", "nope", "x")  # not applied
    c.set("gone", "1")
    c.delete_key("gone")
    c.append("a", "23")
    c.multi_set(["m1", "m2"], ["x", "y"])
    server.set("p", b"\n\x00")
    server.add("n", 10)
    server.compare_set("p", b"\n\x00", "q")
    assert c.get("a") == b"123"  # answered: every query before it has been applied


def test_a_journal_restores_the_contents(tmp_path):
    path = tmp_path / "store.journal"
    first = StoreServer(journal=path).listen()
    _mutate(first)
    contents = dict(first._data)
    first.close()
    assert contents[b"/n"] == b"13" and b"/gone" not in contents and contents[b"/k"] == b"\x00\xff"
    second = StoreServer(journal=path).listen()
    assert second._data == contents
    c = _client(second.port)
    assert c.get("a") == b"123" and c.get("p") == b"q" and c.add("n", 1) == 14
    second.close()


def test_compaction_keeps_the_contents_and_shrinks_the_file(tmp_path):
    path = tmp_path / "store.journal"
    server = StoreServer(journal=path)
    server.set("x", "y")
    for _ in range(10_010):  # past 4x the snapshot (0 records) plus 10000: compacted once
        server.add("beat", 1)
    server.close()
    assert path.stat().st_size < 2000  # a snapshot of 2 keys and a few records since
    assert StoreServer(journal=path)._data == {b"/x": b"y", b"/beat": b"10010"}


def test_a_torn_last_record_is_ignored(tmp_path):
    path, lines = tmp_path / "store.journal", []
    server = StoreServer(journal=path)
    server.set("kept", "1")
    server.set("torn", "2")
    server.close()
    path.write_bytes(path.read_bytes()[:-3])  # killed in the middle of the last write
    again = StoreServer(lines.append, journal=path)
    assert again._data == {b"/kept": b"1"}
    assert len(lines) == 1 and "torn last record" in lines[0] and str(path) in lines[0]
    again.set("more", "3")  # the file was rewritten whole: appends go on after a whole record
    again.close()
    assert StoreServer(journal=path)._data == {b"/kept": b"1", b"/more": b"3"}


def test_clear_empties_the_store_and_the_journal(tmp_path):
    path = tmp_path / "store.journal"
    server = StoreServer(journal=path)
    server.set("a", "1")
    server.clear()
    assert server._data == {} and not server.check(["a"])
    server.set("b", "2")
    server.close()
    assert StoreServer(journal=path)._data == {b"/b": b"2"}


@pytest.mark.parametrize("damage", ["header", "length", "value"])
def test_a_corrupt_journal_is_an_error_naming_it(tmp_path, damage):
    path = tmp_path / "store.journal"
    server = StoreServer(journal=path)
    server.set("a", "1")
    server.set("b", "2")
    server.close()
    data = bytearray(path.read_bytes())
    first = len(JOURNAL_HEADER)  # the first record: its op, lengths, CRC, b"/a", b"1", CRC
    data[{"header": 0, "length": first + 1, "value": first + 23}[damage]] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=str(path)):
        StoreServer(journal=path)


# ---- tagged mutations: a relay's replay is applied once, across a restart from the journal
TAGGED = 0x60
RELAY = bytes(range(16))  # a relay's id
HELLO = bytes([Query.VALIDATE]) + struct.pack("<I", MAGIC)


def _blob(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _tag(seq: int, q: Query, *args: bytes) -> bytes:
    """Query `q` with its arguments, tagged as RELAY's mutation `seq`."""
    return bytes([TAGGED]) + RELAY + struct.pack("<QB", seq, q) + b"".join(args)


def _ask(port: int, data: bytes, n: int) -> bytes:
    """Open a connection, send `data`, read `n` bytes of replies (fewer if it is closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(HELLO + data)
        with s.makefile("rb") as f:
            return f.read(n)


PING = bytes([Query.PING]) + b"ping"  # its echo: every query before it was handled


@pytest.mark.parametrize(
    ("query", "reply", "other", "key", "after"),
    [  # the tagged query and its reply; another client's write before the replay; the result
        pytest.param(
            _tag(1, Query.ADD, _blob(b"/n"), struct.pack("<q", 5)),
            struct.pack("<q", 6),
            lambda c: c.add("n", 10),
            "n",
            b"16",
            id="add",
        ),
        pytest.param(
            _tag(1, Query.APPEND, _blob(b"/a"), _blob(b"2")) + PING,
            b"ping",
            lambda c: c.append("a", "3"),
            "a",
            b"123",
            id="append",
        ),
        pytest.param(
            _tag(1, Query.DELETE_KEY, _blob(b"/d")),
            struct.pack("<q", 1),
            lambda c: c.set("d", "y"),
            "d",
            b"y",
            id="delete_key",
        ),
        pytest.param(
            _tag(1, Query.COMPARE_SET, _blob(b"/a"), _blob(b"1"), _blob(b"c")),
            _blob(b"c"),
            lambda c: c.set("a", "z"),
            "a",
            b"z",
            id="compare_set",
        ),
        pytest.param(
            _tag(1, Query.SET, _blob(b"/a"), _blob(b"s")) + PING,
            b"ping",
            lambda c: c.set("a", "z"),
            "a",
            b"z",
            id="set",
        ),
    ],
)
def test_a_tagged_mutation_replayed_after_a_restart_is_applied_once(
    tmp_path, query, reply, other, key, after
):
    """Its reply lost with the coordinator, the relay sends the same bytes to the store brought
    back from the journal: not applied again, answered as the first time, and another client's
    write made in between stays."""
    path = tmp_path / "store.journal"
    first = StoreServer(journal=path).listen()
    for k, v in (("a", "1"), ("d", "x"), ("n", "1")):
        first.set(k, v)
    assert _ask(first.port, query, len(reply)) == reply
    first.close()
    second = StoreServer(journal=path).listen()
    c = _client(second.port)
    other(c)
    assert _ask(second.port, query, len(reply)) == reply
    assert c.get(key) == after
    assert c.num_keys() == 3  # a, d, n: the tag table is not a key
    second.close()


def test_a_replay_whose_reply_is_not_kept_is_refused(server):
    """Only the relay's last query with a reply can be replayed wanting one (torch's client waits
    for each reply): an older one closes its connection, and the store goes on."""
    add = [_tag(seq, Query.ADD, _blob(b"/n"), struct.pack("<q", 1)) for seq in (1, 2)]
    set_ = _tag(3, Query.SET, _blob(b"/s"), _blob(b"v"))
    assert (
        _ask(server.port, add[0] + add[1] + set_ + PING, 20) == struct.pack("<qq", 1, 2) + b"ping"
    )
    assert _ask(server.port, add[1] + set_ + PING, 12) == struct.pack("<q", 2) + b"ping"
    assert _ask(server.port, add[0], 8) == b""
    assert server.dropped == ["a replayed query (seq 1) whose reply is not kept"]
    c = _client(server.port)
    assert c.get("n") == b"2" and c.add("n", 1) == 3


def test_the_tag_table_survives_compaction_and_a_restart(tmp_path):
    path = tmp_path / "store.journal"
    server = StoreServer(journal=path).listen()
    add = _tag(1, Query.ADD, _blob(b"/n"), struct.pack("<q", 7))
    assert _ask(server.port, add, 8) == struct.pack("<q", 7)
    for _ in range(10_010):  # compacted once: the tag table is in the snapshot
        server.add("beat", 1)
    server.close()
    assert path.stat().st_size < 2000  # a snapshot and a few records since
    again = StoreServer(journal=path).listen()
    assert _ask(again.port, add, 8) == struct.pack("<q", 7)  # not applied again
    assert again.get("n") == b"7" and _client(again.port).num_keys() == 2
    again.close()


def test_a_torn_tagged_record_loses_the_change_and_its_tag_together(tmp_path):
    path = tmp_path / "store.journal"
    server = StoreServer(journal=path).listen()
    server.set("kept", "1")
    add = _tag(1, Query.ADD, _blob(b"/n"), struct.pack("<q", 7))
    assert _ask(server.port, add, 8) == struct.pack("<q", 7)
    server.close()
    path.write_bytes(path.read_bytes()[:-3])  # killed in the middle of the ADD's write
    again = StoreServer(lambda line: None, journal=path).listen()
    assert again._data == {b"/kept": b"1"} and again._tags == {}
    assert _ask(again.port, add, 8) == struct.pack("<q", 7)  # so the replay applies it
    again.close()


def test_a_version_1_journal_still_loads(tmp_path):
    path = tmp_path / "store.journal"
    server = StoreServer(journal=path)
    server.set("a", "1")
    server.add("n", 2)
    server.close()
    data = path.read_bytes()  # no tagged query: the records are those version 1 wrote
    assert data.startswith(JOURNAL_HEADER) and JOURNAL_HEADER.endswith(b"version 2\n")
    path.write_bytes(b"frugaltrain store journal, version 1\n" + data[len(JOURNAL_HEADER) :])
    again = StoreServer(journal=path)
    assert again._data == {b"/a": b"1", b"/n": b"2"} and again._tags == {}
    again.close()
    assert path.read_bytes().startswith(JOURNAL_HEADER)  # rewritten as version 2


# ---- ADD keeps int64s; the accept loop outlives a process short of files or threads
def _add(key: bytes, delta: int) -> bytes:
    return bytes([Query.ADD]) + _blob(key) + struct.pack("<q", delta)


def test_an_add_past_int64_is_refused_and_the_key_kept(tmp_path):
    """torch's store keeps int64s (its server closes a connection whose ADD finds a value past
    one; its sum would overflow): such an ADD closes its connection, tagged or not, and the key
    keeps its value, in the journal too. The store and its other connections go on."""
    path = tmp_path / "store.journal"
    server = StoreServer(lambda line: None, journal=path).listen()
    c = _client(server.port)
    assert c.add("n", INT64_MAX - 1) == INT64_MAX - 1
    assert c.add("low", INT64_MIN + 1) == INT64_MIN + 1
    c.set("huge", str(INT64_MAX + 1))
    assert _ask(server.port, _add(b"/n", 2), 8) == b""
    assert _ask(server.port, _add(b"/low", -2), 8) == b""
    assert _ask(server.port, _add(b"/huge", -2), 8) == b""
    assert _ask(server.port, _tag(1, Query.ADD, _blob(b"/n"), struct.pack("<q", 2)), 8) == b""
    with pytest.raises(ProtocolError, match="past int64"):
        server.add("n", 2)
    assert server.dropped == [
        f"ADD of 2 to {INT64_MAX - 1}: the total is past int64",
        f"ADD of -2 to {INT64_MIN + 1}: the total is past int64",
        "ADD on a key whose value is past int64",
        f"ADD of 2 to {INT64_MAX - 1}: the total is past int64",
    ]
    assert c.get("n") == str(INT64_MAX - 1).encode() and c.get("low") == str(INT64_MIN + 1).encode()
    assert c.add("n", 1) == INT64_MAX  # the first client's connection was never touched
    assert _ask(server.port, _add(b"/low", -1), 8) == struct.pack("<q", INT64_MIN)
    server.close()
    again = StoreServer(journal=path)
    assert again.get("n") == str(INT64_MAX).encode() and again.get("low") == str(INT64_MIN).encode()
    assert again._tags == {}  # the refused tagged ADD was not applied, so not tagged either
    again.close()


class _ShortOfFiles:
    """A listening socket whose first `failures` accept() calls fail as in a process out of
    files."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self.sock, self.failures = sock, failures

    def accept(self) -> tuple[socket.socket, tuple]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self.sock.accept()

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_the_store_goes_on_accepting_when_short_of_files(monkeypatch):
    """accept() failing with EMFILE three times: the store pauses (one log line), goes on, and
    serves the client that was waiting in the backlog."""
    create_server, lines = socket.create_server, []
    monkeypatch.setattr(
        socket, "create_server", lambda *a, **k: _ShortOfFiles(create_server(*a, **k), 3)
    )
    server = StoreServer(lines.append).listen()
    monkeypatch.undo()
    try:
        c = _client(server.port)
        c.set("a", "1")
        assert c.get("a") == b"1"
    finally:
        server.close()
    assert lines == [
        "store: cannot accept connections: Too many open files; retrying",
        "store: accepting connections again",
    ]


def test_a_write_is_seen_by_a_read_sent_after_it_on_another_connection():
    """Arrival order across connections, as torch's one event loop keeps it: a SET sent on one
    connection (no reply) and then, at once, a CHECK of its key on another finds the key, every
    time (with a thread per connection the second one's thread could answer first)."""
    server = StoreServer().listen()
    writer, reader = (socket.create_connection(("127.0.0.1", server.port)) for _ in range(2))
    try:
        writer.sendall(HELLO)
        reader.sendall(HELLO)
        found = 0
        for i in range(2000):
            key = _blob(f"/k{i}".encode())
            writer.sendall(bytes([Query.SET]) + key + _blob(b"v"))
            reader.sendall(bytes([Query.CHECK]) + struct.pack("<Q", 1) + key)
            found += reader.recv(1) == b"\x00"  # READY
        assert found == 2000
    finally:
        writer.close()
        reader.close()
        server.close()
