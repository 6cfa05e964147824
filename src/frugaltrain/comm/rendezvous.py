"""Membership on torch elastic's rendezvous: who is in the next epoch, agreed by every worker.

The engine is `torch.distributed.elastic.rendezvous.DynamicRendezvousHandler`, its state kept on
the TCPStore the launcher hosts (so it outlives any worker) as JSON (`JsonBackend`, below:
torch's c10d backend keeps a pickle there, which every worker would unpickle). What it gives us:

    rounds      a round closes when every participant of the last one has left it (called
                `next_rendezvous` again) or been dropped; everybody who then joins within
                `last_call` of the first is in the next round, and all of them get the same
                participant list and a store of the round's own.
    keep-alive  each participant refreshes its heartbeat in the rendezvous state every
                `keep_alive_interval`; one that misses `keep_alive_max_attempt` of them (killed,
                stopped, cut off) is dropped from the round by whoever syncs next.
    wait list   a worker that asks to join while a round is complete waits, inside
                `next_rendezvous`, until the members open the next round.
    close       the launcher closes the rendezvous when the run is over; a worker still waiting
                gets `RendezvousClosedError`.

A process known to be gone need not wait out its keep-alive: the launcher (a worker process
exited) and the coordinator (a machine's channel closed) `expire` its nodes, and the others drop
them at their next sync, within a poll.

What a rendezvous round does not know is what each participant was doing: a member recovering
from a failure, a member at a round end ready to admit, a restarted worker asking to join, or a
member the others already went on without (stale). So every participant posts that to the
round's store (`Round` below) and all of them apply the same rule to the same list.

Unlike torchelastic's agent, nobody restarts on a membership change: survivors re-rendezvous in
process and build a new gloo group; only a dead or stale worker is (re)started.

The state is kept in the store as JSON, so no worker unpickles what another one wrote.

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
import json
import math
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import torch.distributed as dist
from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
    _NodeDesc,
    _RendezvousState,
)

from frugaltrain.cluster import keys, rendezvous_json
from frugaltrain.cluster.rendezvous_json import RUN_ID, node_name

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


# The handler polls the rendezvous state once a second while it waits, and a waiting node
# refreshes its keep-alive only between polls. So a node counts as dead after at least 3 s
# without one (less would drop nodes that are only waiting), and the last call is longer than
# a poll, so every survivor that is waiting gets into the round the first one opens.
KEEP_ALIVE_S = 0.5
MIN_EXPIRY_S = 3.0
LAST_CALL_S = 2.0


class _Backend(JsonBackend):
    """The JSON backend, which can be cut: while `cut` is set (an injected partition), or once
    the others have marked this worker incarnation evicted (alive but stuck past the deadline,
    comm/ft/operation_log.py), this worker cannot reach the rendezvous: its keep-alives fail, so the
    others drop it, as in a real partition."""

    def __init__(self, store: dist.Store, run_id: str, evicted: Callable[[], bool]) -> None:
        super().__init__(store, run_id)
        self.cut = threading.Event()
        self.evicted = evicted

    def _check(self) -> None:
        if self.cut.is_set():
            raise RendezvousConnectionError("cut off by an injected partition")
        if self.evicted():
            raise RendezvousConnectionError("evicted by the others (stuck past the deadline)")

    def get_state(self):
        self._check()
        return super().get_state()

    def set_state(self, state: bytes, token=None):
        self._check()
        return super().set_state(state, token)


def _handler(
    host: str,
    port: int,
    world_size: int,
    name: str,
    timeout_s: float,
    hb_timeout_s: float,
    evict: str = "",
    namespace: str = "",
) -> tuple[DynamicRendezvousHandler, _Backend, dist.Store]:
    # The rendezvous hands back the run's store; do not start a second TCPStore on the rank 0
    # of each round (torch's default, meant for its own agent).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    client = dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=max(60.0, timeout_s))
    )
    if namespace:  # one rendezvous per shard group (run.shards > 1)
        client = dist.PrefixStore(namespace, client)
    store = dist.PrefixStore(keys.RENDEZVOUS, client)
    backend = _Backend(store, RUN_ID, lambda: bool(evict) and client.check([evict]))
    handler = DynamicRendezvousHandler.from_backend(
        RUN_ID,
        store,
        backend,
        min_nodes=1,
        max_nodes=world_size,
        local_addr=name,
        timeout=RendezvousTimeout(
            join=timedelta(seconds=max(60.0, 4 * timeout_s)),
            last_call=timedelta(seconds=LAST_CALL_S),
            close=timedelta(seconds=10),
        ),
        keep_alive_interval=KEEP_ALIVE_S,
        keep_alive_max_attempt=math.ceil(max(MIN_EXPIRY_S, hb_timeout_s) / KEEP_ALIVE_S),
    )
    return handler, backend, client


@dataclass
class Round:
    """What one rendezvous round decided; every participant computes the same one.

    members: workers of the new epoch (sorted; a worker's gloo rank is its index).
    joiners: restarted workers admitted now (a subset of members), with `tokens`
        ("worker:incarnation") and `donors`: each joiner's donor, the old member that sends it
        its state (`donor_after`: the lowest, unless the joiner refused some).
    started_over: joiners that had refused every old member's state once: their donors
        start over.
    stale: workers the others had already gone on without; they must restart.
    deferred: joiners left out because some member was recovering (they wait for the next).
    """

    epoch: int
    members: list[int]
    joiners: list[int]
    tokens: list[str]
    donors: dict[int, int]
    started_over: list[int]
    round: int
    stale: list[int]
    deferred: list[int]
    store: dist.Store


def decide(who: list[dict]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The rule every participant applies to the same list: (members, joiners, stale, deferred).

    Each entry is {"worker", "epoch" (the member's last epoch, -1 for a joiner), "purpose"
    ("start", "recover", "admit" or "join"), "round"}. Old members are the non-joiners of the
    newest epoch; older ones are stale. Joiners get in only when every old member is at the
    same round end, ready to admit (a member recovering mid-round has operations to re-post,
    which a joiner never took part in).
    """
    old = [w for w in who if w["purpose"] != "join"]
    join = sorted(w["worker"] for w in who if w["purpose"] == "join")
    if not old:
        return [], [], [], join
    newest = max(w["epoch"] for w in old)
    current = [w for w in old if w["epoch"] == newest]
    stale = sorted(w["worker"] for w in old if w["epoch"] < newest)
    admit = all(w["purpose"] == "admit" for w in current) and (
        len({w["round"] for w in current}) == 1
    )
    joiners = join if admit else []
    members = sorted({w["worker"] for w in current} | set(joiners))
    return members, joiners, stale, [] if admit else join


def donor_after(old: list[int], refused: list[int]) -> tuple[int, bool]:
    """A joiner's donor among the old members `old`, and whether its order started over.

    `refused` holds the donors whose state the joiner refused since it last rejoined, in order
    (its who entry; admission.py keeps it). The donor is the first old member after the last
    refused one, wrapping around, that it has not refused; the lowest without refusals. Once it
    has refused every old member, the order starts over from the same place. Every participant
    computes it from the same record, so all agree.
    """
    old = sorted(old)
    if not refused:
        return old[0], False
    ring = [w for w in old if w > refused[-1]] + [w for w in old if w <= refused[-1]]
    fresh = [w for w in ring if w not in refused]
    return (fresh[0], False) if fresh else (ring[0], True)


class Membership:
    """One worker's handle on the run's rendezvous (see the module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        worker: int,
        incarnation: int,
        world_size: int,
        *,
        timeout_s: float,
        hb_timeout_s: float,
        namespace: str = "",
    ) -> None:
        self.worker, self.incarnation = worker, incarnation
        self.timeout_s = timeout_s
        self.handler, self.backend, self.client = _handler(
            host,
            port,
            world_size,
            node_name(worker),
            timeout_s,
            hb_timeout_s,
            keys.evict(worker, incarnation),
            namespace,
        )

    def next(
        self, purpose: str, epoch: int, round_idx: int, refused: tuple[int, ...] = ()
    ) -> Round:
        """Leave the current round, join the next one and agree on what it means. `refused`:
        a joiner's refused donors (`donor_after`). Raises what the rendezvous raises (timeout,
        closed) and store errors (a participant died right after the round closed); the caller
        tries again."""
        info = self.handler.next_rendezvous()
        me = {
            "worker": self.worker,
            "incarnation": self.incarnation,
            "epoch": epoch,
            "purpose": purpose,
            "round": round_idx,
            "refused": list(refused),
        }
        info.store.set(keys.who(info.rank), json.dumps(me))
        everyone = [keys.who(r) for r in range(info.world_size)]
        info.store.wait(everyone, timedelta(seconds=self.timeout_s))
        who = [json.loads(v) for v in info.store.multi_get(everyone)]
        if info.rank == 0:  # epochs are numbered run-wide, one per round that forms a group
            info.store.set(keys.ROUND_EPOCH, str(self.client.add(keys.EPOCHS, 1) - 1))
        new_epoch = int(info.store.get(keys.ROUND_EPOCH))
        members, joiners, stale, deferred = decide(who)
        old = [w for w in who if w["purpose"] != "join" and w["worker"] in members]
        old_members = [w["worker"] for w in old]
        picks = {
            w["worker"]: donor_after(old_members, w.get("refused", []))
            for w in who
            if w["purpose"] == "join" and w["worker"] in joiners
        }
        return Round(
            epoch=new_epoch,
            members=members,
            joiners=joiners,
            tokens=[f"{w['worker']}:{w['incarnation']}" for w in who if w["worker"] in joiners],
            donors={j: donor for j, (donor, _) in picks.items()},
            started_over=sorted(j for j, (_, over) in picks.items() if over),
            round=max((w["round"] for w in old), default=0),
            stale=stale,
            deferred=deferred,
            store=info.store,
        )

    def waiting(self) -> int:
        """Workers on the wait list (asking to join the next round)."""
        return self.handler.num_nodes_waiting()

    def cut(self, on: bool) -> None:
        """An injected partition: this worker's keep-alives fail while `on`."""
        (self.backend.cut.set if on else self.backend.cut.clear)()
