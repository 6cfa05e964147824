"""A member's input cannot crash or wedge the coordinator (cluster/coordinator.py,
cluster/metrics_relay.py): every field of a control frame and every store value it reads is
checked. A machine that sends a bad field or a frame with a bad MAC is logged with its name and
address and dropped, its slots freed; a bad store value is logged by its key and ignored; the
run goes on. The coordinator is driven in process, its control channels over socket pairs, its
store written directly as a member's store tunnel would: no training process runs. At the end:
a machine on another frugaltrain or torch, or on other data, is refused in one line naming both
sides."""

from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
import json
import resource
import secrets
import socket
import struct
import threading

import pytest
from helpers.tokens import TOKEN, tls_connection

from frugaltrain.cluster import keys, rendezvous_json
from frugaltrain.cluster.auth import Channel
from frugaltrain.cluster.coordinator import COORDINATOR_STATE, Coordinator
from frugaltrain.cluster.store import MAGIC, Query
from frugaltrain.metrics.log import read_metrics

PEER = "10.0.0.7:40000"
RDZV_STATE = f"{keys.RENDEZVOUS}/{rendezvous_json.state_key(rendezvous_json.RUN_ID)}"


@pytest.fixture
def coord(make_config, tmp_path):
    cfg = make_config("run.workers=2", "fault_tolerance.enabled=true")
    run_dir = tmp_path / "coordinator"
    run_dir.mkdir()
    c = Coordinator(cfg, run_dir, TOKEN, "127.0.0.1", 0).start()
    yield c
    c.close()


def log_of(coord: Coordinator) -> str:
    return (coord.run_dir / "coordinator.log").read_text()


def step(n: int, by: str = "a") -> str:
    return json.dumps({"kind": "step", "step": n, "by": by})


class Member:
    """The agent's side of one control channel to `coord`, over a socket pair. `serve` writes
    the frames ahead, ends this side, and lets the coordinator serve them to the end; `start`
    serves on a thread while the test talks (`talk`)."""

    def __init__(self, coord: Coordinator, machine: str | None, peer: str = PEER) -> None:
        self.coord, self.machine = coord, machine
        self.key = secrets.token_bytes(32)
        self.sock, theirs = socket.socketpair()
        self.channel = Channel(self.sock, self.key, client=True, peer="coordinator")
        self.theirs = Channel(theirs, self.key, client=False, peer=peer)
        self.thread: threading.Thread | None = None

    def request(self, **fields) -> dict:
        base = {"want": "join", "machine": self.machine, "name": "box", "workers": 1}
        return {k: v for k, v in (base | fields).items() if v is not None}

    def raw(self, body: bytes, mac: bytes | None = None) -> None:
        """A frame of `body` (any bytes), with its right MAC unless `mac` is given."""
        seq = self.channel._sent.to_bytes(8, "big")
        good = hmac.new(self.key, b"C" + seq + body, hashlib.sha256).digest()
        self.sock.sendall(len(body).to_bytes(4, "big") + body + (good if mac is None else mac))
        self.channel._sent += 1

    def serve(self, request: dict, *frames: dict | bytes) -> list[dict]:
        """Join with `request`, send `frames` (bytes: a raw body), then leave; the replies."""
        self.channel.send(request)
        for f in frames:
            self.raw(f) if isinstance(f, bytes) else self.channel.send(f)
        self.sock.shutdown(socket.SHUT_WR)
        self.coord.serve(self.theirs.recv(), self.theirs)
        return self.replies()

    def replies(self) -> list[dict]:
        self.theirs.close()
        out = []
        while True:
            try:
                out.append(self.channel.recv(timeout_s=5))
            except ConnectionError:
                return out

    def start(self) -> dict:
        """Join and stay: the coordinator serves on a thread; its answer."""
        self.channel.send(self.request())
        req = self.theirs.recv()
        self.thread = threading.Thread(target=self.coord.serve, args=(req, self.theirs))
        self.thread.start()
        return self.channel.recv(timeout_s=10)

    def talk(self, msg: dict) -> dict:
        self.channel.send(msg)
        return self.channel.recv(timeout_s=10)

    def leave(self) -> None:
        self.talk({"ping": True, "leaving": True})
        self.thread.join(10)
        assert not self.thread.is_alive()


