"""Which donor a joiner takes its state from, and the donor's digest (comm/ft/admission.py).

Real admissions: ElasticWorlds over one TCPStore, each worker a thread with a store client and
a gloo group of its own, members 0 and 1 at round ends and worker 2 restarted. Only torch
elastic's rendezvous is played by the test (`_Rendezvous`: each round closes once the workers
the test expects are in it); what the participants post to the round and the donor each of them
picks from that is the real code. A "restart" of the joiner is a new ElasticWorld with the next
incarnation, as the launcher would start.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from frugaltrain.cluster import keys
from frugaltrain.comm.ft.admission import STATE_TAG, Admission, StateRefused, state_digests
from frugaltrain.comm.ft.elastic_world import ElasticWorld, Identity

W, JOINER = 3, 2  # members 0 and 1; worker 2 rejoins
ROUND = 3  # the round end of the first admission; the next one is at ROUND + 1
TIMEOUT_S = 30.0
OPTIONS = SimpleNamespace(mix1_deadline_s=5.0, deadline_factor=4.0, deadline_floor_s=60.0)
SEQ = {0: (50, 51, 52), 1: (60, 61, 62)}  # each member's (oplog, mix1, means) counters
RUNS = itertools.count()  # each run's namespace in the module's store


class _Over(BaseException):
    """A worker that would exit, or a round that never fills (not an Exception: the world's
    rendezvous loop retries on those)."""


class _Rendezvous:
    """torch elastic's rendezvous as the test plays it: round k takes exactly the workers in
    rounds[k] (one that asks early waits, as on the wait list) and closes once they are all in;
    each gets its rank in worker order and the round's own store, on its own client (a TCPStore
    client blocks its other users while it waits)."""

    def __init__(self, rounds: list[list[int]]) -> None:
        self.rounds, self.index, self.arrived = rounds, 0, 0
        self.cond = threading.Condition()

    def join(self, worker: int, client: dist.Store) -> SimpleNamespace:
        with self.cond:
            if not self.cond.wait_for(lambda: worker in self._open(), TIMEOUT_S):
                raise _Over(f"worker {worker} asked for a round the test did not plan")
            index, workers = self.index, self.rounds[self.index]
            self.arrived += 1
            if self.arrived == len(workers):
                self.index, self.arrived = index + 1, 0
                self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.index > index, TIMEOUT_S):
                raise _Over(f"round {index} never filled")
        return SimpleNamespace(
            store=dist.PrefixStore(f"round{index}", client),
            rank=workers.index(worker),
            world_size=len(workers),
        )

    def _open(self) -> list[int]:
        return self.rounds[self.index] if self.index < len(self.rounds) else []


class _FlippingLink:
    """A member's gloo group whose link flips one bit of every state sent over it: the last
    byte of the payload, the outer parameters' (state_format puts tensor bytes last)."""

    def __init__(self, pg) -> None:
        self.pg, self.sent = pg, []

    def send(self, tensors, pos, tag):
        if tag == STATE_TAG:
            t = tensors[0].clone()
            t[-1] ^= 1
            tensors = [t]
            self.sent.append(t)  # alive until the send is done
        return self.pg.send(tensors, pos, tag)

    def __getattr__(self, name: str):
        return getattr(self.pg, name)


class _Misfiling:
    """A world's store that writes `digest` (the donor's digest of another transfer) under the
    key of this transfer: a value meant for another round or pair, put in this one's place."""

    def __init__(self, store: dist.Store, key: str, digest: str) -> None:
        self.store, self.key, self.digest = store, key, digest

    def set(self, key: str, value) -> None:
        self.store.set(key, self.digest if key == self.key else value)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def _state(seed: int) -> dict:
    """A small worker state: model and outer parameters, and a field the digest does not cover."""
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    return {"model": model, "outer": {"outer": [torch.randn(15, generator=g)]}, "step": seed}


@dataclass
class _Attempt:
    world: ElasticWorld
    held: dict  # what the joiner holds afterwards
    seq: tuple[int, int, int]  # its counters afterwards
    outcome: object  # True (admitted) or the StateRefused


