"""`ElasticRuntime`: the training loop's side of the fault-tolerant runtime (comm/runtime.py's
`Runtime` hooks): logging scalars through the store (round_scalars.py), the round end (bookkeeping,
recovery from a failure reported during the round, admission of restarted workers), a
restarted worker's rejoin (admission.py), the round record's fields and the membership records.

It also lends the fault-injection layer (comm/faulty.py) what it needs to act like a real
fault: going silent as behind a partition, stopping the heartbeat, and a hook at the start of a
recovery.

Across machines the store can be lost for good (elastic_world.py, `guarded`: the coordinator stayed
away past fault_tolerance.coordinator_wait_s), so there every round end starts with one small
gloo all-reduce: whether every member has lost the store. The members learn it at
different moments (one that has goes on without it meanwhile), but they all take part in the
same all-reduce of the same round, so they agree on the round to stop at: its end is logged
(the logging scalars gathered over gloo), checkpointed, and the worker stops (`stopping`). So a
run whose coordinator is gone loses no finished round, while one machine that lost it alone
(cut off from the coordinator, or its agent dead) stops no one else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection

import torch

from frugaltrain.cluster import keys
from frugaltrain.comm.ft.admission import Admission
from frugaltrain.comm.ft.comm import ElasticComm
from frugaltrain.comm.ft.round_scalars import StoreMeans
from frugaltrain.comm.runtime import Means, RoundEnd, Runtime, StateFn


class ElasticRuntime(Runtime):
    """The runtime around an ElasticComm: its members change between rounds."""

    comm: ElasticComm

    def __init__(
        self, comm: ElasticComm, min_workers: int = 1, local: Collection[int] | None = None
    ) -> None:
        """`min_workers`: with fewer members, wait at a round end for a worker to join (up to
        run.timeout_s). `local`: the workers on this machine, when the run spans machines (its
        checkpoint markers are this machine's own); None: all on one machine."""
        super().__init__(comm)
        self.world, self.oplog = comm.world, comm.oplog
        self.min_workers, self.local = min_workers, set(local) if local is not None else None
        self.means = StoreMeans(comm.oplog)
        self.stopping = False  # the store is lost everywhere: this round end is the last
        logs = self.writes_metrics(comm.rank, 0)  # in every shard group: its own joiners
        self.admission = Admission(comm.oplog, comm.mix1, self.means, comm.shard_link, logs)

    @property
    def round(self) -> int:
        """The last finished round (a restarted worker: its donor's)."""
        return self.world.round

    def metric_mean_async(self, values: list[float]) -> Means:
        """Per-round logging scalars go through the store, so no worker waits for them."""
        return self.means.post(values)

    def rejoin(self, load: Callable[[dict], None], state_fn: StateFn) -> bool:
        return self.admission.rejoin(load, state_fn)

    def writes_metrics(self, worker: int, shard: int) -> bool:
        """Across machines, each machine's lowest slot writes its machine's log (the
        coordinator merges them, cluster/metrics_relay.py), so a lost machine takes no rounds of
        the log with it."""
        if self.local is None:
            return super().writes_metrics(worker, shard)
        return worker == min(self.local) and shard == 0

    def writes_markers(self, local_rank: int) -> bool:
        """The lowest live member (of those on this machine, when the run spans machines)."""
        members = self.comm.members
        if self.local is not None:
            members = [m for m in members if m in self.local]
        return self.comm.rank == members[0]

    def close(self, finished: bool = True) -> None:
        """The worker leaves; `finished`: it trained to the end (the launcher then stops
        restarting workers that die, and closes the rendezvous once the last epoch is done)."""
        store, rank = self.world.store, self.comm.rank
        if finished:
            store.set(keys.final_members(rank), json.dumps(self.comm.members))
            store.set(keys.finished(rank), "1")
            store.set(keys.DONE, "1")
        self.world.heartbeat.stop()

    # ---- what the fault-injection layer calls (comm/faulty.py)
    def silence(self, on: bool) -> None:
        """While `on`, this worker is cut off as behind a partition: no heartbeat and no
        rendezvous keep-alive, while its sockets stay open."""
        if on:
            self.world.heartbeat.silence(True)
            self.world.membership.cut(True)
        else:
            self.world.membership.cut(False)
            self.world.heartbeat.silence(False)

    def stop_heartbeat(self) -> None:
        self.world.heartbeat.stop()

    def at_recovery(self, hook: Callable[[], None]) -> None:
        """Call `hook` whenever this worker starts recovering from a failure (its epoch just
        marked broken, the rendezvous not yet joined)."""
        self.oplog.on_recover.append(hook)

    # ---- the round end (comm/runtime.py)
    def end_round(
        self, round_idx: int, scalars: list[float], close: Callable[[RoundEnd], StateFn]
    ) -> list[dict]:
        """Across machines, first agree whether the store is lost (module docstring)."""
        if self.local is not None and self._store_lost_everywhere():
            return self._last_round(round_idx, scalars, close)
        return super().end_round(round_idx, scalars, close)

    def _store_lost_everywhere(self) -> bool:
        """Whether every member has lost the store (with shards: in every shard group, so that
        a replica's shards stop at the same round end). One machine cut off from the
        coordinator, or whose agent died, does not stop the others."""
        kept = torch.tensor([float(not self.world.store_lost)])
        total, _ = self.oplog.wait(self.oplog.post("max", [kept]))
        everywhere = bool(total.item() == 0)
        link = self.comm.shard_link
        return everywhere if link is None else link.all_true(everywhere)

    def _last_round(
        self, round_idx: int, scalars: list[float], close: Callable[[RoundEnd], StateFn]
    ) -> list[dict]:
        """The round end without the store, the same on every member: the scalars gathered
        over gloo, the round logged and checkpointed (the loop sees `stopping`)."""
        world = self.world
        self._round = world.round = round_idx
        self.stopping = True
        fields = self._round_fields() | {"ft/slowest_round": round_idx}  # every member is here
        events = self._drain_events()
        means = self.means.post(scalars)
        self.means.gather_recent()
        close(RoundEnd(fields, events, means))
        return self._drain_events()

    def _round_fields(self) -> dict:
        """Fault-tolerance fields of worker 0's round record: how far behind the slowest
        member is, and the Mix1 messages worker 0 dropped at the deadline this round."""
        store, members = self.world.store, self.comm.members
        ats = [keys.at(m) for m in members]
        at = self.world.guarded(
            lambda: [int(v) for v in store.multi_get(ats)] if store.check(ats) else [], []
        )
        fields = {"ft/members": len(members), "ft/mix1_late": self.comm.mix1.take_late()}
        if at:
            fields["ft/slowest_round"] = min(at)
        return fields

    def _drain_events(self) -> list[dict]:
        """Membership records and the guard's rejections, in the order they happened."""
        return self.world.take_events() + self.comm.drain_rejections()

    def _admit(self, round_idx: int, state_fn: StateFn) -> None:
        """At a round end: recover from a failure reported during the round (e.g. a Mix1 peer
        failed), then admit restarted workers."""
        world = self.world
        world.round = round_idx
        self.oplog.note_round_end()
        world.guarded(lambda: world.store.set(keys.at(world.rank), str(round_idx)), None)
        reason = world.guarded(world.broken, None)
        if reason is not None:
            self.oplog.recover(reason)
        if world.store_lost:  # no quorum wait, no admission: both need the store
            return
        self._wait_for_quorum()
        self.admission.at_round_end(round_idx, state_fn)

    def _wait_for_quorum(self) -> None:
        """Below run.min_workers members, wait until a worker asks to join (it is admitted
        right after); every member waits the same way, so they decide alike."""
        world, t0 = self.world, time.monotonic()
        if len(world.members) >= self.min_workers or world.membership.waiting() > 0:
            return
        print(
            f"[worker {world.rank} round {world.round}] {len(world.members)} members, fewer "
            f"than run.min_workers = {self.min_workers}: waiting for a worker to join",
            flush=True,
        )
        while world.membership.waiting() == 0:
            if time.monotonic() - t0 > world.timeout_s:
                raise RuntimeError(
                    f"fewer than run.min_workers = {self.min_workers} workers for "
                    f"run.timeout_s = {world.timeout_s:g} s; start a machine or lower it"
                )
            time.sleep(0.5)
