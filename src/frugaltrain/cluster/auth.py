"""Run tokens and the mutual challenge-response that guards a coordinator's public port.

A run across machines has one shared secret, the run token: 32 random bytes kept as 64 hex
characters in a file that only its owner can read (`new_token`, `read_token`). The TCPStore has
no authentication, so the coordinator's store listens on no port, and every machine that joins
proves the token to the coordinator's gateway first, without ever sending it:

    server -> client    FTAUTH1 <nonce_s hex>\\n
    client -> server    <nonce_c hex> <HMAC(token, "client" + nonce_s + nonce_c) hex>\\n
    server -> client    OK <HMAC(token, "server" + nonce_c + nonce_s) hex>\\n
                        or REFUSED <reason>\\n, and nothing more
    both                session key = HMAC(token, "session" + nonce_s + nonce_c)

Each side picks a fresh 32-byte nonce, so a recorded response is useless on a new connection (a
replay is a wrong HMAC), and the server proves the token back, so a fake coordinator without it
is refused by the client too. The "client"/"server" prefixes keep one side's proof from being
reflected as the other's. Lines are bounded and every read has a deadline: a silent or chatty
peer costs one thread for at most `timeout_s`.

After the handshake, `Channel` frames JSON messages with an HMAC under the session key and a
sequence number per direction: a frame cannot be altered, replayed, reordered or sent back to its
sender. Nothing is encrypted (the messages are config and slot numbers, not secrets). Nothing
received is ever unpickled or eval'ed: only JSON, and raw bytes for the store.

What this does not protect: once a connection is spliced to the TCPStore (gateway.py), its bytes
carry no per-message MAC, so an attacker on the path could hijack the live TCP connection after
the handshake. Run on a private network or a WireGuard tunnel when the path is not trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import threading
import time
from pathlib import Path

from frugaltrain.config import ConfigError

TOKEN_BYTES = 32
NONCE_BYTES = 32
MAX_LINE = 512  # a handshake line is ~130 bytes; anything longer is not a handshake
MAX_FRAME = 64 << 20  # bytes of JSON in one Channel frame
STALL_S = 30.0  # once a frame has started, the longest wait for its next bytes
_MAGIC = b"FTAUTH1"
_NO_TOKEN = "no token (not a frugaltrain handshake)"
_HEX = frozenset(b"0123456789abcdef")


class Refused(Exception):
    """The other side failed (or refused) authentication; str() is one line saying why."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


# ---- token files
def new_token(path: str | Path) -> None:
    """Write a fresh run token to `path`, mode 0600, atomically; never replace an existing one
    (machines already holding the old token would be locked out of the run)."""
    path = Path(path)
    if path.exists():
        raise ConfigError(
            f"{path} exists; a run's token is never overwritten: remove it or choose another path"
        )
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(TOKEN_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path)
    except FileExistsError:
        raise ConfigError(
            f"{path} exists; a run's token is never overwritten: remove it or choose another path"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)


def _publish(tmp: Path, path: Path) -> None:
    """Give the finished file its name; a hard link, unlike rename, fails if `path` appeared
    meanwhile (rename is the fallback where the file system has no hard links)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        if path.exists():
            raise FileExistsError(path) from None
        os.replace(tmp, path)


def read_token(path: str | Path) -> bytes:
    """The run token's 32 raw bytes; a one-line ConfigError naming the file and the fix."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        raise ConfigError(
            f"token file {path} does not exist: `frugaltrain coordinator --new-token {path}` "
            "writes one; copy it to each machine"
        ) from None
    except OSError as e:
        raise ConfigError(f"token file {path} cannot be read: {e.strerror or e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"token file {path} is readable by group or others (mode {stat.S_IMODE(mode):o}): "
            f"chmod 600 {path}"
        )
    if len(text) != 2 * TOKEN_BYTES or not set(text.lower().encode()) <= _HEX:
        raise ConfigError(
            f"token file {path} does not hold a token ({2 * TOKEN_BYTES} hex characters): "
            f"write a new one with `frugaltrain coordinator --new-token FILE`"
        )
    return bytes.fromhex(text)