# ---- the store: a member writes any key through its store tunnel
BAD_VALUES = [
    b"null",
    b"{}",
    b'"0,1"',
    b"[]",
    b"[null]",
    b"[true]",
    b'[0, "1"]',
    b"[-1]",
    b"[2]",
    b"[0, 1, 0]",
    b"[99999999999999999999999999]",
    b"[1e400]",
    b"[NaN]",
    b"not json",
    b"\xff\xfe\x00",
    b"[" * 100_000,
    b"",
]


@pytest.mark.parametrize("value", BAD_VALUES, ids=range(len(BAD_VALUES)))
def test_a_bad_final_members_value_is_logged_and_the_run_goes_on(coord, value):
    """The attack found: `null` in ft/final_members/0 made the coordinator's main thread exit
    with a traceback. Now it is logged once, by its key, and the run ends on a good value."""
    coord.store.set(keys.DONE, "1")
    coord.store.set(keys.final_members(0), value)
    for _ in range(3):  # the coordinator polls
        assert coord._run_over() is False
    assert log_of(coord).count("ignored the store's ft/final_members/0") == 1
    coord.store.set(keys.final_members(1), "[0, 1]")
    coord.store.set(keys.finished(0), "1")
    coord.store.set(keys.finished(1), "1")
    assert coord._run_over() is True


def test_final_members_deleted_after_the_check_is_no_error(coord, monkeypatch):
    """A member may delete the key between the coordinator's check and its get."""
    coord.store.set(keys.DONE, "1")
    coord.store.set(keys.final_members(0), "[0]")
    reads = coord.store.get
    monkeypatch.setattr(coord.store, "get", lambda key: reads("deleted"))  # KeyError
    assert coord._training_over() is False


@pytest.mark.parametrize("value", [b"{}", b"[]", b"not json", b'{"round": -1}', b"\xff"])
def test_a_bad_rendezvous_state_never_stops_the_coordinator(coord, value):
    """The rendezvous state is read when a machine's slots are freed (its nodes marked gone)
    and when training is over (the rendezvous closed): a bad one is logged, and the slots are
    freed and the run ends all the same."""
    coord.store.set(RDZV_STATE, value)
    m = Member(coord, "m1")
    assert m.serve(m.request())[0]["slots"] == [0]  # then it leaves: its slot is freed
    assert coord.slots.owner == [None, None]
    coord.store.set(keys.DONE, "1")
    coord.store.set(keys.final_members(0), "[0]")
    coord.store.set(keys.finished(0), "1")
    assert coord._run_over() is True
    assert f"ignored the store's {keys.RENDEZVOUS}" in log_of(coord)


@pytest.mark.parametrize("value", [b"null", b"x", b"9" * 5000, b"1.5"])
def test_a_started_counter_that_holds_no_integer_is_logged(coord, value):
    """A resume that frees a machine's slots counts their first starts in (ft/started)."""
    coord.store.set(keys.STARTED, value)
    coord._count_as_started(2)
    assert coord.store.get(keys.STARTED) == value
    assert log_of(coord).count(f"ignored the store's {keys.STARTED}") == 1


def test_a_resume_over_a_bad_rendezvous_state_starts(coord):
    coord.store.set(RDZV_STATE, b"null-ish")
    coord.close()
    again = Coordinator(coord.cfg, coord.run_dir, TOKEN, "127.0.0.1", 0, resume=True).start()
    try:
        assert again.store.get(RDZV_STATE) == b"null-ish"
        assert f"ignored the store's {keys.RENDEZVOUS}" in log_of(again)
    finally:
        again.close()


