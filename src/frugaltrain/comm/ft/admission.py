"""Admission: how a restarted worker gets back in, at a round end.

A restarted worker (incarnation > 1) waits on the rendezvous's wait list. The first member at a
round end sees it there and decides for all (compare-and-set on that round and epoch) that the
members re-rendezvous; all finish their pending operations, the joiner is admitted, and the
lowest old member (the donor) sends it its whole worker state (outer x and momentum, round,
step, inner AdamW and schedule, and the runtime's sequence counters) point to point. The state
moves in the format of comm/state_format.py, which describes data only: reading it cannot run
code, unlike a pickle, so a peer or the link cannot make the joiner run anything. A size
announced above what the joiner's own model allows (`state_bound`) is refused before anything is
allocated. The joiner checks what it loaded against the donor's digest and records a "rejoined"
event; a mismatch refuses the state (`StateRefused`): the joiner exits and is restarted.

With run.shards = S > 1 a replica is admitted in every shard group at the same round end: the
first process at a round end in any group decides it for all (keys.admit in the run's store),
once the replica's S processes have all asked to join.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from frugaltrain.cluster import keys
from frugaltrain.comm import state_format
from frugaltrain.comm.ft.mix1 import Mix1
from frugaltrain.comm.ft.operation_log import OpLog
from frugaltrain.comm.ft.round_scalars import StoreMeans
from frugaltrain.comm.rendezvous import Round
from frugaltrain.comm.replica_shards import ReplicaShards

SIZE_TAG, STATE_TAG = 1, 2  # point-to-point tags of the state transfer
# What a worker state may hold, in fp32 copies of its model: the model, the inner optimizer's
# two moments, the outer parameters and momentum, error feedback, and room to spare.
MODEL_COPIES = 8
STATE_SLACK_BYTES = 64 << 20  # RNG states, the sampler, counters and the format's headers


class StateRefused(RuntimeError):
    """A donor's state that this worker will not take: too large for its model, malformed, or
    not what the donor's digest says. The worker exits and is restarted, asking again."""


def state_bound(state: dict) -> int:
    """The most bytes a donor's state may announce to a joiner whose own state is `state`:
    MODEL_COPIES fp32 copies of its model, plus slack. Checked before anything is allocated."""
    numel = sum(t.numel() for t in state["model"].values() if isinstance(t, torch.Tensor))
    return MODEL_COPIES * 4 * numel + STATE_SLACK_BYTES


