"""The coordinator's authenticated port, and the joining machine's forwarder to the run's store.

The coordinator's store listens on no port: TCPStore has no authentication, and anyone who can
reach it can rewrite the run's state. The public port is a `Gateway`, which hands each
authenticated store connection to the store in process (or, in tests, connects to a store's
address). Each connection to it must pass TLS and then `auth.server_handshake` first; one that
does not is logged in one line and closed, and it never gets a byte past the `REFUSED` line,
nor a connection to the store.

An authenticated peer's first framed message says what it wants:

    {"want": "store"}   the connection is spliced to the TCPStore: raw bytes both ways, so
                        torch's TCPStore client works unchanged (through a `StoreTunnel`).
    anything else       handed to `serve(request, channel)`: the control channel (config, slot
                        assignment, pings), framed and MAC-protected.

`StoreTunnel` runs on a joining machine: it listens on 127.0.0.1 for the processes of its own
user (another user's connection is refused, `peer_uid`: it would ride the token's authority),
and each local connection (a TCPStore client) gets its own authenticated connection to the gateway,
spliced once `{"want": "store"}` is sent. With `hold_s` > 0 it reads the store protocol instead of
splicing, so that a client's connection outlives a coordinator restart: requests wait while the
gateway is away and are replayed once it is back, each mutation applied once (`StoreTunnel`).

Every byte on the gateway's port travels inside TLS 1.3 (tls.py), the store's included: an
attacker on the network path can neither read the store's keys and values nor slip bytes in (a
record that fails its check ends the connection, logged as "dropped"). The store tunnel's side
towards its own workers is loopback, for this user's processes only.

What a flood of connections costs: each connection not yet authenticated holds a thread and a
file until its handshake ends, refusal included, `handshake_timeout_s` after it began at the
latest (an absolute deadline: a peer that trickles bytes cannot extend it). At most
MAX_PENDING of them are in the handshake at once, MAX_PENDING_PER_ADDRESS from one address (an
IPv6 /64 counts as one); a connection over either cap is closed as soon as it is accepted,
unread. Running out of files or threads costs the connections that met it, never the port: the
accept loop pauses and goes on (store.py's `accepted`). Peers that flood from many addresses can
still keep a token holder out while they do: the caps bound what a flood holds, not who gets in.
"""

from __future__ import annotations

import collections
import ipaddress
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from frugaltrain.cluster import tls
from frugaltrain.cluster.auth import Channel, Refused, RunToken, connect, server_handshake
from frugaltrain.cluster.store import (
    MAGIC,
    MUTATIONS,
    NO_REPLY,
    RELAY_ID,
    WAIT_CANCELED,
    ProtocolError,
    Query,
    Reader,
    accepted,
    read_args,
    read_reply,
    start_thread,
    tagged,
)
from frugaltrain.cluster.tls import TlsSocket

_CHUNK = 1 << 16
# Connections in the handshake at once. Each holds a thread and a file for up to
# handshake_timeout_s: 64 is half of a small open-files limit (128), the rest left to the store's
# connections and the run's files, while an honest handshake lasts a round trip and a half, so
# even many machines starting together have few in flight.
MAX_PENDING = 64
# ... and from one address: a joining machine opens one connection per local store client (its
# agent's, and a few per worker), all at once when its workers start. A connection over a cap
# sees EOF before the challenge, which its handshake reports as "not a coordinator".
MAX_PENDING_PER_ADDRESS = 16
REFUSED_KEPT = 1000
DRAIN_S = 1.0  # after a refusal, the longest we read what the peer sent (within the deadline)
_TURNED_AWAY_LOG_S = 10.0  # one log line per this long, at most, about connections over a cap


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass  # already closed or reset


def _pump(src, dst, note: Callable[[str], None]) -> None:
    """Copy src to dst until src ends, then end dst's write side; an error ends both sockets
    (so the other direction's pump wakes up too), and a broken TLS record is noted."""
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
        _shutdown(dst, socket.SHUT_WR)
    except OSError as e:
        if isinstance(e, tls.TlsError):
            note(str(e))
        _shutdown(src)
        _shutdown(dst)


