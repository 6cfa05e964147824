"""Per-round logging scalars through the store, so that no worker waits for them: each worker
sets its round's scalars, and worker 0 writes a round's record once every member's are in (at
the latest at a checkpoint or the end), averaged over the members that posted."""

from __future__ import annotations

import json
import time

import numpy as np

from frugaltrain.comm.ft import keys
from frugaltrain.comm.ft.oplog import OpLog
from frugaltrain.comm.runtime import Means


class StoreMeans:
    """`seq` counts the rounds of scalars this worker posted (equal on every member; a joiner
    takes its donor's); `joined_at` holds a (re)joined member's first one."""

    def __init__(self, oplog: OpLog) -> None:
        self.world, self.oplog = oplog.world, oplog
        self.seq = 0
        self.joined_at: dict[int, int] = {}

    def post(self, values: list[float]) -> Means:
        """Post this worker's scalars of the round; the result (worker 0 writes the log)
        averages over the members that posted, and its `ready()` says whether they all have."""
        world = self.world
        k = self.seq
        self.seq += 1
        world.store.set(keys.metric(k, world.rank), json.dumps(list(values)))
        if world.rank != 0:  # only worker 0 logs
            return Means(lambda: list(values), lambda: True)
        expected = list(world.members)

        def due() -> list[str]:  # members that left since do not count, nor rejoined ones
            return [
                keys.metric(k, m)
                for m in expected
                if m in world.members and self.joined_at.get(m, 0) <= k
            ]

        def ready() -> bool:
            return world.store.check(due())

        def result() -> list[float]:
            t0 = time.monotonic()
            while not ready() and time.monotonic() - t0 < world.timeout_s:
                if world.is_broken():
                    self.oplog.recover("another worker reported a failure")
                time.sleep(0.01)
            got = [json.loads(world.store.get(key)) for key in due() if world.has(key)]
            for key in due():
                world.store.delete_key(key)
            return np.mean(np.array(got, dtype=np.float64), axis=0).tolist()

        return Means(result, ready)
