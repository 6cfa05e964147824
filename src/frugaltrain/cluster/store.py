"""The run's store without torch: a server that torch's TCPStore clients talk to unchanged.

The coordinator trains nothing, yet hosting a `torch.distributed.TCPStore` made it import torch
(about 220 MB resident before any work). `StoreServer` speaks the TCPStore wire protocol itself,
in the standard library, so the coordinator stays a small process. torch has no server of this
protocol outside its C++ core, hence one written here. The protocol, as the client sends it:

    a query     one byte (`Query`), then its arguments: a key or a value is a little-endian
                uint64 length and that many bytes; a count is a uint64; `ADD`'s delta an int64.
    first       every connection opens with `VALIDATE` and the magic number (no reply); a
                connection that does not is closed.
    replies     a value (length and bytes), an int64, or one byte (`CHECK`: ready or not;
                `WAIT`: stop waiting, or wait cancelled).
    waiting     the client waits for keys itself (`get` waits first, then reads), so `WAIT`'s
                reply comes when the last of its keys is written, from the writer's thread;
                `CANCEL_WAIT` (the client timed out) is answered after any reply already due.
    tagged      `TAGGED` (0x60, not a query byte of torch's), a relay's 16-byte id, a uint64
                seq, then a mutation (SET, APPEND, MULTI_SET, COMPARE_SET, ADD, DELETE_KEY)
                whole, as torch's client sends it. Only gateway.py's relay sends it (torch's
                clients never do, and are served as before).

The same limits as torch's own server: keys up to 8 KiB, values up to 8 MiB, 128 Ki keys per
query; a connection that breaks them or sends an unknown query is closed, the store stays up. An
`ADD` keeps int64 values, as torch's does: one on a key that does not hold an int64 (torch's
server closes that connection) or whose total would pass int64 (torch's would overflow) closes
the connection, and the key keeps its value.
Queues, `LIST_KEYS` and `BARRIER` are not served: nothing in frugaltrain uses them.

One thread serves every connection, as torch's server's one event loop does (`_serve`): each
poll it reads what every ready socket has, then answers the whole queries read, each client's in
its order, the writes that have no reply first (`_answer_batch` says why). So a write on one
connection is seen by a query that another connection sends after it: a protocol that writes,
tells a peer out of band (over gloo), and has the peer check the store finds the write, every
time. (With a thread per connection the second connection's thread could answer first.)
Replies are queued per client and sent without blocking, in order; a client that stops reading
is dropped once its unsent replies pass MAX_UNSENT bytes or SEND_TIMEOUT_S passes without
progress, instead of holding the store.

Tagged mutations are applied once, however often a relay replays them (it numbers each of its
mutations, and replays what it has no proof of after a coordinator restart). The store keeps,
per relay id, the last seq it applied and the last applied tagged query that has a reply (its
seq and that reply), in a tag table outside the keys torch's clients see. A tagged query whose
seq is at most the last applied one is not applied again: a SET, APPEND or MULTI_SET is dropped,
and one with a reply is answered with the kept reply. That is enough because torch's client
waits for each reply before it sends its next query, so a replayed query that needs a reply is
the relay's last one with a reply; any other (its reply is not kept) closes the connection, as
a broken protocol. Seqs only grow, so a replay cannot undo another client's later write either.

The journal (`StoreServer(journal=path)`), so that a coordinator restarted with `--resume` finds
the store as it was: on start the file is loaded, then rewritten as a snapshot of the contents
(a tmp file renamed over it). Every applied mutation is journaled, under the store's lock and
before any reply (or any waiter's wake-up) is sent, each query's records in one write: SET,
APPEND, each pair of MULTI_SET, an ADD, a COMPARE_SET that set the key, a DELETE_KEY that removed
one; the in-process calls too. A record is an op byte (S set, A append, D delete, T tagged), the
key's and the value's lengths and a CRC-32 of those, the key, the value, and a CRC-32 of the
record. A tagged query is one T record, whether it changed a key or not: its key the relay's id,
its value the relay's entry of the tag table (seq, reply seq, the reply's length, the reply)
followed by the records of what the query changed. One record under one CRC: a killed
coordinator keeps the change and its tag together, or neither (a torn record is ignored). The
file opens with a header line naming its version (2; a version-1 file, without T records, loads
too). A snapshot writes every key as an S record, then each relay's entry as a T record with no
change in it. The file is compacted again once it holds 4x the last snapshot's records plus
10000 (heartbeat ADDs come several times a second per worker). Each write is flushed to the
kernel, not fsynced: a killed coordinator loses nothing it wrote (the kernel has it; a torn last
record is ignored on load), while a machine that crashes may lose the page cache's last seconds.
The store is rebuilt by the run's processes anyway (heartbeats, rendezvous), and an fsync per
heartbeat ADD would cost more than that loss. `clear()` empties the store, its tag table and
the journal. The tag table keeps one entry per relay that ever sent a mutation (a few dozen
bytes and its last reply) and is not pruned: a relay gone cannot be told from one held away.

In process, `StoreServer` has the calls of torch's `Store` that the coordinator needs (`get`,
`set`, `check`, `compare_set`, `add`), and `PrefixView` is torch's `PrefixStore` for any object
with those calls.
"""

