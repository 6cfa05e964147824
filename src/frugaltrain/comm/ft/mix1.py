"""Mix1 with a deadline: a non-blocking mix (fgd's Mix1) goes point to point, outside the op
log's sequence, so a straggler never holds it up for long.

Each message is tagged with the worker's Mix1 count (one per round, the same on every worker),
and at the round end a worker waits at most fault_tolerance.mix1_deadline_s for the ones still
missing. A late message is dropped (the row is renormalized over what arrived, as for a lost
message); a peer that is late and whose heartbeat stopped, or whose socket broke, is reported
and the members re-form at the round end. gloo's point-to-point works say they are done only through
`wait()`, and a wait that times out closes the pair, so each message is waited for on a
background thread (`Arrival`) and the round end polls those.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch

from frugaltrain.codecs import compress
from frugaltrain.comm import topology
from frugaltrain.comm.accounting import CommStats
from frugaltrain.comm.base import Handle, Wire, encode_own, finish_mix
from frugaltrain.comm.ft import heartbeat
from frugaltrain.comm.ft.elastic_world import short_error
from frugaltrain.comm.ft.operation_log import OpLog
from frugaltrain.comm.replica_shards import ReplicaShards

PARTS = 4  # tag space per Mix1 message: one tag per encoded part
FOREVER = timedelta(days=365)  # gloo closes a pair whose wait times out: never let it

# The guard on what arrived: (rows, flats, senders) -> the rows and flats it keeps (comm.py).
Judge = Callable[[list, list, list[int]], tuple[list, list]]


class Arrival:
    """Point-to-point works (one message's parts, or this worker's sends) waited for on a
    background thread: `done` is set when they are, `error` then holds a failure (a dead peer:
    its sockets closed). Until then it keeps `group` alive (an old epoch's, maybe)."""

    def __init__(self, works: list, group: object) -> None:
        self.done = threading.Event()
        self.error: str | None = None
        self.group = group
        if works:
            threading.Thread(target=self._wait, args=(works,), daemon=True).start()
        else:
            self.done.set()

    @classmethod
    def failed(cls, error: str) -> Arrival:
        """A message that cannot arrive (its receive could not even be posted)."""
        arrival = cls([], None)
        arrival.error = error
        return arrival

    def _wait(self, works: list) -> None:
        try:
            for work in works:
                work.wait(FOREVER)
        except Exception as e:
            self.error = short_error(e)
        self.group = None  # the group may go now
        self.done.set()


class Mix1:
    """This worker's Mix1 messages: `seq` counts them (their tag), `late` those dropped at the
    deadline (`take_late`)."""

    def __init__(self, oplog: OpLog, stats: CommStats, shard_link: ReplicaShards | None) -> None:
        self.world, self.oplog, self.stats = oplog.world, oplog, stats
        self.shard_link = shard_link
        self.seq = 0
        self.late = 0

    def take_late(self) -> int:
        """Messages dropped at the deadline since the last call."""
        late, self.late = self.late, 0
        return late

    def start(
        self, tensors: list[torch.Tensor], w: np.ndarray, codec: str, wire: Wire, judge: Judge
    ) -> Handle:
        """Send this worker's `tensors` to its column of `w`, receive its row, and return the
        handle whose wait mixes what arrived by the deadline into `tensors`."""
        world = self.world
        if world.is_broken():
            old = list(world.members)
            self.oplog.recover("another worker reported a failure")
            # w was built for the old members: keep the survivors' entries (rows are
            # renormalized over what arrives anyway); the next round builds w for the new ones.
            keep = [old.index(m) for m in world.members]
            w = w[np.ix_(keep, keep)]
        members, me, pg = list(world.members), world.members.index(world.rank), world.pg
        wire.outgoing(tensors)
        send_to, recv_from = topology.peers(w, me)
        k = self.seq
        tag = (k % (1 << 20)) * PARTS
        flat, parts = encode_own(tensors, codec)
        parts = [p.contiguous() for p in parts]
        # Receives first, as in comm/torchdist.py's exchange: a receive posted behind a send
        # already streaming on the same gloo pair is announced only after the whole payload.
        bufs = {j: [torch.empty_like(p) for p in parts] for j in recv_from}
        arrived = {j: self._receive(pg, j, bufs[j], tag) for j in recv_from}
        for j in send_to:  # a send completes when its peer takes it
            try:
                Arrival([pg.send([p], j, tag + i) for i, p in enumerate(parts)], pg)
            except RuntimeError as e:  # the pair is closed: that peer is gone; re-form first
                world.report(f"worker {members[j]}: {short_error(e)}")
                return self.start(tensors, w, codec, wire, judge)
        self.seq += 1
        wire_bytes = compress.wire_bytes(flat.numel(), codec)
        self.stats.count(wire_bytes * len(send_to), wire_bytes * len(recv_from))
        beats = {j: heartbeat.beat_of(world.store, members[j]) for j in recv_from}
        posted = time.monotonic()

        def finish() -> None:
            self._await(arrived)
            got = [
                j
                for j in recv_from
                if self._usable(arrived[j], members[j], beats[j], posted, k, wire)
            ]
            rows, flats, senders = [w[me, me]], [flat], [world.rank]
            for j in self._everywhere(got, members):
                rows.append(w[me, j])
                flats.append(compress.decode(bufs[j], codec, flat.numel()))
                senders.append(members[j])
            rows, flats = judge(rows, flats, senders)
            finish_mix(rows, flats, tensors, renormalize=True)  # over what arrived in time

        return Handle(self.stats, finish, lambda: all(a.done.is_set() for a in arrived.values()))

    @staticmethod
    def _receive(pg, j: int, bufs: list[torch.Tensor], tag: int) -> Arrival:
        try:
            return Arrival([pg.recv([b], j, tag + i) for i, b in enumerate(bufs)], pg)
        except RuntimeError as e:
            return Arrival.failed(short_error(e))

    def _await(self, arrived: dict[int, Arrival]) -> None:
        """Wait for the messages still missing, at most the Mix1 deadline."""
        deadline = min(self.world.options.mix1_deadline_s, self.world.timeout_s)
        t0 = time.monotonic()
        while not all(a.done.is_set() for a in arrived.values()):
            if time.monotonic() - t0 > deadline:
                break
            time.sleep(0.001)

    def _everywhere(self, got: list[int], members: list[int]) -> list[int]:
        """With shards, only the messages that arrived at every shard of the replica count."""
        if self.shard_link is None:
            return got
        here = {members[j] for j in got}  # by worker: the groups' members may differ
        everywhere = self.shard_link.count([r in here for r in range(self.world.world_size)])
        return [j for j in got if everywhere[members[j]]]

    def _usable(
        self, arrival: Arrival, r: int, beat: int, posted: float, k: int, wire: Wire
    ) -> bool:
        """Whether the message from worker r counts: it arrived in time, intact, and the wire
        did not lose it. A late one from a silent peer, or a broken socket, is reported (the
        members re-form at the round end)."""
        if not arrival.done.is_set():
            self.late += 1
            self._check_silent(r, beat, posted)
            return False
        if arrival.error is not None:
            self.world.report(f"worker {r}: {arrival.error}")
            return False
        return wire.received(k, r, self.world.rank)

    def _check_silent(self, member: int, beat: int, since: float) -> None:
        """A message is late: a straggler (heartbeat moving) is only skipped; a silent peer (no
        heartbeat for the heartbeat timeout) is reported."""
        world = self.world
        while heartbeat.beat_of(world.store, member) == beat:
            if time.monotonic() - since >= world.hb_timeout_s:
                late_by = min(world.options.mix1_deadline_s, world.timeout_s)
                world.report(
                    f"worker {member}: no heartbeat for {world.hb_timeout_s:g} s "
                    f"(late for Mix1 by {late_by:g} s)"
                )
                return
            time.sleep(0.05)
