"""The coordinator's authenticated port, and the joining machine's forwarder to the run's store.

The coordinator hosts the run's TCPStore on 127.0.0.1 only: TCPStore has no authentication, and
anyone who can reach it can rewrite the run's state. The public port is a `Gateway`. Each
connection to it must pass `auth.server_handshake` first; one that does not is logged in one line
and closed, and it never gets a byte past the `REFUSED` line, nor a connection to the store.

An authenticated peer's first framed message says what it wants:

    {"want": "store"}   the connection is spliced to the TCPStore: raw bytes both ways, so
                        torch's TCPStore client works unchanged (through a `StoreTunnel`).
    anything else       handed to `serve(request, channel)`: the control channel (config, slot
                        assignment, pings), framed and MAC-protected.

`StoreTunnel` runs on a joining machine: it listens on 127.0.0.1, and each local connection
(a TCPStore client) gets its own authenticated connection to the gateway, spliced once
`{"want": "store"}` is sent.

Not protected: spliced store bytes carry no MAC and no encryption, so an attacker on the network
path could hijack a live connection after its handshake. Run on a private network or WireGuard
when the path is not trusted. Each connection costs a thread, for at most `handshake_timeout_s`
until it authenticates.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from frugaltrain.comm.auth import Channel, Refused, connect, server_handshake

_CHUNK = 1 << 16


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass  # already closed or reset


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until src ends, then end dst's write side; an error ends both sockets
    (so the other direction's pump wakes up too)."""
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
        _shutdown(dst, socket.SHUT_WR)
    except OSError:
        _shutdown(src)
        _shutdown(dst)


def splice(a: socket.socket, b: socket.socket) -> None:
    """Carry raw bytes both ways between a and b until both directions end, then close both."""
    for s in (a, b):
        s.settimeout(None)
    back = threading.Thread(target=_pump, args=(b, a), daemon=True, name="splice")
    back.start()
    _pump(a, b)
    back.join()
    a.close()
    b.close()


def _close_refused(sock: socket.socket) -> None:
    """Close after a refusal without a reset: drain what the peer already sent (bounded), so
    its REFUSED line is not lost to an RST."""
    _shutdown(sock, socket.SHUT_WR)
    try:
        sock.settimeout(1.0)
        for _ in range(16):
            if not sock.recv(4096):
                break
    except OSError:
        pass
    sock.close()


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


def _accept_loop(listener: socket.socket, sockets: _Sockets, handle: Callable) -> None:
    while not sockets.closed:
        try:
            conn, addr = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            break  # the listener was closed
        if not sockets.add(conn):
            conn.close()
            break
        peer = f"{addr[0]}:{addr[1]}"
        t = threading.Thread(target=handle, args=(conn, peer), daemon=True, name=peer)
        sockets.threads = [x for x in sockets.threads if x.is_alive()] + [t]
        t.start()


class _Server:
    """A listening socket, its accept thread and the connections it handed to `handle`."""

    def __init__(self) -> None:
        self._sockets = _Sockets()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def _serve_on(self, bind: str, port: int, handle: Callable, name: str) -> int:
        """Listen at (bind, port), port 0: a free one; returns the port."""
        self._listener = _listen(bind, port)
        port = self._listener.getsockname()[1]
        self._thread = threading.Thread(
            target=_accept_loop,
            args=(self._listener, self._sockets, handle),
            daemon=True,
            name=f"{name}:{port}",
        )
        self._thread.start()
        return port

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
        token: bytes,
        store_addr: tuple[str, int],
        serve: Callable[[dict, Channel], None],
        log: Callable[[str], None] = print,
        handshake_timeout_s: float = 10.0,
    ):
        self.bind, self.port = bind, port
        self.store_addr = store_addr
        self.serve = serve
        self.log = log
        self.handshake_timeout_s = handshake_timeout_s
        self.refused: list[tuple[str, str]] = []  # (peer, reason), in order
        self._token = token
        super().__init__()

    def start(self) -> Gateway:
        self.port = self._serve_on(self.bind, self.port, self._handle, "gateway")
        return self

    def _handle(self, conn: socket.socket, peer: str) -> None:
        try:
            key = server_handshake(conn, self._token, self.handshake_timeout_s)
        except Refused as e:
            self.refused.append((peer, str(e)))
            self.log(f"refused {peer}: {e}")
            _close_refused(conn)
            self._sockets.discard(conn)
            return
        channel = Channel(conn, key, client=False, peer=peer)
        try:
            request = channel.recv(timeout_s=self.handshake_timeout_s)
            if request.get("want") == "store":
                self._splice_store(conn, peer)
            else:
                self.serve(request, channel)
        except (OSError, Refused) as e:  # ConnectionError and TimeoutError are OSErrors
            self.log(f"dropped {peer}: {e}")
        except Exception as e:  # a bug in serve: say so, and keep the gateway up
            self.log(f"serve failed for {peer}: {e!r}")
        finally:
            self._sockets.discard(conn)
            channel.close()

    def _splice_store(self, conn: socket.socket, peer: str) -> None:
        try:
            store = socket.create_connection(self.store_addr, timeout=self.handshake_timeout_s)
        except OSError as e:
            host, port = self.store_addr
            self.log(f"dropped {peer}: cannot reach the store at {host}:{port}: {e}")
            return
        store.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self._sockets.add(store):
            store.close()
            return
        try:
            splice(conn, store)
        finally:
            self._sockets.discard(store)


class StoreTunnel(_Server):
    """A local port for TCPStore clients on a joining machine, forwarded through the gateway."""

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        timeout_s: float = 10.0,
        log: Callable[[str], None] = print,
    ):
        self.host, self.gateway_port = host, port
        self.timeout_s = timeout_s
        self.log = log
        self.port = 0  # the local port, once started
        self._token = token
        super().__init__()

    def start(self) -> StoreTunnel:
        self.port = self._serve_on("127.0.0.1", 0, self._forward, "store-tunnel")
        return self

    def _forward(self, local: socket.socket, peer: str) -> None:
        try:
            channel = connect(self.host, self.gateway_port, self._token, self.timeout_s)
            channel.send({"want": "store"})  # from here on the socket carries raw bytes
        except (OSError, Refused) as e:
            self.log(f"store tunnel: {e}")
            self._sockets.discard(local)
            local.close()
            return
        remote = channel.sock
        remote.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self._sockets.add(remote):
            local.close()
            remote.close()
            return
        try:
            splice(local, remote)
        finally:
            self._sockets.discard(local, remote)
