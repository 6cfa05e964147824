"""Emulated links (run.link_mbit): each worker's algorithm traffic paced in process to a rate.

A laptop's loopback moves a round's bytes in milliseconds, so the point of communicating less
does not show. A `Pacer` makes a worker's operations take as long as they would on a link of
R Mbit/s, without root and without touching the sockets: the transfer runs at full speed, and
`Handle.wait()` then sleeps until the link would have finished it.

The model, per worker:
    the link is one FIFO, full-duplex queue of R Mbit/s, of which a share p = PAYLOAD_SHARE
    carries payload. An operation posted at time t that sends S and receives V bytes (the
    algorithm's count, comm/base.py: ring all-reduce 2(M-1)/M of the payload, gathers (M-1)
    coded copies, ...) starts at max(t, end of the link's previous operation) and ends
    D = max(S, V) * 8 / (p * R * 1e6) seconds later. `wait()` returns no earlier than that
    end; the sleep counts as blocking time, as the real wait does. A non-blocking operation
    thus overlaps compute as on a slow link, and one waited on after its end sleeps nothing.

What it leaves out: latency, congestion, and the other members' links. A collective on real
links ends when its slowest member's part has arrived; here each worker waits on its own link
only, so a slow member's lateness reaches the others at their next operation with it (it posts
late), not in this one. The fault-tolerant runtime's deadlines see the real (fast) arrivals.
Figures of such a run are labelled "emulated"; final figures want shaped links (netlab).
"""

from __future__ import annotations

import time
from collections.abc import Callable

PAYLOAD_SHARE = 0.9
"""The share of a link's rate that carries a collective's payload: TCP/IP and Ethernet headers
and the transport's own messages take the rest. Measured on tc-shaped links of 14 and 28
Mbit/s: gloo's ring all-reduce got 89-91% of the rate, its pair exchange 92-95%
(docs/results/netlab.md, `benchmarks/results/link_probe.json`)."""


class Pacer:
    """One worker's emulated link (the module docstring's model).

    Args:
        mbit: the link's rate R, Mbit/s (> 0).
        payload_share: p, the share of R that carries payload (PAYLOAD_SHARE; tests pass 1).
        clock: seconds, monotonic (time.perf_counter; tests pass a fake one).
        sleep: sleeps the given seconds (time.sleep; tests pass one that moves the fake clock).
    """

    def __init__(
        self,
        mbit: float,
        payload_share: float = PAYLOAD_SHARE,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if mbit <= 0:
            raise ValueError(f"an emulated link's rate must be > 0 Mbit/s, got {mbit}")
        self.mbit = mbit
        self.payload_bps = payload_share * mbit * 1e6
        self.clock = clock
        self._sleep = sleep
        self._free_at = float("-inf")  # when the link finishes the last operation queued on it

    def post(self, sent: int, received: int) -> float:
        """Queue an operation posted now that moves `sent` and `received` bytes; returns the
        time (on `clock`) at which the link has finished it."""
        start = max(self.clock(), self._free_at)
        self._free_at = start + max(sent, received) * 8 / self.payload_bps
        return self._free_at

    def sleep_until(self, t: float) -> None:
        """Sleep out what is left until `t` (nothing if it has passed)."""
        left = t - self.clock()
        if left > 0:
            self._sleep(left)


def pacer_of(link_mbit: list[float], worker: int, shards: int = 1) -> Pacer | None:
    """Worker `worker`'s pacer under run.link_mbit (None: links as they are). With run.shards
    = S each of a replica's S processes moves 1/S of its outer traffic over the replica's one
    link, at the same time as the others: each gets R / S."""
    if not link_mbit:
        return None
    rate = link_mbit[0] if len(link_mbit) == 1 else link_mbit[worker]
    return Pacer(rate / shards)


def links_label(link_mbit: list[float]) -> str:
    """What a run's records, summary and plots say of its links, e.g. "emulated 20 Mbit/s" or
    "emulated 20,20,20,5 Mbit/s" (one rate per worker)."""
    return f"emulated {','.join(f'{r:g}' for r in link_mbit)} Mbit/s"