@dataclass
class _Run:
    port: int
    namespace: str  # each test's own keys in the module's store
    store: dist.Store  # the store under that namespace
    rdzv: _Rendezvous
    members: dict[int, ElasticWorld] = field(default_factory=dict)
    attempts: list[_Attempt] = field(default_factory=list)


@pytest.fixture(scope="module")
def master() -> dist.TCPStore:
    """One store for the module; each run keeps its keys under a namespace of its own."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _world(run: _Run, rank: int, incarnation: int) -> ElasticWorld:
    client = dist.TCPStore("127.0.0.1", run.port, is_master=False, timeout=timedelta(seconds=60))
    me = Identity("127.0.0.1", run.port, rank, W, incarnation, namespace=run.namespace)
    world = ElasticWorld(client, me, OPTIONS, timeout_s=TIMEOUT_S)
    world.heartbeat = SimpleNamespace(start=lambda: None)  # nobody here watches heartbeats
    world.exit = _exit
    rdzv = run.rdzv
    own = world.membership.client
    world.membership.handler = SimpleNamespace(
        next_rendezvous=lambda: rdzv.join(rank, own), num_nodes_waiting=lambda: 1
    )
    return world


def _exit(code: int) -> None:
    raise _Over(f"the worker exited with code {code}")


def _admission(world: ElasticWorld, seq: tuple[int, int, int]) -> Admission:
    """An Admission over the world, with the parts of the runtime it touches stubbed."""
    oplog = SimpleNamespace(
        world=world,
        seq=seq[0],
        finish_pending=lambda: None,
        settle=lambda old, why: None,
        stats=SimpleNamespace(recovery_s=0.0),
    )
    means = SimpleNamespace(seq=seq[2], joined_at={})
    return Admission(oplog, SimpleNamespace(seq=seq[1]), means, shard_link=None, logs=False)


def _member(run: _Run, rank: int, rounds: int, tweak) -> None:
    world = _world(run, rank, 1)
    run.members[rank] = world
    tweak(world)
    admission = _admission(world, SEQ[rank])
    world.rendezvous("start")
    for r in range(ROUND, ROUND + rounds):
        world.round = r
        admission.at_round_end(r, lambda: _state(rank))


def _joiner(run: _Run, attempts: int) -> None:
    for incarnation in range(2, 2 + attempts):
        world = _world(run, JOINER, incarnation)
        held = _state(100 + incarnation)
        admission = _admission(world, (0, 0, 0))

        def load(state: dict, held: dict = held) -> None:
            held.clear()
            held.update(state)

        try:
            outcome = admission.rejoin(load, lambda held=held: held)
        except StateRefused as e:  # the worker exits here and the launcher starts it again
            outcome = e
        seq = (admission.oplog.seq, admission.mix1.seq, admission.means.seq)
        run.attempts.append(_Attempt(world, held, seq, outcome))


def _admit(
    master: dist.TCPStore, attempts: int, tweak: Callable[[ElasticWorld], None], refused: list[int]
) -> _Run:
    """Members 0 and 1 start, then admit worker 2 at `attempts` round ends; `tweak` changes a
    member's world before it starts; `refused`: worker 2's refused donors before it asks."""
    namespace = f"test{next(RUNS)}"
    rdzv = _Rendezvous([[0, 1]] + [[0, 1, JOINER]] * attempts)  # the start, each admission
    run = _Run(master.port, namespace, dist.PrefixStore(namespace, master), rdzv)
    if refused:
        run.store.set(keys.refused_donors(JOINER), json.dumps(refused))
    errors: list[BaseException] = []

    def guarded(fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=guarded, args=(_member, run, r, attempts, tweak)) for r in (0, 1)
    ]
    threads.append(threading.Thread(target=guarded, args=(_joiner, run, attempts)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "an admission hung"
    return run


def _bits(state: dict) -> list[bytes]:
    tensors = [*state["model"].values(), *state["outer"]["outer"]]
    return [t.numpy().tobytes() for t in tensors] + [repr(state["step"]).encode()]


def _joined(world: ElasticWorld) -> list[dict]:
    return [e for e in world.events if e["event"] == "joined"]


def _bad_link(rank: int) -> Callable[[ElasticWorld], None]:
    """Member `rank`'s link flips a bit of every state it sends."""

    def tweak(world: ElasticWorld) -> None:
        if world.rank == rank:
            world._group = lambda rnd: _FlippingLink(ElasticWorld._group(world, rnd))

    return tweak


