"""Worker 0 waits for every member's round scalars before it logs the round
(comm/ft/round_scalars.py). A member that died before posting them is not waited for until
run.timeout_s: once its heartbeat has stopped for the heartbeat timeout the wait ends, and the round
is averaged over those that posted. A live straggler, whose heartbeat moves, is waited for. The
clock is a fake one that moves only when the wait sleeps, so the test asserts when the wait ended on
it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from frugaltrain.cluster import keys
from frugaltrain.comm.ft import round_scalars
from frugaltrain.comm.ft.round_scalars import StoreMeans

HB_TIMEOUT_S = 3.0
TIMEOUT_S = 300.0


class Clock:
    """time.monotonic and time.sleep of round_scalars.py: time passes only in sleep."""

    def __init__(self) -> None:
        self.now = 0.0
        self.at: list[tuple[float, object]] = []  # (when, what happens then)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        while self.at and self.at[0][0] <= self.now:
            self.at.pop(0)[1]()


class Store:
    """A dict as the run's store; worker 1's heartbeat moves on every read while it lives."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.alive = True

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, names: list[str]) -> bool:
        return all(n in self.data for n in names)

    def get(self, key: str) -> bytes:
        if key == keys.heartbeat(1) and self.alive:
            self.data[key] = str(int(self.data[key]) + 1).encode()
        return self.data[key]

    def delete_key(self, key: str) -> None:
        self.data.pop(key, None)


def _worker0(store: Store) -> StoreMeans:
    world = SimpleNamespace(
        rank=0,
        members=[0, 1],
        store=store,
        timeout_s=TIMEOUT_S,
        hb_timeout_s=HB_TIMEOUT_S,
        store_lost=False,
        guarded=lambda call, default: call(),
        is_broken=lambda: False,
        has=lambda key: store.check([key]),
    )
    return StoreMeans(SimpleNamespace(world=world))


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(round_scalars, "time", fake)
    return fake


def test_a_member_dead_before_posting_is_given_up_after_the_heartbeat_timeout(clock):
    store = Store()
    store.set(keys.heartbeat(1), "7")
    clock.at.append((1.0, lambda: setattr(store, "alive", False)))  # worker 1 dies at 1 s
    got = _worker0(store).post([2.0, 4.0])()
    assert got == [2.0, 4.0]  # worker 0's own: worker 1 never posted
    # Its heartbeat was last seen to move at the last poll before 1 s: the wait ended a
    # heartbeat timeout after that poll, at the poll that followed (not at run.timeout_s).
    poll = round_scalars.POLL_S
    assert 1.0 - poll + HB_TIMEOUT_S < clock.now < 1.0 + HB_TIMEOUT_S + 2 * poll


def test_a_live_straggler_is_waited_for(clock):
    store = Store()
    store.set(keys.heartbeat(1), "7")
    late = lambda: store.set(keys.metric(0, 1), json.dumps([4.0, 8.0]))  # noqa: E731
    clock.at.append((20.0, late))  # alive all along, it posts at 20 s
    got = _worker0(store).post([2.0, 4.0])()
    assert got == [3.0, 6.0]
    assert 20.0 <= clock.now < 20.1
