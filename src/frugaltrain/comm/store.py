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

The same limits as torch's own server: keys up to 8 KiB, values up to 8 MiB, 128 Ki keys per
query; a connection that breaks them or sends an unknown query is closed, the store stays up.
Queues, `LIST_KEYS` and `BARRIER` are not served: nothing in frugaltrain uses them. Every reply
is sent under the store's one lock, so replies keep their order; a client that stops reading is
dropped after SEND_TIMEOUT_S instead of holding the store.

In process, `StoreServer` has the calls of torch's `Store` that the coordinator needs (`get`,
`set`, `check`, `compare_set`, `add`), and `PrefixView` is torch's `PrefixStore` for any object
with those calls.
"""

from __future__ import annotations

import enum
import socket
import struct
import threading
from collections.abc import Callable
from typing import Protocol

MAGIC = 0x3C85F7CE
MAX_KEY = 8 * 1024
MAX_VALUE = 8 * 1024 * 1024
MAX_KEYS = 128 * 1024
SEND_TIMEOUT_S = 10


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


class _Client:
    """One client connection: its socket, a reader over it, and the keys it waits for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")
        self.waiting: set[bytes] = set()

    def read(self, n: int) -> bytes:
        data = self.reader.read(n)
        if data is None or len(data) != n:
            raise EOFError
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


class StoreServer:
    """See the module docstring. `listen` serves clients on a port; `serve` one connection."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self.log = log  # told why each broken connection was closed
        self._data: dict[bytes, bytes] = {}
        self._clients: set[_Client] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.port = 0
        self.dropped: list[str] = []  # why each broken connection was closed, in order

    # ---- the network side
    def listen(self, host: str = "127.0.0.1", port: int = 0) -> StoreServer:
        """Accept clients at (host, port) on a thread; port 0 picks a free one (`self.port`)."""
        self._listener = socket.create_server((host, port), backlog=128)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=f"store:{self.port}").start()
        return self

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, sock: socket.socket) -> None:
        """Answer one client's queries until it leaves or breaks the protocol."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
        client = _Client(sock)
        with self._lock:
            self._clients.add(client)
        try:
            opening = client.read(5)
            if opening[0] != Query.VALIDATE or struct.unpack("<I", opening[1:])[0] != MAGIC:
                raise ProtocolError("the connection did not open with TCPStore's magic number")
            while True:
                self._query(client, client.read(1)[0])
        except EOFError:
            pass  # the client left
        except (ProtocolError, OSError) as e:
            self.dropped.append(str(e))
            if self.log is not None:
                self.log(f"store: closed a client's connection: {e}")
        finally:
            with self._lock:
                self._clients.discard(client)
            client.reader.close()
            sock.close()

    def close(self) -> None:
        """Stop listening and end every client's connection."""
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for c in self._clients:
                try:
                    c.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _query(self, c: _Client, q: int) -> None:
        """Read query `q`'s arguments (outside the lock: a slow client holds nobody), then do it
        and reply under the lock."""
        if q in (Query.SET, Query.APPEND):
            key, value = c.blob(MAX_KEY), c.blob(MAX_VALUE)
            with self._lock:
                self._write(key, self._data.get(key, b"") + value if q == Query.APPEND else value)
        elif q == Query.COMPARE_SET:
            key, expected, desired = c.blob(MAX_KEY), c.blob(MAX_VALUE), c.blob(MAX_VALUE)
            with self._lock:
                self._reply(c, _value(self._compare_set(key, expected, desired)))
        elif q == Query.GET:
            key = c.blob(MAX_KEY)
            with self._lock:
                self._reply(c, _value(self._data.get(key, b"")))
        elif q == Query.ADD:
            key, (delta,) = c.blob(MAX_KEY), struct.unpack("<q", c.read(8))
            with self._lock:
                self._reply(c, struct.pack("<q", self._add(key, delta)))
        elif q in (Query.CHECK, Query.WAIT, Query.MULTI_GET):
            keys = [c.blob(MAX_KEY) for _ in range(c.count())]
            with self._lock:
                self._keys_query(c, q, keys)
        elif q == Query.MULTI_SET:
            pairs = [(c.blob(MAX_KEY), c.blob(MAX_VALUE)) for _ in range(c.count())]
            with self._lock:
                for key, value in pairs:
                    self._write(key, value)
        else:
            self._plain_query(c, q)

    def _keys_query(self, c: _Client, q: int, keys: list[bytes]) -> None:
        missing = {k for k in keys if k not in self._data}
        if q == Query.CHECK:
            self._reply(c, NOT_READY if missing else READY)
        elif q == Query.MULTI_GET:
            self._reply(c, b"".join(_value(self._data.get(k, b"")) for k in keys))
        elif missing:
            c.waiting = missing  # answered by the write of the last one
        else:
            self._reply(c, STOP_WAITING)

    def _plain_query(self, c: _Client, q: int) -> None:
        if q == Query.PING:
            nonce = c.read(4)
            with self._lock:
                self._reply(c, nonce)
        elif q == Query.GETNUMKEYS:
            with self._lock:
                self._reply(c, struct.pack("<q", len(self._data)))
        elif q == Query.DELETE_KEY:
            key = c.blob(MAX_KEY)
            with self._lock:
                self._reply(c, struct.pack("<q", int(self._data.pop(key, None) is not None)))
        elif q == Query.CANCEL_WAIT:
            with self._lock:
                c.waiting = set()
                self._reply(c, WAIT_CANCELED)
        else:
            name = Query(q).name if q in Query._value2member_map_ else str(q)
            raise ProtocolError(f"query {name} is not served by this store")

    def _reply(self, c: _Client, data: bytes) -> None:
        """Send under the lock (replies keep their order); a client that does not read within
        SEND_TIMEOUT_S is cut off."""
        try:
            c.sock.sendall(data)
        except OSError:
            c.waiting = set()
            try:
                c.sock.shutdown(socket.SHUT_RDWR)  # its reader thread ends the connection
            except OSError:
                pass

    # ---- the data, under the lock
    def _write(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        for c in self._clients:
            if key in c.waiting:
                c.waiting.discard(key)
                if not c.waiting:
                    self._reply(c, STOP_WAITING)

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
        try:
            total = int(self._data.get(key, b"0")) + delta
        except ValueError:
            raise ProtocolError("ADD on a key that does not hold an integer") from None
        self._write(key, str(total).encode())
        return total

    # ---- in process: the calls of torch's Store, with the "/" its clients put before each key
    def get(self, key: str) -> bytes:
        """The value of `key`; KeyError if it has none (torch's `get` would wait for it)."""
        with self._lock:
            return self._data[_key(key)]

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._write(_key(key), _bytes(value))

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(_key(k) in self._data for k in keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with self._lock:
            return self._compare_set(_key(key), _bytes(expected), _bytes(desired))

    def add(self, key: str, amount: int) -> int:
        with self._lock:
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
