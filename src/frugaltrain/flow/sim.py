"""Discrete-event projection of the three modes from measured profiles. Output is SIMULATED.

Inputs are measured on this machine: encoder seconds per call (fitted on the warm-up profile's
calls; `charge_calls` puts a call's time on its first sample), per-micro-batch backbone seconds
(the better of the two cost models), the optimizer time per step, and the 1- vs 2-thread
speed-ups. The simulator then replays the same plans with P producers, C consumers and S slots
per producer, modelling exactly the dependencies the runtime enforces (frozen encoder):

  a producer runs its encoder calls in consume order and needs a free slot per sample
  (sample j waits for the release of sample j - S); a consumer runs its micro-batches in order,
  each when its samples are ready; all consumers meet at the step barrier (all-reduce + step);
  sync mode additionally waits for the whole batch before compute and for the handoff before
  the producer may start the next batch.

It ignores IPC cost, contention for memory bandwidth and oversubscription, which is why it is
validated against the real 2-worker runs before any projection is shown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from frugaltrain.flow.packing import BatchPlan


@dataclass
class SimResult:
    samples_per_s: float
    """simulated."""
    consumer_busy_frac: float
    """simulated: mean over consumers of compute / window."""
    producer_busy_frac: float
    """simulated: mean over producers of compute / window."""


def _evaluate(roots, deps: Callable, value: Callable) -> dict:
    """Memoised DAG evaluation with an explicit stack (no recursion limit at large scale)."""
    memo: dict = {}
    for root in roots:
        stack, on = [root], {root}
        while stack:
            n = stack[-1]
            if n in memo:
                stack.pop()
                on.discard(n)
                continue
            ds = deps(n)
            missing = next((d for d in ds if d not in memo), None)
            if missing is not None:  # one at a time, so the stack is the DFS path
                if missing in on:
                    raise RuntimeError(f"simulated deadlock at {missing}: raise pool.slots")
                on.add(missing)
                stack.append(missing)
            else:
                memo[n] = value(n, [memo[d] for d in ds])
                stack.pop()
                on.discard(n)
    return memo


@dataclass
class _Streams:
    """Where every sample sits in its producer's stream and in its consumer's micro-batches."""

    stream: list[list[tuple[int, int, int]]]
    """per producer: (step, sample_id, consumer) in consume order (its encoder calls)."""
    pos: dict[int, tuple[int, int]]
    """sample_id -> (producer, position in its stream)."""
    where: dict[int, tuple[int, int, int]]
    """sample_id -> (consumer, step, micro-batch index)."""
    first_of_step: dict[tuple[int, int], int]
    """(producer, step) -> position of the producer's first sample of that step."""


def charge_calls(
    plans: list[BatchPlan], call_s: Callable[[list[int]], float]
) -> Callable[[int], float]:
    """Per-sample encoder seconds from per-call seconds: a call's whole time on its first
    sample and 0 on the others, so its samples become ready together, when the call ends."""
    charged = {
        sids[i]: call_s(sids) if i == 0 else 0.0
        for pl in plans
        for sids, _ in pl.encoder_batches()
        for i in range(len(sids))
    }
    return charged.__getitem__


def _streams(plans: list[BatchPlan], P: int) -> _Streams:
    st = _Streams(stream=[[] for _ in range(P)], pos={}, where={}, first_of_step={})
    for k, pl in enumerate(plans):
        for b, (sids, c) in enumerate(pl.encoder_batches()):
            p = b % P  # encoder calls are dealt to producers round robin, as in the runtime
            for sid in sids:
                st.first_of_step.setdefault((p, k), len(st.stream[p]))
                st.pos[sid] = (p, len(st.stream[p]))
                st.stream[p].append((k, sid, c))
        for c, bins in enumerate(pl.rank_bins):
            for b_i, b in enumerate(bins):
                for sid in b:
                    st.where[sid] = (c, k, b_i)
    return st


