"""The rendezvous state in the store as JSON, so no worker unpickles what another one wrote.

torch elastic's `DynamicRendezvousHandler` keeps its `_RendezvousState` in a backend as bytes it
makes with `pickle.dumps`, and it `pickle.loads` whatever the backend's `get_state` returns. Its
c10d backend stores those bytes (base64) in the store as they are, so every worker would unpickle
what any process that can reach the store wrote there, and a pickle can run code.

`JsonBackend` keeps the same state as JSON instead:

    set_state   the handler's own bytes (pickled in this process a moment ago) are read with an
                unpickler that builds only the state's classes (`_OwnStateUnpickler`), turned into
                JSON and written with the c10d backend's compare-and-set: the fencing token is the
                value last read from the store, and the write succeeds iff the store then holds
                exactly what this call wrote.
    get_state   reads the JSON, checks every field (types, sizes), builds the state here and
                hands the handler `pickle.dumps` of it: bytes made in this process.

The store's value is `null` until the first state is written ("no state yet": get_state returns
None). A value that is not a well-formed state raises `StateError` (a RendezvousStateError and a
ValueError) with one line saying what is wrong.

`JsonBackend.expire` marks nodes known to be gone (a process that exited, a machine whose
channel closed) as dead at once, instead of after their keep-alive runs out.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    _NodeDesc,
    _RendezvousState,
)

NO_STATE = b"null"
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


class StateError(RendezvousStateError, ValueError):
    """The store holds something that is not a well-formed rendezvous state."""


# ---- the handler's bytes -> JSON
class _OwnStateUnpickler(pickle.Unpickler):
    """Reads the handler's own pickle of its state: builds only the classes that takes."""

    ALLOWED = {
        (_RendezvousState.__module__, "_RendezvousState"): _RendezvousState,
        (_NodeDesc.__module__, "_NodeDesc"): _NodeDesc,
        ("datetime", "datetime"): datetime,
        ("datetime", "timezone"): timezone,
        ("datetime", "timedelta"): timedelta,
        ("builtins", "set"): set,
        ("builtins", "dict"): dict,
    }

    def find_class(self, module: str, name: str) -> Any:
        cls = self.ALLOWED.get((module, name))
        if cls is None:
            raise StateError(f"rendezvous state: refusing to build {module}.{name}")
        return cls


def to_json(state_bits: bytes) -> bytes:
    """The handler's pickled `_RendezvousState` as the JSON the store keeps."""
    try:
        state = _OwnStateUnpickler(io.BytesIO(state_bits)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise StateError(f"rendezvous state: cannot read the handler's state ({exc})") from None
    if type(state) is not _RendezvousState or set(vars(state)) != set(FIELDS):
        raise StateError(f"rendezvous state: unexpected {type(state).__name__} from the handler")
    doc = {
        "round": state.round,
        "complete": state.complete,
        "deadline": _time(state.deadline),
        "closed": state.closed,
        "participants": [[_node(n), r] for n, r in state.participants.items()],
        "wait_list": [_node(n) for n in sorted(state.wait_list)],
        "redundancy_list": [_node(n) for n in sorted(state.redundancy_list)],
        "last_heartbeats": [[_node(n), _time(t)] for n, t in state.last_heartbeats.items()],
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _node(n: _NodeDesc) -> list:
    return [n.addr, n.pid, n.local_id]


def _time(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


# ---- JSON from the store -> a checked state
def from_json(raw: bytes) -> _RendezvousState:
    """The state `raw` (the store's value) describes; StateError on anything else."""
    if len(raw) > MAX_STATE_BYTES:
        raise StateError(f"rendezvous state: {len(raw)} bytes, more than {MAX_STATE_BYTES}")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StateError(f"rendezvous state: not JSON ({reason})") from None
    if not isinstance(doc, dict) or set(doc) != set(FIELDS):
        raise StateError(f"rendezvous state: the fields must be exactly {', '.join(FIELDS)}")
    state = _RendezvousState()
    state.round = _int(doc["round"], "round")
    state.complete = _bool(doc["complete"], "complete")
    state.deadline = None if doc["deadline"] is None else _datetime(doc["deadline"], "deadline")
    state.closed = _bool(doc["closed"], "closed")
    state.participants = {
        _node_of(n, "participants"): _int(r, "a rank")
        for n, r in _pairs(doc["participants"], "participants")
    }
    state.wait_list = {_node_of(n, "wait_list") for n in _list(doc["wait_list"], "wait_list")}
    state.redundancy_list = {
        _node_of(n, "redundancy_list") for n in _list(doc["redundancy_list"], "redundancy_list")
    }
    state.last_heartbeats = {
        _node_of(n, "last_heartbeats"): _datetime(t, "a heartbeat")
        for n, t in _pairs(doc["last_heartbeats"], "last_heartbeats")
    }
    return state


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


def _node_of(x: object, what: str) -> _NodeDesc:
    if type(x) is not list or len(x) != 3 or type(x[0]) is not str or len(x[0]) > MAX_ADDR:
        raise _bad(f"node in {what}", x)
    return _NodeDesc(x[0], _int(x[1], "pid"), _int(x[2], "local id"))


# ---- the backend
class JsonBackend(RendezvousBackend):
    """A rendezvous backend on a torch.distributed Store that keeps the state as JSON, with the
    c10d backend's compare-and-set semantics (see the module docstring)."""

    def __init__(self, store: Store, run_id: str) -> None:
        if not run_id:
            raise ValueError("the run id must be a non-empty string")
        self._store = store
        self._key = "frugaltrain.rendezvous.json." + run_id
        self._call_store("compare_set", self._key, "", NO_STATE.decode())  # "no state yet"

    @property
    def name(self) -> str:
        return "frugaltrain-json"

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._decode(self._call_store("get", self._key))

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write `state` iff the store still holds what `token` was read from (no token: iff
        there is no state yet). Returns the state then in the store, its token, and whether
        this call wrote it; None if there is no state."""
        desired = to_json(state)
        if token and not isinstance(token, bytes):  # not a token of this backend: cannot match
            current = self.get_state()
            return None if current is None else (*current, False)
        expected = token if token else NO_STATE
        stored = self._call_store("compare_set", self._key, expected.decode(), desired.decode())
        current = self._decode(stored)
        if current is None:
            return None
        return (*current, stored == desired)

    def expire(self, dead: Callable[[list], bool]) -> int:
        """Date back to EXPIRED the heartbeat of every node `dead([addr, pid, local id])` is
        true of, so the handler drops them at its next sync; compare-and-set, tried again while
        another process writes meanwhile. Returns how many nodes were marked."""
        while True:
            raw = self._call_store("get", self._key)
            if raw == NO_STATE:
                return 0
            from_json(raw)  # well-formed, or StateError
            doc = json.loads(raw)
            beats = [pair for pair in doc["last_heartbeats"] if dead(pair[0])]
            if not beats:
                return 0
            for pair in beats:
                pair[1] = EXPIRED
            new = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
            if self._call_store("compare_set", self._key, raw.decode(), new.decode()) == new:
                return len(beats)

    def _decode(self, raw: bytes) -> tuple[bytes, Token] | None:
        if raw == NO_STATE:
            return None
        return pickle.dumps(from_json(raw)), raw

    def _call_store(self, op: str, *args: str) -> bytes:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(f"the store failed on {op}: {exc}") from exc
