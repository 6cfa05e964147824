"""`ElasticComm`: the Comm a strategy sees on the fault-tolerant runtime.

Its collectives go through the op log (operation_log.py): an all-reduce is a sequenced sum, a
blocking mix a sequenced gather whose rows are renormalized over the members that delivered, so both
survive a member's failure. A non-blocking mix (Mix1) goes point to point with a deadline
(mix1.py), and the guard judges the messages that arrived by their norms and this worker's own.
Everything the training loop calls is on the runtime (runtime.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from frugaltrain.codecs import compress
from frugaltrain.codecs.feedback import ErrorFeedback
from frugaltrain.comm.base import Comm, Handle, finish_mix, flatten, unflatten_into
from frugaltrain.comm.ft.elastic_world import ElasticWorld, Identity, Options
from frugaltrain.comm.ft.mix1 import Mix1
from frugaltrain.comm.ft.operation_log import OpLog
from frugaltrain.comm.guard import Guard
from frugaltrain.comm.replica_shards import ReplicaShards


class ElasticComm(Comm):
    """Comm whose `members` shrink when workers fail and grow when they rejoin.

    Args:
        store: the run's TCPStore (hosted by the launcher, not by a worker).
        me: who this process is and where the store listens (world.Identity).
        options: the fault-tolerance settings (world.Options: config's [fault_tolerance]).
        timeout_s: run.timeout_s, the longest any wait may last.
        guard: keeps bad contributions out (comm/guard.py). Mix1 on this runtime judges the
            messages that arrived by their norms and this worker's own; blocking operations
            share the norms of all members first, as on the other runtimes.
        shard_link: the other shards of this worker's replica (run.shards > 1).

    A first start meets the other first starts and forms the first epoch here; a restarted one
    joins through its runtime's `rejoin`.
    """

    def __init__(
        self,
        store: dist.TCPStore,
        me: Identity,
        options: Options,
        *,
        timeout_s: float,
        guard: Guard | None = None,
        shard_link: ReplicaShards | None = None,
    ) -> None:
        self.world = ElasticWorld(store, me, options, timeout_s)  # first: `members` lives there
        super().__init__(deterministic=False, guard=guard, shard_link=shard_link)
        self.rank, self.world_size = me.rank, me.world_size
        self.world.earlier = self.drain_rejections
        self.oplog = OpLog(self.world, self.stats)
        self.mix1 = Mix1(self.oplog, self.stats, shard_link)
        self.world.start()

    @property
    def members(self) -> list[int]:
        return self.world.members

    @members.setter
    def members(self, value: list[int]) -> None:
        self.world.members = value

    # ---- Comm runtime hooks
    def _all_reduce_sum(self, tensors: list[torch.Tensor], scale: float) -> Handle:
        op = self.oplog.post("sum", [flatten(tensors)])

        def finish() -> None:
            total, n = self.oplog.wait(op)  # mean over whoever took part in the end
            unflatten_into(total / n, tensors)

        return Handle(self.stats, finish, lambda: self.oplog.completed(op))

    def _mix(
        self, tensors: list[torch.Tensor], w: np.ndarray, codec: str, feedback: ErrorFeedback | None
    ) -> Handle:
        members, me = list(self.members), self.position
        # Gossip travels as a gather here (operation_log.py): count what really moves.
        others = len(members) - 1
        own, parts = self._encode_counted(tensors, codec, feedback, others, others)
        op = self.oplog.post("gather", parts)

        def finish() -> None:
            got = self.oplog.wait(op)
            rows, flats = [], []
            for j, r in enumerate(members):
                if w[me, j] == 0 or r not in got:
                    continue
                if j != me and not self.wire.received(op.seq, r, self.rank):
                    continue
                rows.append(w[me, j])
                flats.append(own if j == me else compress.decode(got[r], codec, own.numel()))
            finish_mix(rows, flats, tensors, renormalize=True)  # over those that delivered

        return Handle(self.stats, finish, lambda: self.oplog.completed(op))

    def _metric_sum(self, t: torch.Tensor) -> None:
        t.copy_(self.oplog.wait(self.oplog.post("sum", [t]))[0])

    def _metric_max(self, t: torch.Tensor) -> None:
        t.copy_(self.oplog.wait(self.oplog.post("max", [t]))[0])

    def _mix_apart(
        self, tensors: list[torch.Tensor], w: np.ndarray, codec: str, feedback: ErrorFeedback | None
    ) -> Handle:
        """A blocking mix is a sequenced operation (above); a non-blocking one (Mix1) goes
        point to point with a deadline, so a straggler never holds it up for long. Mix1 sends
        parameters, always with a dense codec: it has no error feedback."""
        if feedback is not None:
            raise ValueError("a non-blocking mix takes no error feedback (its codec is dense)")
        return self.mix1.start(tensors, w, codec, self.wire, self._judge_arrivals)

    def _judge_arrivals(self, rows: list, flats: list, senders: list[int]) -> tuple[list, list]:
        """The guard on what arrived in time (this worker's own contribution first): the ones
        rejected by their norms are left out of the row; if it is this worker's own, it takes
        its peers' values."""
        if self.guard is None or len(flats) < 2:
            return rows, flats
        v = self.guard.judge(np.array(self.guard.norms(flats)), senders, own=0)
        if v.clean:
            return rows, flats
        keep = [i for i in range(len(flats)) if v.accepted[i]] or [0]
        scale = [float(v.scale[i]) for i in keep]
        return [rows[i] for i in keep], [flats[i] * c for i, c in zip(keep, scale, strict=True)]