# ---- the control channel: a join request's fields
BAD_JOINS = [
    {"want": "config"},
    {"want": None},
    {"want": ["join"]},
    {"machine": ["m1"]},
    {"machine": "m 1"},
    {"machine": "x" * 65},
    {"machine": 7},
    {"name": {"a": 1}},
    {"live": "yes"},
    {"live": 1},
    {"workers": "2"},
    {"workers": 0},
    {"workers": -3},
    {"workers": True},
    {"workers": 2.0},
    {"workers": 10**30},
    {"rounds": "1,2"},
    {"rounds": [[1, 2, 3]]},
    {"rounds": [["1", 2]]},
    {"rounds": [[1, -2]]},
    {"rounds": [[10**30, 2]]},
    {"rounds": [None]},
]


@pytest.mark.parametrize("fields", BAD_JOINS, ids=range(len(BAD_JOINS)))
def test_a_bad_join_request_is_refused_with_its_sender_and_holds_no_slot(coord, fields):
    m = Member(coord, "m1")
    replies = m.serve(m.request(**fields))
    assert len(replies) == 1 and replies[0]["error"].startswith("bad request: ")
    assert coord.slots.owner == [None, None]
    field = next(k for k in ("want", "machine", "name", "live", "workers", "rounds") if k in fields)
    assert f"refused a request from {PEER}: {field}: " in log_of(coord)


def test_a_bad_join_request_from_a_known_machine_drops_it(coord):
    """The machine id is good and held slots: that machine is dropped, its slot freed."""
    m = Member(coord, "m1")
    assert m.start()["slots"] == [0]
    again = Member(coord, "m1", peer="10.0.0.7:40001")
    assert "error" in again.serve(again.request(workers="all"))[0]
    assert coord.slots.owner == [None, None]
    assert "refused a request from machine box (10.0.0.7:40001): workers: " in log_of(coord)
    assert "machine box dropped: slots [0] are free" in log_of(coord)
    m.leave()


def test_a_name_is_one_printable_line_in_the_log(coord):
    m = Member(coord, "m1")
    m.serve(m.request(name="evil\nforged line\x1b[2J" + "x" * 100))
    line = next(x for x in log_of(coord).splitlines() if "joined" in x)
    assert "machine evil?forged line?[2J" in line and "x" * 65 not in line


# ---- the control channel: pings
BAD_PINGS = [
    {"metrics": "a line"},
    {"metrics": [1]},
    {"metrics": [None]},
    {"metrics": ["not json"]},
    {"metrics": ["[1, 2]"]},
    {"metrics": [json.dumps({"kind": "step", "step": "7"})]},
    {"metrics": [json.dumps({"kind": "step", "step": -1})]},
    {"metrics": [json.dumps({"kind": "step", "step": 2**64})]},
    {"metrics": [json.dumps({"kind": "step", "step": True})]},
    {"metrics": [json.dumps({"kind": ["step"], "step": 3})]},
    {"metrics": [json.dumps({"step": 3})]},
    {"metrics": ['{"kind": "membership", "x": "\u2028"}']},  # a line break to splitlines
    {"metrics": ['{"kind": "membership", "x": "\ud800"}']},  # not UTF-8: cannot be written
    {"metrics": ['{"kind": "membership", "x": ' + "[" * 40 + "]" * 40 + "}"]},
    {"finished": 0},
    {"finished": "0"},
    {"finished": [1]},  # not its slot
    {"finished": [0.0]},
    {"finished": [[0]]},
    {"leaving": "yes"},
    {"leaving": 1},
]


@pytest.mark.parametrize("fields", BAD_PINGS, ids=range(len(BAD_PINGS)))
def test_a_bad_ping_drops_its_machine_and_frees_its_slots(coord, fields):
    m = Member(coord, "m1")
    ok = {"ping": True, "metrics": [step(1)], "finished": []}
    replies = m.serve(m.request(), ok, {"ping": True} | fields, ok)
    assert [r.get("ok") for r in replies] == [None, True]  # the config, then one ping
    assert coord.slots.owner == [None, None]
    log = log_of(coord)
    assert f"machine box ({PEER}) sent a bad frame: " in log
    assert "machine box dropped: slots [0] are free" in log
    assert [r["step"] for r in read_metrics(coord.run_dir / "metrics.jsonl")] == [1]


