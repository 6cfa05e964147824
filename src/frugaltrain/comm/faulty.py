"""Fault injection as a layer around any runtime: the plain one, the fault-tolerant one and the
simulator's comms inject the same faults the same way (frugaltrain/inject.py parses
`fault_tolerance.inject` and decides when each fault is due; this makes it happen).

    FaultyWire      the comm's wire (comm/base.py `Wire`): what this worker sends in a corrupt
                    round is garbage, and each gossip message it receives may be lost (the same
                    decision on every run: `Injector.dropped`).
    FaultyRuntime   the runtime around the loop: after every inner step a straggler sleeps,
                    and a kill, hang, partition or stall happens when it is due; a kill at
                    recovery fires as this worker starts recovering.

The launcher puts the layer on (train/supervisor.py; the simulator puts FaultyWire on its
virtual workers' comms, sim/engine.py); a runtime holds no fault logic, only what a fault needs
to act like a real one (Runtime.silence, stop_heartbeat, at_recovery: the fault-tolerant
runtime's stop its heartbeat and rendezvous keep-alive; the plain runtime has neither, so there
a silent worker is only late, and a killed one ends the run).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from frugaltrain.comm.base import Wire
from frugaltrain.comm.ft import heartbeat
from frugaltrain.comm.runtime import Means, RoundEnd, Runtime, StateFn
from frugaltrain.inject import Injector, corrupt_, fire


class FaultyWire(Wire):
    """Worker `rank`'s wire under `injector`; `round_of` says the last finished round."""

    def __init__(self, injector: Injector, rank: int, round_of: Callable[[], int]) -> None:
        self.injector, self.rank, self.round_of = injector, rank, round_of
        self.dropped = 0  # messages lost so far

    def outgoing(self, tensors: list[torch.Tensor]) -> None:
        """An injected corruption: everything this worker sends in that round is garbage."""
        round_idx = self.round_of() + 1
        value = self.injector.corrupt.get(round_idx)
        if value:
            print(f"[worker {self.rank} round {round_idx}] injected fault: corrupt {value}")
            corrupt_(tensors, value)

    def received(self, seq: int, sender: int, receiver: int) -> bool:
        if self.injector.dropped(0, seq, sender, receiver):
            self.dropped += 1
            return False
        return True


class FaultyRuntime(Runtime):
    """`runtime` with `injector`'s faults; everything else is the runtime's own."""

    def __init__(self, runtime: Runtime, injector: Injector) -> None:
        super().__init__(runtime.comm)
        self.runtime, self.injector = runtime, injector
        self.rank = runtime.comm.rank
        runtime.comm.wire = FaultyWire(injector, self.rank, lambda: runtime.round)
        runtime.at_recovery(self._recovering)

    def on_step(self, step: int, compute_s: float) -> None:
        """After each inner step: injected straggling, then a kill, hang, partition or stall
        when one is due."""
        self.runtime.on_step(step, compute_s)
        fault = self.injector.on_step(step, compute_s)
        if fault is None:
            return
        print(f"[worker {self.rank} step {step}] injected fault: {fault}", flush=True)
        if fault == "partition":  # silent, alive, sockets open; then back
            self.runtime.silence(True)
            time.sleep(self.injector.partition_s)
            self.runtime.silence(False)
            print(f"[worker {self.rank} step {step}] partition healed", flush=True)
            return
        if fault == "stall":  # heartbeats go on: only the adaptive deadline sees it
            time.sleep(self.injector.stall_s)
            print(f"[worker {self.rank} step {step}] stall over", flush=True)
            return
        if fault == "hang":
            self.runtime.stop_heartbeat()  # heartbeats stop with the process
            time.sleep(2 * heartbeat.PERIOD_S)
        fire(fault)

    def _recovering(self) -> None:
        """A kill at=recovery: die while the others re-form."""
        round_idx = self.runtime.round + 1
        if self.injector.dies_in_recovery(round_idx):
            print(f"[worker {self.rank} round {round_idx}] injected fault: kill", flush=True)
            fire("kill")

    # ---- the rest is the runtime's
    @property
    def stopping(self) -> bool:
        return self.runtime.stopping

    def metric_mean(self, values: list[float]) -> list[float]:
        return self.runtime.metric_mean(values)

    def metric_mean_async(self, values: list[float]) -> Means:
        return self.runtime.metric_mean_async(values)

    def metric_max(self, values: list[float]) -> list[float]:
        return self.runtime.metric_max(values)

    def metric_mean_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.runtime.metric_mean_tensors(tensors)

    def barrier(self) -> None:
        self.runtime.barrier()

    def end_round(
        self, round_idx: int, scalars: list[float], close: Callable[[RoundEnd], StateFn]
    ) -> list[dict]:
        return self.runtime.end_round(round_idx, scalars, close)

    def rejoin(self, load: Callable[[dict], None], state_fn: StateFn) -> bool:
        return self.runtime.rejoin(load, state_fn)

    def writes_metrics(self, worker: int, shard: int) -> bool:
        return self.runtime.writes_metrics(worker, shard)

    def writes_markers(self, local_rank: int) -> bool:
        return self.runtime.writes_markers(local_rank)
