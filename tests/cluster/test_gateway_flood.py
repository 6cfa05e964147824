"""cluster/gateway.py under a flood of connections: running out of files or threads does not shut
the port, the connections in the handshake are capped overall and per address, and a peer that
trickles bytes is cut off at the handshake deadline, its refusal included."""

from __future__ import annotations

import os
import queue
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers.tokens import TOKEN, tls_connection

from frugaltrain.cluster import gateway
from frugaltrain.cluster.auth import Channel, client_handshake, connect
from frugaltrain.cluster.gateway import Gateway, StoreTunnel, peer_uid
from frugaltrain.cluster.tls import TlsError


def _echo(request: dict, channel: Channel) -> None:
    channel.send({"echo": request.get("want")})


@pytest.fixture
def lines() -> list[str]:
    return []


def _gateway(lines: list[str], handshake_timeout_s: float) -> Gateway:
    # the store address is never used: these tests ask for the control channel only
    return Gateway(
        "127.0.0.1", 0, TOKEN, ("127.0.0.1", 9), _echo, lines.append, handshake_timeout_s
    ).start()


def _join(port: int, source: str = "127.0.0.1") -> dict:
    """A token holder's handshake and one request, from the local address `source`."""
    sock = tls_connection(port, timeout_s=30, source=source)
    try:
        channel = Channel(sock, client_handshake(sock, TOKEN.secret, 30), client=True)
        channel.send({"want": "config"})
        return channel.recv(timeout_s=30)
    finally:
        sock.close()


def _idle(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))


def _first_line(sock: socket.socket) -> bytes:
    """The gateway's first line on `sock` (its challenge), or b"" if it closed without one."""
    line = b""
    while not line.endswith(b"\n"):
        b = sock.recv(1)
        if not b:
            return line
        line += b
    return line


