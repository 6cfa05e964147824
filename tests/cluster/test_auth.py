"""Run tokens, the mutual handshake, the framed channel, and the gateway in front of a TCPStore:
who has the token gets in, who does not gets one REFUSED line and never reaches the store."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
import stat
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers.tokens import OTHER_RUN, TOKEN, WRONG_SECRET, tls_connection

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
from frugaltrain.cluster.tls import PIN_PREFIX
from frugaltrain.config import ConfigError

SECRET, OTHER = TOKEN.secret, WRONG_SECRET.secret  # for the token handshake alone


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


def _in_tls(gw: Gateway):
    """A connection that passed TLS with the right pin: the token handshake is the test's."""
    return tls_connection(gw.port)


# ---- token files
def test_new_token_is_private_and_never_overwritten(tmp_path):
    path = tmp_path / "run.token"
    token = new_token(path)
    text = path.read_text()
    key_file = tmp_path / "run.token.key"
    assert token.key_file == key_file
    for f in (path, key_file):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    secret, pin = text.split()
    assert len(secret) == 64 and pin.startswith(PIN_PREFIX) and text.endswith("\n")
    assert read_token(path) == token and len(token.secret) == TOKEN_BYTES
    pem = key_file.read_text()
    der = ssl.PEM_cert_to_DER_cert(pem[pem.index("-----BEGIN CERTIFICATE-----") :])
    assert hashlib.sha256(der).digest() == token.pin  # the file pins the key file's certificate
    assert "PRIVATE KEY" in pem and "PRIVATE KEY" not in text
    with pytest.raises(ConfigError, match="never overwritten") as e:
        new_token(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert path.read_text() == text and key_file.read_text() == pem
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.token", "run.token.key"]


def test_read_token_errors_name_the_file_and_the_fix(tmp_path):
    missing = tmp_path / "missing.token"
    with pytest.raises(ConfigError, match="--new-token") as e:
        read_token(missing)
    assert str(missing) in str(e.value)

    def private(name: str, text: bytes):
        path = tmp_path / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, text)
        os.close(fd)
        return path

    bad = private("bad.token", b"abc123\n")
    with pytest.raises(ConfigError, match="64 hex") as e:
        read_token(bad)
    assert str(bad) in str(e.value)

    unpinned = private("old.token", TOKEN.secret.hex().encode() + b"\n")  # the secret alone
    with pytest.raises(ConfigError, match="pins no coordinator certificate.*--new-token") as e:
        read_token(unpinned)
    assert str(unpinned) in str(e.value)

    shared = tmp_path / "shared.token"
    new_token(shared)
    shared.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600") as e:
        read_token(shared)
    assert str(shared) in str(e.value) and "\n" not in str(e.value)


def test_the_coordinator_key_file_is_checked_before_it_listens(tmp_path):
    token = new_token(tmp_path / "run.token")
    token.server_context()  # the pair as written

    other = new_token(tmp_path / "other.token")
    os.replace(other.key_file, token.key_file)  # another run's key beside this token
    with pytest.raises(ConfigError, match="is not the certificate that token file") as e:
        token.server_context()
    assert str(token.key_file) in str(e.value) and "--new-token" in str(e.value)

    token.key_file.chmod(0o644)
    with pytest.raises(ConfigError, match=f"chmod 600 {token.key_file}"):
        Gateway("127.0.0.1", 0, token, ("127.0.0.1", 9), lambda r, c: None)

    token.key_file.unlink()  # a machine that joins has the token file only
    with pytest.raises(ConfigError, match="key file .* does not exist.*stays on the coordinator"):
        token.server_context()


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
    a, b, got = _handshake_pair(SECRET, SECRET)
    assert got["key"] == got["client"] and len(got["key"]) == 32
    _, _, again = _handshake_pair(SECRET, SECRET)
    assert again["key"] != got["key"]  # fresh nonces, fresh key
    for s in (a, b):
        s.close()


def test_wrong_token_is_refused_on_both_sides():
    a, b, got = _handshake_pair(OTHER, SECRET)
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
        client_handshake(a, SECRET, timeout_s=5)
    t.join()
    a.close()
    b.close()


def test_silent_server_is_refused_by_the_client():
    a, b = socket.socketpair()
    with pytest.raises(Refused, match="no handshake within 0.2 s"):
        client_handshake(a, SECRET, timeout_s=0.2)
    a.close()
    b.close()


# ---- the gateway refuses without TLS and the token, and nothing reaches the store
def test_wrong_token_through_the_gateway_gets_one_line_and_no_store(gated):
    gw, backend, lines, _ = gated
    with pytest.raises(Refused, match="wrong token"):
        connect("127.0.0.1", gw.port, WRONG_SECRET)

    sock = _in_tls(gw)
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


def test_a_token_of_another_run_is_refused_by_the_pin_before_the_token(gated):
    gw, backend, _, _ = gated
    with pytest.raises(Refused, match="certificate the token file does not pin") as e:
        connect("127.0.0.1", gw.port, OTHER_RUN)
    assert f"127.0.0.1:{gw.port}" in str(e.value) and "\n" not in str(e.value)
    gw.close()
    assert backend.accepted == 0


