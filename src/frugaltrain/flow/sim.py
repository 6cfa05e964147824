"""Discrete-event projection of the three modes from measured profiles. Output is SIMULATED.

Inputs are measured on this machine: per-sample encoder seconds (fitted, linear + quadratic in
visual tokens), per-micro-batch backbone seconds (the better of the two cost models), the
optimizer time per step, and the 1- vs 2-thread speed-ups. The simulator then replays the same
plans with P producers, C consumers and S slots per producer, modelling exactly the dependencies
the runtime enforces (frozen encoder):

  a producer encodes its samples in consume order, one at a time, and needs a free slot
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
    """Simulated throughput of sync or flow (frozen encoder) over `plans`."""
    P, C, K = producers, len(plans[0].rank_bins), len(plans)
    sync = mode == "sync"
    # Producer streams: (step, sample_id, consumer) in consume order, round-robin over producers.
    stream: list[list[tuple[int, int, int]]] = [[] for _ in range(P)]
    where: dict[int, tuple[int, int, int]] = {}  # sample_id -> (consumer, step, bin index)
    first_of_step: dict[tuple[int, int], int] = {}
    pos: dict[int, tuple[int, int]] = {}
    for k, pl in enumerate(plans):
        for i, (sid, c) in enumerate(pl.consume_order()):
            p = i % P
            first_of_step.setdefault((p, k), len(stream[p]))
            pos[sid] = (p, len(stream[p]))
            stream[p].append((k, sid, c))
        for c, bins in enumerate(pl.rank_bins):
            for b_i, b in enumerate(bins):
                for sid in b:
                    where[sid] = (c, k, b_i)

    def deps(n):
        kind = n[0]
        if kind == "ready":
            _, p, j = n
            k, sid, _ = stream[p][j]
            d = [("ready", p, j - 1)] if j else []
            if j >= slots:
                d.append(("release", p, j - slots))
            if sync and k and first_of_step.get((p, k)) == j:
                d.append(("handoff", k - 1))
            return d
        if kind == "release":  # flow: when its micro-batch is done; sync: at the handoff
            _, p, j = n
            c, k, b_i = where[stream[p][j][1]]
            return [("recv", c, k)] if sync else [("bin_end", c, k, b_i)]
        if kind == "bin_end":
            _, c, k, b_i = n
            prev = [("bin_end", c, k, b_i - 1)] if b_i else [("step_start", k)]
            if sync and b_i == 0:
                prev.append(("recv", c, k))
            return prev + [("ready", *pos[s]) for s in plans[k].rank_bins[c][b_i]]
        if kind == "step_start":
            return [("step_end", n[1] - 1)] if n[1] else []
        if kind == "step_end":
            k = n[1]
            return [
                ("bin_end", c, k, len(plans[k].rank_bins[c]) - 1)
                if plans[k].rank_bins[c]
                else ("step_start", k)
                for c in range(C)
            ]
        if kind == "recv":
            _, c, k = n
            return [("step_start", k)] + [
                ("ready", *pos[s]) for b in plans[k].rank_bins[c] for s in b
            ]
        if kind == "handoff":
            return [("recv", c, n[1]) for c in range(C)]
        raise AssertionError(n)

    def value(n, vals):
        t = max(vals, default=0.0)
        if n[0] == "ready":
            return t + enc_s(stream[n[1]][n[2]][1])
        if n[0] == "bin_end":
            return t + bin_s(plans[n[2]].rank_bins[n[1]][n[3]])
        if n[0] == "step_start" and n[1]:
            return t + optim_s
        return t

    memo = _evaluate([("step_end", k) for k in range(K)], deps, value)
    t0 = memo[("step_end", warmup_steps - 1)] if warmup_steps else 0.0
    t1 = memo[("step_end", K - 1)]
    measured = [k for k in range(warmup_steps, K)]
    n = sum(len(b) for k in measured for bins in plans[k].rank_bins for b in bins)
    busy_c = sum(bin_s(b) for k in measured for bins in plans[k].rank_bins for b in bins)
    busy_p = sum(enc_s(s) for k in measured for bins in plans[k].rank_bins for b in bins for s in b)
    return SimResult(n / (t1 - t0), busy_c / C / (t1 - t0), busy_p / P / (t1 - t0))


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