@dataclass(eq=False)
class _Graph:
    """The dependency DAG of one simulated run; a node's value is the time it happens.

    ("ready", p, j)         producer p has encoded the j-th sample of its stream
    ("release", p, j)       that sample's slot is free again
    ("bin_end", c, k, i)    consumer c has run micro-batch i of step k
    ("step_start", k)       the step barrier before step k is passed (optimizer step done)
    ("step_end", k)         every consumer has run all of step k's micro-batches
    ("recv", c, k)          sync: consumer c holds all of its samples of step k
    ("handoff", k)          sync: every consumer holds batch k
    """

    plans: list[BatchPlan]
    st: _Streams
    sync: bool
    slots: int
    enc_s: Callable[[int], float]
    bin_s: Callable[[list[int]], float]
    optim_s: float

    def __post_init__(self) -> None:
        self.C = len(self.plans[0].rank_bins)
        self._deps = {
            "ready": self._ready,
            "release": self._release,
            "bin_end": self._bin_end,
            "step_start": self._step_start,
            "step_end": self._step_end,
            "recv": self._recv,
            "handoff": self._handoff,
        }

    def deps(self, n: tuple) -> list[tuple]:
        return self._deps[n[0]](*n[1:])

    def value(self, n: tuple, vals: list[float]) -> float:
        t = max(vals, default=0.0)
        if n[0] == "ready":
            return t + self.enc_s(self.st.stream[n[1]][n[2]][1])
        if n[0] == "bin_end":
            return t + self.bin_s(self.plans[n[2]].rank_bins[n[1]][n[3]])
        if n[0] == "step_start" and n[1]:
            return t + self.optim_s
        return t

    def _ready(self, p: int, j: int) -> list[tuple]:
        k = self.st.stream[p][j][0]
        d = [("ready", p, j - 1)] if j else []
        if j >= self.slots:
            d.append(("release", p, j - self.slots))
        if self.sync and k and self.st.first_of_step.get((p, k)) == j:
            d.append(("handoff", k - 1))
        return d

    def _release(self, p: int, j: int) -> list[tuple]:
        """Flow: when its micro-batch is done; sync: at the handoff."""
        c, k, b_i = self.st.where[self.st.stream[p][j][1]]
        return [("recv", c, k)] if self.sync else [("bin_end", c, k, b_i)]

    def _bin_end(self, c: int, k: int, b_i: int) -> list[tuple]:
        prev = [("bin_end", c, k, b_i - 1)] if b_i else [("step_start", k)]
        if self.sync and b_i == 0:
            prev.append(("recv", c, k))
        return prev + [("ready", *self.st.pos[s]) for s in self.plans[k].rank_bins[c][b_i]]

    def _step_start(self, k: int) -> list[tuple]:
        return [("step_end", k - 1)] if k else []

    def _step_end(self, k: int) -> list[tuple]:
        bins = self.plans[k].rank_bins
        return [
            ("bin_end", c, k, len(bins[c]) - 1) if bins[c] else ("step_start", k)
            for c in range(self.C)
        ]

    def _recv(self, c: int, k: int) -> list[tuple]:
        mine = [s for b in self.plans[k].rank_bins[c] for s in b]
        return [("step_start", k)] + [("ready", *self.st.pos[s]) for s in mine]

    def _handoff(self, k: int) -> list[tuple]:
        return [("recv", c, k) for c in range(self.C)]


def simulate(
    plans: list[BatchPlan],
    *,
    mode: str,
    producers: int,
    slots: int,
    enc_s: Callable[[int], float],
    bin_s: Callable[[list[int]], float],
    optim_s: float,
    warmup_steps: int,
) -> SimResult:
    """Simulated throughput of sync or flow (frozen encoder) over `plans`.

    Args:
        slots: S, slots per producer.
        enc_s: encoder seconds charged to one sample, by sample id (see `charge_calls`).
        bin_s: backbone seconds of one micro-batch (a list of sample ids).
        optim_s: all-reduce + optimizer step seconds per step.
    """
    g = _Graph(
        plans=plans,
        st=_streams(plans, producers),
        sync=mode == "sync",
        slots=slots,
        enc_s=enc_s,
        bin_s=bin_s,
        optim_s=optim_s,
    )
    K = len(plans)
    memo = _evaluate([("step_end", k) for k in range(K)], g.deps, g.value)
    t0 = memo[("step_end", warmup_steps - 1)] if warmup_steps else 0.0
    wall = memo[("step_end", K - 1)] - t0
    bins = [b for pl in plans[warmup_steps:] for rank in pl.rank_bins for b in rank]
    n = sum(len(b) for b in bins)
    busy_c = sum(bin_s(b) for b in bins)
    busy_p = sum(enc_s(s) for b in bins for s in b)
    return SimResult(n / wall, busy_c / g.C / wall, busy_p / producers / wall)


def simulate_monolithic(
    plans: list[BatchPlan],
    *,
    enc_s: Callable[[int], float],
    bin_s: Callable[[list[int]], float],
    optim_s: float,
    replicas: int = 1,
    warmup_steps: int = 0,
) -> SimResult:
    """Lockstep: per step, encoder then backbone on each replica's share, then the step.
    With replicas > 1 the bins are dealt to replicas as the plan deals them to consumers."""
    total = 0.0
    n = 0
    for k, pl in enumerate(plans):
        if k < warmup_steps:
            continue
        per = [0.0] * replicas
        for c, bins in enumerate(pl.rank_bins):
            for b in bins:
                per[c % replicas] += bin_s(b) + sum(enc_s(s) for s in b)
                n += len(b)
        total += max(per) + optim_s
    return SimResult(n / total, 1.0, 1.0)
