"""TLS 1.3 on the coordinator's port, with its certificate pinned by the run token file.

As `kubeadm join` pins the control plane's CA by its hash, a run's token file carries the
sha256 of the coordinator's certificate beside the token: `new_identity` makes a self-signed
certificate and its key (ECDSA P-256, from the `cryptography` package, since Python's `ssl`
cannot make one) when `--new-token` writes the file, and the key stays on the coordinator in a
file of its own. A joining machine accepts the coordinator whose certificate hashes to the pin
and no other: no certificate authority, host name or clock is involved, so nothing but the
token file must reach the machines. Everything on the port travels inside TLS 1.3 from the
first byte (the token handshake, the control channel and the store's bytes): an on-path relay
can neither read nor inject.

`TlsSocket` is a TLS connection over a blocking socket that one thread may read while another
writes, as the gateway's splice and the store tunnel's relay do. Python's `SSLSocket` does not
promise that (OpenSSL's SSL objects are not for concurrent use), so the TLS state lives in an
`SSLObject` over memory buffers, touched under a lock only while it encrypts or decrypts; the
socket's reads and writes happen outside it. The server sends no session tickets, so after the
handshake only a writer makes bytes for the wire.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import io
import os
import socket
import ssl
import threading
import time
from pathlib import Path

from frugaltrain.config import ConfigError

PIN_PREFIX = "sha256:"
_RECORD = 16 << 10  # plaintext per TLS record
_READ = 64 << 10  # ciphertext per socket read


class TlsError(ConnectionError):
    """The TLS handshake failed, or the peer's certificate is not the pinned one."""


# ---- the coordinator's identity
def new_identity(path: Path) -> bytes:
    """Write a new key and self-signed certificate to `path` (PEM, mode 0600, never over an
    existing file); the certificate's pin."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise ConfigError(
            "writing a run token needs the `cryptography` package (a dependency of frugaltrain): "
            "pip install cryptography"
        ) from None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "frugaltrain coordinator")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ) + cert.public_bytes(serialization.Encoding.PEM)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


def server_context(key_file: Path, pin: bytes, token_file: Path | str) -> ssl.SSLContext:
    """The coordinator's TLS context from its key file, checked against the token's pin; a
    one-line ConfigError naming the file and the fix."""
    fix = "`frugaltrain coordinator --new-token FILE` writes a token and its key file together"
    try:
        mode = key_file.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(
            f"the coordinator's key file {key_file} does not exist: it is written beside the "
            f"token file {token_file} and stays on the coordinator; {fix}"
        ) from None
    if mode & 0o077:
        raise ConfigError(
            f"key file {key_file} is readable by group or others (mode {mode & 0o777:o}): "
            f"chmod 600 {key_file}"
        )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.num_tickets = 0  # no post-handshake messages: see TlsSocket
    try:
        ctx.load_cert_chain(key_file)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(
            f"key file {key_file} holds no key and certificate ({e}); {fix}"
        ) from None
    pem = key_file.read_text()
    der = ssl.PEM_cert_to_DER_cert(pem[pem.index("-----BEGIN CERTIFICATE-----") :])
    if not hmac.compare_digest(hashlib.sha256(der).digest(), pin):
        raise ConfigError(
            f"key file {key_file} is not the certificate that token file {token_file} pins: "
            f"they come from different runs; {fix}"
        )
    return ctx


def _client_context() -> ssl.SSLContext:
    """Trust is the pin alone (checked after the handshake), so no CA and no host name."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


_CLIENT = _client_context()


