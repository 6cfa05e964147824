"""Per-round logging scalars through the store, so that no worker waits for them: each worker
sets its round's scalars, and worker 0 writes a round's record once every member's are in (at
the latest at a checkpoint or the end), averaged over the members that posted.

Once the store is lost for good (elastic_world.py, `guarded`), the last round end gathers every
member's recent scalars over gloo instead (`gather_recent`), and the rounds still waiting for their
means are averaged from those, exactly as from the store.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import torch

from frugaltrain.cluster import keys
from frugaltrain.comm.ft import heartbeat
from frugaltrain.comm.ft.operation_log import OpLog
from frugaltrain.comm.runtime import Means, MeansUnavailable

KEEP = 16  # rounds of its own scalars each worker keeps for `gather_recent`
POLL_S = 0.25  # how often a wait for scalars reads the heartbeats of the members not in yet


class StoreMeans:
    """`seq` counts the rounds of scalars this worker posted (equal on every member; a joiner
    takes its donor's); `joined_at` holds a (re)joined member's first one."""

    def __init__(self, oplog: OpLog) -> None:
        self.world, self.oplog = oplog.world, oplog
        self.seq = 0
        self.joined_at: dict[int, int] = {}
        self.recent: dict[int, list[float]] = {}  # this worker's last KEEP rounds of scalars
        self.table: dict[tuple[int, int], list[float]] | None = None  # (seq, member): scalars

    def post(self, values: list[float]) -> Means:
        """Post this worker's scalars of the round; the result (worker 0 writes the log)
        averages over the members that posted, and its `ready()` says whether they all have."""
        world = self.world
        k = self.seq
        self.seq += 1
        self.recent = {s: v for s, v in self.recent.items() if s > k - KEEP} | {k: list(values)}
        key = keys.metric(k, world.rank)
        world.guarded(lambda: world.store.set(key, json.dumps(list(values))), None)
        if world.rank != 0:  # only worker 0 logs
            return Means(lambda: list(values), lambda: True)
        expected = list(world.members)

        def due() -> list[int]:  # members that left since do not count, nor rejoined ones
            return [m for m in expected if m in world.members and self.joined_at.get(m, 0) <= k]

        def ready() -> bool:
            if self.table is not None:
                return True
            names = [keys.metric(k, m) for m in due()]
            return world.guarded(lambda: world.store.check(names), False)

        def read() -> list[list[float]]:
            names = [keys.metric(k, m) for m in due()]
            got = [json.loads(world.store.get(key)) for key in names if world.has(key)]
            for key in names:
                world.store.delete_key(key)
            return got

        def missing() -> list[int]:
            return world.guarded(lambda: [m for m in due() if not world.has(keys.metric(k, m))], [])

        def result() -> list[float]:
            if self.table is not None:
                got = [self.table[k, m] for m in due() if (k, m) in self.table]
                return np.mean(np.array(got, dtype=np.float64), axis=0).tolist()
            t0, silence = time.monotonic(), Silence(world)
            while not ready() and time.monotonic() - t0 < world.timeout_s:
                if world.guarded(world.is_broken, False):
                    self.oplog.recover("another worker reported a failure")
                if world.store_lost or silence.of_all(missing):
                    break
                time.sleep(0.01)
            got = world.guarded(read, None)
            if got is None:  # lost meanwhile: the last round end gathers them (gather_recent)
                raise MeansUnavailable(f"round scalars {k}: the run's store is gone")
            return np.mean(np.array(got, dtype=np.float64), axis=0).tolist()

        return Means(result, ready)

    def gather_recent(self) -> None:
        """Every member's last KEEP rounds of scalars, over gloo (one gather that every member
        posts at the same point), into `table`: the store is gone."""
        width = len(next(iter(self.recent.values())))
        rows = torch.full((KEEP, 1 + width), math.nan, dtype=torch.float64)
        for i, (s, v) in enumerate(sorted(self.recent.items())):
            rows[i, 0] = s
            rows[i, 1:] = torch.tensor(v, dtype=torch.float64)
        got = self.oplog.wait(self.oplog.post("gather", [rows]))
        self.table = {
            (int(r[0]), member): r[1:].tolist()
            for member, (t,) in got.items()
            for r in t
            if not math.isnan(r[0])
        }


class Silence:
    """Whether the members a wait for round scalars still lacks are all silent: their heartbeats
    have not moved for the heartbeat timeout (dead or cut off). Their scalars will not come, so
    the wait ends there instead of at run.timeout_s; the next blocking operation finds them
    and the members re-form. A live straggler's heartbeat moves, and it is waited for."""

    def __init__(self, world) -> None:
        self.world = world
        self.beats: dict[int, tuple[int, float]] = {}  # each one's last count and when it moved
        self.next_check = 0.0

    def of_all(self, missing) -> bool:
        """`missing()`: the members not in yet. Reads their heartbeats every POLL_S."""
        world, now = self.world, time.monotonic()
        if now < self.next_check:
            return False
        members = missing()
        counts = world.guarded(lambda: {m: heartbeat.beat_of(world.store, m) for m in members}, {})
        after = time.monotonic()
        self.next_check = after + POLL_S
        if not members or len(counts) < len(members):
            return False
        if after - now > world.hb_timeout_s / 2:  # reads held (the coordinator away, say):
            self.beats = {}  # nobody's beats could reach the store meanwhile
        silent = heartbeat.stopped(self.beats, counts, after, world.hb_timeout_s)
        return len(silent) == len(members)
