"""cluster/tls.py: a TLS connection that one thread reads while another writes, its peek and its
orderly half-close, and the pin that decides which coordinator a machine believes."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest
from helpers.tokens import OTHER_RUN, TOKEN

from frugaltrain.cluster import tls


def _pair(pin: bytes = TOKEN.pin) -> tuple[tls.TlsSocket, tls.TlsSocket]:
    """A client and a server TLS connection over a socket pair, handshaken."""
    a, b = socket.socketpair()
    deadline = time.monotonic() + 10
    got: dict = {}

    def serve() -> None:
        try:
            got["server"] = tls.accept(b, TOKEN.server_context(), deadline)
        except (tls.TlsError, OSError) as e:
            got["error"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        client = tls.open_client(a, pin, deadline, "the test's coordinator")
    finally:
        t.join()
    return client, got["server"]


def _read_to_end(sock: tls.TlsSocket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(1 << 16):
        out += chunk
    return bytes(out)


def test_both_directions_at_once_on_two_threads_each_side():
    """8 MiB each way, every side writing on one thread while another reads: the bytes that
    arrive are the bytes sent, in order (each record through one lock, I/O outside it)."""
    client, server = _pair()
    up, down = os.urandom(8 << 20), os.urandom(8 << 20)
    got: dict = {}

    def send(sock: tls.TlsSocket, data: bytes) -> None:
        for i in range(0, len(data), 100_003):  # records cut at odd places
            sock.sendall(data[i : i + 100_003])
        sock.shutdown(socket.SHUT_WR)

    def receive(sock: tls.TlsSocket, name: str) -> None:
        got[name] = _read_to_end(sock)

    threads = [
        threading.Thread(target=send, args=(client, up)),
        threading.Thread(target=send, args=(server, down)),
        threading.Thread(target=receive, args=(server, "up")),
        threading.Thread(target=receive, args=(client, "down")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert hashlib.sha256(got["up"]).digest() == hashlib.sha256(up).digest()
    assert hashlib.sha256(got["down"]).digest() == hashlib.sha256(down).digest()
    client.close()
    server.close()


def test_a_peek_leaves_the_bytes_and_a_half_close_leaves_the_way_back():
    client, server = _pair()
    client.sendall(b"hello")
    assert server.recv(1, socket.MSG_PEEK) == b"h"
    assert server.recv(5) == b"hello"
    client.shutdown(socket.SHUT_WR)  # close_notify: the end of what the client sends
    assert server.recv(5) == b""
    server.sendall(b"still here")  # the server's side stays open
    server.shutdown(socket.SHUT_WR)
    assert _read_to_end(client) == b"still here"
    client.close()
    server.close()


def test_the_pin_of_another_certificate_is_refused_after_the_handshake():
    with pytest.raises(tls.TlsError, match="certificate the token file does not pin"):
        _pair(pin=OTHER_RUN.pin)


def test_an_injected_record_ends_the_connection():
    """A well-formed application-data record that the client never sealed, slipped in after a
    real one: the reader gets the real bytes, then TlsError, never the injected ones."""
    client, server = _pair()
    client.sendall(b"real")
    forged = os.urandom(40)
    client.sock.sendall(bytes([0x17, 0x03, 0x03, 0x00, len(forged)]) + forged)
    assert server.recv(4) == b"real"
    with pytest.raises(tls.TlsError, match="TLS"):
        server.recv(100)
    client.close()
    server.close()


def test_a_server_that_closes_unread_is_a_tls_error_not_a_reset():
    """A gateway over its caps closes a connection unread; the client's hello, unread, makes
    that close a reset. The client says the coordinator closed the connection, in one line."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        raw = socket.create_connection(listener.getsockname(), timeout=10)
        conn, _ = listener.accept()
        got: dict = {}

        def client() -> None:
            try:
                tls.open_client(raw, TOKEN.pin, time.monotonic() + 10, "the coordinator")
            except Exception as e:  # noqa: BLE001 (the test inspects it)
                got["error"] = e

        t = threading.Thread(target=client)
        t.start()
        conn.settimeout(10)
        assert conn.recv(1, socket.MSG_PEEK)  # the hello is here, and stays unread
        conn.close()
        t.join(20)
        raw.close()
    assert isinstance(got["error"], tls.TlsError), got
    assert "closed the connection" in str(got["error"]) and "\n" not in str(got["error"])