# ---- the handshake
def _peer(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else "local"


def _read_line(sock: socket.socket, deadline: float) -> bytes | None:
    """One line without its newline, read a byte at a time so nothing after it is consumed.
    None on EOF; raises TimeoutError past the deadline and ValueError past MAX_LINE."""
    line = bytearray()
    while len(line) <= MAX_LINE:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        b = sock.recv(1)
        if not b:
            return None
        if b == b"\n":
            return bytes(line)
        line += b
    raise ValueError(f"line longer than {MAX_LINE} bytes")


def _hex_field(field: bytes, n: int) -> bytes | None:
    """`n` bytes from exactly 2n lowercase hex characters, else None."""
    if len(field) != 2 * n or not set(field) <= _HEX:
        return None
    return bytes.fromhex(field.decode())


def _check_response(line: bytes | None, token: bytes, nonce_s: bytes) -> bytes:
    """The client's nonce from its response line, or Refused with the server's reason."""
    fields = (line or b"").split(b" ")
    if len(fields) != 2:
        raise Refused(_NO_TOKEN)
    nonce_c, proof = _hex_field(fields[0], NONCE_BYTES), _hex_field(fields[1], 32)
    if nonce_c is None or proof is None:
        raise Refused(_NO_TOKEN)
    if not hmac.compare_digest(proof, _mac(token, b"client", nonce_s, nonce_c)):
        raise Refused("wrong token")
    return nonce_c


def server_handshake(sock: socket.socket, token: bytes, timeout_s: float = 10.0) -> bytes:
    """Challenge the peer; the session key if it proves the token. On failure the peer gets one
    `REFUSED <reason>` line, our side stops writing, and Refused is raised (the caller closes)."""
    deadline = time.monotonic() + timeout_s
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    try:
        sock.settimeout(timeout_s)
        sock.sendall(_MAGIC + b" " + nonce_s.hex().encode() + b"\n")
        nonce_c = _check_response(_read_line(sock, deadline), token, nonce_s)
        sock.sendall(b"OK " + _mac(token, b"server", nonce_c, nonce_s).hex().encode() + b"\n")
    except Refused as e:
        reason = str(e)
    except TimeoutError:
        reason = f"{_NO_TOKEN}: no handshake within {timeout_s:g} s"
    except ValueError as e:
        reason = f"{_NO_TOKEN}: {e}"
    except OSError as e:
        reason = f"{_NO_TOKEN}: {e.strerror or e}"
    else:
        return _mac(token, b"session", nonce_s, nonce_c)
    try:
        sock.sendall(b"REFUSED " + reason.encode() + b"\n")
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the peer is gone; it gets nothing either way
    raise Refused(reason)


def _printable(raw: bytes) -> str:
    """A peer's bytes shown in one of our messages: printable ASCII only."""
    text = raw.decode("ascii", errors="replace")
    return "".join(c if c.isprintable() else "?" for c in text)[:200]


def client_handshake(
    sock: socket.socket, token: bytes, timeout_s: float = 10.0, *, peer: str | None = None
) -> bytes:
    """Answer the coordinator's challenge and check its proof; the session key, or Refused.
    `peer` names the coordinator in messages (default: the socket's peer address)."""
    deadline = time.monotonic() + timeout_s
    where = f"the coordinator at {peer or _peer(sock)}"
    try:
        challenge = _read_line(sock, deadline)
        fields = (challenge or b"").split(b" ")
        nonce_s = _hex_field(fields[-1], NONCE_BYTES) if len(fields) == 2 else None
        if fields[0] != _MAGIC or nonce_s is None:
            raise Refused(f"{where} did not send a frugaltrain handshake: not a coordinator")
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        proof = _mac(token, b"client", nonce_s, nonce_c)
        sock.sendall(nonce_c.hex().encode() + b" " + proof.hex().encode() + b"\n")
        reply = _read_line(sock, deadline) or b""
    except TimeoutError:
        raise Refused(f"{where} sent no handshake within {timeout_s:g} s") from None
    except ValueError as e:
        raise Refused(f"{where} did not send a frugaltrain handshake: {e}") from None
    except OSError as e:
        raise Refused(f"{where} closed the connection: {e.strerror or e}") from None
    if reply.startswith(b"REFUSED "):
        reason = _printable(reply[len(b"REFUSED ") :])
        fix = "; use the run's token file (--token FILE)" if reason == "wrong token" else ""
        raise Refused(f"{where} refused this machine: {reason}{fix}")
    server = _hex_field(reply[len(b"OK ") :], 32) if reply.startswith(b"OK ") else None
    if server is None or not hmac.compare_digest(server, _mac(token, b"server", nonce_c, nonce_s)):
        raise Refused(f"{where} did not prove the run token: not this run's coordinator")
    return _mac(token, b"session", nonce_s, nonce_c)


# ---- the authenticated channel
class Channel:
    """JSON messages over an authenticated socket: 4-byte big-endian length, the JSON, then
    HMAC(session key, direction + 8-byte sequence number + JSON). Reads take exactly a frame's
    bytes (no buffered reader), so raw bytes that follow a frame stay in the socket."""

    def __init__(self, sock: socket.socket, key: bytes, *, client: bool, peer: str = ""):
        self.sock = sock
        self.peer = peer or _peer(sock)
        self._key = key
        self._out, self._in = (b"C", b"S") if client else (b"S", b"C")
        self._sent = 0
        self._received = 0
        self._send_lock = threading.Lock()

    def send(self, msg: dict) -> None:
        body = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
        if len(body) > MAX_FRAME:
            raise ValueError(f"message of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
        with self._send_lock:
            mac = _mac(self._key, self._out, self._sent.to_bytes(8, "big"), body)
            self.sock.sendall(len(body).to_bytes(4, "big") + body + mac)
            self._sent += 1

    def _exact(self, n: int) -> bytes:
        """n bytes of a frame already started; a peer stalled past STALL_S is cut off."""
        buf = bytearray()
        self.sock.settimeout(STALL_S)
        try:
            while len(buf) < n:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
                if not chunk:
                    raise ConnectionError(f"{self.peer} closed the connection mid-frame")
                buf += chunk
        except TimeoutError:
            self.close()
            raise ConnectionError(f"{self.peer} stalled mid-frame for {STALL_S:g} s") from None
        return bytes(buf)

    def recv(self, timeout_s: float | None = None) -> dict:
        """The next message; TimeoutError if none starts within timeout_s (None: wait),
        ConnectionError on EOF, Refused on a bad MAC or anything but a JSON object."""
        self.sock.settimeout(timeout_s)
        if not self.sock.recv(1, socket.MSG_PEEK):
            raise ConnectionError(f"{self.peer} closed the connection")
        n = int.from_bytes(self._exact(4), "big")
        if n > MAX_FRAME:
            raise Refused(f"{self.peer} sent a frame of {n} bytes (limit {MAX_FRAME})")
        body = self._exact(n)
        mac = self._exact(32)
        want = _mac(self._key, self._in, self._received.to_bytes(8, "big"), body)
        if not hmac.compare_digest(mac, want):
            raise Refused(
                f"{self.peer} sent a frame with a bad MAC (altered, replayed or reordered)"
            )
        self._received += 1
        try:
            msg = json.loads(body)
        except ValueError:
            raise Refused(f"{self.peer} sent a frame that is not JSON") from None
        if not isinstance(msg, dict):
            raise Refused(f"{self.peer} sent a frame that is not a JSON object")
        return msg

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(host: str, port: int, token: bytes, timeout_s: float = 10.0) -> Channel:
    """Connect to a coordinator's gateway and prove the run token; the authenticated channel."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise ConnectionError(
            f"cannot reach the coordinator at {host}:{port}: {e.strerror or e}; "
            "is it running, and is the port open?"
        ) from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        key = client_handshake(sock, token, timeout_s, peer=f"{host}:{port}")
    except Refused:
        sock.close()
        raise
    return Channel(sock, key, client=True, peer=f"{host}:{port}")
