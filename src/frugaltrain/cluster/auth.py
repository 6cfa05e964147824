"""Run tokens and the mutual challenge-response that guards a coordinator's public port.

A run across machines has one token file, written by `frugaltrain coordinator --new-token`: the
run's secret (32 random bytes as 64 hex characters) and, on a second line, the pin of the
coordinator's TLS certificate (`sha256:` and 64 hex characters), mode 0600 (`new_token`,
`read_token`). The certificate's key stays on the coordinator in a file beside it
(`<token file>.key`, tls.py). Every connection to the coordinator's port is TLS 1.3 first,
the client checking the certificate against the pin (tls.py); inside it, the machine proves
the secret without ever sending it:

    server -> client    FTAUTH1 <nonce_s hex>\\n
    client -> server    <nonce_c hex> <HMAC(token, "client" + nonce_s + nonce_c) hex>\\n
    server -> client    OK <HMAC(token, "server" + nonce_c + nonce_s) hex>\\n
                        or REFUSED <reason>\\n, and nothing more
    both                session key = HMAC(token, "session" + nonce_s + nonce_c)

Each side picks a fresh 32-byte nonce, so a recorded response is useless on a new connection (a
replay is a wrong HMAC), and the server proves the token back, so a fake coordinator without it
is refused by the client too (as is one without the pinned certificate's key, before). The
"client"/"server" prefixes keep one side's proof from being reflected as the other's. Lines are
bounded and every read has a deadline: a silent or chatty peer costs one thread for at most
`timeout_s`.

After the handshake, `Channel` frames JSON messages with an HMAC under the session key and a
sequence number per direction (inside TLS this is a second lock on the same door; it keeps a
frame's sender and order checked whatever carries it). Nothing received is ever unpickled or
eval'ed: only JSON, and raw bytes for the store, which travel inside the same TLS connection.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import ssl
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from frugaltrain.cluster import tls
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
@dataclass(frozen=True)
class RunToken:
    """What a token file holds: the run's secret, and the pin (sha256) of the coordinator's TLS
    certificate. `path` is the file it was read from; the coordinator's key file lies beside it
    (`key_file`), on the coordinator only."""

    secret: bytes
    pin: bytes
    path: Path | None = None

    @property
    def key_file(self) -> Path:
        if self.path is None:
            raise ConfigError("this run token was not read from a file, so it has no key file")
        return key_file_of(self.path)

    def server_context(self) -> ssl.SSLContext:
        """The coordinator's TLS context: its key file, checked against the pin."""
        return tls.server_context(self.key_file, self.pin, self.path or "")


def key_file_of(token_path: str | Path) -> Path:
    """Where the coordinator keeps the key of the certificate that `token_path` pins."""
    token_path = Path(token_path)
    return token_path.with_name(token_path.name + ".key")


def new_token(path: str | Path) -> RunToken:
    """Write a fresh run token and a new coordinator certificate: the token file (the secret
    and the certificate's pin, mode 0600, for every machine) and its key file (the key and the
    certificate, mode 0600, for the coordinator only). Never replaces an existing token
    (machines already holding it would be locked out of the run) or key."""
    path = Path(path)
    exists = f"{path} exists; a run's token is never overwritten: remove it or choose another path"
    if path.exists():
        raise ConfigError(exists)
    key_path = key_file_of(path)
    try:
        pin = tls.new_identity(key_path)
    except FileExistsError:
        raise ConfigError(
            f"{key_path} exists (the key of another token?): remove it or choose another path"
        ) from None
    secret = secrets.token_bytes(TOKEN_BYTES)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{secret.hex()}\n{tls.PIN_PREFIX}{pin.hex()}\n")
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path)
    except FileExistsError:
        key_path.unlink(missing_ok=True)
        raise ConfigError(exists) from None
    finally:
        tmp.unlink(missing_ok=True)
    return RunToken(secret, pin, path)


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


def read_token(path: str | Path) -> RunToken:
    """The run token in `path`; a one-line ConfigError naming the file and the fix."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii", errors="replace")
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
    lines = text.split()
    secret = _hex_field(lines[0].lower().encode(), TOKEN_BYTES) if lines else None
    if secret is None or len(lines) > 2:
        raise ConfigError(
            f"token file {path} does not hold a token ({2 * TOKEN_BYTES} hex characters): "
            f"write a new one with `frugaltrain coordinator --new-token FILE`"
        )
    pin_text = lines[1] if len(lines) == 2 else ""
    pin = None
    if pin_text.startswith(tls.PIN_PREFIX):
        pin = _hex_field(pin_text[len(tls.PIN_PREFIX) :].lower().encode(), 32)
    if pin is None:
        raise ConfigError(
            f"token file {path} pins no coordinator certificate (a second line "
            f"{tls.PIN_PREFIX}<64 hex characters>): write a new token and key with "
            "`frugaltrain coordinator --new-token FILE`"
        )
    return RunToken(secret, pin, path)


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


def server_handshake(
    sock: socket.socket, token: bytes, timeout_s: float = 10.0, *, deadline: float | None = None
) -> bytes:
    """Challenge the peer; the session key if it proves the token by `deadline` (default:
    `timeout_s` from now). On failure the peer gets one `REFUSED <reason>` line, our side
    stops writing, and Refused is raised (the caller closes)."""
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
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


def connect(host: str, port: int, token: RunToken, timeout_s: float = 10.0) -> Channel:
    """Connect to a coordinator's gateway: TLS with its certificate checked against the token
    file's pin, then the token proved inside it; the authenticated channel."""
    where = f"{host}:{port}"
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise ConnectionError(
            f"cannot reach the coordinator at {where}: {e.strerror or e}; "
            "is it running, and is the port open?"
        ) from None
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    deadline = time.monotonic() + timeout_s
    try:
        sock = tls.open_client(raw, token.pin, deadline, f"the coordinator at {where}")
        key = client_handshake(sock, token.secret, deadline - time.monotonic(), peer=where)
    except tls.TlsError as e:
        raw.close()
        raise Refused(str(e)) from None
    except TimeoutError:
        raw.close()
        raise Refused(
            f"the coordinator at {where} sent no handshake within {timeout_s:g} s"
        ) from None
    except (Refused, OSError):
        raw.close()
        raise
    return Channel(sock, key, client=True, peer=where)
