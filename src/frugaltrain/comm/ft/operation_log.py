"""The operation log: every blocking operation (all-reduce, gather, metric, barrier) a worker
posts, numbered in the order posted, and how a failure is survived.

    post    all workers post the same operations in the same order, so number s means the same
            thing everywhere. Blocking gossip travels as gathers, so a missing worker breaks an
            operation for every member alike (never for some only).
    wait    polls the operation; it fails on a gloo error (a killed peer closes its sockets),
            when a member's heartbeat has stopped for the heartbeat timeout (a hung, stopped or
            cut-off peer: seen within seconds, not at run.timeout_s), on the adaptive deadline
            (fault_tolerance.deadline_factor x the p90 of recent round times, within
            [fault_tolerance.deadline_floor_s, run.timeout_s]: a peer alive but stuck; the
            members that have not posted the operation are cut out of the rendezvous), or when
            another worker has marked the epoch broken in the store. Once the store is lost
            for good (elastic_world.py, `guarded`), only gloo's own deadline is left. Time in which
            this worker's own store reads were held up (the coordinator away: its machine's store
            tunnel holds requests until it is back, cluster/gateway.py) counts against neither
            the deadline nor anyone's heartbeat: nobody's beats reached the store then.
    recover mark the epoch broken (the first reason wins) and re-rendezvous (elastic_world.py); the
            survivors build the new group and re-post (`settle`), in order, every operation from
            the lowest one any of them still has pending. One that no survivor finished runs
            again over the live set: an all-reduce mean divides by the live count and a mix
            renormalizes each row over the members that delivered. One that some survivor
            finished before the failure (a peer that died in the operation's last exchanges can
            leave it finished on some members and failed on others) is not run again: the
            lowest survivor that finished it broadcasts its result, so every member ends with
            the same result, over the members that took part then, and applies the same step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from frugaltrain.cluster import keys
from frugaltrain.comm.accounting import CommStats
from frugaltrain.comm.ft import heartbeat
from frugaltrain.comm.ft.elastic_world import EVICTED_EXIT, ElasticWorld, StoreLost, short_error

LOG_KEEP = 8  # completed operations whose inputs are kept for a re-post after a failure
POLL_S = 0.05  # how often a wait looks at the store (broken epoch, heartbeats)
RECENT_ROUNDS = 20  # round ends the adaptive deadline looks at


@dataclass(eq=False)
class Op:
    """One posted operation: kind in sum/max (all-reduce) or gather. `inputs` are kept so the
    operation can be posted again in a new epoch; the rest is its current posting. `covers`:
    the members whose inputs its result holds, when it is another member's result taken by
    broadcast (OpLog.settle); None: `members`, those it runs over."""

    seq: int
    kind: str
    inputs: list[torch.Tensor]
    epoch: int = -1
    members: list[int] = field(default_factory=list)
    works: list = field(default_factory=list)
    outputs: object = None
    done: bool = False
    result: object = None
    covers: list[int] | None = None


class OpLog:
    """This worker's posted operations over `world`; `stats` counts the time spent recovering.
    `on_recover`: called as a recovery starts (the epoch is marked broken, the rendezvous not
    yet joined)."""

    def __init__(self, world: ElasticWorld, stats: CommStats) -> None:
        self.world, self.stats = world, stats
        self.seq = 0
        self.log: list[Op] = []
        self.round_ends: list[float] = []  # monotonic time of the last round ends (deadline)
        self.on_recover: list[Callable[[], None]] = []

    # ---- posting
    def post(self, kind: str, inputs: list[torch.Tensor]) -> Op:
        world = self.world
        if world.guarded(world.is_broken, False):
            self.recover("another worker reported a failure")
        op = Op(self.seq, kind, [t.detach().clone() for t in inputs])
        self.seq += 1
        self.log.append(op)
        done = [o for o in self.log if o.done]
        if len(done) > LOG_KEEP:
            drop = {id(o) for o in done[: len(done) - LOG_KEEP]}
            self.log = [o for o in self.log if id(o) not in drop]
        self._launch(op)
        world.guarded(lambda: world.store.set(keys.posted(world.rank), str(op.seq)), None)
        return op

    def _launch(self, op: Op) -> None:
        world = self.world
        op.epoch, op.members, op.done, op.covers = world.epoch, list(world.members), False, None
        n = len(op.members)
        if n == 1:
            op.works = []
            op.outputs = op.inputs[0].clone() if op.kind != "gather" else [[p] for p in op.inputs]
            return
        if op.kind == "gather":
            bufs = [[torch.empty_like(p) for _ in range(n)] for p in op.inputs]
            op.works = [world.pg.allgather([b], [p]) for b, p in zip(bufs, op.inputs, strict=True)]
            op.outputs = bufs
            return
        buf = op.inputs[0].clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX if op.kind == "max" else dist.ReduceOp.SUM
        op.works = [world.pg.allreduce([buf], opts)]
        op.outputs = buf

    @staticmethod
    def _covers(op: Op) -> list[int]:
        """The members whose inputs `op`'s result holds."""
        return op.members if op.covers is None else op.covers

    @classmethod
    def _result(cls, op: Op):
        covers = cls._covers(op)
        if op.kind == "gather":
            return {r: [b[i] for b in op.outputs] for i, r in enumerate(covers)}
        return op.outputs, len(covers)

    def completed(self, op: Op) -> bool:
        return op.done or all(w.is_completed() for w in op.works)

    # ---- waiting
    def wait(self, op: Op) -> dict | tuple:
        """The operation's result (gather: {rank: parts}; all-reduce: (total, members)), after
        as many recoveries as it takes."""
        while not op.done:
            t_wait = time.monotonic()
            reason = self._failure(op, t_wait)
            if reason is None:
                return op.result
            self.stats.recovery_s += time.monotonic() - t_wait  # the wait that found it
            self.recover(reason)
        return op.result

    def _failure(self, op: Op, t_wait: float) -> str | None:
        """Poll `op` until it completes (None) or fails (why)."""
        world = self.world
        peers = [m for m in op.members if m != world.rank]
        beats: dict[int, tuple[int, float]] = {}  # each peer's last count and when it moved
        next_check, away = t_wait, 0.0  # away: time this worker's own store reads were held
        deadline, why = self.deadline()
        while True:
            if all(w.is_completed() for w in op.works):
                try:
                    for w in op.works:
                        w.wait()
                except Exception as e:  # gloo reports a dead peer as a RuntimeError
                    reason = short_error(e)
                    low = reason.lower()
                    if "timeout" in low or "timed out" in low:  # gloo's deadline: timeout_s
                        reason = f"no answer within run.timeout_s = {world.timeout_s:g} s"
                    return reason
                op.done, op.result = True, self._result(op)
                return None
            now = time.monotonic()
            if world.store_lost:  # no checks without the store: gloo's own deadline is left
                time.sleep(0.001)
                continue
            if now - t_wait - away > deadline:
                return self._evict_stuck(op, why)
            if now >= next_check:
                if world.guarded(lambda: world.has(keys.broken(op.epoch)), False):
                    return "another worker reported a failure"
                counts = world.guarded(
                    lambda: {m: heartbeat.beat_of(world.store, m) for m in peers}, None
                )
                if counts is None:
                    continue
                after = time.monotonic()
                next_check = after + POLL_S
                held = after - now > world.hb_timeout_s / 2  # the coordinator away, say
                if held or not beats:  # nobody's beats could reach the store meanwhile either
                    away += (after - now) if held else 0.0
                    beats = {m: (c, after) for m, c in counts.items()}
                    continue
                silent = heartbeat.stopped(beats, counts, after, world.hb_timeout_s)
                if silent:  # a straggler, whose heartbeat moves, is waited for
                    return f"worker {silent[0]}: no heartbeat for {world.hb_timeout_s:g} s"
            time.sleep(0.001)

    def finish_pending(self) -> None:
        """Wait for every operation still pending (before the members re-form on purpose)."""
        for o in self.log:
            if not o.done:
                self.wait(o)

    def note_round_end(self) -> None:
        self.round_ends = [*self.round_ends[-RECENT_ROUNDS:], time.monotonic()]

    def deadline(self) -> tuple[float, str]:
        """How long a blocking wait may last, and why: fault_tolerance.deadline_factor x the 90th
        percentile of the last 20 rounds' wall times, within [fault_tolerance.deadline_floor_s,
        run.timeout_s];
        run.timeout_s until three rounds have been timed."""
        ends, opts, timeout_s = self.round_ends, self.world.options, self.world.timeout_s
        if len(ends) < 4:
            return timeout_s, f"run.timeout_s = {timeout_s:g} s"
        p90 = float(np.percentile(np.diff(ends), 90))
        d = min(timeout_s, max(opts.deadline_floor_s, opts.deadline_factor * p90))
        return d, f"{d:.1f} s: {opts.deadline_factor:g} x p90 round {p90:.2f} s, floor " + (
            f"{opts.deadline_floor_s:g} s, cap run.timeout_s = {timeout_s:g} s"
        )

    def _evict_stuck(self, op: Op, why: str) -> str:
        """The deadline passed. Members that have not posted `op` (alive, their heartbeats
        beating, but stuck) are cut out of the rendezvous, so the others re-form without them;
        when one wakes up it finds itself evicted and restarts."""
        store = self.world.store
        stuck = [m for m in op.members if m != self.world.rank and self._posted(m) < op.seq]
        for m in stuck:
            store.set(keys.evict(m, int(store.get(keys.incarnation(m)))), "1")
        return (f"workers {stuck}: " if stuck else "") + f"no answer within the deadline ({why})"

    def _posted(self, member: int) -> int:
        key = keys.posted(member)
        return int(self.world.store.get(key)) if self.world.has(key) else -1

    # ---- recovery
    def recover(self, reason: str) -> None:
        """Mark this epoch broken (the first reason named wins), re-rendezvous with whoever is
        alive, and re-post what was interrupted."""
        world = self.world
        if world.store_lost:
            raise StoreLost(f"{reason}; the members cannot re-form without the run's store")
        t0 = time.monotonic()
        reason = world.store.compare_set(keys.broken(world.epoch), "", reason).decode()
        for hook in self.on_recover:
            hook()
        old = list(world.members)
        world.rendezvous("recover")
        if world.members == old:  # e.g. a partition that healed before the others agreed
            world.event("reformed", reason=reason)
        self.settle(old, reason)
        self.stats.recovery_s += time.monotonic() - t0

    def settle(self, old: list[int], reason: str) -> None:
        """After a rendezvous: log who left, then re-post, in order, every operation from the
        lowest one any old member still has pending (joiners took part in none of them).

        A member that died in an operation's last exchanges can leave it finished on some
        members and failed on others (gloo: those that already had all they needed from it are
        done). Those that finished it may have used the result already (the outer step), so
        it is not run again: the lowest member that finished it broadcasts its result, and
        every other member takes that, with the members whose inputs it holds. Each member
        posts the operations it finished (`done`) next to the lowest one it has pending
        (`low`)."""
        world = self.world
        lost = sorted(set(old) - set(world.members))
        if lost:
            world.event("left", workers=lost, reason=reason)
        stay = [m for m in world.members if m in old]
        low = min((o.seq for o in self.log if not o.done), default=self.seq)
        done = {o.seq: self._covers(o) for o in self.log if o.done}
        mine = json.dumps({"low": low, "done": done})
        world.store.set(keys.low(world.epoch, world.rank), mine)
        lows = [keys.low(world.epoch, m) for m in stay]
        world.store.wait(lows, timedelta(seconds=world.timeout_s))
        posted = dict(zip(stay, (json.loads(v) for v in world.store.multi_get(lows)), strict=True))
        start = min(p["low"] for p in posted.values())
        kept = {o.seq for o in self.log}
        if any(s not in kept for s in range(start, self.seq)):
            world.event("evicted", reason=f"cannot replay operations from {start}")
            world.exit(EVICTED_EXIT)
        for o in sorted(self.log, key=lambda o: o.seq):
            if o.seq < start:
                continue
            finished = [m for m in stay if str(o.seq) in posted[m]["done"]]
            if finished:  # the same result everywhere, whoever finished it
                root = finished[0]
                self._share(o, root, posted[root]["done"][str(o.seq)])
            else:
                self._launch(o)

    def _share(self, op: Op, root: int, covers: list[int]) -> None:
        """Post `op` as a broadcast of `root`'s result (over the members `covers`) to this
        epoch's members: a member that had not finished it takes that result; one that had
        keeps its own, which is the same."""
        world = self.world
        if world.pg is None:  # alone: the one member left is the one that finished it
            assert op.done, f"operation {op.seq}: nobody here finished it"
            return
        if op.kind == "gather":  # one tensor per input: its part from each member of `covers`
            if world.rank == root:
                bufs = [
                    torch.stack([op.result[r][i] for r in covers]) for i in range(len(op.inputs))
                ]
            else:
                bufs = [p.new_empty((len(covers), *p.shape)) for p in op.inputs]
        else:
            bufs = [op.result[0] if world.rank == root else torch.empty_like(op.inputs[0])]
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = world.members.index(root), 0
        works = [world.pg.broadcast([b], opts) for b in bufs]
        if op.done:  # finished here: only lends its result (or a buffer it drops)
            return
        print(
            f"[worker {world.rank} round {world.round}] operation {op.seq} ({op.kind}) was "
            f"finished before the failure; taking worker {root}'s result over {covers}",
            flush=True,
        )
        op.epoch, op.members, op.covers = world.epoch, list(world.members), list(covers)
        op.works, op.outputs = works, bufs if op.kind == "gather" else bufs[0]
