"""Admission: how a restarted worker gets back in, at a round end.

A restarted worker (incarnation > 1) waits on the rendezvous's wait list. The first member at a
round end sees it there and decides for all (compare-and-set on that round and epoch) that the
members re-rendezvous; all finish their pending operations, the joiner is admitted, and its
donor, an old member, sends it its whole worker state (outer x and momentum, round, step, inner
AdamW and schedule, and the runtime's sequence counters) point to point. The state moves in the
format of comm/state_format.py, which describes data only: reading it cannot run code, unlike a
pickle, so a peer or the link cannot make the joiner run anything. A size announced above what
the joiner's own model allows (`state_bound`) is refused before anything is allocated.

The donor then posts its digest of the transfer in the store, under a key that names the round,
the donor and the joiner (keys.donor_digest); the digest covers the model and outer parameters
and the counters, and is bound to that same (round, donor, joiner), so a digest written for
another transfer never matches (`state_digests`). The joiner loads the state, hashes what it
now holds the same way and records a "rejoined" event when the two agree.

A state too large, malformed or not what the digest says is refused (`StateRefused`): the
joiner records a "refused" event naming the donor and the reason, adds the donor to its
refused donors (keys.refused_donors), exits and is restarted. Asking again, it posts that list
in its rendezvous entry, and every participant picks the same donor from it
(rendezvous.py `donor_after`): the lowest old member at first, then the next old member after
the last refused one, wrapping around; once it has refused every old member, the order starts
over (the members' "joined" event says so). Admitted, it forgets the list.

With run.shards = S > 1 a replica is admitted in every shard group at the same round end: the
first process at a round end in any group decides it for all (keys.admit in the run's store),
once the replica's S processes have all asked to join. Each shard takes its group's donor's
shard; one shard's refusal refuses them all.
"""

from __future__ import annotations

