"""Run tokens, the mutual handshake, the framed channel, and the gateway in front of a TCPStore:
who has the token gets in, who does not gets one REFUSED line and never reaches the store."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import stat
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from frugaltrain.cluster.auth import (
    TOKEN_BYTES,
    Channel,
    Refused,
    client_handshake,
    connect,
    new_token,
    read_token,
    server_handshake,
)
from frugaltrain.cluster.gateway import Gateway, StoreTunnel
from frugaltrain.config import ConfigError

TOKEN = bytes(range(TOKEN_BYTES))
OTHER = bytes(reversed(range(TOKEN_BYTES)))


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def _read_line(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    line = b""
    while not line.endswith(b"\n"):
        b = sock.recv(1)
        assert b, f"EOF after {line!r}"
        line += b
    return line


class _Backend:
    """A listening socket standing in for the store: counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = self.sock.getsockname()
        self.accepted = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def gated():
    """A gateway in front of a counting backend, its log and the requests `serve` got."""
    backend, lines, served = _Backend(), [], []

    def serve(request: dict, channel: Channel) -> None:
        served.append(request)
        channel.send({"reply": request.get("want")})

    gw = Gateway("127.0.0.1", 0, TOKEN, backend.addr, serve, lines.append, handshake_timeout_s=0.5)
    gw.start()
    yield gw, backend, lines, served
    gw.close()
    backend.close()


def _raw(gw: Gateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.port), timeout=10)


# ---- token files
def test_new_token_is_private_and_never_overwritten(tmp_path):
    path = tmp_path / "run.token"
    new_token(path)
    text = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(text.strip()) == 64 and text.endswith("\n")
    assert len(read_token(path)) == TOKEN_BYTES
    with pytest.raises(ConfigError, match="never overwritten") as e:
        new_token(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.token"]  # no temp file left


def test_read_token_errors_name_the_file_and_the_fix(tmp_path):
    missing = tmp_path / "missing.token"
    with pytest.raises(ConfigError, match="--new-token") as e:
        read_token(missing)
    assert str(missing) in str(e.value)

    bad = tmp_path / "bad.token"
    fd = os.open(bad, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"abc123\n")
    os.close(fd)
    with pytest.raises(ConfigError, match="64 hex") as e:
        read_token(bad)
    assert str(bad) in str(e.value)

    shared = tmp_path / "shared.token"
    new_token(shared)
    shared.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600") as e:
        read_token(shared)
    assert str(shared) in str(e.value) and "\n" not in str(e.value)


# ---- the handshake
def _handshake_pair(client_token: bytes, server_token: bytes):
    a, b = socket.socketpair()
    got = {}

    def server() -> None:
        try:
            got["key"] = server_handshake(b, server_token, timeout_s=5)
        except Refused as e:
            got["refused"] = str(e)

    t = threading.Thread(target=server)
    t.start()
    try:
        got["client"] = client_handshake(a, client_token, timeout_s=5)
    except Refused as e:
        got["client_refused"] = str(e)
    t.join()
    return a, b, got


def test_handshake_gives_both_sides_the_same_session_key():
    a, b, got = _handshake_pair(TOKEN, TOKEN)
    assert got["key"] == got["client"] and len(got["key"]) == 32
    _, _, again = _handshake_pair(TOKEN, TOKEN)
    assert again["key"] != got["key"]  # fresh nonces, fresh key
    for s in (a, b):
        s.close()


def test_wrong_token_is_refused_on_both_sides():
    a, b, got = _handshake_pair(OTHER, TOKEN)
    assert got["refused"] == "wrong token"
    assert "refused this machine: wrong token" in got["client_refused"]
    assert "--token FILE" in got["client_refused"]
    for s in (a, b):
        s.close()


def test_fake_server_without_the_token_is_refused_by_the_client():
    a, b = socket.socketpair()

    def fake() -> None:  # speaks the protocol but only knows OTHER, and says OK to anybody
        nonce_s = os.urandom(32)
        b.sendall(b"FTAUTH1 " + nonce_s.hex().encode() + b"\n")
        nonce_c = bytes.fromhex(_read_line(b).split()[0].decode())
        b.sendall(b"OK " + _mac(OTHER, b"server", nonce_c, nonce_s).hex().encode() + b"\n")

    t = threading.Thread(target=fake)
    t.start()
    with pytest.raises(Refused, match="did not prove the run token"):
        client_handshake(a, TOKEN, timeout_s=5)
    t.join()
    a.close()
    b.close()


def test_silent_server_is_refused_by_the_client():
    a, b = socket.socketpair()
    with pytest.raises(Refused, match="no handshake within 0.2 s"):
        client_handshake(a, TOKEN, timeout_s=0.2)
    a.close()
    b.close()


# ---- the gateway refuses without a token, and nothing reaches the store
def test_wrong_token_through_the_gateway_gets_one_line_and_no_store(gated):
    gw, backend, lines, _ = gated
    with pytest.raises(Refused, match="wrong token"):
        connect("127.0.0.1", gw.port, OTHER)

    sock = _raw(gw)
    challenge = _read_line(sock)
    nonce_s = bytes.fromhex(challenge.split()[1].decode())
    nonce_c = os.urandom(32)
    proof = _mac(OTHER, b"client", nonce_s, nonce_c)
    sock.sendall(nonce_c.hex().encode() + b" " + proof.hex().encode() + b"\n")
    rest = _read_all(sock)
    sock.close()
    assert challenge.startswith(b"FTAUTH1 ") and len(challenge) == len(b"FTAUTH1 ") + 65
    assert rest == b"REFUSED wrong token\n"  # and then EOF: nothing else ever
    gw.close()  # waits for nothing; the handlers have logged before closing the socket
    assert [reason for _, reason in gw.refused] == ["wrong token", "wrong token"]
    assert len(lines) == 2 and all(line.startswith("refused 127.0.0.1:") for line in lines)
    assert all(line.endswith(": wrong token") and "\n" not in line for line in lines)
    assert backend.accepted == 0


@pytest.mark.parametrize("send", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 2000, b""])
def test_garbage_or_silence_is_refused(gated, send):
    gw, backend, lines, _ = gated
    sock = _raw(gw)
    challenge = _read_line(sock)
    sock.sendall(send)
    rest = _read_all(sock)
    sock.close()
    assert challenge.startswith(b"FTAUTH1 ")
    assert rest.startswith(b"REFUSED no token (not a frugaltrain handshake)")
    assert rest.count(b"\n") == 1 and rest.endswith(b"\n")
    if not send:
        assert b"no handshake within 0.5 s" in rest
    gw.close()
    assert len(gw.refused) == 1 and gw.refused[0][1].startswith("no token")
    assert len(lines) == 1 and lines[0].startswith("refused ")
    assert backend.accepted == 0


