"""The rendezvous state as the store keeps it (JSON), read and changed without torch.

comm/rendezvous.py turns torch elastic's rendezvous state into this JSON and back for the
workers' handlers. What the processes that watch a run do to it needs no handler, and so no
torch: `expire` marks nodes known to be gone (a process that exited, a lost machine's slots) so
the handlers drop them at their next sync, and `close` ends the rendezvous when training is over
(a process still waiting to join is told so). Both compare-and-set on the store, tried again
while another process writes meanwhile, as the handlers do.

`parse` checks a stored value field by field (types, sizes) before anything is built from it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone

from frugaltrain.cluster import keys
from frugaltrain.cluster.store import PrefixView, Store

RUN_ID = "frugaltrain"
NO_STATE = b"null"  # the store's value before the first state is written
MAX_STATE_BYTES = 4 << 20  # a state of MAX_NODES nodes in each list fits well inside
MAX_NODES = 4096
MAX_ADDR = 256
MAX_INT = 2**63 - 1
EXPIRED = datetime(1970, 1, 1, tzinfo=timezone.utc).isoformat()  # a heartbeat long expired
FIELDS = (
    "round",
    "complete",
    "deadline",
    "closed",
    "participants",
    "wait_list",
    "redundancy_list",
    "last_heartbeats",
)
Node = tuple[str, int, int]  # address, pid, local id


class StateError(ValueError):
    """The store holds something that is not a well-formed rendezvous state."""


def node_name(worker: int) -> str:
    """A worker's address in the rendezvous (every incarnation's; the pid tells them apart)."""
    return f"worker{worker}"


def state_key(run_id: str) -> str:
    return "frugaltrain.rendezvous.json." + run_id


def dumps(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def empty() -> dict:
    """The state of a rendezvous nobody has joined yet (torch's `_RendezvousState()`)."""
    return {
        "round": 0,
        "complete": False,
        "deadline": None,
        "closed": False,
        "participants": [],
        "wait_list": [],
        "redundancy_list": [],
        "last_heartbeats": [],
    }


# ---- reading: a checked state
def parse(raw: bytes) -> dict:
    """The state `raw` describes, every field checked: nodes as (address, pid, local id), times
    as datetimes, participants and heartbeats as (node, value) pairs. StateError otherwise."""
    if len(raw) > MAX_STATE_BYTES:
        raise StateError(f"rendezvous state: {len(raw)} bytes, more than {MAX_STATE_BYTES}")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StateError(f"rendezvous state: not JSON ({reason})") from None
    if not isinstance(doc, dict) or set(doc) != set(FIELDS):
        raise StateError(f"rendezvous state: the fields must be exactly {', '.join(FIELDS)}")
    return {
        "round": _int(doc["round"], "round"),
        "complete": _bool(doc["complete"], "complete"),
        "deadline": None if doc["deadline"] is None else _datetime(doc["deadline"], "deadline"),
        "closed": _bool(doc["closed"], "closed"),
        "participants": [
            (_node(n, "participants"), _int(r, "a rank"))
            for n, r in _pairs(doc["participants"], "participants")
        ],
        "wait_list": [_node(n, "wait_list") for n in _list(doc["wait_list"], "wait_list")],
        "redundancy_list": [
            _node(n, "redundancy_list") for n in _list(doc["redundancy_list"], "redundancy_list")
        ],
        "last_heartbeats": [
            (_node(n, "last_heartbeats"), _datetime(t, "a heartbeat"))
            for n, t in _pairs(doc["last_heartbeats"], "last_heartbeats")
        ],
    }


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _bad(what: str, value: object) -> StateError:
    return StateError(f"rendezvous state: bad {what}: {str(value)[:80]!r}")


def _int(x: object, what: str) -> int:
    if type(x) is not int or not 0 <= x <= MAX_INT:
        raise _bad(what, x)
    return x


def _bool(x: object, what: str) -> bool:
    if type(x) is not bool:
        raise _bad(what, x)
    return x


def _datetime(x: object, what: str) -> datetime:
    if type(x) is not str or len(x) > 64:
        raise _bad(what, x)
    try:
        return datetime.fromisoformat(x)
    except ValueError:
        raise _bad(what, x) from None


def _list(x: object, what: str) -> list:
    if type(x) is not list or len(x) > MAX_NODES:
        raise _bad(what, x)
    return x


def _pairs(x: object, what: str) -> list:
    items = _list(x, what)
    if any(type(p) is not list or len(p) != 2 for p in items):
        raise _bad(what, x)
    return items


def _node(x: object, what: str) -> Node:
    if type(x) is not list or len(x) != 3 or type(x[0]) is not str or len(x[0]) > MAX_ADDR:
        raise _bad(f"node in {what}", x)
    return (x[0], _int(x[1], "pid"), _int(x[2], "local id"))


# ---- changing it in the store
def rendezvous_store(store: Store, namespace: str = "") -> Store:
    """Where a shard group's rendezvous keeps its state in the run's store."""
    return PrefixView(keys.RENDEZVOUS, PrefixView(namespace, store) if namespace else store)


def update(store: Store, change: Callable[[dict], bool], run_id: str = RUN_ID) -> bool:
    """Apply `change` to the stored state (an empty one if there is none yet) and write it back
    with compare-and-set, again while another process writes meanwhile. `change` edits the
    JSON document in place and says whether it changed anything; returns that."""
    key = state_key(run_id)
    store.compare_set(key, "", NO_STATE.decode())  # "no state yet", as the handlers start it
    while True:
        raw = store.get(key)
        if raw != NO_STATE:
            parse(raw)  # well-formed, or StateError
        doc = empty() if raw == NO_STATE else json.loads(raw)
        if not change(doc):
            return False
        new = dumps(doc)
        if store.compare_set(key, raw.decode(), new.decode()) == new:
            return True


def expire(store: Store, name: str, pid: int | None = None, namespace: str = "") -> int:
    """Date back to EXPIRED the heartbeat of `name`'s nodes (only process `pid`'s, if given) in
    the run's `store`, so the handlers drop them at their next sync instead of waiting out
    their keep-alive. Returns how many nodes were marked."""
    marked = 0

    def mark(doc: dict) -> bool:
        nonlocal marked
        beats = [p for p in doc["last_heartbeats"] if p[0][0] == name and pid in (None, p[0][1])]
        for pair in beats:
            pair[1] = EXPIRED
        marked = len(beats)
        return bool(beats)

    update(rendezvous_store(store, namespace), mark)
    return marked


def refresh(store: Store, namespace: str = "", now: datetime | None = None) -> int:
    """Date every node's heartbeat to `now` (the store was restored after the coordinator was
    away, and no keep-alive could reach it meanwhile: without this, the first handler to sync
    would drop every other node). Returns how many were dated."""
    stamp = (now or datetime.now(timezone.utc)).isoformat()
    dated = 0

    def date(doc: dict) -> bool:
        nonlocal dated
        for pair in doc["last_heartbeats"]:
            pair[1] = stamp
        dated = len(doc["last_heartbeats"])
        return bool(dated)

    update(rendezvous_store(store, namespace), date)
    return dated


def close(store: Store, namespace: str = "") -> None:
    """Close the rendezvous in the run's `store`: a worker still waiting to join is told so and
    exits (torch's `set_closed`, without a handler)."""

    def shut(doc: dict) -> bool:
        done, doc["closed"] = doc["closed"], True
        return not done

    update(rendezvous_store(store, namespace), shut)