from __future__ import annotations

import enum
import errno
import os
import select
import selectors
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, NamedTuple, Protocol

MAGIC = 0x3C85F7CE
MAX_KEY = 8 * 1024
MAX_VALUE = 8 * 1024 * 1024
MAX_KEYS = 128 * 1024
SEND_TIMEOUT_S = 10
MAX_UNSENT = 64 << 20  # bytes of replies a client may leave unread (a few 8 MiB values)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # what torch's store keeps for ADD


class Query(enum.IntEnum):
    """The query byte, in torch's order (c10d::detail::QueryType)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


READY, NOT_READY = b"\x00", b"\x01"
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"


class ProtocolError(ValueError):
    """A client broke the protocol or a limit: its connection is closed."""


class Store(Protocol):
    """The calls of a store that run_store.py and rendezvous_json.py use (torch's Store has
    them too)."""

    def get(self, key: str) -> bytes: ...
    def set(self, key: str, value: str | bytes) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...


def _bytes(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def _key(key: str) -> bytes:
    return b"/" + key.encode()  # torch's TCPStore client sends every key after a "/"


def _value(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


class Reader:
    """Whole items of the protocol from a socket, within torch's limits. While `taken` is a
    bytearray, every byte read is also added to it (the store tunnel forwards queries as read)."""

    def __init__(self, sock: socket.socket) -> None:
        self.file = sock.makefile("rb")
        self.taken: bytearray | None = None

    def read(self, n: int) -> bytes:
        data = self.file.read(n)
        if data is None or len(data) != n:
            raise EOFError
        if self.taken is not None:
            self.taken += data
        return data

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def blob(self, limit: int) -> bytes:
        n = self.u64()
        if n > limit:
            raise ProtocolError(f"a {n}-byte key or value, more than {limit}")
        return self.read(n)

    def count(self) -> int:
        n = self.u64()
        if n > MAX_KEYS:
            raise ProtocolError(f"{n} keys in one query, more than {MAX_KEYS}")
        return n

    def opening(self) -> None:
        """The connection's first bytes: VALIDATE and the magic number, or ProtocolError."""
        first = self.read(5)
        if first[0] != Query.VALIDATE or struct.unpack("<I", first[1:])[0] != MAGIC:
            raise ProtocolError("the connection did not open with TCPStore's magic number")


def read_args(r: Reader, q: int) -> tuple:
    """Query `q`'s arguments, read whole: keys and values as bytes, ADD's delta an int, PING's
    nonce 4 bytes; CHECK, WAIT and MULTI_GET give one list of keys, MULTI_SET one of pairs.
    ProtocolError for a query this store does not serve."""
    if q in (Query.SET, Query.APPEND):
        return r.blob(MAX_KEY), r.blob(MAX_VALUE)
    if q == Query.COMPARE_SET:
        return r.blob(MAX_KEY), r.blob(MAX_VALUE), r.blob(MAX_VALUE)
    if q in (Query.GET, Query.DELETE_KEY):
        return (r.blob(MAX_KEY),)
    if q == Query.ADD:
        return r.blob(MAX_KEY), struct.unpack("<q", r.read(8))[0]
    if q in (Query.CHECK, Query.WAIT, Query.MULTI_GET):
        return ([r.blob(MAX_KEY) for _ in range(r.count())],)
    if q == Query.MULTI_SET:
        return ([(r.blob(MAX_KEY), r.blob(MAX_VALUE)) for _ in range(r.count())],)
    if q == Query.PING:
        return (r.read(4),)
    if q in (Query.GETNUMKEYS, Query.CANCEL_WAIT):
        return ()
    name = Query(q).name if q in Query._value2member_map_ else str(q)
    raise ProtocolError(f"query {name} is not served by this store")


NO_REPLY = (Query.SET, Query.APPEND, Query.MULTI_SET)
MUTATIONS = (*NO_REPLY, Query.COMPARE_SET, Query.ADD, Query.DELETE_KEY)
TAGGED = 0x60  # not one of torch's query bytes: a relay's mutation, applied once (module doc)
RELAY_ID = 16  # bytes of a relay's id
_TAG = struct.Struct(f"<{RELAY_ID}sQB")  # after TAGGED: the relay's id, seq, the inner query


def tagged(relay: bytes, seq: int, query: bytes) -> bytes:
    """`query` (a mutation, whole, as torch's client sent it) tagged as relay `relay`'s `seq`."""
    return bytes([TAGGED]) + _TAG.pack(relay, seq, query[0]) + query[1:]


def read_tag(r: Reader) -> tuple[bytes, int, int]:
    """After the TAGGED byte: (relay id, seq, inner query); ProtocolError if that query is not a
    mutation."""
    relay, seq, q = _TAG.unpack(r.read(_TAG.size))
    if q not in MUTATIONS:
        raise ProtocolError(f"a tagged query {q}, not a mutation")
    return relay, seq, q


