"""Bad contributions kept out of every exchange: a robust-aggregation guard.

Before pseudo-gradients or parameters are averaged or mixed, the members share the norms of
their contributions (one small collective of one number per member; the same list everywhere)
and all apply the same rule (`verdict`):

    non-finite (nan, inf)        always rejected
    norm > factor x median       rejected (action "reject", the default) or scaled down to
                                 factor x median (action "clip"); the median is over the
                                 finite norms, so one bad worker of three cannot move it

A rejected contribution is left out: an average divides by the accepted count, a gossip row is
renormalized over the accepted members in it, and the rejected worker itself takes its accepted
peers' values instead of its own (resynchronized from them). Everyone logs it
(`"kind": "rejected"` in metrics.jsonl). With one worker there is nothing to compare with and
nothing is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def guard_of(run) -> Guard:
    """The guard a run's [run] section asks for (run.guard, run.guard_factor)."""
    return Guard(action=run.guard, factor=run.guard_factor)


@dataclass(frozen=True)
class Guard:
    """action: reject, clip or off (off still rejects non-finite contributions); factor: the
    multiple of the median norm above which a contribution is an outlier."""

    action: str = "reject"
    factor: float = 10.0


@dataclass
class Verdict:
    accepted: np.ndarray  # bool per member position
    scale: np.ndarray  # multiplier per member position (clip), 1 otherwise
    norms: np.ndarray
    median: float
    rejected: list[int] = field(default_factory=list)  # member positions
    clipped: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.rejected and not self.clipped


def norm_of(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of a contribution in fp64; inf if any value is not finite."""
    total = sum(t.detach().double().pow(2).sum().item() for t in tensors)
    return float(np.sqrt(total)) if np.isfinite(total) else float("inf")


def verdict(norms: np.ndarray, guard: Guard) -> Verdict:
    """The same decision on every member from the same list of norms."""
    finite = np.isfinite(norms)
    median = float(np.median(norms[finite])) if finite.any() else float("nan")
    limit = guard.factor * median
    outlier = np.zeros(len(norms), dtype=bool)
    if guard.action != "off" and median > 0:
        outlier = finite & (norms > limit)
    accepted = finite & ~outlier if guard.action == "reject" else finite.copy()
    scale = np.ones(len(norms))
    if guard.action == "clip":
        scale[outlier] = limit / norms[outlier]
    return Verdict(
        accepted=accepted,
        scale=scale,
        norms=norms,
        median=median,
        rejected=[int(i) for i in np.flatnonzero(~accepted)],
        clipped=[int(i) for i in np.flatnonzero(outlier)] if guard.action == "clip" else [],
    )


def guarded_weights(w: np.ndarray, v: Verdict) -> np.ndarray:
    """Mixing weights without the rejected members: their columns are zeroed and each row
    renormalized over what is left (a row left empty keeps only its own entry)."""
    out = w * v.accepted[None, :]
    for i, row in enumerate(out):
        total = row.sum()
        if total > 0:
            out[i] = row / total
        else:
            out[i] = 0.0
            out[i, i] = 1.0
    return out


class ContributionGuard:
    """The guard as a part of a Comm: it judges contributions by their norms (`verdict`),
    remembers whether this worker's own was rejected (a strategy then drops what it kept from
    it) and keeps the records for worker 0's log (`"kind": "rejected"`).

    rule: the run's Guard. replica: with run.shards > 1, the other shards of this worker's
    replica (comm/replica_shards.py): norms are then of the replica's whole contribution, so
    every shard group reaches the same verdict."""

    def __init__(self, rule: Guard, replica=None) -> None:
        self.rule = rule
        self.replica = replica
        self.records: list[dict] = []
        self._rejected_self = False

    def norm(self, tensors: list[torch.Tensor]) -> float:
        """The norm judged for this worker's contribution `tensors`."""
        return norm_of(tensors) if self.replica is None else self.replica.norm(tensors)

    def norms(self, flats: list[torch.Tensor]) -> list[float]:
        """The norms judged for contributions that arrived, one flat tensor each."""
        if self.replica is None:
            return [norm_of([f]) for f in flats]
        return self.replica.norms(flats)

    def judge(self, norms: np.ndarray, workers: list[int], own: int) -> Verdict:
        """The verdict on `norms`, the contributions of `workers` (this worker's at index
        `own`), recorded unless clean."""
        v = verdict(norms, self.rule)
        if not v.clean:
            self._rejected_self |= own in v.rejected
            self.records.append(
                {
                    "kind": "rejected",
                    "workers": [workers[i] for i in v.rejected + v.clipped],
                    "action": "clip" if v.clipped else "reject",
                    "norms": [float(x) for x in v.norms],
                    "median": v.median,
                    "factor": self.rule.factor,
                }
            )
        return v

    def take_rejection(self) -> bool:
        """Whether this worker's own contribution was rejected since the last call."""
        rejected, self._rejected_self = self._rejected_self, False
        return rejected

    def drain(self) -> list[dict]:
        """The records since the last call."""
        out, self.records = self.records, []
        return out
