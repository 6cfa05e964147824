"""`ElasticComm`: the torch.distributed runtime with membership epochs, deadlines and rejoin.

Engine: torch elastic's rendezvous (`DynamicRendezvousHandler`, c10d backend, on the TCPStore
the launcher hosts) decides who is in each membership epoch (comm/rendezvous.py); each epoch gets
a fresh gloo process group over the store of its rendezvous round. docs/fault_tolerance.md
explains why this and not torchft.

How a failure is handled (every worker runs the same code):

    post    every operation (all-reduce, gather, metric, barrier) gets a sequence number; all
            workers post the same operations in the same order, so number s means the same
            thing everywhere. Blocking gossip travels as gathers, so a missing worker breaks an
            operation for every member alike (never for some only).
    wait    polls the operation; it fails on a gloo error (a killed peer closes its sockets),
            when a member's heartbeat has stopped for the heartbeat timeout (a hung, stopped or
            cut-off peer: seen within seconds, not at run.timeout_s), on the adaptive deadline
            (run.deadline_factor x the p90 of recent round times, within [run.deadline_floor_s,
            run.timeout_s]: a peer alive but stuck; the members that have not posted the
            operation are cut out of the rendezvous), or when another worker has marked the
            epoch broken in the store. Groups of past epochs are kept, never destroyed (a gloo
            group's destructor waits for its pending operations, up to run.timeout_s).
    recover mark epoch e broken (the first reason wins) and re-rendezvous: the round closes
            once every old participant has left it or been dropped for a missed keep-alive
            (dead, stopped, cut off), and the survivors form the next one. A member the others
            went on without finds out before it asks again, or in the round, and exits with
            code 75; the launcher restarts it as a joiner. The survivors build the new group
            and re-post, in order, every operation from the lowest one any of them still has
            pending, now over the live set: an all-reduce mean divides by the live count and a
            mix renormalizes each row over the members that delivered.
    rejoin  a restarted worker (incarnation > 1) waits on the rendezvous's wait list; the first
            member at a round end sees it there and decides for all (compare-and-set on that
            round) that the members re-rendezvous; all finish their pending operations, the
            joiner is admitted, and the lowest old member sends it its whole worker state
            (outer x and momentum, round, step, inner AdamW and schedule) point to point.

Two things never wait on a straggler (only the participants of blocking operations do):

    Mix1    a non-blocking mix (fgd's Mix1) goes point to point, outside the sequence above:
            each message is tagged with the worker's Mix1 count (one per round, the same on
            every worker), and at the round end a worker waits at most run.mix1_deadline_s for
            the ones still missing. A late message is dropped (the row is renormalized over what
            arrived, as for a lost message); a peer that is late and whose heartbeat stopped, or
            whose socket broke, is reported and the members re-form at the round end.
    metrics the per-round logging scalars go through the store, and worker 0 writes a round's
            record once every member's scalars are in (at the latest at a checkpoint or the end).

Membership changes are printed with a worker/round prefix and handed to worker 0's metrics log
as `"kind": "membership"` records.

With run.shards = S > 1 (docs/sharding.md) there is one such world per shard index s: its
members are the replicas, each represented by its shard-s process, and its keys live under the
store prefix `shard{s}`. A dead process takes its whole replica out (the launcher stops the
siblings and restarts all S), so every shard group loses and regains the same member. What must
agree across the S groups goes through the replica's ShardLink (comm/shardlink.py): the guard's
norms, which Mix1 messages count (those that arrived at every shard), and when a restarted
replica is admitted: the first process at a round end in any group decides it for all
(`ft/admit/ROUND` in the run's store), once the replica's S processes have all asked to join.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from frugaltrain.comm import compress, topology
from frugaltrain.comm.base import (
    Comm,
    Handle,
    encode_own,
    finish_mix,
    flatten,
    unflatten_into,
)
from frugaltrain.comm.feedback import ErrorFeedback
from frugaltrain.comm.guard import Guard, norm_of, verdict
from frugaltrain.comm.rendezvous import Membership, Round, evict_key
from frugaltrain.comm.runtime import Means, Runtime, StateFn
from frugaltrain.comm.shardlink import ShardLink
from frugaltrain.faults import Injector, corrupt_, fire

EVICTED_EXIT = 75  # exit code of a worker the others declared dead; the launcher restarts it
_HB_PERIOD_S = 0.2
_LOG_KEEP = 8  # completed operations whose inputs are kept for a re-post after a failure
_PARTS = 4  # tag space per Mix1 message: one tag per encoded part
_FOREVER = timedelta(days=365)  # gloo closes a pair whose wait times out: never let it


def state_digest(state: dict) -> str:
    """Short hash of a worker state's model and outer parameters (equal iff bitwise equal)."""
    import hashlib

    h = hashlib.sha256()
    tensors = list(state["model"].values()) + list(state.get("outer", {}).get("outer", []))
    for t in tensors:
        h.update(t.detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _short(e: Exception) -> str:
    """A gloo error in one line, without the source path gloo puts in front."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    text = text.split("] ", 1)[-1]
    return text.split(". ", 1)[0][:120]


class _Op:
    """One posted operation: kind in sum/max (all-reduce) or gather; `inputs` are kept so the
    operation can be posted again in a new epoch."""

    def __init__(self, seq: int, kind: str, inputs: list[torch.Tensor]) -> None:
        self.seq, self.kind, self.inputs = seq, kind, inputs
        self.epoch = -1
        self.members: list[int] = []
        self.works: list = []
        self.outputs = None
        self.done = False
        self.result = None


class ElasticComm(Comm):
    """Comm whose `members` shrink when workers fail and grow when they rejoin.

    Args:
        store: the run's TCPStore (hosted by the launcher, not by a worker).
        rank: this worker's fixed rank (its data shard and its name in logs).
        world_size: configured number of workers.
        timeout_s: deadline of every wait (run.timeout_s), seconds.
        mix1_deadline_s: longest wait for missing Mix1 messages at a round end (see above).
        injector: faults to apply to this worker (frugaltrain.faults).
        host, port: where the store listens (the heartbeat thread opens its own client).
        guard: keeps bad contributions out (comm/guard.py). Mix1 on this runtime judges the
            messages that arrived by their norms and this worker's own; blocking operations
            share the norms of all members first, as on the other runtimes.
        namespace: store prefix of this world's keys ("shard{s}" with shards; "" without).
        shard_link: the other shards of this worker's replica (run.shards > 1).
    """

    def __init__(
        self,
        store: dist.TCPStore,
        rank: int,
        world_size: int,
        *,
        timeout_s: float,
        mix1_deadline_s: float = 10.0,
        deadline_factor: float = 4.0,
        deadline_floor_s: float = 60.0,
        injector: Injector | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        incarnation: int = 1,
        guard: Guard | None = None,
        namespace: str = "",
        shard_link: ShardLink | None = None,
    ) -> None:
        super().__init__(deterministic=False, guard=guard, shard_link=shard_link)
        self.root = store  # the run's store: replica-wide decisions (shards)
        self.namespace = namespace
        self.store = dist.PrefixStore(namespace, store) if namespace else store
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout_s
        self.mix1_deadline_s = mix1_deadline_s
        self.deadline_factor, self.deadline_floor_s = deadline_factor, deadline_floor_s
        self._round_ends: list[float] = []  # monotonic time of the last round ends (deadline)
        self.hb_timeout_s = max(1.0, min(3.0, timeout_s / 4))
        self.injector = injector
        self.incarnation = incarnation
        self.epoch = -1
        self.pg = None
        # Groups of past epochs, never destroyed: a gloo group's destructor waits for its pending
        # operations, and an operation a hung peer never joined ends only at run.timeout_s.
        # Workers leave with os._exit, so these are never torn down.
        self._retired: list = []
        self.seq = 0
        self.log: list[_Op] = []
        self.round = 0
        self.dropped = 0
        self.mix1_seq = 0  # Mix1 messages posted (their tag); equal on every worker per round
        self.metric_seq = 0  # rounds of logging scalars posted to the store
        self.mix1_late = 0  # Mix1 messages dropped at the deadline, this round (worker's view)
        self._in_flight: list[threading.Thread] = []  # background waits on Mix1 sends/recvs
        self._records_due: list[str] = []
        self._joined_at: dict[int, int] = {}  # a (re)joined member's first metric_seq
        self._stop = threading.Event()
        self._silent = threading.Event()  # an injected partition: no heartbeat
        self.membership = Membership(
            host,
            port,
            rank,
            incarnation,
            world_size,
            timeout_s=timeout_s,
            hb_timeout_s=self.hb_timeout_s,
            namespace=namespace,
        )
        # Heartbeats start on becoming a member: a restarted worker waiting to rejoin must not
        # look alive under its rank while the others decide who is left.
        self._hb = threading.Thread(target=self._beat, args=(host, port), daemon=True)
        if incarnation == 1:
            # First starts meet before the rendezvous, so that its first round has all of them.
            if store.add("ft/started", 1) == world_size:
                store.set("ft/all_started", "1")
            store.wait(["ft/all_started"])
            self._rendezvous("start")

    # ---- heartbeats and store helpers
    def _beat(self, host: str, port: int) -> None:
        try:
            client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
            if self.namespace:
                client = dist.PrefixStore(self.namespace, client)
            while not self._stop.is_set():
                if not self._silent.is_set():
                    client.add(f"ft/hb/{self.rank}", 1)
                self._stop.wait(_HB_PERIOD_S)
        except Exception:  # the store went away: the run is over
            return

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def _broken(self) -> str | None:
        """Why this worker's epoch was marked broken, or None while it is whole."""
        key = f"ft/ep/{self.epoch}/broken"
        return self.store.get(key).decode() if self._has(key) else None

    def _event(self, event: str, **fields) -> None:
        rec = {"kind": "membership", "event": event, "round": self.round, "epoch": self.epoch}
        rec.update(fields)
        rec["members"] = list(self.members)
        self.events.append(rec)
        detail = " ".join(f"{k}={v}" for k, v in fields.items())
        print(
            f"[worker {self.rank} round {self.round}] membership: {event} {detail} "
            f"-> members {self.members} (epoch {self.epoch})",
            flush=True,
        )

    def _rendezvous(self, purpose: str) -> Round:
        """Take part in rendezvous rounds (ft/rendezvous.py) until this worker is in one whose
        gloo group forms; returns that round. A stale worker (the others went on without it)
        exits to be restarted; a joiner deferred by a recovering member waits for the next."""
        while True:
            self._check_evicted()
            try:
                rnd = self.membership.next(purpose, self.epoch, self.round)
            except RendezvousClosedError:  # the launcher closed it: training is over
                print(f"[worker {self.rank}] the run ended while it waited to join", flush=True)
                self._exit(0)
            except Exception as e:  # a join timeout, or a participant died as the round closed
                print(f"[worker {self.rank}] rendezvous: {_short(e)}; again", flush=True)
                continue
            if self.rank in rnd.stale:
                self._event("evicted", reason="the others went on without it")
                self._exit(EVICTED_EXIT)
            if self.rank in rnd.deferred:
                continue
            previous, self.epoch, self.members = self.epoch, rnd.epoch, list(rnd.members)
            self.store.set(f"ft/ep/{rnd.epoch}/members", json.dumps(rnd.members))
            if previous >= 0:  # how a worker left behind in `previous` learns it was dropped
                self.store.compare_set(f"ft/ep/{previous}/next", "", str(rnd.epoch))
            try:
                if self.pg is not None:
                    self._retired.append(self.pg)
                    self.pg = None
                self.pg = self._group(rnd)
            except Exception as e:  # a member is gone already: one more round
                self._report(f"group setup: {_short(e)}")
                continue
            if not self._hb.is_alive() and not self._stop.is_set():
                self._hb.start()
            return rnd

    def _group(self, rnd: Round):
        """The gloo group of a round's members, over the round's own store."""
        if len(rnd.members) == 1:
            return None
        return dist.ProcessGroupGloo(
            dist.PrefixStore("pg", rnd.store),
            rnd.members.index(self.rank),
            len(rnd.members),
            timedelta(seconds=self.timeout_s),
        )

    def _check_evicted(self) -> None:
        """Before asking for a new round: if the members of this worker's epoch have already
        formed the next one without it (it was silent or cut off), it must restart and rejoin."""
        key = f"ft/ep/{self.epoch}/next"
        if self.epoch < 0 or not self._has(key):
            return
        nxt = int(self.store.get(key))
        members = json.loads(self.store.get(f"ft/ep/{nxt}/members"))
        if self.rank not in members:
            reason = self._broken() or "dropped from the rendezvous (no keep-alive)"
            self.epoch, self.members = nxt, members
            self._event("evicted", reason=reason)
            self._exit(EVICTED_EXIT)

    # ---- operations
    def _launch(self, op: _Op) -> None:
        op.epoch, op.members, op.done = self.epoch, list(self.members), False
        n = len(op.members)
        if n == 1:
            op.works = []
            op.outputs = op.inputs[0].clone() if op.kind != "gather" else [[p] for p in op.inputs]
            return
        if op.kind == "gather":
            bufs = [[torch.empty_like(p) for _ in range(n)] for p in op.inputs]
            op.works = [self.pg.allgather([b], [p]) for b, p in zip(bufs, op.inputs, strict=True)]
            op.outputs = bufs
            return
        buf = op.inputs[0].clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX if op.kind == "max" else dist.ReduceOp.SUM
        op.works = [self.pg.allreduce([buf], opts)]
        op.outputs = buf

    def _result(self, op: _Op):
        if op.kind == "gather":
            return {r: [b[i] for b in op.outputs] for i, r in enumerate(op.members)}
        return op.outputs, len(op.members)

    def _post(self, kind: str, inputs: list[torch.Tensor]) -> _Op:
        if self._has(f"ft/ep/{self.epoch}/broken"):
            self._recover("another worker reported a failure")
        op = _Op(self.seq, kind, [t.detach().clone() for t in inputs])
        self.seq += 1
        self.log.append(op)
        done = [o for o in self.log if o.done]
        if len(done) > _LOG_KEEP:
            drop = {id(o) for o in done[: len(done) - _LOG_KEEP]}
            self.log = [o for o in self.log if id(o) not in drop]
        self._launch(op)
        self.store.set(f"ft/posted/{self.rank}", str(op.seq))  # who is stuck, at a deadline
        return op

    def _completed(self, op: _Op) -> bool:
        return op.done or all(w.is_completed() for w in op.works)

    def _wait(self, op: _Op):
        while not op.done:
            t_wait = time.monotonic()
            next_check = t_wait + 0.05
            beats = {m: (self._heartbeat(m), t_wait) for m in op.members if m != self.rank}
            deadline, why = self.deadline()
            reason = None
            while reason is None:
                if all(w.is_completed() for w in op.works):
                    try:
                        for w in op.works:
                            w.wait()
                    except Exception as e:  # gloo reports a dead peer as a RuntimeError
                        reason = _short(e)
                        low = reason.lower()
                        if "timeout" in low or "timed out" in low:  # gloo's deadline: timeout_s
                            reason = f"no answer within run.timeout_s = {self.timeout_s:g} s"
                        break
                    op.done, op.result = True, self._result(op)
                    return op.result
                now = time.monotonic()
                if now - t_wait > deadline:
                    reason = self._evict_stuck(op, why)
                elif now >= next_check:
                    next_check = now + 0.05
                    if self._has(f"ft/ep/{op.epoch}/broken"):
                        reason = "another worker reported a failure"
                    else:  # a silent member fails the wait now, a straggler is waited for
                        reason = self._silent_member(beats, now)
                time.sleep(0.001)
            self.stats.recovery_s += time.monotonic() - t_wait  # the wait that found the failure
            self._recover(reason)
        return op.result

    def deadline(self) -> tuple[float, str]:
        """How long a blocking wait may last, and why: run.deadline_factor x the 90th percentile
        of the last 20 rounds' wall times, within [run.deadline_floor_s, run.timeout_s];
        run.timeout_s until three rounds have been timed."""
        ends = self._round_ends
        if len(ends) < 4:
            return self.timeout_s, f"run.timeout_s = {self.timeout_s:g} s"
        p90 = float(np.percentile(np.diff(ends), 90))
        d = min(self.timeout_s, max(self.deadline_floor_s, self.deadline_factor * p90))
        return d, f"{d:.1f} s: {self.deadline_factor:g} x p90 round {p90:.2f} s, floor " + (
            f"{self.deadline_floor_s:g} s, cap run.timeout_s = {self.timeout_s:g} s"
        )

    def _evict_stuck(self, op: _Op, why: str) -> str:
        """The deadline passed. Members that have not posted `op` (alive, their heartbeats
        beating, but stuck) are cut out of the rendezvous, so the others re-form without them;
        when one wakes up it finds itself evicted and restarts."""
        stuck = [m for m in op.members if m != self.rank and self._posted(m) < op.seq]
        for m in stuck:
            self.store.set(evict_key(m, int(self.store.get(f"ft/incarnation/{m}"))), "1")
        return (f"workers {stuck}: " if stuck else "") + f"no answer within the deadline ({why})"

    def _posted(self, member: int) -> int:
        key = f"ft/posted/{member}"
        return int(self.store.get(key)) if self._has(key) else -1

    def _silent_member(self, beats: dict[int, tuple[int, float]], now: float) -> str | None:
        """The first member whose heartbeat has not moved for the heartbeat timeout (hung,
        stopped or cut off); `beats` holds each one's last count and when it moved."""
        for member, (last, since) in beats.items():
            beat = self._heartbeat(member)
            if beat != last:
                beats[member] = (beat, now)
            elif now - since > self.hb_timeout_s:
                return f"worker {member}: no heartbeat for {self.hb_timeout_s:g} s"
        return None

    # ---- recovery
    def _recover(self, reason: str) -> None:
        """Mark this epoch broken (the first reason named wins), re-rendezvous with whoever is
        alive, and re-post what was interrupted."""
        t0 = time.monotonic()
        reason = self.store.compare_set(f"ft/ep/{self.epoch}/broken", "", reason).decode()
        if self.injector and self.injector.dies_in_recovery(self.round + 1):
            print(f"[worker {self.rank} round {self.round + 1}] injected fault: kill", flush=True)
            fire("kill")  # while the others re-form
        old = list(self.members)
        self._rendezvous("recover")
        if self.members == old:  # e.g. a partition that healed before the others agreed
            self._event("reformed", reason=reason)
        self._settle(old, reason)
        self.stats.recovery_s += time.monotonic() - t0

    def _settle(self, old: list[int], reason: str) -> None:
        """After a rendezvous: log who left, then re-post, in order, every operation from the
        lowest one any old member still has pending (joiners took part in none of them)."""
        lost = sorted(set(old) - set(self.members))
        if lost:
            self._event("left", workers=lost, reason=reason)
        stay = [m for m in self.members if m in old]
        low = min((o.seq for o in self.log if not o.done), default=self.seq)
        self.store.set(f"ft/ep/{self.epoch}/low/{self.rank}", str(low))
        keys = [f"ft/ep/{self.epoch}/low/{m}" for m in stay]
        self.store.wait(keys, timedelta(seconds=self.timeout_s))
        start = min(int(v) for v in self.store.multi_get(keys))
        kept = {o.seq for o in self.log}
        if any(s not in kept for s in range(start, self.seq)):
            self._event("evicted", reason=f"cannot replay operations from {start}")
            self._exit(EVICTED_EXIT)
        for o in sorted(self.log, key=lambda o: o.seq):
            if o.seq < start:
                continue
            if o.done:  # finished here but not everywhere: take part again, keep our result
                shadow = _Op(o.seq, o.kind, o.inputs)
                self._launch(shadow)
            else:
                self._launch(o)

    def _exit(self, code: int) -> None:
        sys.stdout.flush()
        self._stop.set()
        os._exit(code)

    # ---- Comm runtime hooks
    def _all_reduce_sum(self, tensors: list[torch.Tensor], scale: float) -> Handle:
        op = self._post("sum", [flatten(tensors)])

        def finish() -> None:
            total, n = self._wait(op)  # mean over whoever took part in the end
            unflatten_into(total / n, tensors)

        return Handle(self.stats, finish, lambda: self._completed(op))

    def _start_mix(
        self,
        tensors: list[torch.Tensor],
        w: np.ndarray,
        codec: str,
        blocking: bool,
        feedback: ErrorFeedback | None = None,
    ) -> Handle:
        """A blocking mix is a sequenced operation (below); a non-blocking one (Mix1) goes
        point to point with a deadline, so a straggler never holds it up for long. Mix1 sends
        parameters, always with a dense codec: it has no error feedback."""
        if blocking:
            return super()._start_mix(tensors, w, codec, blocking, feedback)
        if feedback is not None:
            raise ValueError("a non-blocking mix takes no error feedback (its codec is dense)")
        return self._mix_with_deadline(tensors, w, codec)

    def _in_background(self, works: list, pg) -> threading.Event:
        """Wait for gloo `works` on a thread (gloo's p2p works report completion only through
        wait(), and a wait that times out closes the pair). The event is set when they are
        done; `errors` on the event holds the failure, if any."""
        done = threading.Event()
        done.error = None  # type: ignore[attr-defined]

        def wait() -> None:
            try:
                for work in works:
                    work.wait(_FOREVER)
            except Exception as e:  # a dead peer: its sockets closed
                done.error = _short(e)  # type: ignore[attr-defined]
            done.pg = None  # type: ignore[attr-defined]  # the group may go now
            done.set()

        done.pg = pg  # type: ignore[attr-defined]  # keeps an old epoch's group alive meanwhile
        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        self._in_flight = [t for t in self._in_flight if t.is_alive()] + [thread]
        return done

    def _heartbeat(self, member: int) -> int:
        key = f"ft/hb/{member}"
        return int(self.store.get(key)) if self._has(key) else 0

    def _mix_with_deadline(self, tensors: list[torch.Tensor], w: np.ndarray, codec: str) -> Handle:
        if self._has(f"ft/ep/{self.epoch}/broken"):
            old = list(self.members)
            self._recover("another worker reported a failure")
            # w was built for the old members: keep the survivors' entries (rows are
            # renormalized over what arrives anyway); the next round builds w for the new ones.
            keep = [old.index(m) for m in self.members]
            w = w[np.ix_(keep, keep)]
        members, me, pg = list(self.members), self.position, self.pg
        self._outgoing(tensors)
        send_to, recv_from = topology.peers(w, me)
        k = self.mix1_seq
        tag = (k % (1 << 20)) * _PARTS
        flat, parts = encode_own(tensors, codec)
        parts = [p.contiguous() for p in parts]
        for j in send_to:  # a send completes when its peer takes it
            try:
                self._in_background([pg.send([p], j, tag + i) for i, p in enumerate(parts)], pg)
            except RuntimeError as e:  # the pair is closed: that peer is gone; re-form first
                self._report(f"worker {members[j]}: {_short(e)}")
                return self._mix_with_deadline(tensors, w, codec)
        self.mix1_seq += 1
        wire = compress.wire_bytes(flat.numel(), codec)
        self.stats.bytes_sent += wire * len(send_to)
        self.stats.bytes_received += wire * len(recv_from)
        bufs = {j: [torch.empty_like(p) for p in parts] for j in recv_from}
        arrived = {}
        for j in recv_from:
            try:
                works = [pg.recv([b], j, tag + i) for i, b in enumerate(bufs[j])]
                arrived[j] = self._in_background(works, pg)
            except RuntimeError as e:
                arrived[j] = threading.Event()
                arrived[j].error = _short(e)  # type: ignore[attr-defined]
                arrived[j].set()
        beats = {j: self._heartbeat(members[j]) for j in recv_from}
        posted = time.monotonic()

        deadline = min(self.mix1_deadline_s, self.timeout_s)

        def finish() -> None:
            t0 = time.monotonic()
            while not all(e.is_set() for e in arrived.values()):
                if time.monotonic() - t0 > deadline:
                    break
                time.sleep(0.001)
            usable = [
                j for j in recv_from if self._usable(arrived[j], members[j], beats[j], posted, k)
            ]
            if self.shard_link is not None:  # only what arrived at every shard of the replica
                got = {members[j] for j in usable}  # by worker: the groups' members may differ
                everywhere = self.shard_link.count([r in got for r in range(self.world_size)])
                usable = [j for j in usable if everywhere[members[j]]]
            rows, flats, senders = [w[me, me]], [flat], [self.rank]
            for j in usable:
                rows.append(w[me, j])
                flats.append(compress.decode(bufs[j], codec, flat.numel()))
                senders.append(members[j])
            rows, flats = self._judge_arrivals(rows, flats, senders)
            finish_mix(rows, flats, tensors, renormalize=True)  # over what arrived in time

        return Handle(self.stats, finish, lambda: all(e.is_set() for e in arrived.values()))

    def _usable(self, arrived: threading.Event, r: int, beat: int, posted: float, k: int) -> bool:
        """Whether Mix1's message from worker r counts: it arrived in time, intact, and was not
        dropped by an injected fault. A late one from a silent peer, or a broken socket, is
        reported (the members re-form at the round end)."""
        if not arrived.is_set():
            self.mix1_late += 1
            self._check_silent(r, beat, posted)
            return False
        if arrived.error is not None:  # type: ignore[attr-defined]
            self._report(f"worker {r}: {arrived.error}")  # type: ignore[attr-defined]
            return False
        if self.injector and self.injector.dropped(0, k, r, self.rank):
            self.dropped += 1
            return False
        return True

    def _judge_arrivals(self, rows: list, flats: list, senders: list[int]) -> tuple[list, list]:
        """The guard on what arrived in time (this worker's own contribution first): the ones
        rejected by their norms are left out of the row; if it is this worker's own, it takes
        its peers' values."""
        if self.guard is None or len(flats) < 2:
            return rows, flats
        if self.shard_link is None:
            norms = [norm_of([f]) for f in flats]
        else:  # the whole replicas' norms: the same verdict in every shard group
            norms = self.shard_link.norms(flats)
        v = verdict(np.array(norms), self.guard)
        if v.clean:
            return rows, flats
        record = self._rejection_record(v)
        record["workers"] = [senders[i] for i in v.rejected + v.clipped]
        self.events.append(record)
        self._rejected_self |= 0 in v.rejected
        keep = [i for i in range(len(flats)) if v.accepted[i]] or [0]
        scale = [float(v.scale[i]) for i in keep]
        return [rows[i] for i in keep], [flats[i] * c for i, c in zip(keep, scale, strict=True)]

    def _outgoing(self, tensors: list[torch.Tensor]) -> None:
        """An injected corruption: everything this worker sends in that round is garbage."""
        value = self.injector.corrupt.get(self.round + 1) if self.injector else None
        if value:
            print(f"[worker {self.rank} round {self.round + 1}] injected fault: corrupt {value}")
            corrupt_(tensors, value)

    def _report(self, reason: str) -> None:
        """Mark the epoch broken; the members re-form at the next round end (or operation)."""
        self.store.compare_set(f"ft/ep/{self.epoch}/broken", "", reason)

    def _check_silent(self, member: int, beat: int, since: float) -> None:
        """A Mix1 message is late: a straggler (heartbeat moving) is only skipped; a silent
        peer (no heartbeat for the heartbeat timeout) is reported."""
        while self._heartbeat(member) == beat:
            if time.monotonic() - since >= self.hb_timeout_s:
                self._report(
                    f"worker {member}: no heartbeat for {self.hb_timeout_s:g} s "
                    f"(late for Mix1 by {min(self.mix1_deadline_s, self.timeout_s):g} s)"
                )
                return
            time.sleep(0.05)

    def _mix(
        self,
        tensors: list[torch.Tensor],
        w: np.ndarray,
        codec: str,
        feedback: ErrorFeedback | None = None,
    ) -> Handle:
        members, me = list(self.members), self.position
        # Gossip travels as a gather here (see the module docstring): count what really moves.
        others = len(members) - 1
        own, parts = self._encode_counted(tensors, codec, feedback, others, others)
        op = self._post("gather", parts)

        def finish() -> None:
            got = self._wait(op)
            rows, flats = [], []
            for j, r in enumerate(members):
                if w[me, j] == 0 or r not in got:
                    continue
                if j != me and self.injector and self.injector.dropped(0, op.seq, r, self.rank):
                    self.dropped += 1
                    continue
                rows.append(w[me, j])
                flats.append(own if j == me else compress.decode(got[r], codec, own.numel()))
            finish_mix(rows, flats, tensors, renormalize=True)  # over those that delivered

        return Handle(self.stats, finish, lambda: self._completed(op))

    def _metric_sum(self, t: torch.Tensor) -> None:
        t.copy_(self._wait(self._post("sum", [t]))[0])

    def _metric_max(self, t: torch.Tensor) -> None:
        t.copy_(self._wait(self._post("max", [t]))[0])

    def metric_mean_async(self, values: list[float]) -> Means:
        """Per-round logging scalars go through the store, so no worker waits for them; the
        result (worker 0 writes the log) averages over the members that posted, and its
        `ready()` says whether they all have."""
        k = self.metric_seq
        self.metric_seq += 1
        self.store.set(f"ft/metric/{k}/{self.rank}", json.dumps(list(values)))
        if self.rank != 0:  # only worker 0 logs
            return Means(lambda: list(values), lambda: True)
        expected = list(self.members)

        def keys() -> list[str]:  # members that left since do not count, nor rejoined ones
            return [
                f"ft/metric/{k}/{m}"
                for m in expected
                if m in self.members and self._joined_at.get(m, 0) <= k
            ]

        def ready() -> bool:
            return self.store.check(keys())

        def result() -> list[float]:
            t0 = time.monotonic()
            while not ready() and time.monotonic() - t0 < self.timeout_s:
                if self._has(f"ft/ep/{self.epoch}/broken"):
                    self._recover("another worker reported a failure")
                time.sleep(0.01)
            got = [json.loads(self.store.get(key)) for key in keys() if self._has(key)]
            for key in keys():
                self.store.delete_key(key)
            return np.mean(np.array(got, dtype=np.float64), axis=0).tolist()

        return Means(result, ready)

    def round_fields(self) -> dict:
        """Fault-tolerance fields of worker 0's round record: how far behind the slowest
        member is, and the Mix1 messages worker 0 dropped at the deadline this round."""
        keys = [f"ft/at/{m}" for m in self.members]
        at = [int(v) for v in self.store.multi_get(keys)] if self.store.check(keys) else []
        fields = {"ft/members": len(self.members), "ft/mix1_late": self.mix1_late}
        if at:
            fields["ft/slowest_round"] = min(at)
        self.mix1_late = 0
        return fields

    def writes_markers(self, local_rank: int) -> bool:
        """The lowest live member (local launches only: one machine)."""
        return self.rank == self.members[0]

    # ---- hooks the training loop calls (comm.base.Comm, train/loop.py)
    def on_step(self, step: int, compute_s: float) -> None:
        """After each inner step: injected straggling, kill or hang."""
        if self.injector is None:
            return
        fault = self.injector.on_step(step, compute_s)
        if fault is not None:
            print(f"[worker {self.rank} step {step}] injected fault: {fault}", flush=True)
            if fault == "partition":  # silent, alive, sockets open; then back
                self._silent.set()
                self.membership.cut(True)
                time.sleep(self.injector.partition_s)
                self.membership.cut(False)
                self._silent.clear()
                print(f"[worker {self.rank} step {step}] partition healed", flush=True)
                return
            if fault == "stall":  # heartbeats go on: only the adaptive deadline sees it
                time.sleep(self.injector.stall_s)
                print(f"[worker {self.rank} step {step}] stall over", flush=True)
                return
            if fault == "hang":
                self._stop.set()  # heartbeats stop with the process
                time.sleep(2 * _HB_PERIOD_S)
            fire(fault)

    def on_round_end(self, round_idx: int, state_fn: Callable[[], dict]) -> None:
        """At a round end: admit restarted workers (same decision on every member) and send
        them this worker's state if it is the donor."""
        self.round = round_idx
        self._round_ends = [*self._round_ends[-20:], time.monotonic()]
        self.store.set(f"ft/at/{self.rank}", str(round_idx))
        reason = self._broken()
        if reason is not None:  # e.g. a Mix1 peer failed this round
            self._recover(reason)
        if self.rank == 0:  # the joiners' own records, set before they took part in this round
            for key in [k for k in self._records_due if self._has(k)]:
                self.events.append(json.loads(self.store.get(key)))
                self._records_due.remove(key)
        # The first member at this round end decides whether the members re-rendezvous here:
        # when a worker waits on the rendezvous's wait list (a restarted one asking to join, or
        # one the others went on without). The decision holds for its epoch only: a member that
        # has since re-formed (a failure) takes part in no admission at this round end.
        key = f"ft/round/{round_idx}"
        if not self._has(key):
            admit = self._admission_due(round_idx)
            self.store.compare_set(key, "", f"{int(admit)}@{self.epoch}")
        if self.store.get(key).decode() != f"1@{self.epoch}":
            return
        for o in self.log:  # the old epoch's operations end before the new one starts
            if not o.done:
                self._wait(o)
        t0, old = time.monotonic(), list(self.members)
        rnd = self._rendezvous("admit")
        self._settle(old, "missed the rendezvous (no keep-alive)")
        self.stats.recovery_s += time.monotonic() - t0  # admitting a restarted worker
        if not rnd.joiners:  # a member was recovering: the joiners wait for the next round end
            return
        for j in rnd.joiners:  # they post logging scalars from the next round on
            self._joined_at[j] = self.metric_seq
        if self.rank == rnd.donor:
            state = state_fn()
            state["ft_seq"] = (self.seq, self.mix1_seq, self.metric_seq)
            buf = io.BytesIO()
            torch.save(state, buf)
            payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
            for j in rnd.joiners:
                pos = rnd.members.index(j)
                self.pg.send([size], pos, 1).wait()
                self.pg.send([payload], pos, 2).wait()
            self.store.set(f"ft/donor_digest/{round_idx}", state_digest(state))
        self._event("joined", workers=rnd.joiners, donor=rnd.donor)
        self._records_due += [f"ft/record/{t}" for t in rnd.tokens]

    def _admission_due(self, round_idx: int) -> bool:
        """Whether the members re-rendezvous at this round end: a worker waits on the wait list.
        With shards, one decision for every shard group (the first process at this round end,
        in any group, takes it): a restarted replica whose S processes have all asked to join."""
        if self.shard_link is None:
            return self.membership.waiting() > 0
        decided = f"ft/admit/{round_idx}"
        if not self.root.check([decided]):
            keys = [f"ft/ready/{r}" for r in range(self.world_size) if r not in self.members]
            ready = [k for k in keys if self.root.check([k])]
            if self.root.compare_set(decided, "", str(int(bool(ready)))).decode() == "1":
                for k in ready:  # admitted at this round end: not again at the next
                    self.root.delete_key(k)
        return self.root.get(decided).decode() == "1"

    def _ask_to_join(self) -> None:
        """A restarted replica asks to join once all its S processes are here (the replica
        group's barrier): from then on the next round end admits it in every shard group."""
        if self.shard_link is not None:
            self.shard_link.all_true(True)
            if self.shard_link.index == 0:
                self.root.set(f"ft/ready/{self.rank}", str(self.incarnation))

    def rejoin(self, load: Callable[[dict], None], state_fn: Callable[[], dict]) -> bool:
        """On a restarted worker: join the rendezvous, and once the members admit it at a
        round end, receive a live peer's state and `load` it. Returns False on a first start
        (nothing to do)."""
        if self.incarnation == 1:
            return False
        token = f"{self.rank}:{self.incarnation}"
        print(f"[worker {self.rank}] restarted (incarnation {self.incarnation}); asking to rejoin")
        self._ask_to_join()
        rnd = self._rendezvous("join")
        self.round = rnd.round
        pos = rnd.members.index(rnd.donor)
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([size], pos, 1).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.recv([payload], pos, 2).wait()
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
        self.seq, self.mix1_seq, self.metric_seq = state.pop("ft_seq")
        load(state)
        mine = state_digest(state_fn())  # what this worker now holds, after loading
        self.store.wait([f"ft/donor_digest/{self.round}"], timedelta(seconds=self.timeout_s))
        theirs = self.store.get(f"ft/donor_digest/{self.round}").decode()
        match = mine == theirs
        if self.shard_link is not None:  # every shard of the replica matches its donor shard
            match = self.shard_link.all_true(match)
        self._event(
            "rejoined",
            worker=self.rank,
            donor=rnd.donor,
            params_digest=mine,
            donor_digest=theirs,
            match=match,
        )
        self.store.set(f"ft/record/{token}", json.dumps(self.events[-1]))
        return True

    def close(self, finished: bool = True) -> None:
        if finished:
            self.store.set(f"ft/final_members/{self.rank}", json.dumps(self.members))
            self.store.set(f"ft/finished/{self.rank}", "1")
            self.store.set("ft/done", "1")
        self._stop.set()


class ElasticRuntime(Runtime):
    """The loop's side of the fault-tolerant runtime: logging scalars through the store, faults
    at every step, admission of restarted workers at a round end, rejoin."""

    comm: ElasticComm

    def metric_mean_async(self, values: list[float]) -> Means:
        return self.comm.metric_mean_async(values)

    def on_step(self, step: int, compute_s: float) -> None:
        self.comm.on_step(step, compute_s)

    def rejoin(self, load: Callable[[dict], None], state_fn: StateFn) -> bool:
        return self.comm.rejoin(load, state_fn)

    def writes_markers(self, local_rank: int) -> bool:
        return self.comm.writes_markers(local_rank)

    def _round_fields(self) -> dict:
        return self.comm.round_fields()

    def _admit(self, round_idx: int, state_fn: StateFn) -> None:
        self.comm.on_round_end(round_idx, state_fn)
