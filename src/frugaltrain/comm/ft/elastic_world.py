"""`ElasticWorld`: one worker's place in a fault-tolerant world, shared by the parts of its runtime.

It holds the worker's epoch, the epoch's members and their gloo group, the last finished round
and the membership records for worker 0's log, and it moves from one epoch to the next through
the rendezvous (comm/rendezvous.py): `rendezvous` takes part in rounds until this worker is in
one whose group forms; a worker the others went on without exits with EVICTED_EXIT and is
restarted by the launcher. Marking an epoch broken (`report`) is how any part says the members
must re-form; the op log (operation_log.py) does the re-forming.

Across machines the store is reached through the machine's tunnel (train/agent.py), which holds
requests while the coordinator is away and, past fault_tolerance.coordinator_wait_s, closes
them: the store is then lost for good. `guarded` is how the parts that run inside a round (the
op log's checks, the round end, the logging scalars) see that: they go on without the store, on
gloo alone, and the round end stops the worker once every member has lost it (runtime.py).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, TypeVar

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from frugaltrain.cluster import keys
from frugaltrain.comm.ft import heartbeat
from frugaltrain.comm.rendezvous import Membership, Round

T = TypeVar("T")
EVICTED_EXIT = 75  # exit code of a worker the others declared dead; the launcher restarts it
STOPPED_EXIT = 76  # exit code of a worker that checkpointed its round and stopped: store lost


class Options(Protocol):
    """The fault-tolerance settings the runtime reads (config's [fault_tolerance] section)."""

    mix1_deadline_s: float  # the longest wait for missing Mix1 messages at a round end
    deadline_factor: float  # the adaptive deadline: this x the p90 of recent round times,
    deadline_floor_s: float  # but at least this


@dataclass(frozen=True)
class Identity:
    """Who a process is in its fault-tolerant world, and where the run's store listens (the
    heartbeat thread and the rendezvous open clients of their own).

    rank: the worker's fixed rank (its data shard and its name in logs; with shards, its
        replica). world_size: configured number of workers. incarnation: how many times the
        launcher has started it. namespace: store prefix of this world's keys (keys.namespace).
        held_store: the store is reached through a machine's tunnel that may give up on it
        (the run spans machines); a lost store is then survived to the round end.
    """

    host: str
    port: int
    rank: int
    world_size: int
    incarnation: int = 1
    namespace: str = ""
    held_store: bool = False


class StoreLost(RuntimeError):
    """The run's store is gone for good, and what was asked cannot be done without it."""


def short_error(e: Exception) -> str:
    """A gloo error in one line, without the source path gloo puts in front."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    text = text.split("] ", 1)[-1]
    return text.split(". ", 1)[0][:120]


class ElasticWorld:
    """See the module docstring. `root` is the run's store (replica-wide decisions), `store` the
    world's (under its namespace)."""

    def __init__(self, root: dist.Store, me: Identity, options: Options, timeout_s: float) -> None:
        self.root = root
        self.store = dist.PrefixStore(me.namespace, root) if me.namespace else root
        self.me, self.options = me, options
        self.rank, self.world_size, self.incarnation = me.rank, me.world_size, me.incarnation
        self.timeout_s = timeout_s  # run.timeout_s: the longest any wait may last
        self.hb_timeout_s = heartbeat.timeout_of(timeout_s)
        self.epoch = -1
        self.members: list[int] = []
        self.pg = None
        # Groups of past epochs, never destroyed: a gloo group's destructor waits for its pending
        # operations, and an operation a hung peer never joined ends only at run.timeout_s.
        # Workers leave with os._exit, so these are never torn down.
        self._retired: list = []
        self.round = 0  # the last finished round
        self.store_lost = False  # `guarded`: the store is gone for good
        self.events: list[dict] = []  # membership records for worker 0's log
        # Records made elsewhere before a membership record (the comm's rejections): moved in
        # ahead of it, so the log keeps the order things happened in.
        self.earlier: Callable[[], list[dict]] = list
        self.membership = Membership(
            me.host,
            me.port,
            me.rank,
            me.incarnation,
            me.world_size,
            timeout_s=timeout_s,
            hb_timeout_s=self.hb_timeout_s,
            namespace=me.namespace,
        )
        self.heartbeat = heartbeat.Heartbeat(me.host, me.port, me.rank, me.namespace)

    def start(self) -> None:
        """A first start meets the other first starts of its world (its shard group's, with
        shards: each has its own rendezvous) before the rendezvous, so that its first round has
        all of them; a restarted worker joins later (admission.py)."""
        if self.incarnation != 1:
            return
        keys.count_start(self.store, self.world_size)
        self.store.wait([keys.ALL_STARTED])
        self.rendezvous("start")

    # ---- the store lost for good (across machines)
    def guarded(self, call: Callable[[], T], default: T) -> T:
        """`call()`, or `default` once the store is lost. With a held store (Identity), a
        connection error marks it lost: its machine's tunnel gave up on the coordinator. In a
        run on one machine a store error propagates as it always did."""
        if self.store_lost:
            return default
        try:
            return call()
        except dist.DistNetworkError as e:
            if not self.me.held_store:
                raise
            self.lose_store(short_error(e))
            return default

    def lose_store(self, why: str) -> None:
        if not self.store_lost:
            self.store_lost = True
            print(
                f"[worker {self.rank} round {self.round}] the run's store is gone ({why}): "
                "going on without it to the round end",
                flush=True,
            )

    # ---- the epoch's state in the store
    def has(self, key: str) -> bool:
        return self.store.check([key])

    def is_broken(self) -> bool:
        """Whether some member has marked this worker's epoch broken."""
        return self.has(keys.broken(self.epoch))

    def broken(self) -> str | None:
        """Why this worker's epoch was marked broken, or None while it is whole."""
        key = keys.broken(self.epoch)
        return self.store.get(key).decode() if self.has(key) else None

    def report(self, reason: str) -> None:
        """Mark the epoch broken; the members re-form at the next round end (or operation)."""
        self.store.compare_set(keys.broken(self.epoch), "", reason)

    # ---- membership records
    def event(self, event: str, **fields) -> None:
        """A membership record for worker 0's log, printed with a worker/round prefix."""
        rec = {"kind": "membership", "event": event, "round": self.round, "epoch": self.epoch}
        rec.update(fields)
        rec["members"] = list(self.members)
        self.add_record(rec)
        detail = " ".join(f"{k}={v}" for k, v in fields.items())
        print(
            f"[worker {self.rank} round {self.round}] membership: {event} {detail} "
            f"-> members {self.members} (epoch {self.epoch})",
            flush=True,
        )

    def add_record(self, rec: dict) -> None:
        self.events += self.earlier()
        self.events.append(rec)

    def take_events(self) -> list[dict]:
        """The membership records since the last call (with what came before them)."""
        out, self.events = self.events, []
        return out

    # ---- moving to the next epoch
    def rendezvous(self, purpose: str, refused: tuple[int, ...] = ()) -> Round:
        """Take part in rendezvous rounds until this worker is in one whose gloo group forms;
        returns that round. A stale worker (the others went on without it) exits to be
        restarted; a joiner deferred by a recovering member waits for the next. `refused`: a
        joiner's refused donors, which its donor skips (rendezvous.py `donor_after`)."""
        while True:
            self._check_evicted()
            try:
                rnd = self.membership.next(purpose, self.epoch, self.round, refused)
            except RendezvousClosedError:  # the launcher closed it: training is over
                print(f"[worker {self.rank}] the run ended while it waited to join", flush=True)
                self.exit(0)
            except Exception as e:  # a join timeout, or a participant died as the round closed
                print(f"[worker {self.rank}] rendezvous: {short_error(e)}; again", flush=True)
                continue
            if self.rank in rnd.stale:
                self.event("evicted", reason="the others went on without it")
                self.exit(EVICTED_EXIT)
            if self.rank in rnd.deferred:
                continue
            if self._enter(rnd):
                self.heartbeat.start()
                return rnd

    def _enter(self, rnd: Round) -> bool:
        """Become a member of `rnd`'s epoch and build its group; False if a member is gone
        already (the epoch is reported broken: one more round)."""
        previous, self.epoch, self.members = self.epoch, rnd.epoch, list(rnd.members)
        self.store.set(keys.members(rnd.epoch), json.dumps(rnd.members))
        if previous >= 0:  # how a worker left behind in `previous` learns it was dropped
            self.store.compare_set(keys.next_epoch(previous), "", str(rnd.epoch))
        try:
            if self.pg is not None:
                self._retired.append(self.pg)
                self.pg = None
            self.pg = self._group(rnd)
        except Exception as e:
            self.report(f"group setup: {short_error(e)}")
            return False
        return True

    def _group(self, rnd: Round):
        """The gloo group of a round's members, over the round's own store."""
        if len(rnd.members) == 1:
            return None
        return dist.ProcessGroupGloo(
            dist.PrefixStore(keys.GROUP, rnd.store),
            rnd.members.index(self.rank),
            len(rnd.members),
            timedelta(seconds=self.timeout_s),
        )

    def _check_evicted(self) -> None:
        """Before asking for a new round: if the members of this worker's epoch have already
        formed the next one without it (it was silent or cut off), it must restart and rejoin."""
        key = keys.next_epoch(self.epoch)
        if self.epoch < 0 or not self.has(key):
            return
        nxt = int(self.store.get(key))
        members = json.loads(self.store.get(keys.members(nxt)))
        if self.rank not in members:
            reason = self.broken() or "dropped from the rendezvous (no keep-alive)"
            self.epoch, self.members = nxt, members
            self.event("evicted", reason=reason)
            self.exit(EVICTED_EXIT)

    def exit(self, code: int) -> None:
        sys.stdout.flush()
        self.heartbeat.stop()
        os._exit(code)