def test_a_frame_with_a_bad_mac_frees_its_machines_slots(coord):
    """Found unchecked: the Refused a bad MAC raises went past `_follow`, and the machine's
    slots stayed held although its channel was closed."""
    m = Member(coord, "m1")
    m.channel.send(m.request(workers=2))
    m.channel.send({"ping": True, "metrics": [], "finished": []})
    m.raw(b'{"ping": true, "finished": [0, 1], "leaving": true}', mac=bytes(32))
    # no shutdown: the coordinator must stop reading on the MAC alone
    m.coord.serve(m.theirs.recv(), m.theirs)
    assert [r.get("ok") for r in m.replies()] == [None, True]
    assert coord.slots.owner == [None, None] and coord.slots.finished == set()
    said = f"machine box ({PEER}) sent a bad frame: {PEER} sent a frame with a bad MAC"
    assert said in log_of(coord)


def test_an_escaped_lone_surrogate_is_a_good_line(coord):
    """Not every odd line is bad: escaped, it is plain ASCII in the log."""
    m = Member(coord, "m1")
    line = '{"kind": "membership", "x": "\\ud800"}'
    assert [r.get("ok") for r in m.serve(m.request(), {"metrics": [line]})] == [None, True]
    assert read_metrics(coord.run_dir / "metrics.jsonl")[0]["x"] == "\ud800"


@pytest.mark.parametrize("body", [b"[1, 2]", b"not json", b'"text"', b"\xff\xfe"])
def test_a_frame_that_is_not_an_object_frees_its_machines_slots(coord, body):
    m = Member(coord, "m1")
    m.serve(m.request(), body)
    assert coord.slots.owner == [None, None]
    assert f"machine box ({PEER}) sent a bad frame: " in log_of(coord)


def test_a_bad_record_from_another_machine_leaves_the_source_pinging(coord):
    """Found unchecked: a wrong-typed record from a machine that is not the metrics source was
    kept in its reserve, and every later ping, from any machine, failed on it. Now that
    machine is dropped, and the source's pings and log go on."""
    a = Member(coord, "ma")
    assert a.start()["slots"] == [0]
    assert a.talk({"ping": True, "metrics": [step(1), step(2)]})["ok"]
    b = Member(coord, "mb", peer="10.0.0.8:40000")
    bad = json.dumps({"kind": "step", "step": "3"})
    replies = b.serve(b.request(), {"ping": True, "metrics": [step(1, "b"), bad]})
    assert [r.get("slots") for r in replies] == [[1]]  # joined, then dropped at its ping
    assert coord.slots.owner == ["ma", None]
    assert coord.metrics.reserve.get("mb", []) == []
    assert a.talk({"ping": True, "metrics": [step(3)], "finished": [0]})["ok"]
    a.leave()
    recs = read_metrics(coord.run_dir / "metrics.jsonl")
    assert [(r["step"], r["by"]) for r in recs] == [(1, "a"), (2, "a"), (3, "a")]
    assert "machine box (10.0.0.8:40000) sent a bad frame: machine mb: metrics: " in log_of(coord)


def test_a_good_machine_joins_after_every_attack(coord):
    for fields in BAD_JOINS:
        m = Member(coord, "m1")
        m.serve(m.request(**fields))
    for fields in BAD_PINGS:
        m = Member(coord, "m1")
        m.serve(m.request(), {"ping": True} | fields)
    good = Member(coord, "good")
    assert good.start()["slots"] == [0]
    assert good.talk({"ping": True, "metrics": [], "finished": [0]}) == {"ok": True, "done": False}
    good.leave()
    assert coord.slots.finished == {0}


# ---- the coordinator's own process
def test_the_open_files_limit_is_raised_to_the_hard_limit(coord):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or "open files: could not raise the limit" in log_of(coord)
    assert "open files: " in log_of(coord)