# ---- the connection
class TlsSocket:
    """A TLS connection over blocking socket `sock`, with the socket methods the gateway, the
    channel and the store tunnel use: one reader and one writer may work at once (see the
    module docstring). `shutdown(SHUT_WR)` sends TLS's close_notify first, so the peer reads
    an orderly end; a raw end of the socket without it also reads as the end."""

    def __init__(self, sock: socket.socket, obj: ssl.SSLObject, incoming, outgoing) -> None:
        self.sock = sock
        self._obj, self._in, self._out = obj, incoming, outgoing
        self._ssl = threading.Lock()  # the SSLObject and its two buffers
        self._send = threading.Lock()  # ciphertext goes out in the order it was made
        self._read = threading.Lock()  # one reader at a time
        self._plain = bytearray()  # decrypted, not yet read (what a peek leaves)
        self._ended = False  # the peer ended its side

    # -- what the gateway and the channel call
    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)

    def getpeername(self):
        return self.sock.getpeername()

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> TlsSocket:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def peer_certificate_pin(self) -> bytes:
        return hashlib.sha256(self._obj.getpeercert(binary_form=True) or b"").digest()

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        with self._send:
            for i in range(0, len(view), _RECORD):
                with self._ssl:
                    self._obj.write(view[i : i + _RECORD])
                    wire = self._out.read()
                self.sock.sendall(wire)

    def recv(self, n: int, flags: int = 0) -> bytes:
        with self._read:
            if not self._plain and not self._ended:
                self._plain += self._decrypt()
            out = bytes(self._plain[:n])
            if not flags & socket.MSG_PEEK:
                del self._plain[:n]
            return out

    def recv_into(self, buf, n: int = 0) -> int:
        data = self.recv(n or len(buf))
        buf[: len(data)] = data
        return len(data)

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        if mode != "rb":
            raise ValueError("a TlsSocket's file reads bytes only")
        return io.BufferedReader(_RawReader(self))

    def shutdown(self, how: int) -> None:
        """SHUT_WR ends our side in order (close_notify, then the socket's write side); the
        others end the socket at once, which wakes a thread blocked on it."""
        if how == socket.SHUT_WR and self._send.acquire(timeout=1.0):
            try:
                with self._ssl:
                    try:
                        self._obj.unwrap()
                    except (ssl.SSLWantReadError, ssl.SSLError, ValueError):
                        pass  # close_notify is written; the peer's is not awaited
                    wire = self._out.read()
                self.sock.sendall(wire)
            except OSError:
                pass
            finally:
                self._send.release()
        self.sock.shutdown(how)

    # -- the TLS record layer
    def _decrypt(self) -> bytes:
        """The next plaintext from the wire; b"" at the end."""
        while True:
            with self._ssl:
                try:
                    return self._obj.read(_READ)
                except ssl.SSLWantReadError:
                    reply = self._out.read()  # a post-handshake answer, if the peer asked one
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    self._ended = True
                    return b""
                except ssl.SSLError as e:  # a record altered, injected or cut: the end
                    raise TlsError(f"TLS: {e.reason or e}") from None
            if reply:
                with self._send:
                    self.sock.sendall(reply)
            wire = self.sock.recv(_READ)
            with self._ssl:
                if wire:
                    self._in.write(wire)
                else:
                    self._in.write_eof()

    def handshake(self, deadline: float) -> None:
        """Run the TLS handshake by `deadline` (time.monotonic()); TimeoutError past it,
        TlsError if TLS fails."""
        while True:
            try:
                self._obj.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            except ssl.SSLError as e:
                self._flush_quietly()  # the alert, so the peer learns why
                raise TlsError(f"no TLS handshake: {e.reason or e}") from None
            try:
                self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                self.sock.sendall(self._out.read())
                if done:
                    return
                if time.monotonic() >= deadline:
                    raise TimeoutError
                wire = self.sock.recv(_READ)
            except (ConnectionError, BrokenPipeError) as e:  # a reset: it closed unread
                raise TlsError(f"no TLS handshake: the peer closed the connection ({e})") from None
            if not wire:
                raise TlsError("no TLS handshake: the peer closed the connection")
            self._in.write(wire)

    def _flush_quietly(self) -> None:
        try:
            self.sock.sendall(self._out.read())
        except OSError:
            pass


class _RawReader(io.RawIOBase):
    """A TlsSocket as a raw stream, for io.BufferedReader (store.py's Reader)."""

    def __init__(self, tls: TlsSocket) -> None:
        self._tls = tls

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        return self._tls.recv_into(buf)


def _wrap(sock: socket.socket, ctx: ssl.SSLContext, *, server: bool) -> TlsSocket:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_side=server)
    return TlsSocket(sock, obj, incoming, outgoing)


def accept(sock: socket.socket, ctx: ssl.SSLContext, deadline: float) -> TlsSocket:
    """The server's side of the handshake on an accepted socket."""
    tls = _wrap(sock, ctx, server=True)
    tls.handshake(deadline)
    return tls


def open_client(sock: socket.socket, pin: bytes, deadline: float, where: str) -> TlsSocket:
    """The client's side: TLS, then the coordinator's certificate checked against the pin."""
    tls = _wrap(sock, _CLIENT, server=False)
    try:
        tls.handshake(deadline)
    except TlsError as e:
        raise TlsError(f"{where}: {e}") from None
    if not hmac.compare_digest(tls.peer_certificate_pin(), pin):
        raise TlsError(
            f"{where} presented a certificate the token file does not pin "
            f"({PIN_PREFIX}{tls.peer_certificate_pin().hex()[:16]}...): not this run's "
            "coordinator, or a token file from another run"
        )
    return tls
