"""Property tests (hypothesis) of what a member sends the coordinator and what it writes into the
run's store: whatever the values, the coordinator's handler returns (nothing raises past it),
no slot stays held by a machine it dropped, and the metrics relay and the store's readers keep
working. Examples are derandomized and bounded, so CI sees the same ones every run."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frugaltrain.cluster import keys, rendezvous_json, run_store
from frugaltrain.cluster.auth import Channel
from frugaltrain.cluster.coordinator import Coordinator, Slots
from frugaltrain.cluster.metrics_relay import MetricsRelay
from frugaltrain.cluster.store import StoreServer

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
W = 2  # the run's slots
RDZV_STATE = f"{keys.RENDEZVOUS}/{rendezvous_json.state_key(rendezvous_json.RUN_ID)}"

# Any JSON value Python's json reads, NaN and infinities included, ints past int64 too.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
ABSENT = object()


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """A frame field: absent, any JSON value, or one close to what an agent sends."""
    return st.just(ABSENT) | json_values | plausible


def step_line(n: int) -> str:
    return json.dumps({"kind": "step", "step": n})


records = st.fixed_dictionaries(
    {"kind": st.sampled_from(["step", "round", "membership"]) | json_values},
    optional={"step": st.integers(min_value=-2, max_value=2**64) | json_values, "x": json_values},
)
lines = (
    records.map(lambda r: json.dumps(r, allow_nan=True))
    | st.text(max_size=40)
    | st.sampled_from(['{"kind": "m", "x": "\u2028"}', '{"kind": "m", "x": "\ud800"}'])
    | json_values
)


@pytest.fixture(scope="module")
def coord(config_factory, tmp_path_factory):
    """A coordinator whose store is in process (no port: `serve` is called directly)."""
    cfg = config_factory(tmp_path_factory.mktemp("fuzz"), f"run.workers={W}")
    run_dir = tmp_path_factory.mktemp("coordinator")
    c = Coordinator(cfg, run_dir, bytes(32), "127.0.0.1", 0)
    c.store = StoreServer()
    return c


def fresh(coord: Coordinator) -> Coordinator:
    """Every example starts from an empty run: all slots free, nothing logged yet."""
    coord.slots, coord.machines = Slots(W), {}
    coord.metrics = MetricsRelay(coord.metrics.path)
    coord.metrics.path.unlink(missing_ok=True)
    coord.store, coord.done, coord.ignored = StoreServer(), threading.Event(), set()
    return coord


def frame(key: bytes, seq: int, body: bytes, mac: bytes | None = None) -> bytes:
    """A control frame from the agent's side: length, body, HMAC (cluster/auth.py's Channel)."""
    good = hmac.new(key, b"C" + seq.to_bytes(8, "big") + body, hashlib.sha256).digest()
    return len(body).to_bytes(4, "big") + body + (good if mac is None else mac)


class Signed(bytes):
    """A frame body that `serve` sends with its right MAC (other bytes go on the wire as
    they are)."""


def signed(msg: object) -> Signed:
    """Any JSON value as a signed frame body, NaN included (Channel.send refuses NaN)."""
    return Signed(json.dumps(msg, allow_nan=True).encode())


def serve(coord: Coordinator, request: dict, *after: bytes) -> list[dict]:
    """`request` and then `after` written ahead, the agent's side ended, then the coordinator
    serves the channel to its end. Its replies."""
    key = secrets.token_bytes(32)
    mine, theirs = socket.socketpair()
    agent = Channel(mine, key, client=True, peer="coordinator")
    for seq, data in enumerate([signed(request), *after]):
        mine.sendall(frame(key, seq, data) if isinstance(data, Signed) else data)
    mine.shutdown(socket.SHUT_WR)
    channel = Channel(theirs, key, client=False, peer="10.9.9.9:1")
    coord.serve(channel.recv(timeout_s=5), channel)  # must return, whatever came
    channel.close()
    replies = []
    while True:
        try:
            replies.append(agent.recv(timeout_s=5))
        except ConnectionError:
            mine.close()
            return replies


def still_serving(coord: Coordinator) -> None:
    """A good machine joins, pings with a metrics line and leaves; the relay reads every
    reserve on the way (where a bad record once broke every later ping)."""
    replies = serve(
        coord,
        {"want": "join", "machine": "good", "workers": 1},
        signed({"ping": True, "metrics": [step_line(10**6)], "finished": []}),
    )
    assert replies[0]["slots"] and replies[1] == {"ok": True, "done": False}
    assert "good" not in coord.slots.owner  # it left: its slot is free again


@SETTINGS
@given(
    want=st.just("join") | json_values,
    machine=field(st.sampled_from(["m1", "m2", "", "m" * 64, "m" * 65])),
    name=field(st.text(max_size=80)),
    live=field(st.booleans()),
    workers=field(st.integers(min_value=-1, max_value=W + 1)),
    rounds=field(st.lists(st.tuples(st.integers(-1, 5), st.integers(-1, 20)), max_size=3)),
)
def test_any_join_request_is_served_and_leaves_no_slot_held(
    coord, want, machine, name, live, workers, rounds
):
    c = fresh(coord)
    request = {"want": want, "machine": machine, "name": name, "live": live}
    request |= {"workers": workers, "rounds": rounds}
    serve(c, {k: v for k, v in request.items() if v is not ABSENT})
    assert c.slots.owner == [None] * W  # joined and left, or refused: nothing held
    still_serving(c)


@SETTINGS
@given(
    metrics=field(st.lists(lines, max_size=4)),
    finished=field(st.lists(st.integers(-1, W), max_size=3)),
    leaving=field(st.booleans()),
    other=st.lists(lines, max_size=3),
)
def test_any_ping_is_served_and_a_dropped_machine_holds_no_slot(
    coord, metrics, finished, leaving, other
):
    """Machine m0 holds slot 0 and is the metrics source; m1 (slot 1) sends the ping."""
    c = fresh(coord)
    c.slots.claim("m0", 1)
    c.metrics.add("m0", [step_line(1)], ["m0"])
    msg = {"ping": True, "metrics": metrics, "finished": finished, "leaving": leaving}
    ping = {k: v for k, v in msg.items() if v is not ABSENT}
    replies = serve(c, {"want": "join", "machine": "m1"}, signed(ping), signed({"metrics": other}))
    assert c.slots.owner[0] == "m0" and c.slots.owner[1] in ("m1", None)
    if c.slots.owner[1] == "m1":  # a finished slot is never handed out again
        assert 1 in c.slots.finished or (replies[-1]["ok"] and ping.get("leaving") is True)
    c.metrics.add("m0", [step_line(2)], c.slots.holders())  # the source pings on
    c.slots.release("m0")
    still_serving(c)


@SETTINGS
@given(body=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_frame_body_is_served_and_frees_the_slots(coord, body):
    """A good ping that says it is leaving would keep its slots; but object keys of at most
    6 characters never spell "leaving"."""
    c = fresh(coord)
    serve(c, {"want": "join", "machine": "m1", "workers": W}, Signed(body))
    assert c.slots.owner == [None] * W
    still_serving(c)


@SETTINGS
@given(data=st.binary(min_size=1, max_size=80))
def test_any_bytes_on_the_channel_are_served_and_free_the_slots(coord, data):
    """Raw bytes where a frame should be: a bad length, MAC or body, or a cut frame."""
    c = fresh(coord)
    serve(c, {"want": "join", "machine": "m1", "workers": W}, data)
    assert c.slots.owner == [None] * W
    still_serving(c)


STORE_KEYS = [
    keys.DONE,
    keys.final_members(0),
    keys.final_members(1),
    keys.finished(0),
    keys.STARTED,
    RDZV_STATE,
]
store_values = st.binary(max_size=64) | json_values.map(
    lambda v: json.dumps(v, allow_nan=True).encode()
)


@SETTINGS
@given(writes=st.dictionaries(st.sampled_from(STORE_KEYS), store_values, min_size=1))
def test_any_store_values_leave_the_coordinator_and_agents_serving(coord, writes):
    """What the coordinator reads (the end of training, the first-start counter, the
    rendezvous state when it frees slots or closes the rendezvous) and what an agent reads
    (the rendezvous state, when it restarts a worker: run_store.forget)."""
    c = fresh(coord)
    for key, value in writes.items():
        c.store.set(key, value)
    for _ in range(2):
        c._run_over()
    c._count_as_started(1)
    c.slots.claim("m1", W)
    assert c._release("m1", "machine m1 lost") == list(range(W))
    for rank in range(W):
        run_store.forget(c.store, c.cfg, rank)
    read = {keys.final_members(r) for r in range(W)} | {keys.RENDEZVOUS, keys.STARTED}
    assert c.ignored <= read
    c.done.clear()  # a run the values ended; serving goes on all the same
    still_serving(c)
    c.store.set(keys.DONE, "1")  # and the run ends as it should
    for r in range(W):
        c.store.set(keys.final_members(r), "[0, 1]")
        c.store.set(keys.finished(r), "1")
    assert c._run_over() is True