def read_reply(r: Reader, q: int, n_keys: int) -> bytes:
    """The server's whole reply to query `q` (not one of NO_REPLY); `n_keys`: MULTI_GET's
    number of keys. The server is trusted here: a value's length is not limited."""
    if q in (Query.COMPARE_SET, Query.GET):
        return _value(r.read(r.u64()))
    if q == Query.MULTI_GET:
        return b"".join(_value(r.read(r.u64())) for _ in range(n_keys))
    if q in (Query.ADD, Query.GETNUMKEYS, Query.DELETE_KEY):
        return r.read(8)
    if q == Query.PING:
        return r.read(4)
    return r.read(1)  # CHECK, WAIT, CANCEL_WAIT


# ---- accepting connections (the gateway's ports use this too)
# accept() failing with one of these says that the one pending connection it took failed (Linux
# hands a pending connection's network error to accept(), see accept(2)): the next one is taken
# at once. Any other error pauses the loop (`accepted`).
_CONNECTION_FAILED = frozenset(
    {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.ENETUNREACH}
    | {errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENOPROTOOPT, errno.EOPNOTSUPP}
)
ACCEPT_BACKOFF_MIN_S = 0.05  # the first pause after a failed accept(), doubled while it fails
ACCEPT_BACKOFF_MAX_S = 1.0  # and the longest: a port comes back within a second of its files