def test_a_refused_donor_is_skipped_and_the_next_one_admits_the_joiner(master):
    run = _admit(master, attempts=2, tweak=_bad_link(0), refused=[])
    first, second = run.attempts
    assert isinstance(first.outcome, StateRefused), first.outcome
    assert str(first.outcome).startswith("the state from donor 0 hashes to ")
    refused = first.world.events[-1]
    assert (refused["event"], refused["worker"], refused["donor"]) == ("refused", JOINER, 0)
    assert refused["reason"] == str(first.outcome)
    assert json.loads(run.store.get(keys.record(f"{JOINER}:2"))) == refused  # for worker 0's log
    # Every member picked the same donors from the joiner's rendezvous entries.
    for member in run.members.values():
        assert [e["donors"] for e in _joined(member)] == [[0], [1]]
    assert second.outcome is True
    rejoined = second.world.events[-1]
    assert (rejoined["event"], rejoined["donor"], rejoined["round"]) == ("rejoined", 1, ROUND + 1)
    # Worker 2 holds donor 1's state and counters, bit for bit.
    assert _bits(second.held) == _bits(_state(1)) and second.seq == SEQ[1]
    assert not run.store.check([keys.refused_donors(JOINER)])  # admitted: the list is forgotten


def test_the_donor_order_wraps_and_starts_over_once_every_member_was_refused(master):
    # Worker 2 had refused both members: the order starts over after the last one, 1, with 0
    # (which still sends a bad state), then goes on to 1.
    run = _admit(master, attempts=2, tweak=_bad_link(0), refused=[0, 1])
    first, second = run.attempts
    assert isinstance(first.outcome, StateRefused) and first.world.events[-1]["donor"] == 0
    for member in run.members.values():
        joined = _joined(member)
        assert [e["donors"] for e in joined] == [[0], [1]]
        assert joined[0]["started_over"] == [JOINER] and "started_over" not in joined[1]
    assert second.outcome is True and second.world.events[-1]["donor"] == 1
    assert _bits(second.held) == _bits(_state(1)) and second.seq == SEQ[1]


@pytest.mark.parametrize(
    "other",
    [(ROUND - 1, 0, JOINER), (ROUND, 1, JOINER), (ROUND, 0, 1)],
    ids=["another-round", "another-donor", "another-joiner"],
)
def test_a_digest_of_another_transfer_is_not_accepted(master, other):
    # Donor 0 sends its state intact, but the value under this transfer's key is its digest of
    # the same state and counters for another (round, donor, joiner).
    mine = (ROUND, 0, JOINER)
    assert keys.donor_digest(*other) != keys.donor_digest(*mine)
    state0 = _state(0)
    (honest,) = state_digests(state0, SEQ[0], [mine])
    (misfiled,) = state_digests(state0, SEQ[0], [other])

    def tweak(world: ElasticWorld) -> None:
        if world.rank == 0:
            world.store = _Misfiling(world.store, keys.donor_digest(*mine), misfiled)

    run = _admit(master, attempts=1, tweak=tweak, refused=[])
    (attempt,) = run.attempts
    assert _bits(attempt.held) == _bits(state0)  # the state itself arrived whole
    assert str(attempt.outcome) == (
        f"the state from donor 0 hashes to {honest}, its digest says {misfiled}"
    )
    assert run.store.get(keys.refused_donors(JOINER)) == b"[0]"  # next time: donor 1