def state_digest(state: dict) -> str:
    """Short hash of a worker state's model and outer parameters (equal iff bitwise equal)."""
    h = hashlib.sha256()
    tensors = list(state["model"].values()) + list(state.get("outer", {}).get("outer", []))
    for t in tensors:
        h.update(t.detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Admission:
    """Admission of restarted workers into `oplog`'s world; the donor also sends the counters
    of `mix1` and `means`, so the joiner posts what the members post next."""

    def __init__(
        self,
        oplog: OpLog,
        mix1: Mix1,
        means: StoreMeans,
        shard_link: ReplicaShards | None,
        logs: bool,
    ) -> None:
        """`logs`: this worker writes a metrics log (Runtime.writes_metrics), so it collects
        the joiners' own records."""
        self.world, self.oplog, self.mix1, self.means = oplog.world, oplog, mix1, means
        self.shard_link, self.logs = shard_link, logs
        self._records_due: list[str] = []  # joiners' records, for the metrics log

    # ---- the members' side
    def at_round_end(self, round_idx: int, state_fn: Callable[[], dict]) -> None:
        """Admit restarted workers (same decision on every member) and send them this
        worker's state if it is the donor."""
        if self.logs:  # the joiners' own records, set before they took part in this round
            self.world.guarded(self._collect_records, None)  # the store lost: left for later
        if not self._decided(round_idx):
            return
        world = self.world
        self.oplog.finish_pending()  # the old epoch's operations end before the new one starts
        t0, old = time.monotonic(), list(world.members)
        rnd = world.rendezvous("admit")
        self.oplog.settle(old, "missed the rendezvous (no keep-alive)")
        self.oplog.stats.recovery_s += time.monotonic() - t0  # admitting a restarted worker
        if not rnd.joiners:  # a member was recovering: the joiners wait for the next round end
            return
        for j in rnd.joiners:  # they post logging scalars from the next round on
            self.means.joined_at[j] = self.means.seq
        if world.rank == rnd.donor:
            self._send_state(rnd, round_idx, state_fn)
        world.event("joined", workers=rnd.joiners, donor=rnd.donor)
        self._records_due += [keys.record(t) for t in rnd.tokens]

    def _collect_records(self) -> None:
        """Log the joiners' own records that they have set (each once)."""
        world = self.world
        for key in [k for k in self._records_due if world.has(k)]:
            world.add_record(json.loads(world.store.get(key)))
            self._records_due.remove(key)

    def _decided(self, round_idx: int) -> bool:
        """Whether the members re-rendezvous at this round end. The first member here decides,
        when a worker waits on the rendezvous's wait list (a restarted one asking to join, or
        one the others went on without). The decision holds for its epoch only: a member that
        has since re-formed (a failure) takes part in no admission at this round end."""
        world = self.world
        key = keys.round_decision(round_idx)

        def decide() -> bool:
            if not world.has(key):
                admit = self._admission_due(round_idx)
                world.store.compare_set(key, "", f"{int(admit)}@{world.epoch}")
            return world.store.get(key).decode() == f"1@{world.epoch}"

        # The store lost here (the coordinator gone at this very round end): nobody admits;
        # the next round end's all-reduce finds the store lost everywhere and stops the run.
        return world.guarded(decide, False)

    def _admission_due(self, round_idx: int) -> bool:
        """Whether a worker waits on the wait list. With shards, one decision for every shard
        group (the first process at this round end, in any group, takes it): a restarted
        replica whose S processes have all asked to join."""
        world = self.world
        if self.shard_link is None:
            return world.membership.waiting() > 0
        decided, root = keys.admit(round_idx), world.root
        if not root.check([decided]):
            ready = [keys.ready(r) for r in range(world.world_size) if r not in world.members]
            ready = [k for k in ready if root.check([k])]
            if root.compare_set(decided, "", str(int(bool(ready)))).decode() == "1":
                for k in ready:  # admitted at this round end: not again at the next
                    root.delete_key(k)
        return root.get(decided).decode() == "1"

    def _send_state(self, rnd: Round, round_idx: int, state_fn: Callable[[], dict]) -> None:
        """The donor's side: its state and counters to every joiner, then its digest."""
        state = state_fn()
        state["ft_seq"] = (self.oplog.seq, self.mix1.seq, self.means.seq)
        payload = torch.frombuffer(bytearray(state_format.encode(state)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        for j in rnd.joiners:
            pos = rnd.members.index(j)
            self.world.pg.send([size], pos, SIZE_TAG).wait()
            self.world.pg.send([payload], pos, STATE_TAG).wait()
        self.world.store.set(keys.donor_digest(round_idx), state_digest(state))

    # ---- the joiner's side
    def rejoin(self, load: Callable[[dict], None], state_fn: Callable[[], dict]) -> bool:
        """On a restarted worker: join the rendezvous, and once the members admit it at a
        round end, receive a live peer's state and `load` it. Returns False on a first start
        (nothing to do)."""
        world = self.world
        if world.incarnation == 1:
            return False
        rank, incarnation = world.rank, world.incarnation
        token = f"{rank}:{incarnation}"
        print(
            f"[worker {rank}] restarted (incarnation {incarnation}); asking to rejoin", flush=True
        )
        bound = state_bound(state_fn())  # this worker's own model, before anything arrives
        self._ask_to_join()
        rnd = world.rendezvous("join")
        world.round = rnd.round
        state = self._receive_state(rnd, bound)
        self.oplog.seq, self.mix1.seq, self.means.seq = state.pop("ft_seq")
        load(state)
        mine = state_digest(state_fn())  # what this worker now holds, after loading
        digest = keys.donor_digest(world.round)
        world.store.wait([digest], timedelta(seconds=world.timeout_s))
        theirs = world.store.get(digest).decode()
        match = mine == theirs
        if self.shard_link is not None:  # every shard of the replica matches its donor shard
            match = self.shard_link.all_true(match)
        world.event(
            "rejoined",
            worker=world.rank,
            donor=rnd.donor,
            params_digest=mine,
            donor_digest=theirs,
            match=match,
        )
        world.store.set(keys.record(token), json.dumps(world.events[-1]))
        if not match:  # a corrupt or forged state is not trained on
            raise StateRefused(
                f"worker {rank}: the state from donor {rnd.donor} hashes to {mine}, its digest "
                f"says {theirs}; refused (restarted, it asks to rejoin again)"
            )
        return True

    def _ask_to_join(self) -> None:
        """A restarted replica asks to join once all its S processes are here (the replica
        group's barrier): from then on the next round end admits it in every shard group."""
        if self.shard_link is not None:
            self.shard_link.all_true(True)
            if self.shard_link.index == 0:
                self.world.root.set(keys.ready(self.world.rank), str(self.world.incarnation))

    def _receive_state(self, rnd: Round, bound: int) -> dict:
        """The donor's state, read as state_format data; StateRefused if it announces more than
        `bound` bytes (before allocating them) or is not a worker state."""
        pos = rnd.members.index(rnd.donor)
        size = torch.zeros(1, dtype=torch.int64)
        self.world.pg.recv([size], pos, SIZE_TAG).wait()
        n = int(size.item())
        if not 0 < n <= bound:
            raise StateRefused(
                f"donor {rnd.donor} announced a state of {n} bytes; this worker's model allows "
                f"1 to {bound}"
            )
        payload = torch.empty(n, dtype=torch.uint8)
        self.world.pg.recv([payload], pos, STATE_TAG).wait()
        try:
            state = state_format.decode(payload.numpy())
        except ValueError as e:
            raise StateRefused(f"donor {rnd.donor} sent a malformed state: {e}") from None
        seq = state.get("ft_seq") if isinstance(state, dict) else None
        if not (isinstance(seq, tuple) and len(seq) == 3 and all(type(s) is int for s in seq)):
            raise StateRefused(f"donor {rnd.donor} sent no worker state with its counters")
        return state
