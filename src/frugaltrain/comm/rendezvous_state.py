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

The JSON itself (its fields, their checks, and the changes made to it without a handler) is
cluster/rendezvous_json.py, which needs no torch.
"""

from __future__ import annotations

import io
import pickle
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

from frugaltrain.cluster import rendezvous_json

NO_STATE = rendezvous_json.NO_STATE
FIELDS = rendezvous_json.FIELDS


class StateError(RendezvousStateError, rendezvous_json.StateError):
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
    return rendezvous_json.dumps(doc)


def _node(n: _NodeDesc) -> list:
    return [n.addr, n.pid, n.local_id]


def _time(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


# ---- JSON from the store -> a checked state
def from_json(raw: bytes) -> _RendezvousState:
    """The state `raw` (the store's value) describes; StateError on anything else."""
    try:
        doc = rendezvous_json.parse(raw)
    except rendezvous_json.StateError as e:
        raise StateError(str(e)) from None
    state = _RendezvousState()
    state.round, state.complete = doc["round"], doc["complete"]
    state.deadline, state.closed = doc["deadline"], doc["closed"]
    state.participants = {_NodeDesc(*n): r for n, r in doc["participants"]}
    state.wait_list = {_NodeDesc(*n) for n in doc["wait_list"]}
    state.redundancy_list = {_NodeDesc(*n) for n in doc["redundancy_list"]}
    state.last_heartbeats = {_NodeDesc(*n): t for n, t in doc["last_heartbeats"]}
    return state


# ---- the backend
class JsonBackend(RendezvousBackend):
    """A rendezvous backend on a torch.distributed Store that keeps the state as JSON, with the
    c10d backend's compare-and-set semantics (see the module docstring)."""

    def __init__(self, store: Store, run_id: str) -> None:
        if not run_id:
            raise ValueError("the run id must be a non-empty string")
        self._store = store
        self._key = rendezvous_json.state_key(run_id)
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

    def _decode(self, raw: bytes) -> tuple[bytes, Token] | None:
        if raw == NO_STATE:
            return None
        return pickle.dumps(from_json(raw)), raw

    def _call_store(self, op: str, *args: str) -> bytes:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(f"the store failed on {op}: {exc}") from exc
