"""Heartbeats: a counter each member adds to in the store every PERIOD_S, from a thread of its
own. A member whose counter has not moved for the heartbeat timeout is silent (hung, stopped or
cut off); one whose counter moves is alive, however slow its training is. That is what tells a
straggler from a dead peer while an operation or a Mix1 message is late."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from frugaltrain.cluster import keys

PERIOD_S = 0.2


def timeout_of(timeout_s: float) -> float:
    """The heartbeat timeout: a quarter of run.timeout_s, within [1 s, 3 s] (long enough for a
    busy machine's scheduling hiccups, short next to any deadline)."""
    return max(1.0, min(3.0, timeout_s / 4))


def beat_of(store: dist.Store, member: int) -> int:
    """A member's heartbeat count (0 before its first beat)."""
    key = keys.heartbeat(member)
    return int(store.get(key)) if store.check([key]) else 0


def stopped(
    beats: dict[int, tuple[int, float]], counts: dict[int, int], now: float, hb_timeout_s: float
) -> list[int]:
    """The members of `counts` (heartbeat counts just read, at `now`) whose count has not moved
    for hb_timeout_s. `beats` holds each one's last count and when it moved, and is brought up
    to date; a member first seen now has just moved."""
    silent = []
    for member, count in counts.items():
        last = beats.get(member)
        if last is None or last[0] != count:
            beats[member] = (count, now)
        elif now - last[1] > hb_timeout_s:
            silent.append(member)
    return silent


class Heartbeat:
    """This worker's heartbeat thread, on a store client of its own (the worker's own client
    may be blocked in a long wait). It starts on becoming a member: a restarted worker waiting
    to rejoin must not look alive under its rank while the others decide who is left."""

    def __init__(self, host: str, port: int, rank: int, namespace: str = "") -> None:
        self._where = (host, port, namespace)
        self._key = keys.heartbeat(rank)
        self._stop = threading.Event()
        self._silent = threading.Event()  # a partition: alive, but no beat reaches the store
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def start(self) -> None:
        """Start beating (once; not after `stop`)."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def stop(self) -> None:
        """No more beats (the process is leaving, or stops answering)."""
        self._stop.set()

    def silence(self, on: bool) -> None:
        """While `on`, the thread runs but no beat reaches the store."""
        (self._silent.set if on else self._silent.clear)()

    def _beat(self) -> None:
        """Beat until stopped. A failed beat (the store away past this client's timeout, or
        its connection closed) opens a new client: a worker that goes on training must not
        fall silent for good because the coordinator was away once."""
        while not self._stop.is_set():
            try:
                self._beat_on(self._client())
            except Exception:
                self._stop.wait(1.0)

    def _client(self) -> dist.Store:
        host, port, namespace = self._where
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        return dist.PrefixStore(namespace, client) if namespace else client

    def _beat_on(self, client: dist.Store) -> None:
        while not self._stop.is_set():
            if not self._silent.is_set():
                client.add(self._key, 1)
            self._stop.wait(PERIOD_S)