def test_replayed_handshake_is_refused(gated):
    """A man in the middle records a real client's bytes and plays them on a new connection."""
    gw, backend, lines, served = gated
    relay = socket.create_server(("127.0.0.1", 0))
    recorded = bytearray()

    def mitm() -> None:
        client, _ = relay.accept()
        upstream = _raw(gw)
        client.settimeout(10)

        def down() -> None:
            while data := upstream.recv(4096):
                client.sendall(data)
            client.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=down)
        t.start()
        while data := client.recv(4096):
            recorded.extend(data)
            upstream.sendall(data)
        upstream.shutdown(socket.SHUT_WR)
        t.join()
        client.close()
        upstream.close()

    t = threading.Thread(target=mitm)
    t.start()
    channel = connect("127.0.0.1", relay.getsockname()[1], TOKEN)
    channel.send({"want": "config"})
    assert channel.recv(timeout_s=10) == {"reply": "config"}
    channel.close()
    t.join()
    relay.close()
    assert served == [{"want": "config"}] and not gw.refused

    sock = _raw(gw)
    _read_line(sock)
    sock.sendall(bytes(recorded))
    rest = _read_all(sock)
    sock.close()
    assert rest == b"REFUSED wrong token\n"
    gw.close()
    assert [reason for _, reason in gw.refused] == ["wrong token"]
    assert served == [{"want": "config"}] and backend.accepted == 0


def test_tcpstore_client_straight_at_the_gateway_fails():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("kept", "1")
    before = store.num_keys()
    lines = []
    gw = Gateway(
        "127.0.0.1", 0, TOKEN, ("127.0.0.1", store.port), lambda r, c: None, lines.append, 0.5
    )
    gw.start()
    try:
        with pytest.raises(RuntimeError):
            client = dist.TCPStore(
                "127.0.0.1", gw.port, is_master=False, timeout=timedelta(seconds=2)
            )
            client.set("intruder", "1")
    finally:
        gw.close()
    assert store.num_keys() == before and store.get("kept") == b"1"
    assert not store.check(["intruder"])
    assert gw.refused and all(r.startswith("no token") for _, r in gw.refused)
    assert all(line.startswith("refused ") for line in lines)


