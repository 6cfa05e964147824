"""Fault injection on the real runtime: `fault_tolerance.inject` (or `frugaltrain train --inject`).

Specs are `;`-separated, each `kind:key=value,...`:

    kill:worker=2,round=5      SIGKILL worker 2 halfway through outer round 5 (1-based), once
    kill:worker=1,round=3,at=recovery
                               SIGKILL worker 1 as it starts recovering from a failure in round 3
                               or later, once (a second fault while the others re-form)
    hang:worker=1,round=3      worker 1 stops answering (SIGSTOP, heartbeats included) mid-round 3
    partition:worker=1,round=3,seconds=5
                               worker 1 is cut off mid-round 3 for 5 s: no heartbeat, no
                               rendezvous keep-alive, no message sent or taken, then it comes
                               back (its sockets stay open, as behind a partition that heals).
                               If the others have dropped it by then, it leaves and rejoins
    stall:worker=1,round=3,seconds=60
                               worker 1's training stops mid-round 3 for 60 s while its
                               heartbeats go on (stuck in a data loader, swapping): only the
                               adaptive deadline (fault_tolerance.deadline_factor) finds it
    slow:worker=1,factor=3     worker 1's inner steps take `factor` times their measured time
                               (it sleeps the difference; without worker=, every worker)
    slow:worker=1,seconds=0.2  worker 1 sleeps 0.2 s more after every inner step, however fast
                               the machine is (factor= and seconds= may be combined)
    drop:p=0.1                 each gossip message a worker receives is dropped with probability p
                               (deterministic by seed; the receiver renormalizes its row)
    corrupt:worker=1,round=3,value=1e30
                               everything worker 1 sends in round 3 (pseudo-gradients,
                               parameters) is garbage: value = nan, inf, 1e30 (finite but
                               absurd) or bitflip (the top exponent bit of one number flipped)

Faults are tied to steps and rounds, which only move forward: a restarted worker rejoins past the
fault that stopped it and meets only the ones scheduled later (so one worker can fail several
times in a run). A kill at=recovery fires only in a worker's first incarnation.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

_KEYS = {"kill": {"worker", "round", "at"}, "hang": {"worker", "round"}}
_KEYS["slow"] = {"worker", "factor", "seconds"}
_KEYS["drop"] = {"p"}
_KEYS["partition"] = {"worker", "round", "seconds"}
_KEYS["stall"] = {"worker", "round", "seconds"}
_KEYS["corrupt"] = {"worker", "round", "value"}
_ONCE = ("kill", "hang", "partition", "stall", "corrupt")  # faults that fire once, in one round
CORRUPTIONS = ("nan", "inf", "1e30", "bitflip")
WIRE_FAULTS = ("corrupt", "drop")  # act on what travels, not on a process: any runtime has them


@dataclass(frozen=True)
class Fault:
    kind: str
    worker: int = -1
    round: int = 0
    factor: float = 1.0
    p: float = 0.0
    seconds: float = 0.0
    value: str = ""
    at: str = ""  # kill only: "" (mid-round) or "recovery"


def parse(spec: str) -> list[Fault]:
    """Parse a `fault_tolerance.inject` string; ValueError names the bad part and the accepted
    form."""
    faults = []
    for part in filter(None, (s.strip() for s in spec.split(";"))):
        kind, _, args = part.partition(":")
        corruption, at = None, ""
        if kind not in _KEYS:
            raise ValueError(
                f"fault_tolerance.inject part {part!r}: unknown fault {kind!r}; use kill, hang, "
                "partition, stall, slow, drop or corrupt (e.g. 'kill:worker=2,round=5')"
            )
        values: dict[str, float] = {}
        for item in filter(None, (a.strip() for a in args.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key not in _KEYS[kind]:
                raise ValueError(
                    f"fault_tolerance.inject part {part!r}: expected keys {sorted(_KEYS[kind])} "
                    "as key=value"
                )
            if key == "value":
                if value not in CORRUPTIONS:
                    raise ValueError(
                        f"fault_tolerance.inject part {part!r}: value must be one of "
                        f"{', '.join(CORRUPTIONS)}"
                    )
                corruption = value
                continue
            if key == "at":
                if value not in ("step", "recovery"):
                    raise ValueError(
                        f"fault_tolerance.inject part {part!r}: at must be step or recovery"
                    )
                at = "" if value == "step" else value
                continue
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(
                    f"fault_tolerance.inject part {part!r}: {key} must be a number"
                ) from None
        given = set(values) | ({"value"} if corruption else set())
        if kind == "slow":
            if not {"factor", "seconds"} & given:
                raise ValueError(f"fault_tolerance.inject part {part!r}: needs factor= or seconds=")
        elif not _KEYS[kind] - {"at"} <= given:
            raise ValueError(f"fault_tolerance.inject part {part!r}: needs {sorted(_KEYS[kind])}")
        if kind == "drop" and not 0.0 <= values["p"] < 1.0:
            raise ValueError(f"fault_tolerance.inject part {part!r}: p must be in [0, 1)")
        if kind == "slow" and values.get("factor", 1.0) < 1.0:
            raise ValueError(f"fault_tolerance.inject part {part!r}: factor must be >= 1")
        if kind == "slow" and values.get("seconds", 0.0) < 0:
            raise ValueError(f"fault_tolerance.inject part {part!r}: seconds must be >= 0")
        if kind in ("partition", "stall") and values["seconds"] <= 0:
            raise ValueError(f"fault_tolerance.inject part {part!r}: seconds must be positive")
        if kind in _ONCE and values["round"] < 1:
            raise ValueError(f"fault_tolerance.inject part {part!r}: round counts from 1")
        faults.append(
            Fault(
                kind,
                worker=int(values.get("worker", -1)),
                round=int(values.get("round", 0)),
                factor=values.get("factor", 1.0),
                p=values.get("p", 0.0),
                seconds=values.get("seconds", 0.0),
                value=corruption if kind == "corrupt" else "",
                at=at,
            )
        )
    return faults


class Injector:
    """Applies the faults of one worker. `on_step` runs after every inner step."""

    def __init__(self, faults: list[Fault], rank: int, H: int, first_incarnation: bool, seed: int):
        mine = [f for f in faults if f.worker in (-1, rank)]
        self.H = H
        self.slow = max([f.factor for f in mine if f.kind == "slow"], default=1.0)
        self.drop_p = max([f.p for f in mine if f.kind == "drop"], default=0.0)
        self.slow_s = max([f.seconds for f in mine if f.kind == "slow"], default=0.0)
        self.partition_s = max([f.seconds for f in mine if f.kind == "partition"], default=0.0)
        self.stall_s = max([f.seconds for f in mine if f.kind == "stall"], default=0.0)
        # A fault "mid-round r" fires after step (r - 1) H + ceil(H / 2).
        self.stops = {}
        self.corrupt: dict[int, str] = {}  # round -> corruption of what this worker sends
        self.recovery_kill = 0  # die when recovering in this round or later (0: never)
        for f in mine:
            if f.kind == "corrupt":
                self.corrupt[f.round] = f.value
            elif f.at == "recovery":
                self.recovery_kill = f.round if first_incarnation else 0
            elif f.kind in _ONCE:
                self.stops[(f.round - 1) * H + (H + 1) // 2] = f.kind
        self.seed = seed

    def on_step(self, step: int, compute_s: float) -> str | None:
        """Sleep for a straggler; return "kill", "hang", "partition" or "stall" when it is due at
        `step`."""
        delay = (self.slow - 1.0) * compute_s + self.slow_s
        if delay > 0:
            time.sleep(delay)
        return self.stops.get(step)

    def dies_in_recovery(self, round_idx: int) -> bool:
        """Whether a recovery starting in round `round_idx` (1-based) is this worker's last."""
        return 0 < self.recovery_kill <= round_idx

    def dropped(self, epoch: int, seq: int, src: int, dst: int) -> bool:
        """Whether the message src -> dst of operation `seq` is lost (same answer on every run)."""
        if self.drop_p <= 0.0 or src == dst:
            return False
        import numpy as np  # here: the config (and the coordinator with it) imports this file

        rng = np.random.default_rng([self.seed, epoch, seq, src, dst, 0xD20])
        return bool(rng.random() < self.drop_p)


def corrupt_(tensors: list, value: str) -> None:
    """Overwrite `tensors` (in place) with the corruption `value` (CORRUPTIONS)."""
    import torch

    if value == "bitflip":  # the top exponent bit of the first number: x -> x * 2^128 or so
        first = next(t for t in tensors if t.numel())
        bits = first.detach().view(-1)[:1].view(torch.int32)
        bits.bitwise_xor_(1 << 30)
        return
    for t in tensors:
        t.fill_(float(value))


def fire(kind: str) -> None:
    """Kill or freeze this process (the injected fault, not an error path)."""
    sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
    os.kill(os.getpid(), sig)