class AcceptBackoff:
    """The pause after accept() fails for want of files or memory: ACCEPT_BACKOFF_MIN_S,
    doubled up to ACCEPT_BACKOFF_MAX_S while it keeps failing; one log line per streak, and one
    when accepting works again. Shared by the blocking loop (`accepted`) and the store's own."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self.pause = log, 0.0

    def failed(self, e: OSError) -> float:
        """The next pause, in seconds."""
        if not self.pause:
            self.log(f"cannot accept connections: {e.strerror or e}; retrying")
        self.pause = min(2 * self.pause, ACCEPT_BACKOFF_MAX_S) or ACCEPT_BACKOFF_MIN_S
        return self.pause

    def accepted(self) -> None:
        if self.pause:
            self.log("accepting connections again")
            self.pause = 0.0


def accepted(
    listener: socket.socket, closing: Callable[[], bool], log: Callable[[str], None]
) -> Iterator[tuple[socket.socket, tuple]]:
    """Each (connection, address) `listener` accepts, until `closing()` is true.

    A loop that ends on accept()'s first error lets one flood shut a port for good: with the
    process out of files, every accept() fails with EMFILE until something is closed. So no error
    ends this one while not closing. After one that says the process or the kernel is short of
    something for now (EMFILE, ENFILE, ENOBUFS, ENOMEM; or an error not known) it pauses,
    ACCEPT_BACKOFF_MIN_S doubling up to ACCEPT_BACKOFF_MAX_S while accept() keeps failing (the
    backlog keeps the connections that wait), and logs one line per streak; after one about a
    single connection (_CONNECTION_FAILED) it takes the next at once.
    A listener with a timeout wakes up to check `closing()`; without one, whoever closes sets
    `closing()` first, then shuts the listener down, which ends a blocked accept()."""
    backoff = AcceptBackoff(log)
    while not closing():
        try:
            conn, addr = listener.accept()
        except TimeoutError:
            continue
        except OSError as e:
            if closing() or listener.fileno() < 0:
                return
            if e.errno not in _CONNECTION_FAILED:
                time.sleep(backoff.failed(e))
            continue
        backoff.accepted()
        yield conn, addr


def start_thread(
    conn: socket.socket, target: Callable, args: tuple, peer: str, log: Callable[[str], None]
) -> threading.Thread | None:
    """A daemon thread named `peer` running target(*args) for the connection `conn`, started;
    None, with `conn` closed and one line logged, when no thread can be started now (out of
    threads or memory: that connection is lost, the port goes on)."""
    t = threading.Thread(target=target, args=args, daemon=True, name=peer)
    try:
        t.start()
    except RuntimeError as e:  # "can't start new thread"
        log(f"closed the connection from {peer}: cannot start its thread: {e}")
        conn.close()
        return None
    return t


class _NeedMore(Exception):
    """The bytes received so far end inside a query: wait for more."""


class _Client(Reader):
    """One client connection: its socket, the bytes received and not parsed yet (read through
    `Reader`'s calls, `_NeedMore` when they run out), the replies not sent yet, and the keys it
    waits for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.taken = None
        self.inbox = bytearray()
        self.at = 0  # the next byte of `inbox` to parse
        self.opened = False
        self.outbox = bytearray()
        self.stalled_since = 0.0  # when `outbox` last stopped draining (0: empty)
        self.broken = ""  # why a send failed on another thread (the loop drops it)
        self.ended = False  # it sent EOF: closed once its replies are sent
        self.waiting: set[bytes] = set()

    def read(self, n: int) -> bytes:
        if self.at + n > len(self.inbox):
            raise _NeedMore
        self.at += n
        return bytes(self.inbox[self.at - n : self.at])

    def next_query(
        self, only: tuple[int, ...] = ()
    ) -> tuple[int, tuple, tuple[bytes, int] | None] | None:
        """The next whole query as (query, arguments, tag), or None until more bytes arrive (or,
        with `only`, while the next one is not one of those queries: it stays, unread);
        ProtocolError as soon as what arrived breaks the protocol or a limit."""
        try:
            if not self.opened:
                self.opening()
                self.opened = True
                self._consume()
            q, tag = self.read(1)[0], None
            if q == TAGGED:  # a relay's mutation: (its id, seq), then the query itself
                relay, seq, q = read_tag(self)
                tag = relay, seq
            if only and q not in only:
                raise _NeedMore
            query = q, read_args(self, q), tag
        except _NeedMore:
            self.at = 0  # a partial (or held back) query stays for later
            return None
        self._consume()
        return query

    def _consume(self) -> None:
        del self.inbox[: self.at]
        self.at = 0


JOURNAL_HEADER = b"frugaltrain store journal, version 2\n"
_HEADERS = (JOURNAL_HEADER, b"frugaltrain store journal, version 1\n")  # 1: no T records
_SET, _APPEND, _DELETE, _TAGGED = b"S", b"A", b"D", b"T"
_OPS = (_SET, _APPEND, _DELETE, _TAGGED)
_HEAD = struct.Struct("<cQQI")  # op, key length, value length, CRC-32 of those
_CRC = struct.Struct("<I")
_TAG_HEAD = struct.Struct("<QQQ")  # a T record's value: seq, reply seq, reply length


class Tag(NamedTuple):
    """What the store keeps of one relay: its last applied seq, and the last applied tagged query
    that has a reply (its seq and that reply; 0 and b"" before one)."""

    seq: int
    reply_seq: int = 0
    reply: bytes = b""


def _record(op: bytes, key: bytes, value: bytes = b"") -> bytes:
    """One journal record: a head (the op byte, the key's and the value's lengths as uint64s,
    and their CRC-32), the key, the value, then the CRC-32 of all that. A torn write leaves a
    short record; corruption fails a CRC (the head's own one: a bad length is not taken as torn)."""
    lengths = struct.pack("<cQQ", op, len(key), len(value))
    body = lengths + _CRC.pack(zlib.crc32(lengths)) + key + value
    return body + _CRC.pack(zlib.crc32(body))


def _tag_record(relay: bytes, tag: Tag, records: bytes = b"") -> bytes:
    """A T record: the relay's id as its key; its Tag, then `records` (what the tagged query
    changed, whole records) as its value. One record, so kept or torn as a whole."""
    value = _TAG_HEAD.pack(tag.seq, tag.reply_seq, len(tag.reply)) + tag.reply + records
    return _record(_TAGGED, relay, value)


def _parse(data: bytes, pos: int) -> tuple[bytes, bytes, bytes, int] | None:
    """The record at `pos` as (op, key, value, end), or None if the file ends inside it;
    ValueError if it is corrupt."""
    if pos + _HEAD.size > len(data):
        return None
    op, n_key, n_value, crc = _HEAD.unpack_from(data, pos)
    if crc != zlib.crc32(data[pos : pos + _HEAD.size - _CRC.size]) or op not in _OPS:
        raise ValueError(f"corrupt record head at byte {pos}")
    key_at = pos + _HEAD.size
    end = key_at + n_key + n_value
    if end + _CRC.size > len(data):
        return None
    if _CRC.unpack_from(data, end)[0] != zlib.crc32(data[pos:end]):
        raise ValueError(f"corrupt record at byte {pos}")
    return op, data[key_at : key_at + n_key], data[key_at + n_key : end], end + _CRC.size


def _replay(data: dict[bytes, bytes], op: bytes, key: bytes, value: bytes) -> None:
    if op == _SET:
        data[key] = value
    elif op == _APPEND:
        data[key] = data.get(key, b"") + value
    else:
        data.pop(key, None)


def _replay_tagged(data: dict[bytes, bytes], value: bytes, at: int) -> Tag:
    """Apply the records inside a T record's value; its Tag. ValueError if they do not parse
    whole (the T record's own CRC held, so they are corrupt, not torn)."""
    bad = ValueError(f"corrupt tagged record at byte {at}")
    if len(value) < _TAG_HEAD.size:
        raise bad
    seq, reply_seq, n_reply = _TAG_HEAD.unpack_from(value)
    pos = _TAG_HEAD.size + n_reply
    if pos > len(value):
        raise bad
    tag = Tag(seq, reply_seq, value[_TAG_HEAD.size : pos])
    while pos < len(value):
        rec = _parse(value, pos)
        if rec is None or rec[0] == _TAGGED:
            raise bad
        op, key, inner, pos = rec
        _replay(data, op, key, inner)
    return tag


class Journal:
    """The store's contents and tag table in a file: a snapshot, then each mutation since,
    appended. The caller holds the store's lock around every call."""

    def __init__(self, path: Path, log: Callable[[str], None]) -> None:
        self.path, self.log = Path(path), log
        self._file: BinaryIO | None = None
        self._records = 0  # in the file now
        self._snapshot = 0  # in the last snapshot

    def load(self) -> tuple[dict[bytes, bytes], dict[bytes, Tag]]:
        """The contents and the tag table the file holds (empty if there is none). A torn last
        record (a killed process) is ignored with a log line; other corruption is a ValueError
        naming the file. A version-1 file (no tag table) loads too."""
        if not self.path.exists():
            return {}, {}
        data, out, tags = self.path.read_bytes(), {}, {}
        if not data.startswith(_HEADERS):
            raise ValueError(f"{self.path}: not a frugaltrain store journal of a known version")
        pos = len(JOURNAL_HEADER)  # every version's header has its length
        while pos < len(data):
            try:
                rec = _parse(data, pos)
                if rec is None:
                    self.log(
                        f"store: ignored a torn last record in {self.path} "
                        f"({len(data) - pos} bytes)"
                    )
                    break
                op, key, value, end = rec
                if op == _TAGGED:
                    tags[key] = _replay_tagged(out, value, pos)
                else:
                    _replay(out, op, key, value)
                pos = end
            except ValueError as e:
                raise ValueError(f"{self.path}: {e}") from None
        return out, tags

    def compact(self, contents: dict[bytes, bytes], tags: dict[bytes, Tag]) -> None:
        """Rewrite the file as one snapshot of `contents` and `tags` (a tmp file renamed over
        it: a crash leaves the old file or the new one), then append to it."""
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(JOURNAL_HEADER)
            for key, value in contents.items():
                f.write(_record(_SET, key, value))
            for relay, tag in tags.items():
                f.write(_tag_record(relay, tag))
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")  # noqa: SIM115 (open until close())
        self._records = self._snapshot = len(contents) + len(tags)

    def append(
        self, records: bytes, n: int, contents: dict[bytes, bytes], tags: dict[bytes, Tag]
    ) -> None:
        """Write `n` records in one write, through to the kernel (flushed, not fsynced); compact
        once the file holds 4x the last snapshot's records plus 10000 (heartbeat ADDs keep
        coming)."""
        if self._file is None:
            return  # closed: the server is going away, its late writes with it
        self._file.write(records)
        self._file.flush()
        self._records += n
        if self._records > 4 * self._snapshot + 10_000:
            self.compact(contents, tags)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_BURST = 16  # reads (or accepts) of one socket per report before the others get their turn


class _Poller:
    """Readiness of the store's sockets, reported in the order it arose. On Linux: epoll,
    edge-triggered, so a socket is queued when new bytes reach it and one that became readable
    later is reported later. (Level-triggered epoll queues a socket it reported again, behind the
    others, which can put a later query ahead of an earlier one on another connection.) A report
    is read until the socket has nothing more (EAGAIN), else its bytes wait for the next edge.
    Elsewhere: a selector, in its own order."""

    def __init__(self) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._selector = None if self._epoll else selectors.DefaultSelector()
        self._objects: dict[int, tuple[socket.socket, object]] = {}

    @staticmethod
    def _mask(events: int) -> int:
        return (
            select.EPOLLET
            | (select.EPOLLIN if events & READ else 0)
            | (select.EPOLLOUT if events & WRITE else 0)
        )

    def register(self, sock: socket.socket, events: int, data: object = None) -> None:
        self._objects[sock.fileno()] = sock, data
        if self._epoll is not None:
            self._epoll.register(sock.fileno(), self._mask(events))
        else:
            self._selector.register(sock, events, data)

    def modify(self, sock: socket.socket, events: int, data: object = None) -> None:
        if self._epoll is not None:
            self._epoll.modify(sock.fileno(), self._mask(events))
        else:
            self._selector.modify(sock, events, data)

    def unregister(self, sock: socket.socket) -> None:
        self._objects.pop(sock.fileno(), None)
        if self._epoll is not None:
            self._epoll.unregister(sock.fileno())
        else:
            self._selector.unregister(sock)

    def poll(self, timeout: float) -> list[tuple[socket.socket, object, int]]:
        """(socket, data, READ | WRITE) of each socket ready within `timeout` seconds."""
        if self._selector is not None:
            return [(k.fileobj, k.data, ev) for k, ev in self._selector.select(timeout)]
        out, readable = [], select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
        for fd, ev in self._epoll.poll(timeout):
            if fd in self._objects:  # not one unregistered meanwhile
                sock, data = self._objects[fd]
                out.append(
                    (
                        sock,
                        data,
                        (READ if ev & readable else 0) | (WRITE if ev & select.EPOLLOUT else 0),
                    )
                )
        return out

    def close(self) -> None:
        (self._epoll or self._selector).close()


class StoreServer:
    """See the module docstring. `listen` serves clients on a port; `adopt` a connection handed
    over in process. With `journal`, the contents are loaded from that file and every mutation
    is written to it."""

    def __init__(
        self, log: Callable[[str], None] | None = None, journal: Path | None = None
    ) -> None:
        self.log = log  # told why each broken connection was closed
        self._data: dict[bytes, bytes] = {}
        self._tags: dict[bytes, Tag] = {}  # relay id -> what it has applied (module docstring)
        self._changes: list[bytes] = []  # the journal records of the query being answered
        self._written: set[bytes] = set()  # and the keys it wrote (their waiters to wake)
        self._clients: set[_Client] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._closing = False
        self._selector = _Poller()
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self._selector.register(self._wake_r, READ)
        self._want_write: set[_Client] = set()  # replies queued: the loop watches their sockets
        self._adopted: list[socket.socket] = []  # connections handed over, for the loop
        self._more: set[_Client] = set()  # clients whose last burst was cut short
        self._more_accepts = False  # the listener's, likewise
        self._thread: threading.Thread | None = None
        self._backoff = AcceptBackoff(self._say)
        self._accept_paused_until = 0.0
        self.port = 0
        self.dropped: list[str] = []  # why each broken connection was closed, in order
        self._journal: Journal | None = None
        if journal is not None:
            self._journal = Journal(journal, log or print)
            self._data, self._tags = self._journal.load()
            self._journal.compact(self._data, self._tags)
        # each query's answer: its reply, or None (none, or not yet: WAIT)
        self._answers: dict[int, Callable[..., bytes | None]] = {
            Query.SET: self._set,
            Query.APPEND: self._append,
            Query.COMPARE_SET: lambda c, k, e, d: _value(self._compare_set(k, e, d)),
            Query.GET: lambda c, k: _value(self._data.get(k, b"")),
            Query.ADD: lambda c, k, delta: struct.pack("<q", self._add(k, delta)),
            Query.CHECK: self._check,
            Query.WAIT: self._wait,
            Query.MULTI_GET: self._multi_get,
            Query.MULTI_SET: self._multi_set,
            Query.GETNUMKEYS: lambda c: struct.pack("<q", len(self._data)),
            Query.DELETE_KEY: lambda c, k: struct.pack("<q", int(self._delete(k))),
            Query.CANCEL_WAIT: self._cancel_wait,
            Query.PING: lambda c, nonce: nonce,
        }

    # ---- the network side: one thread, one selector (module docstring)
    def listen(self, host: str = "127.0.0.1", port: int = 0) -> StoreServer:
        """Serve clients at (host, port) on a thread; port 0 picks a free one (`self.port`)."""
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector.register(self._listener, READ)
        return self.start()

    def start(self) -> StoreServer:
        """Serve, on a thread, the connections handed over (`adopt`) and, after `listen`, those
        its port accepts."""
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"store:{self.port}")
        self._thread.start()
        return self

    def _serve(self) -> None:
        """Until close(): take new connections, read every readable socket, answer the whole
        queries read (`_answer_batch`), and send what is queued."""
        while not self._closing:
            batch = []
            for sock, client, events in self._selector.poll(self._timeout()):
                if sock is self._listener:
                    self._accept_some()
                elif sock is self._wake_r:
                    self._drain_wake()
                elif self._guarded(client, self._ready, client, events):
                    batch.append(client)
            for c in list(self._more - set(batch)):  # a burst cut short: the rest of its bytes
                if self._guarded(c, self._receive, c):
                    batch.append(c)
            self._answer_batch(batch)
            self._tidy()
        for c in list(self._clients):
            self._drop(c, "")
        self._selector.close()

    def _guarded(self, c: _Client, fn: Callable, *args) -> bool:
        """fn(*args); a bug met there costs `c`'s connection, never the loop that every client
        depends on (False then)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 (logged with its type; the store goes on)
            self._drop(c, f"{type(e).__name__}: {e}")
            return False

    def _ready(self, c: _Client, events: int) -> bool:
        """Send what `c` is owed and read what it sent; whether it sent anything."""
        if events & WRITE:
            self._flush(c)
        return bool(events & READ) and self._receive(c)

    def _answer_batch(self, batch: list[_Client]) -> None:
        """Answer the whole queries the clients of one poll sent, each client's in its order.
        Queries without a reply (SET, APPEND, MULTI_SET) lead: their sender went on at once, so
        a query that another client sent after one of them, having heard of it out of band, can
        be in the same batch, and the kernel's order of readiness within a batch is not the
        order of arrival. The rest were sent concurrently (none was answered), so any order of
        them is one the clients could have seen."""
        for only in (NO_REPLY, ()):
            for c in batch:
                self._guarded(c, self._answer_all, c, only)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _timeout(self) -> float:
        """How long a poll may wait: not at all while a burst was cut short, until a paused
        accept resumes, or a second (to see stalled clients)."""
        if self._more:
            return 0.0
        if self._accept_paused_until:
            return max(0.0, min(1.0, self._accept_paused_until - time.monotonic()))
        return 1.0

    def _accept_some(self) -> None:
        """Up to _BURST pending connections; the rest wait for the next turn."""
        for _ in range(_BURST):
            if not self._accept_one():
                return
        self._more_accepts = True

    def _accept_one(self) -> bool:
        """One pending connection, if any (False: none, or accept paused). Short of files or
        memory (accept's errors other than one connection's own), stop listening for a pause
        that doubles while it fails, and log one line per streak (`accepted` says why)."""
        try:
            conn, addr = self._listener.accept()
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in _CONNECTION_FAILED or self._closing:
                return not self._closing
            self._accept_paused_until = time.monotonic() + self._backoff.failed(e)
            self._selector.unregister(self._listener)
            return False
        self._backoff.accepted()
        self._register(conn)
        return True

    def adopt(self, sock: socket.socket) -> None:
        """Serve the client connected on `sock`, a connection handed over in process (from any
        thread: the loop registers it)."""
        with self._lock:
            self._adopted.append(sock)
        self._wake()

    def _register(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = _Client(sock)
        with self._lock:
            self._clients.add(client)
        self._selector.register(sock, READ, client)

    def _receive(self, c: _Client) -> bool:
        """What `c` has sent, into its inbox (up to _BURST reads: then it is in `_more` for the
        next turn); whether it sent anything and is still connected."""
        self._more.discard(c)
        got = False
        for _ in range(_BURST):
            try:
                data = c.sock.recv(1 << 16)
            except BlockingIOError:
                return got
            except OSError as e:
                self._drop(c, f"the connection broke: {e.strerror or e}")
                return False
            if not data:  # the client is done sending: answer what it sent, then close
                c.ended = True
                return got
            c.inbox += data
            got = True
        self._more.add(c)
        return got

    def _answer_all(self, c: _Client, only: tuple[int, ...] = ()) -> bool:
        """Answer each whole query in `c.inbox` in turn (with `only`: while the next is one of
        those); False if it broke the protocol (then it is dropped)."""
        if c not in self._clients:
            return False
        try:
            while (query := c.next_query(only)) is not None:
                q, args, tag = query
                with self._lock:
                    reply = self._answer(c, q, args, tag)
                    if reply is not None:
                        self._reply(c, reply)
        except ProtocolError as e:
            self._drop(c, str(e))
            return False
        return True

    def _reply(self, c: _Client, data: bytes) -> None:
        """Queue `data` after `c`'s earlier replies and send what the socket takes now; the
        loop sends the rest when it can (called under the lock, from any thread)."""
        if c.broken:
            return
        c.outbox += data
        self._send(c)
        if c.outbox:
            self._want_write.add(c)
            self._wake()

    def _send(self, c: _Client) -> None:
        """As much of `c.outbox` as its socket takes now (under the lock)."""
        try:
            sent = c.sock.send(c.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            c.broken, c.waiting = f"the connection broke: {e.strerror or e}", set()
            self._wake()
            return
        del c.outbox[:sent]
        if sent or not c.outbox:
            c.stalled_since = time.monotonic() if c.outbox else 0.0
        elif not c.stalled_since:
            c.stalled_since = time.monotonic()

    def _flush(self, c: _Client) -> None:
        with self._lock:
            self._send(c)
            if not c.outbox and not c.broken:
                self._want_write.add(c)  # _tidy sees it is empty and stops watching

    def _tidy(self) -> None:
        """Between selects: resume a paused accept when due, watch for writability where
        replies wait (only there), and drop the clients that broke or stopped reading."""
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self._listener, READ)  # an edge now if any are pending
        elif self._more_accepts:
            self._more_accepts = False
            self._accept_some()
        with self._lock:
            due, self._want_write = self._want_write, set()
            adopted, self._adopted = self._adopted, []
        for sock in adopted:
            self._register(sock)
        now = time.monotonic()
        for c in list(self._clients):
            if c.broken:
                self._drop(c, c.broken)
            elif c.ended and not c.outbox:
                self._drop(c, "")  # it left
            elif len(c.outbox) > MAX_UNSENT or (
                c.stalled_since and now - c.stalled_since > SEND_TIMEOUT_S
            ):
                self._drop(c, f"it left {len(c.outbox)} bytes of replies unread")
            elif c in due:
                events = READ | (WRITE if c.outbox else 0)
                self._selector.modify(c.sock, events, c)

    def _drop(self, c: _Client, why: str) -> None:
        """End `c`'s connection (on the loop's thread); `why` empty: it left."""
        with self._lock:
            if c not in self._clients:
                return
            self._clients.discard(c)
            c.waiting = set()
        self._more.discard(c)
        if why:
            self.dropped.append(why)
            self._say(f"closed a client's connection: {why}")
        self._selector.unregister(c.sock)
        c.sock.close()

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log(f"store: {line}")

    def _wake(self) -> None:
        """Make the loop's select return (a reply queued, a client added, close())."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or the store is closed

    def close(self) -> None:
        """Stop listening, end every client's connection, and close the journal."""
        self._closing = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=SEND_TIMEOUT_S)  # it ends every client's connection
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            if self._journal is not None:
                self._journal.close()

    def clear(self) -> None:
        """Empty the store, its tag table and its journal (a resume that goes on from
        checkpoints instead: every relay gave up before)."""
        with self._lock:
            self._data, self._tags = {}, {}
            if self._journal is not None:
                self._journal.compact(self._data, self._tags)

    # ---- each query's answer, under the lock
    def _answer(
        self, c: _Client, q: int, args: tuple, tag: tuple[bytes, int] | None
    ) -> bytes | None:
        """Query `q`'s reply, once its changes are journaled and their waiters woken; `tag`:
        (relay id, seq) of a tagged query."""
        if tag is not None:
            return self._tagged(c, *tag, q, args)
        try:
            return self._answers[q](c, *args)
        finally:
            self._commit()

    def _tagged(self, c: _Client, relay: bytes, seq: int, q: int, args: tuple) -> bytes | None:
        """Relay `relay`'s mutation `seq`: applied if it is new, else answered as it was."""
        last = self._tags.get(relay, Tag(0))
        if seq <= last.seq:  # a replay of what this store (or the one before it) applied
            if q in NO_REPLY:
                return None
            if seq != last.reply_seq:
                raise ProtocolError(f"a replayed query (seq {seq}) whose reply is not kept")
            return last.reply
        applied = None
        try:
            reply = self._answers[q](c, *args)
            self._tags[relay] = (
                Tag(seq, last.reply_seq, last.reply) if reply is None else Tag(seq, seq, reply)
            )
            applied = relay
        finally:
            self._commit(applied)  # not tagged if it failed (a ProtocolError: nothing changed)
        return reply

    def _commit(self, relay: bytes | None = None) -> None:
        """Journal the answered query's changes in one write (inside the T record of `relay`'s
        tag when it was tagged: one record, kept or lost whole), then wake their waiters."""
        changes, written = self._changes, self._written
        self._changes, self._written = [], set()
        if self._journal is not None and (changes or relay is not None):
            if relay is not None:
                changes = [_tag_record(relay, self._tags[relay], b"".join(changes))]
            self._journal.append(b"".join(changes), len(changes), self._data, self._tags)
        for c in self._clients if written else ():
            if c.waiting & written:
                c.waiting -= written
                if not c.waiting:
                    self._reply(c, STOP_WAITING)

    def _set(self, c: _Client, key: bytes, value: bytes) -> None:
        self._write(key, value)

    def _append(self, c: _Client, key: bytes, value: bytes) -> None:
        self._write(key, self._data.get(key, b"") + value, appended=value)

    def _multi_set(self, c: _Client, pairs: list[tuple[bytes, bytes]]) -> None:
        for key, value in pairs:
            self._write(key, value)

    def _check(self, c: _Client, keys: list[bytes]) -> bytes:
        return READY if all(k in self._data for k in keys) else NOT_READY

    def _multi_get(self, c: _Client, keys: list[bytes]) -> bytes:
        return b"".join(_value(self._data.get(k, b"")) for k in keys)

    def _wait(self, c: _Client, keys: list[bytes]) -> bytes | None:
        missing = {k for k in keys if k not in self._data}
        if missing:
            c.waiting = missing  # answered by the write of the last one
            return None
        return STOP_WAITING

    def _cancel_wait(self, c: _Client) -> bytes:
        c.waiting = set()
        return WAIT_CANCELED

    # ---- the data, under the lock; each change is kept for _commit, which journals it before
    # anyone is answered
    def _write(self, key: bytes, value: bytes, appended: bytes | None = None) -> None:
        self._data[key] = value
        if self._journal is not None:
            self._changes.append(
                _record(_SET, key, value) if appended is None else _record(_APPEND, key, appended)
            )
        self._written.add(key)

    def _delete(self, key: bytes) -> bool:
        if self._data.pop(key, None) is None:
            return False
        if self._journal is not None:
            self._changes.append(_record(_DELETE, key))
        return True

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """torch's rule: a missing key is set iff `expected` is empty; otherwise the reply is
        `expected` itself. A present key is set iff it holds `expected`. Returns the value."""
        if key not in self._data:
            if expected:
                return expected
            self._write(key, desired)
        elif self._data[key] == expected:
            self._write(key, desired)
        return self._data[key]

    def _add(self, key: bytes, delta: int) -> int:
        """torch's rule: the key's value read as an int64 (0 if missing) plus `delta`, kept as
        its decimal digits. A value that is not an int64 (torch's server drops the connection)
        or a total past int64 (torch's reply could not hold it) is a ProtocolError, and the key
        keeps its value: nothing is written."""
        try:
            held = int(self._data.get(key, b"0"))
        except ValueError:
            raise ProtocolError("ADD on a key that does not hold an integer") from None
        if not INT64_MIN <= held <= INT64_MAX:
            raise ProtocolError("ADD on a key whose value is past int64")
        total = held + delta
        if not INT64_MIN <= total <= INT64_MAX:
            raise ProtocolError(f"ADD of {delta} to {held}: the total is past int64")
        self._write(key, str(total).encode())
        return total

    # ---- in process: the calls of torch's Store, with the "/" its clients put before each key
    def get(self, key: str) -> bytes:
        """The value of `key`; KeyError if it has none (torch's `get` would wait for it)."""
        with self._lock:
            return self._data[_key(key)]

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """The lock around an in-process change, journaled (`_commit`) before it is let go."""
        with self._lock:
            try:
                yield
            finally:
                self._commit()

    def set(self, key: str, value: str | bytes) -> None:
        with self._changing():
            self._write(_key(key), _bytes(value))

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(_key(k) in self._data for k in keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with self._changing():
            return self._compare_set(_key(key), _bytes(expected), _bytes(desired))

    def add(self, key: str, amount: int) -> int:
        with self._changing():
            return self._add(_key(key), amount)


class PrefixView:
    """Every key of `store` under `prefix + "/"`, as torch's PrefixStore names them."""

    def __init__(self, prefix: str, store: Store) -> None:
        self.prefix, self.store = prefix, store

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def get(self, key: str) -> bytes:
        return self.store.get(self._k(key))

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(self._k(key), value)

    def check(self, keys: list[str]) -> bool:
        return self.store.check([self._k(k) for k in keys])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.store.compare_set(self._k(key), expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._k(key), amount)