def splice(a, b, note: Callable[[str], None] = lambda why: None) -> None:
    """Carry raw bytes both ways between a and b (sockets, or TLS connections) until both
    directions end, then close both. `note` hears why a TLS connection broke."""
    for s in (a, b):
        s.settimeout(None)
    back = threading.Thread(target=_pump, args=(b, a, note), daemon=True, name="splice")
    back.start()
    _pump(a, b, note)
    back.join()
    a.close()
    b.close()


def _close_refused(sock: socket.socket, deadline: float) -> None:
    """Close after a refusal without a reset: read what the peer sent until it ends its side or
    `deadline` (time.monotonic()) passes, so that its REFUSED line is not lost to an RST. The
    deadline is absolute: with a timeout per read, a peer that trickles a byte at a time could
    hold the thread for as many reads as we allow."""
    _shutdown(sock, socket.SHUT_WR)
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(4096):
                break
    except OSError:
        pass
    sock.close()


def _no_tls(e: OSError, timeout_s: float) -> str:
    """Why a connection that failed in its TLS handshake is refused."""
    if isinstance(e, TimeoutError):
        return f"no TLS handshake within {timeout_s:g} s (not a frugaltrain client)"
    return f"no TLS handshake: {e.strerror or e}"


def _source(host: str) -> str:
    """What the per-address cap counts a connection against: its IPv4 address (an IPv4-mapped
    IPv6 one included), or its IPv6 /64, since one machine may hold a whole /64."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class _Pending:
    """The connections still in the handshake, counted overall and per source (`_source`), and
    those turned away for being over MAX_PENDING or MAX_PENDING_PER_ADDRESS. Without a cap, idle
    connections would hold a thread and a file each until the process runs out of one."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.total = 0
        self.turned_away = 0
        self._by_source: dict[str, int] = {}
        self._lock = threading.Lock()
        self._logged_at = -_TURNED_AWAY_LOG_S

    def admit(self, host: str, peer: str) -> bool:
        """Count a new connection from `host` in, or turn it away (logged at most once per
        _TURNED_AWAY_LOG_S: a flood must not flood the log too)."""
        source = _source(host)
        with self._lock:
            n = self._by_source.get(source, 0)
            if self.total < MAX_PENDING and n < MAX_PENDING_PER_ADDRESS:
                self._by_source[source] = n + 1
                self.total += 1
                return True
            self.turned_away += 1
            now = time.monotonic()
            say = now - self._logged_at >= _TURNED_AWAY_LOG_S
            if say:
                self._logged_at = now
            total, turned_away = self.total, self.turned_away
        if say:
            try:
                self.log(
                    f"turned away {peer}: {total} connections in the handshake, {n} from "
                    f"{source} (at most {MAX_PENDING}, {MAX_PENDING_PER_ADDRESS} per address); "
                    f"{turned_away} turned away so far"
                )
            except Exception:  # noqa: BLE001 (the accept loop must outlive its log)
                pass
        return False

    def release(self, host: str) -> None:
        """A connection counted in by `admit` has left the handshake."""
        source = _source(host)
        with self._lock:
            self.total -= 1
            if self._by_source[source] == 1:
                del self._by_source[source]
            else:
                self._by_source[source] -= 1


class _Sockets:
    """The open sockets of a Gateway or StoreTunnel and the threads that handle them, so close()
    can end every connection and wait for its handler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.threads: list[threading.Thread] = []
        self.closed = False

    def add(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self.closed:
                return False
            self._open.update(socks)
            return True

    def discard(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.difference_update(socks)

    def close_all(self) -> None:
        with self._lock:
            self.closed = True
            socks, self._open = list(self._open), set()
        for s in socks:
            _shutdown(s)  # wakes the thread blocked on it, which closes it

    def join(self, timeout_s: float) -> None:
        """Wait (bounded: `serve` may be busy elsewhere) for the connection handlers to end."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _listen(bind: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((bind, port))
    sock.listen(128)
    sock.settimeout(0.2)  # the accept loop checks for close() this often
    return sock