# ---- the channel
def _channels() -> tuple[Channel, Channel, socket.socket, socket.socket]:
    a, b, got = _handshake_pair(TOKEN, TOKEN)
    return Channel(a, got["client"], client=True), Channel(b, got["key"], client=False), a, b


def _raw_frame(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    head = sock.recv(4, socket.MSG_WAITALL)
    body = sock.recv(int.from_bytes(head, "big") + 32, socket.MSG_WAITALL)
    return head + body


def test_channel_round_trips_messages():
    client, server, a, b = _channels()
    msgs = [{"want": "config"}, {"slot": 3, "hosts": ["a", "b"]}, {"x": "é" * 1000}]
    for m in msgs:
        client.send(m)
    assert [server.recv(timeout_s=5) for _ in msgs] == msgs
    server.send({"ok": True})
    assert client.recv(timeout_s=5) == {"ok": True}
    with pytest.raises(TimeoutError):
        client.recv(timeout_s=0.05)
    server.close()
    with pytest.raises(ConnectionError):
        client.recv(timeout_s=5)
    client.close()


def test_channel_refuses_altered_replayed_and_reflected_frames():
    client, server, a, b = _channels()
    client.send({"slot": 1})
    frame = _raw_frame(b)  # taken off the wire before the server read it

    flipped = bytearray(frame)
    flipped[6] ^= 0x01
    a.sendall(bytes(flipped))
    with pytest.raises(Refused, match="bad MAC"):
        server.recv(timeout_s=5)

    client2, server2, a2, b2 = _channels()
    client2.send({"slot": 1})
    frame = _raw_frame(b2)
    a2.sendall(frame)
    assert server2.recv(timeout_s=5) == {"slot": 1}
    a2.sendall(frame)  # the same bytes again
    with pytest.raises(Refused, match="bad MAC"):
        server2.recv(timeout_s=5)

    b2.sendall(frame)  # the client's own frame sent back to it
    with pytest.raises(Refused, match="bad MAC"):
        client2.recv(timeout_s=5)
    for s in (a, b, a2, b2):
        s.close()


def test_channel_refuses_an_oversized_frame():
    client, server, a, b = _channels()
    a.sendall((1 << 31).to_bytes(4, "big"))
    with pytest.raises(Refused, match="limit"):
        server.recv(timeout_s=5)
    a.close()
    b.close()


def test_connect_to_a_closed_port_names_it():
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with pytest.raises(ConnectionError, match=f"coordinator at 127.0.0.1:{port}.*port open"):
        connect("127.0.0.1", port, TOKEN, timeout_s=2)


# ---- end to end: TCPStore clients through a tunnel and the gateway
def test_tcpstore_through_tunnel_and_gateway():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lines, served = [], []

    def serve(request: dict, channel: Channel) -> None:
        served.append(request)
        channel.send({"config": {"slot": 2}})

    gw = Gateway("127.0.0.1", 0, TOKEN, ("127.0.0.1", store.port), serve, lines.append).start()
    tunnel = StoreTunnel("127.0.0.1", gw.port, TOKEN).start()
    try:
        t = timedelta(seconds=10)
        one = dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=t)
        two = dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=t)
        one.set("a", "1")
        assert two.get("a") == b"1" and store.get("a") == b"1"
        assert one.add("n", 2) == 2 and two.add("n", 3) == 5
        assert two.compare_set("a", "1", "2") == b"2"
        assert one.compare_set("a", "1", "3") == b"2"  # expected value no longer there
        waiter = threading.Thread(target=one.wait, args=(["late"],))
        waiter.start()
        two.set("late", "x")
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        big = os.urandom(1 << 20)
        one.set("big", big)
        assert two.get("big") == big

        channel = connect("127.0.0.1", gw.port, TOKEN)
        channel.send({"want": "config"})
        assert channel.recv(timeout_s=10) == {"config": {"slot": 2}}
        channel.close()
        assert served == [{"want": "config"}]
        del one, two
    finally:
        tunnel.close()
        gw.close()
    assert not gw.refused and not any(line.startswith("refused") for line in lines)