@pytest.mark.parametrize("send", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 2000, b""])
def test_garbage_or_silence_before_tls_is_refused(gated, send):
    gw, backend, lines, _ = gated
    sock = _raw(gw)
    sock.sendall(send)
    rest = _read_all(sock)
    sock.close()
    assert b"FTAUTH1" not in rest and b"REFUSED" not in rest  # at most a TLS alert
    gw.close()
    why = "no TLS handshake within 0.5 s" if not send else "no TLS handshake: "
    assert len(gw.refused) == 1 and gw.refused[0][1].startswith(why)
    assert len(lines) == 1 and lines[0].startswith("refused ")
    assert backend.accepted == 0


@pytest.mark.parametrize("send", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 2000, b""])
def test_garbage_or_silence_inside_tls_is_refused(gated, send):
    gw, backend, lines, _ = gated
    sock = _in_tls(gw)
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


class _Relay:
    """A man in the middle: passes bytes both ways between a client and the gateway, records
    what the client sent, and may add bytes of its own towards the gateway."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.up = bytearray()  # client -> gateway, as sent
        self.down = bytearray()  # gateway -> client
        self.inject: tuple[int, bytes] | None = None  # after this many bytes up, these
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client, _ = self.server.accept()
        upstream = _raw(self.gw)
        for s in (client, upstream):
            s.settimeout(20)

        def down() -> None:
            try:
                while data := upstream.recv(4096):
                    self.down.extend(data)
                    client.sendall(data)
                client.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        t = threading.Thread(target=down)
        t.start()
        try:
            while data := client.recv(4096):
                self.up.extend(data)
                upstream.sendall(data)
                if self.inject and len(self.up) >= self.inject[0]:
                    upstream.sendall(self.inject[1])
                    self.inject = None
            upstream.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        t.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        self.thread.join(20)
        self.server.close()


def test_replayed_handshake_is_refused(gated):
    """A man in the middle records a real client's bytes and plays them on a new connection:
    TLS's fresh randoms make the recording worthless (and the token handshake inside would
    refuse it as a replay too, test_a_replayed_token_response_is_refused)."""
    gw, backend, lines, served = gated
    relay = _Relay(gw)
    channel = connect("127.0.0.1", relay.port, TOKEN)
    channel.send({"want": "config"})
    assert channel.recv(timeout_s=10) == {"reply": "config"}
    channel.close()
    relay.close()
    assert served == [{"want": "config"}] and not gw.refused

    sock = _raw(gw)
    sock.sendall(bytes(relay.up))
    _read_all(sock)
    sock.close()
    gw.close()
    assert len(gw.refused) == 1 and gw.refused[0][1].startswith("no TLS handshake")
    assert served == [{"want": "config"}] and backend.accepted == 0


def test_a_replayed_token_response_is_refused(gated):
    """Inside TLS, the token handshake on its own: a response recorded on one connection is a
    wrong HMAC on the next, whose challenge has a fresh nonce."""
    gw, backend, _, served = gated
    first = _in_tls(gw)
    nonce_s = bytes.fromhex(_read_line(first).split()[1].decode())
    nonce_c = os.urandom(32)
    proof = _mac(SECRET, b"client", nonce_s, nonce_c)
    response = nonce_c.hex().encode() + b" " + proof.hex().encode()
    first.sendall(response + b"\n")
    assert _read_line(first).startswith(b"OK ")
    first.close()

    again = _in_tls(gw)
    _read_line(again)
    again.sendall(response + b"\n")
    rest = _read_all(again)
    again.close()
    assert rest == b"REFUSED wrong token\n"
    gw.close()
    assert [reason for _, reason in gw.refused] == ["wrong token"]
    assert backend.accepted == 0


def test_an_on_path_relay_can_neither_read_nor_inject_store_bytes():
    """Between a machine's store tunnel and the gateway, a relay passes everything through and
    then slips a TCPStore SET into the stream: the TLS record check drops the connection, the
    store never applies it, and the relay's recording holds none of the keys or values."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lines = []
    gw = Gateway("127.0.0.1", 0, TOKEN, ("127.0.0.1", store.port), lambda r, c: None, lines.append)
    gw.start()
    relay = _Relay(gw)
    tunnel = StoreTunnel("127.0.0.1", relay.port, TOKEN, log=lines.append).start()
    key, value = b"plain-key-5f3e", b"plain-value-9c1d"
    forged = bytes([2]) + (6).to_bytes(8, "little") + b"forged" + (1).to_bytes(8, "little") + b"1"
    try:
        client = dist.TCPStore(
            "127.0.0.1", tunnel.port, is_master=False, timeout=timedelta(seconds=10)
        )
        client.set(key.decode(), value)
        assert store.get(key.decode()) == value
        relay.inject = (len(relay.up) + 1, forged)  # with the client's next bytes
        with pytest.raises((RuntimeError, dist.DistStoreError)):
            client.set("after", "1")
            client.get("after")
        del client
    finally:
        tunnel.close()
        relay.close()
        gw.close()
    assert not store.check(["forged"])
    assert any(line.startswith("dropped ") and "TLS" in line for line in lines), lines
    wire = bytes(relay.up) + bytes(relay.down)
    assert key not in wire and value not in wire and b"forged" not in wire[: -len(forged)]


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
    assert gw.refused and all(r.startswith("no TLS handshake") for _, r in gw.refused)
    assert all(line.startswith("refused ") for line in lines)


# ---- the channel
def _channels() -> tuple[Channel, Channel, socket.socket, socket.socket]:
    a, b, got = _handshake_pair(SECRET, SECRET)
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