class _Server:
    """A listening socket, its accept thread and the connections it handed to `handle`; with
    `_pending` (the Gateway), the connections in the handshake are capped."""

    log: Callable[[str], None]

    def __init__(self, pending: _Pending | None = None) -> None:
        self._sockets = _Sockets()
        self._pending = pending
        self._name = ""  # in log lines: the gateway, or the store tunnel
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def _serve_on(self, bind: str, port: int, handle: Callable, name: str) -> int:
        """Listen at (bind, port), port 0: a free one; returns the port."""
        self._listener = _listen(bind, port)
        self._name = name
        port = self._listener.getsockname()[1]
        self._thread = threading.Thread(
            target=self._accept_loop, args=(handle,), daemon=True, name=f"{name}:{port}"
        )
        self._thread.start()
        return port

    def _accept_loop(self, handle: Callable) -> None:
        """Hand each connection to `handle` on a thread of its own until close(); running out
        of files or threads does not end it (store.py's `accepted` and `start_thread`)."""
        assert self._listener is not None
        for conn, addr in accepted(self._listener, lambda: self._sockets.closed, self._say):
            peer = f"{addr[0]}:{addr[1]}"
            if self._pending is not None and not self._pending.admit(addr[0], peer):
                conn.close()  # over a cap: at once, unread
                continue
            t = None
            if self._sockets.add(conn):  # else closing
                t = start_thread(conn, handle, (conn, peer), peer, self._say)
            if t is not None:
                self._sockets.threads = [x for x in self._sockets.threads if x.is_alive()] + [t]
                continue
            conn.close()  # closing, or no thread for it
            self._sockets.discard(conn)
            if self._pending is not None:
                self._pending.release(addr[0])

    def _say(self, line: str) -> None:
        self.log(f"{self._name}: {line}")

    def close(self) -> None:
        """Stop accepting, and end every open connection (and splice)."""
        self._sockets.close_all()
        if self._listener is not None:
            self._listener.close()
        if self._thread is not None:
            self._thread.join()
        self._sockets.join(timeout_s=5.0)