import hashlib
import json
import struct
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
    not what the donor's digest says. The worker exits and is restarted, asking the next donor
    (`Admission._refuse`)."""


def state_bound(state: dict) -> int:
    """The most bytes a donor's state may announce to a joiner whose own state is `state`:
    MODEL_COPIES fp32 copies of its model, plus slack. Checked before anything is allocated."""
    numel = sum(t.numel() for t in state["model"].values() if isinstance(t, torch.Tensor))
    return MODEL_COPIES * 4 * numel + STATE_SLACK_BYTES


Transfer = tuple[int, int, int]  # (round, donor, joiner): the state transfer a digest names


def state_digests(state: dict, seq: tuple[int, int, int], transfers: list[Transfer]) -> list[str]:
    """Short hashes of a worker state's model and outer parameters and its sequence counters
    `seq` (equal iff bitwise equal), one per transfer, bound to it: a digest made for another
    round, donor or joiner never matches. The tensors are hashed once for all transfers."""
    h = hashlib.sha256(struct.pack(">3q", *seq))
    tensors = list(state["model"].values()) + list(state.get("outer", {}).get("outer", []))
    for t in tensors:
        h.update(t.detach().cpu().float().contiguous().numpy().tobytes())
    digests = []
    for transfer in transfers:  # a fixed-size trailer: no other (tensors, transfer) reads alike
        bound = h.copy()
        bound.update(struct.pack(">3q", *transfer))
        digests.append(bound.hexdigest()[:16])
    return digests


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
        if world.rank in rnd.donors.values():
            self._send_state(rnd, state_fn)
        fields = {"workers": rnd.joiners, "donors": [rnd.donors[j] for j in rnd.joiners]}
        if rnd.started_over:  # they had refused every old member's state once
            fields["started_over"] = rnd.started_over
        world.event("joined", **fields)
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

    def _send_state(self, rnd: Round, state_fn: Callable[[], dict]) -> None:
        """The donor's side: its state and counters to each joiner it is the donor of, then
        the digest of each transfer under that transfer's own key."""
        world = self.world
        joiners = [j for j in rnd.joiners if rnd.donors[j] == world.rank]
        state = state_fn()
        seq = (self.oplog.seq, self.mix1.seq, self.means.seq)
        state["ft_seq"] = seq
        payload = torch.frombuffer(bytearray(state_format.encode(state)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        for j in joiners:
            pos = rnd.members.index(j)
            world.pg.send([size], pos, SIZE_TAG).wait()
            world.pg.send([payload], pos, STATE_TAG).wait()
        transfers = [(rnd.round, world.rank, j) for j in joiners]
        digests = state_digests(state, seq, transfers)
        for transfer, digest in zip(transfers, digests, strict=True):
            world.store.set(keys.donor_digest(*transfer), digest)

    # ---- the joiner's side
    def rejoin(self, load: Callable[[dict], None], state_fn: Callable[[], dict]) -> bool:
        """On a restarted worker: join the rendezvous, and once the members admit it at a
        round end, receive its donor's state and `load` it. Returns False on a first start
        (nothing to do). A refused state raises StateRefused, once recorded (`_refuse`)."""
        world = self.world
        if world.incarnation == 1:
            return False
        rank, incarnation = world.rank, world.incarnation
        print(
            f"[worker {rank}] restarted (incarnation {incarnation}); asking to rejoin", flush=True
        )
        bound = state_bound(state_fn())  # this worker's own model, before anything arrives
        refused = self._refused_before()
        self._ask_to_join()
        rnd = world.rendezvous("join", tuple(refused))
        world.round, donor = rnd.round, rnd.donors[rank]
        if rank in rnd.started_over:
            print(
                f"[worker {rank}] it refused every old member's state once; donors start over "
                f"with {donor}",
                flush=True,
            )
        try:
            mine, theirs = self._take_state(rnd, donor, bound, load, state_fn)
        except StateRefused as e:
            self._refuse(rnd, donor, refused, str(e))
            raise
        if refused:  # admitted: its next restart starts from the lowest donor again
            world.store.delete_key(keys.refused_donors(rank))
        world.event(
            "rejoined",
            worker=rank,
            donor=donor,
            params_digest=mine,
            donor_digest=theirs,
            match=True,
        )
        world.store.set(keys.record(f"{rank}:{incarnation}"), json.dumps(world.events[-1]))
        return True

    def _take_state(
        self,
        rnd: Round,
        donor: int,
        bound: int,
        load: Callable[[dict], None],
        state_fn: Callable[[], dict],
    ) -> tuple[str, str]:
        """Receive `donor`'s state, load it and check what this worker now holds against the
        donor's digest of this transfer: (this worker's digest, the donor's). StateRefused
        when the state is too large, malformed, or not what the digest says (on any shard)."""
        world = self.world
        state = self._receive_state(rnd, donor, bound)
        self.oplog.seq, self.mix1.seq, self.means.seq = state.pop("ft_seq")
        load(state)
        transfer = (rnd.round, donor, world.rank)
        seq = (self.oplog.seq, self.mix1.seq, self.means.seq)
        (mine,) = state_digests(state_fn(), seq, [transfer])  # what it holds, after loading
        key = keys.donor_digest(*transfer)
        world.store.wait([key], timedelta(seconds=world.timeout_s))
        theirs = world.store.get(key).decode()
        match = mine == theirs
        if self.shard_link is not None:  # every shard of the replica matches its donor shard
            match = self.shard_link.all_true(match)
        if mine != theirs:  # a corrupt or forged state is not trained on
            raise StateRefused(
                f"the state from donor {donor} hashes to {mine}, its digest says {theirs}"
            )
        if not match:
            raise StateRefused("another shard of this replica refused its donor's state")
        return mine, theirs

    def _refused_before(self) -> list[int]:
        """The donors this worker refused since it last rejoined (keys.refused_donors)."""
        world, key = self.world, keys.refused_donors(self.world.rank)
        if not world.has(key):
            return []
        try:
            return keys.parse_members(world.store.get(key), world.world_size)
        except ValueError as e:
            print(f"[worker {world.rank}] {key}: {e}; asking the lowest donor", flush=True)
            return []

    def _refuse(self, rnd: Round, donor: int, refused: list[int], reason: str) -> None:
        """Record a refused state: `donor` joins this worker's refused donors, so that its next
        admission asks the next one (a fresh list once its donors started over), and a
        "refused" event naming the donor and `reason` goes to worker 0's log."""
        world = self.world
        after = [donor] if world.rank in rnd.started_over else [*refused, donor]
        world.store.set(keys.refused_donors(world.rank), json.dumps(after))
        world.event("refused", worker=world.rank, donor=donor, reason=reason)
        token = f"{world.rank}:{world.incarnation}"
        world.store.set(keys.record(token), json.dumps(world.events[-1]))

    def _ask_to_join(self) -> None:
        """A restarted replica asks to join once all its S processes are here (the replica
        group's barrier): from then on the next round end admits it in every shard group."""
        if self.shard_link is not None:
            self.shard_link.all_true(True)
            if self.shard_link.index == 0:
                self.world.root.set(keys.ready(self.world.rank), str(self.world.incarnation))

    def _receive_state(self, rnd: Round, donor: int, bound: int) -> dict:
        """`donor`'s state, read as state_format data; StateRefused if it announces more than
        `bound` bytes (before allocating them) or is not a worker state."""
        pos = rnd.members.index(donor)
        size = torch.zeros(1, dtype=torch.int64)
        self.world.pg.recv([size], pos, SIZE_TAG).wait()
        n = int(size.item())
        if not 0 < n <= bound:
            raise StateRefused(
                f"donor {donor} announced a state of {n} bytes; this worker's model allows "
                f"1 to {bound}"
            )
        payload = torch.empty(n, dtype=torch.uint8)
        self.world.pg.recv([payload], pos, STATE_TAG).wait()
        try:
            state = state_format.decode(payload.numpy())
        except ValueError as e:
            raise StateRefused(f"donor {donor} sent a malformed state: {e}") from None
        seq = state.get("ft_seq") if isinstance(state, dict) else None
        if not (isinstance(seq, tuple) and len(seq) == 3 and all(type(s) is int for s in seq)):
            raise StateRefused(f"donor {donor} sent no worker state with its counters")
        return state