def _until(condition, timeout_s: float = 30.0) -> None:
    """Wait for `condition()`; a generous bound, so a loaded machine only makes it slower."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _needs_addresses(*hosts: str) -> None:
    for host in hosts:
        try:
            with socket.socket() as s:
                s.bind((host, 0))
        except OSError:
            pytest.skip(f"cannot bind {host} (Linux's loopback holds all of 127.0.0.0/8)")


# ---- running out of files or threads
_OUT_OF_FILES = textwrap.dedent(
    """
    import os, resource, sys
    from frugaltrain.cluster import gateway
    from frugaltrain.cluster.auth import read_token

    gateway.MAX_PENDING = gateway.MAX_PENDING_PER_ADDRESS = 10_000  # files run out first
    echo = lambda request, channel: channel.send({"echo": request.get("want")})
    gw = gateway.Gateway(
        "127.0.0.1", 0, read_token(sys.argv[1]), ("127.0.0.1", 9), echo,
        lambda line: print(line, flush=True), handshake_timeout_s=60,
    ).start()
    # room for 8 more files: the test's 40 idle connections use them up
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1 + 8, hard))
    print("port", gw.port, flush=True)
    sys.stdin.readline()  # the test is done
    print("accepting", gw._thread.is_alive(), flush=True)
    gw.close()
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts files in /proc")
def test_out_of_files_the_gateway_goes_on_accepting():
    """200 idle connections against a coordinator allowed 128 files used to end its accept loop
    (EMFILE) for good. Here a gateway with room for 8 more files gets 40: accept() fails, the
    loop backs off, and once the idle connections leave, a token holder gets in."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _OUT_OF_FILES, str(TOKEN.path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [out.put(x.strip()) for x in proc.stdout], daemon=True).start()
    seen: list[str] = []

    def wait_for(prefix: str) -> str:
        while not any(x.startswith(prefix) for x in seen):
            seen.append(out.get(timeout=60))
        return next(x for x in seen if x.startswith(prefix))

    try:
        port = int(wait_for("port ").split()[1])
        idle = [_idle(port) for _ in range(40)]  # the backlog (128) takes what is not accepted
        wait_for("gateway: cannot accept connections: Too many open files; retrying")
        for sock in idle:
            sock.close()
        channel = connect("127.0.0.1", port, TOKEN, timeout_s=60)
        channel.send({"want": "config"})
        assert channel.recv(timeout_s=60) == {"echo": "config"}
        channel.close()
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert wait_for("accepting ") == "accepting True"
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
    streak = [x for x in seen if x.startswith("gateway: ") and "accept" in x]
    assert streak[:2] == [  # one line per streak of failures, however many accept() calls
        "gateway: cannot accept connections: Too many open files; retrying",
        "gateway: accepting connections again",
    ]


def test_a_thread_that_cannot_start_costs_its_connection_only(lines, monkeypatch):
    gw = _gateway(lines, handshake_timeout_s=30)
    doomed = socket.socket()
    doomed.bind(("127.0.0.1", 0))
    host, port = doomed.getsockname()
    peer = f"{host}:{port}"
    start = threading.Thread.start

    def start_or_fail(thread: threading.Thread) -> None:
        if thread.name == peer:
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_fail)
    try:
        doomed.settimeout(30)
        doomed.connect(("127.0.0.1", gw.port))
        assert _first_line(doomed) == b""  # closed unread
        doomed.close()
        assert _join(gw.port) == {"echo": "config"}
        assert gw.pending == 0 and gw._thread.is_alive()
    finally:
        gw.close()
    assert f"gateway: closed the connection from {peer}: cannot start its thread" in lines[0]


# ---- caps on the connections in the handshake
def test_connections_over_the_caps_are_closed_unread(lines, monkeypatch):
    """Per address 3, overall 5: a sixth idle connection from one address is closed at once,
    a token holder from another address still gets in, and once the overall cap is full
    nobody does until the idle connections leave."""
    _needs_addresses("127.0.0.2", "127.0.0.3")
    monkeypatch.setattr(gateway, "MAX_PENDING_PER_ADDRESS", 3)
    monkeypatch.setattr(gateway, "MAX_PENDING", 5)
    gw = _gateway(lines, handshake_timeout_s=60)  # the idle ones are held for the whole test
    idle = []
    try:
        idle += [_idle(gw.port) for _ in range(5)]
        # accepted in the order they connected: the last two closed at once, unread
        assert [_first_line(s) for s in idle[3:]] == [b"", b""]
        assert gw.pending == 3 and gw.turned_away == 2
        assert not select.select(idle[:3], [], [], 0)[0]  # held: the TLS handshake waits

        assert _join(gw.port, "127.0.0.2") == {"echo": "config"}  # another address gets in
        _until(lambda: gw.pending == 3)  # and is no longer pending once authenticated
        idle += [_idle(gw.port, "127.0.0.2") for _ in range(2)]
        _until(lambda: gw.pending == 5)  # the overall cap

        with pytest.raises(TlsError, match="closed the connection"):  # EOF, no TLS
            _join(gw.port, "127.0.0.3")
        assert gw.turned_away == 3

        for sock in idle:
            sock.close()
        _until(lambda: gw.pending == 0)  # each held one is refused as it ends
        assert _join(gw.port) == {"echo": "config"}
    finally:
        for sock in idle:
            sock.close()
        gw.close()
    turned = [x for x in lines if x.startswith("turned away ")]
    assert 1 <= len(turned) <= 3  # at most one line per _TURNED_AWAY_LOG_S
    assert turned[0].startswith("turned away 127.0.0.1:")
    assert "3 connections in the handshake, 3 from 127.0.0.1" in turned[0]


def test_the_per_address_cap_counts_an_ipv6_64_as_one_source():
    assert (
        gateway._source("2001:db8::1") == gateway._source("2001:db8::ffff:2") == ("2001:db8::/64")
    )
    assert gateway._source("2001:db8:0:1::1") != gateway._source("2001:db8::1")
    assert gateway._source("::ffff:10.0.0.7") == "10.0.0.7"  # IPv4 on a dual-stack port
    assert gateway._source("10.0.0.7") == "10.0.0.7"


# ---- the handshake deadline holds for a peer that trickles bytes
def _trickle(sock, period_s: float, give_up_s: float) -> tuple[bytes, float]:
    """Send a byte every `period_s` (never a newline) until the gateway's socket is gone (a
    send or read fails: it was closed, not just shut for writing); what it sent back, and the
    seconds from the start until then. `sock`: a socket, or a TLS connection over one."""
    raw = getattr(sock, "sock", sock)
    start = time.monotonic()
    got = b""
    shut = False  # the gateway sent EOF; it may still be reading (the drain after a refusal)
    try:
        while time.monotonic() - start < give_up_s:
            sock.sendall(b"x")
            if shut:
                time.sleep(period_s)
                continue
            if select.select([raw], [], [], period_s)[0]:
                chunk = sock.recv(4096)
                got += chunk
                shut = not chunk
        raise AssertionError(f"still open after {give_up_s} s; got {got!r}")
    except OSError:  # the reset of a closed socket
        return got, time.monotonic() - start
    finally:
        sock.close()


_TLS_RECORD_HEAD = bytes([0x16, 0x03, 0x01, 0x40, 0x00])  # a handshake record of 16 KiB


@pytest.mark.parametrize("layer", ["tls", "token"])
def test_a_trickling_peer_is_cut_off_at_the_handshake_deadline(lines, monkeypatch, layer):
    """One byte per 0.2 s extends no timeout, in the TLS handshake (a record that never ends)
    or in the token handshake inside TLS: refused at the deadline, and the drain after the
    refusal ends there too (DRAIN_S made long to show that the deadline bounds it). Before,
    the drain read up to 16 times with 1 s each, so such a peer held the thread 3.2 s more
    here and up to 16 s more by default."""
    deadline_s = 1.5
    monkeypatch.setattr(gateway, "DRAIN_S", 60.0)
    gw = _gateway(lines, handshake_timeout_s=deadline_s)
    try:
        if layer == "tls":
            sock = _idle(gw.port)
            sock.sendall(_TLS_RECORD_HEAD)
        else:
            sock = tls_connection(gw.port)
        got, elapsed_s = _trickle(sock, period_s=0.2, give_up_s=30)
        _until(lambda: gw.pending == 0)
    finally:
        gw.close()
    if layer == "tls":
        assert got == b""
        reason = "no TLS handshake within 1.5 s (not a frugaltrain client)"
    else:
        assert got.startswith(b"FTAUTH1 ")
        reason = "no token (not a frugaltrain handshake): no handshake within 1.5 s"
        assert got.endswith(b"REFUSED " + reason.encode() + b"\n")
    assert [r for _, r in gw.refused] == [reason]
    # closed at the deadline; the margin is for a loaded machine and the last 0.2 s byte
    assert deadline_s - 0.5 <= elapsed_s < deadline_s + 2.5


def test_peer_uid_names_the_user_at_the_other_end():
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux's /proc/net/tcp")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        try:
            assert peer_uid(conn) == os.getuid()
        finally:
            conn.close()
            client.close()


def test_the_store_tunnel_refuses_another_local_user():
    """A process of another user on a joining machine cannot ride its tunnel to the store: it
    is closed unread, with one line (the tunnel carries the token's authority)."""
    system_python = Path("/usr/bin/python3")  # the venv's may not be readable by nobody
    if os.getuid() != 0 or not Path("/proc/net/tcp").exists() or not system_python.exists():
        pytest.skip("needs root (to run a client as another user), Linux and /usr/bin/python3")
    lines: list[str] = []
    tunnel = StoreTunnel("127.0.0.1", 1, TOKEN, log=lines.append).start()  # no gateway needed
    code = (
        "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1])));"
        "s.settimeout(20); print(repr(s.recv(1)))"
    )
    try:
        done = subprocess.run(
            [str(system_python), "-c", code, str(tunnel.port)],
            capture_output=True,
            text=True,
            timeout=60,
            user=65534,  # nobody
        )
    finally:
        tunnel.close()
    assert done.stdout.strip() == "b''", done.stderr
    assert len(lines) == 1 and "a process of uid 65534: it serves uid 0 only" in lines[0]


def test_the_refusals_kept_are_the_newest_few(lines, monkeypatch):
    """A long flood of refused peers must not grow the gateway's memory: it keeps the newest
    REFUSED_KEPT refusals (and logs each)."""
    monkeypatch.setattr(gateway, "REFUSED_KEPT", 2)
    gw = _gateway(lines, handshake_timeout_s=5)
    try:
        for _ in range(3):
            with _idle(gw.port) as sock:
                sock.sendall(b"not TLS\n")
                sock.settimeout(30)
                while sock.recv(4096):
                    pass
        _until(lambda: sum(x.startswith("refused ") for x in lines) == 3)
    finally:
        gw.close()
    assert len(gw.refused) == 2
    assert [peer for peer, _ in gw.refused] == [x.split()[1][:-1] for x in lines[-2:]]