class Gateway(_Server):
    """The coordinator's public port: authenticate, then splice to the store or call `serve`."""

    def __init__(
        self,
        bind: str,
        port: int,
        token: RunToken,
        store: tuple[str, int] | Callable[[], socket.socket],
        serve: Callable[[dict, Channel], None],
        log: Callable[[str], None] = print,
        handshake_timeout_s: float = 10.0,
    ):
        self.bind, self.port = bind, port
        self.store = store  # a store's address, or what hands a connection to one in process
        self.serve = serve
        self.log = log
        self.handshake_timeout_s = handshake_timeout_s
        # (peer, reason), in order: the newest REFUSED_KEPT, so a long flood holds no memory
        self.refused: collections.deque[tuple[str, str]] = collections.deque(maxlen=REFUSED_KEPT)
        self._token = token
        self._tls = token.server_context()  # before any connection: a missing key fails here
        self._gate = _Pending(log)
        super().__init__(self._gate)

    def start(self) -> Gateway:
        self.port = self._serve_on(self.bind, self.port, self._handle, "gateway")
        return self

    @property
    def pending(self) -> int:
        """Connections in the handshake now (accepted, neither authenticated nor closed)."""
        return self._gate.total

    @property
    def turned_away(self) -> int:
        """Connections closed unread for being over MAX_PENDING or MAX_PENDING_PER_ADDRESS."""
        return self._gate.turned_away

    def _authenticate(self, conn: socket.socket, peer: str) -> tuple[TlsSocket, bytes] | None:
        """TLS, then the token: the TLS connection and the session key, or None with the peer
        refused and its connection closed, all by `handshake_timeout_s` after it started; it
        counts as pending until then."""
        deadline = time.monotonic() + self.handshake_timeout_s
        sock: socket.socket | TlsSocket = conn
        try:
            sock = tls.accept(conn, self._tls, deadline)
            timeout_s = self.handshake_timeout_s
            return sock, server_handshake(sock, self._token.secret, timeout_s, deadline=deadline)
        except (Refused, tls.TlsError, TimeoutError, OSError) as e:
            timeout_s = self.handshake_timeout_s
            reason = str(e) if isinstance(e, (Refused, tls.TlsError)) else _no_tls(e, timeout_s)
            self.refused.append((peer, reason))
            try:
                self.log(f"refused {peer}: {reason}")
            finally:  # a log that fails never leaks the socket
                _close_refused(sock, min(deadline, time.monotonic() + DRAIN_S))
                self._sockets.discard(conn)
            return None
        finally:
            self._gate.release(peer.rsplit(":", 1)[0])

    def _handle(self, conn: socket.socket, peer: str) -> None:
        authenticated = self._authenticate(conn, peer)
        if authenticated is None:
            return
        sock, key = authenticated
        channel = Channel(sock, key, client=False, peer=peer)
        try:
            request = channel.recv(timeout_s=self.handshake_timeout_s)
            if request.get("want") == "store":
                self._splice_store(sock, peer)
            else:
                self.serve(request, channel)
        except (OSError, Refused) as e:  # ConnectionError and TimeoutError are OSErrors
            self.log(f"dropped {peer}: {e}")
        except Exception as e:  # a bug in serve: say so, and keep the gateway up
            self.log(f"serve failed for {peer}: {e!r}")
        finally:
            self._sockets.discard(conn)
            channel.close()

    def _splice_store(self, conn: TlsSocket, peer: str) -> None:
        try:
            store = self._open_store()
        except OSError as e:
            self.log(f"dropped {peer}: cannot reach the store: {e}")
            return
        if not self._sockets.add(store):
            store.close()
            return
        try:
            splice(conn, store, lambda why: self.log(f"dropped {peer}: {why}"))
        finally:
            self._sockets.discard(store)

    def _open_store(self) -> socket.socket:
        """A new connection to the store: handed over in process (the coordinator's store has
        no port: only authenticated peers reach it), or over TCP to an address."""
        if callable(self.store):
            return self.store()
        sock = socket.create_connection(self.store, timeout=self.handshake_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


_PROC_TCP = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def peer_uid(conn: socket.socket, tries: int = 5) -> int | None:
    """The user owning the other end of a loopback TCP connection (None: not found, or no
    /proc/net/tcp: not Linux). TCP has no SO_PEERCRED, but the kernel lists every socket with
    its owner: the other end is the row whose local port is our peer's and remote port ours.
    The table is read a page at a time while sockets come and go, so a row can be missed on
    one reading: a few are tried."""
    try:
        ours, theirs = conn.getsockname()[1], conn.getpeername()[1]
    except OSError:
        return None
    for attempt in range(tries):
        uid = _uid_in_tables(ours, theirs)
        if uid is not None:
            return uid
        time.sleep(0.01 * (attempt + 1))
    return None


def _uid_in_tables(ours: int, theirs: int) -> int | None:
    for table in _PROC_TCP:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()  # sl local remote st queues tr retrnsmt uid ...
            if (
                int(f[1].rsplit(":", 1)[1], 16) == theirs
                and int(f[2].rsplit(":", 1)[1], 16) == ours
            ):
                return int(f[7])
    return None


class StoreTunnel(_Server):
    """A local port for TCPStore clients on a joining machine, forwarded through the gateway.

    With `hold_s` 0 each local connection is spliced to its gateway connection: when the
    coordinator goes, the client's connection goes with it. With `hold_s` > 0 each local
    connection gets a `_Relay` that reads the client's queries and the store's replies whole
    and keeps every request not yet answered. When the gateway connection breaks, the client's
    connection stays open: the relay reconnects every _RETRY_S for up to `hold_s` seconds and
    replays, in order, what is unanswered and what the client sent meanwhile; past `hold_s` it
    closes the client's connection (the client errors as it would have without a hold).

    What a replay does, on a coordinator restarted with its store's journal: every mutation is
    applied exactly once. The relay tags each SET, APPEND, MULTI_SET, COMPARE_SET, ADD and
    DELETE_KEY with its own random id and a growing seq (store.py's `TAGGED`); the store applies
    a tag's query only if its seq is past the last one it applied for that relay, and journals
    the relay's last seq and last reply in the same record as the change. So an ADD or APPEND
    whose reply was lost after the old store applied and journaled it is not applied again: the
    replay gets the reply the first one had (the same total, the same COMPARE_SET value, the
    same DELETE_KEY count), and a replayed SET, MULTI_SET or COMPARE_SET cannot undo another
    client's write made between the original and the replay. Reads (GET, CHECK, MULTI_GET,
    GETNUMKEYS, PING) are sent again untagged and answer from the store as it is then. A WAIT
    is sent again with all its keys: those already written answer at once.

    `away_since` is time.monotonic() when the gateway was found gone and is not back yet, else
    None; `held` counts the requests waiting for a reply (or, without one, not yet known
    applied) over all local connections.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: RunToken,
        timeout_s: float = 10.0,
        log: Callable[[str], None] = print,
        hold_s: float = 0.0,
    ):
        self.host, self.gateway_port = host, port
        self.timeout_s = timeout_s
        self.log = log
        self.hold_s = hold_s
        self.port = 0  # the local port, once started
        self.away_since: float | None = None
        self._token = token
        self._relays: set[_Relay] = set()
        self._away_lock = threading.Lock()
        super().__init__()

    def start(self) -> StoreTunnel:
        handle = self._hold if self.hold_s > 0 else self._forward
        self.port = self._serve_on("127.0.0.1", 0, self._own_user_only(handle), "store-tunnel")
        return self

    def _own_user_only(self, handle: Callable) -> Callable:
        """`handle` for connections from processes of this user only: the tunnel carries its
        own token's authority, so another local user must not ride it to the store."""
        me = os.getuid()

        def checked(conn: socket.socket, peer: str) -> None:
            uid = peer_uid(conn)
            if uid == me or (uid is None and not _PROC_TCP[0].exists()):
                return handle(conn, peer)
            who = "an unknown user" if uid is None else f"uid {uid}"
            self.log(f"store tunnel: refused {peer}, a process of {who}: it serves uid {me} only")
            self._sockets.discard(conn)
            conn.close()

        return checked

    @property
    def held(self) -> int:
        return sum(r.held for r in list(self._relays))

    def _open_store(self, timeout_s: float) -> socket.socket:
        """An authenticated gateway connection that carries raw store bytes from here on."""
        channel = connect(self.host, self.gateway_port, self._token, timeout_s)
        channel.send({"want": "store"})
        remote = channel.sock
        remote.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return remote

    def _forward(self, local: socket.socket, peer: str) -> None:
        try:
            remote = self._open_store(self.timeout_s)
        except (OSError, Refused) as e:
            self.log(f"store tunnel: {e}")
            self._sockets.discard(local)
            local.close()
            return
        if not self._sockets.add(remote):
            local.close()
            remote.close()
            return
        try:
            splice(local, remote)
        finally:
            self._sockets.discard(local, remote)

    def _hold(self, local: socket.socket, peer: str) -> None:
        relay = _Relay(self, local)
        self._relays.add(relay)
        try:
            relay.run()
        finally:
            self._relays.discard(relay)
            self._sockets.discard(local)

    def _went_away(self) -> None:
        with self._away_lock:
            if self.away_since is None:
                self.away_since = time.monotonic()
                self.log(
                    f"store tunnel: lost the coordinator at {self.host}:{self.gateway_port}; "
                    f"holding {self.held} requests, up to {self.hold_s:g} s"
                )

    def _came_back(self) -> None:
        with self._away_lock:
            if self.away_since is not None:
                away = time.monotonic() - self.away_since
                self.away_since = None
                self.log(
                    f"store tunnel: the coordinator at {self.host}:{self.gateway_port} is back "
                    f"after {away:.1f} s; replaying {self.held} requests"
                )


_HELLO = bytes([Query.VALIDATE]) + struct.pack("<I", MAGIC)
_RETRY_S = 0.5
# Store connections in a row that end with requests held and no reply before the relay gives
# up: the store closes a connection on a query it refuses (an ADD past int64, a key over its
# limit), so replaying that query would be refused forever.
_FRUITLESS = 3
_CONFIRM_AFTER = 16  # no-reply requests in a row before the relay sends a PING of its own
_OWN_PING = bytes([Query.PING]) + b"ftrl"


@dataclass
class _Request:
    """One whole request as the client sent it (a mutation tagged: `raw` is what is sent and
    replayed, `query` the client's own); `own`: the relay's PING (its echo is not passed on);
    `n_keys`: MULTI_GET's number of keys (of values in its reply)."""

    query: int
    raw: bytes
    n_keys: int = 0
    own: bool = False


class _Relay:
    """One local TCPStore client's connection through the gateway, held while the gateway is
    away (see StoreTunnel). The handler thread reads the client's requests and sends them; a
    second thread owns the gateway connection: it connects, replays what is unanswered, and
    passes the replies back whole.

    A request leaves `pending` when a reply shows the store handled it: its own reply, or, for
    SET, APPEND and MULTI_SET (no reply), the reply to any later request, since the store
    handles one connection's queries in order. Until then a no-reply request is replayed too:
    the break may have come before the store read it. A client that only sets would keep them
    all, so after _CONFIRM_AFTER of them in a row the relay sends a PING of its own, whose echo
    proves them applied. Assumes torch's client: while a WAIT is unanswered it sends nothing
    but CANCEL_WAIT (the one byte of STOP_WAITING could not be told from another reply); and
    it waits for each reply before its next query, so a replayed mutation with a reply is the
    last one the store kept a reply for (see store.py's TAGGED). Mutations are sent tagged, and
    kept and replayed so; a TAGGED query from the client itself is refused.
    """

    def __init__(self, tunnel: StoreTunnel, local: socket.socket) -> None:
        self.tunnel, self.local = tunnel, local
        self.id = os.urandom(RELAY_ID)  # the store applies each of its mutations once, by seq
        self.seq = 0  # of the last mutation read from the client
        self.pending: list[_Request] = []  # in the order sent, until known handled
        self.remote: socket.socket | None = None  # None while away: requests wait in pending
        self._lock = threading.Lock()  # pending and remote
        self._send_lock = threading.Lock()  # bytes to the gateway in order: a replay, then new
        self._done = threading.Event()  # the client left, or the relay gave up

    @property
    def held(self) -> int:
        return sum(not x.own for x in list(self.pending))

    def run(self) -> None:
        """Relay until the client leaves, the gateway stays away past hold_s, or close()."""
        self.local.settimeout(None)
        remote = threading.Thread(target=self._remote_loop, daemon=True, name="store-relay")
        remote.start()
        try:
            self._read_requests()
        except (EOFError, OSError):
            pass  # the client left, or its connection was closed here
        except ProtocolError as e:
            self.tunnel.log(f"store tunnel: closed a client's connection: {e}")
        finally:
            self._done.set()
            with self._lock:
                if self.remote is not None:
                    _shutdown(self.remote)  # wakes the remote thread
            remote.join(self.tunnel.timeout_s + _RETRY_S)
            self.local.close()

    # ---- the client's side: its requests, read whole
    def _read_requests(self) -> None:
        r = Reader(self.local)
        r.opening()  # checked here; each gateway connection gets the relay's own
        while True:
            r.taken = bytearray()
            q = r.read(1)[0]
            args = read_args(r, q)  # a TAGGED query from the client is not served
            n_keys = len(args[0]) if q == Query.MULTI_GET else 0
            raw = bytes(r.taken)
            if q in MUTATIONS:
                self.seq += 1
                raw = tagged(self.id, self.seq, raw)
            self._submit(_Request(q, raw, n_keys))

    def _submit(self, req: _Request) -> None:
        """Keep `req` until it is answered; send it now if the gateway is there (else the
        replay will)."""
        with self._send_lock:
            with self._lock:
                self.pending.append(req)
                data = req.raw + self._confirm()
                sock = self.remote
            if sock is not None:
                self._send(sock, data)

    def _confirm(self) -> bytes:
        """The relay's own PING after _CONFIRM_AFTER no-reply requests in a row (see the class
        docstring); none while a WAIT is unanswered (its reply could come before the echo)."""
        tail = self.pending[-_CONFIRM_AFTER:]
        if len(tail) < _CONFIRM_AFTER or any(x.query not in NO_REPLY for x in tail):
            return b""
        if any(x.query == Query.WAIT for x in self.pending):
            return b""
        self.pending.append(_Request(Query.PING, _OWN_PING, own=True))
        return _OWN_PING

    def _send(self, sock: socket.socket, data: bytes) -> None:
        try:
            sock.sendall(data)
        except OSError:
            _shutdown(sock)  # the remote thread sees the break, reconnects and replays

    # ---- the gateway's side
    def _remote_loop(self) -> None:
        deadline = time.monotonic() + self.tunnel.hold_s  # the first connection is held too
        fruitless = 0  # connections in a row that ended with requests held and none answered
        while (sock := self._connect(deadline)) is not None:
            answered = self._serve(sock)
            if self._stopping():
                break
            fruitless = 0 if answered or not self.held else fruitless + 1
            if fruitless >= _FRUITLESS:  # the store refuses a held request: replaying is futile
                self.tunnel.log(
                    f"store tunnel: the store closed {fruitless} connections in a row without "
                    f"answering the client's next request; closing the client's connection"
                )
                break
            self.tunnel._went_away()
            deadline = time.monotonic() + self.tunnel.hold_s
        _shutdown(self.local)  # gave up or done: the client's next read fails, as without a hold

    def _connect(self, deadline: float) -> socket.socket | None:
        """A gateway connection, tried every _RETRY_S until `deadline`; None when the relay
        gives up or is done."""
        t = self.tunnel
        while not self._stopping():
            timeout_s = min(t.timeout_s, max(_RETRY_S, deadline - time.monotonic()))
            try:
                sock = t._open_store(timeout_s)
            except (OSError, Refused) as e:
                t._went_away()
                if time.monotonic() >= deadline:
                    t.log(
                        f"store tunnel: the coordinator at {t.host}:{t.gateway_port} did not come "
                        f"back within {t.hold_s:g} s ({e}); closing a store client's connection "
                        f"with {self.held} requests held"
                    )
                    self._done.set()
                    return None
                self._done.wait(_RETRY_S)
                continue
            if not t._sockets.add(sock):
                sock.close()  # the tunnel is closing
                return None
            t._came_back()
            return sock
        return None

    def _stopping(self) -> bool:
        return self._done.is_set() or self.tunnel._sockets.closed

    def _serve(self, sock: socket.socket) -> int:
        """Replay what is unanswered on `sock`, then pass its replies back until it breaks;
        the number of replies passed."""
        sock.settimeout(None)
        replay = threading.Thread(target=self._replay, args=(sock,), daemon=True)
        replay.start()  # on its own thread: replies to a long replay are read meanwhile
        reader = Reader(sock)
        answered = 0
        try:
            while True:
                self._pass_reply(reader)
                answered += 1
        except (EOFError, OSError):
            pass  # the gateway went: the caller holds and reconnects
        except ProtocolError as e:
            self.tunnel.log(f"store tunnel: closed a client's connection: {e}")
            self._done.set()
        finally:
            _shutdown(sock)
            replay.join()  # before remote is cleared: a late replay must not set it again
            with self._lock:
                self.remote = None
            self.tunnel._sockets.discard(sock)
            reader.file.close()
            sock.close()
        return answered

    def _replay(self, sock: socket.socket) -> None:
        """The opening, then every unanswered request, before any new one (the send lock)."""
        with self._send_lock:
            with self._lock:
                self.remote = sock
                data = _HELLO + b"".join(x.raw for x in self.pending)
            self._send(sock, data)

    def _pass_reply(self, r: Reader) -> None:
        """Read the next reply whole, drop the requests it shows handled, pass it on."""
        if not r.file.peek(1):
            raise EOFError  # a reply has begun, so its request is in pending
        with self._lock:
            i = next((i for i, x in enumerate(self.pending) if x.query not in NO_REPLY), None)
            if i is None:
                raise ProtocolError("the store sent a reply to no request")
            head = self.pending[i]
        reply = read_reply(r, head.query, head.n_keys)
        with self._lock:
            last = i
            if head.query == Query.WAIT and reply == WAIT_CANCELED:
                last = self._cancel_after(i)  # cancelled first: this byte answers both
            del self.pending[: last + 1]
        if not head.own:
            try:
                self.local.sendall(reply)
            except OSError:
                self._done.set()  # the client left
                raise EOFError from None

    def _cancel_after(self, i: int) -> int:
        for j in range(i + 1, len(self.pending)):
            if self.pending[j].query == Query.CANCEL_WAIT:
                return j
        raise ProtocolError("the store cancelled a wait the client did not cancel")