def test_a_log_that_cannot_be_written_leaks_no_socket(coord):
    """With coordinator.log unwritable (here a directory; in a flood, no descriptor left),
    logging a refusal must not raise in the gateway's handler before the socket is closed."""
    log = coord.run_dir / "coordinator.log"
    log.unlink()
    log.mkdir()
    with tls_connection(coord.port) as s:
        s.sendall(b"no token\n")
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert b"REFUSED" in got
    for t in list(coord.gateway._sockets.threads):
        t.join(10)
    assert len(coord.gateway.refused) == 1
    assert coord.gateway._sockets._open == set()
    assert coord.unlogged >= 1


# ---- versions and data: what every machine of a run must share
__version__ = importlib.metadata.version("frugaltrain")
DATA_A, DATA_B = "a" * 64, "b" * 64


def _versions(torch: str, frugaltrain: str = __version__) -> dict:
    return {"frugaltrain": frugaltrain, "torch": torch}


def test_a_machine_on_another_torch_than_the_first_is_refused(coord):
    first = Member(coord, "m1")
    first.request = lambda **f: Member.request(first, versions=_versions("2.13.0"), **f)
    assert "slots" in first.start()  # the first machine's torch becomes the run's
    other = Member(coord, "m2")
    replies = other.serve(other.request(name="other", versions=_versions("2.12.0")))
    assert replies == [{"error": "other runs torch 2.12.0; box runs torch 2.13.0"}]
    assert "refused machine other (10.0.0.7:40000): other runs torch 2.12.0" in log_of(coord)
    assert coord.slots.of("m2") == []
    first.leave()


def test_another_frugaltrain_than_the_coordinators_is_refused(coord):
    m = Member(coord, "m1")
    replies = m.serve(m.request(versions=_versions("2.13.0", frugaltrain="9.9.9")))
    want = f"box runs frugaltrain 9.9.9; the coordinator runs frugaltrain {__version__}"
    assert replies == [{"error": want}]
    assert coord.slots.of("m1") == []


@pytest.mark.parametrize("versions", [["2.13"], {"torch": 2.13}, {"torch": "2.13\n0"}])
def test_a_bad_versions_field_is_a_bad_request(coord, versions):
    m = Member(coord, "m1")
    (reply,) = m.serve(m.request(versions=versions))
    assert reply["error"].startswith("bad request: versions: ")


def test_a_machine_on_other_data_is_refused_and_its_slots_freed(coord):
    first = Member(coord, "m1")
    replies = first.serve(first.request(), {"ping": True, "data": DATA_A})
    assert "slots" in replies[0] and replies[1]["ok"] is True
    other = Member(coord, "m2")
    replies = other.serve(other.request(name="other"), {"ping": True, "data": DATA_B})
    assert "slots" in replies[0]
    assert replies[1] == {
        "error": f"other trains on data with sha256 {DATA_B}; box trains on data with sha256 "
        f"{DATA_A}"
    }
    assert coord.slots.of("m2") == []
    saved = json.loads((coord.run_dir / COORDINATOR_STATE).read_text())
    assert saved["data"] == [DATA_A, "box"]  # a resumed coordinator keeps the run's data


def test_a_resumed_coordinator_keeps_the_runs_torch_and_data(coord, make_config):
    first = Member(coord, "m1")
    first.serve(first.request(versions=_versions("2.13.0")), {"ping": True, "data": DATA_A})
    coord.close()
    again = Coordinator(coord.cfg, coord.run_dir, coord.token, "127.0.0.1", 0, resume=True)
    assert again.versions["torch"] == ["2.13.0", "box"] and again.data == [DATA_A, "box"]


def test_the_store_has_no_port_only_the_gateways_connections(coord):
    """No local user of the coordinator's host reaches the store: it listens nowhere, and the
    gateway hands each authenticated store connection to it in process."""
    assert coord.store._listener is None and coord.store.port == 0
    hello = bytes([Query.VALIDATE]) + struct.pack("<I", MAGIC)
    with coord._store_connection() as conn:
        conn.settimeout(10)
        conn.sendall(hello + bytes([Query.PING]) + b"ping")
        assert conn.recv(4) == b"ping"
