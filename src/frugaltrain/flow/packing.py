"""Packing scheduler: best-fit decreasing with a segment tree, cost models, dispatch to ranks.

FlowTrain (arXiv 2606.23087, Alg. 1) packs ready samples into micro-batches of capacity L with
best-fit, costs a micro-batch B as Cost(B) = sum(l)/L + l_max^2/L^2, and deals micro-batches to
data-parallel ranks in zig-zag (snake) order. We also fit
t = a*sum(l) + b*sum(l^2) + c*l_max^2 + e*sum(l)^2 + d to measured micro-batch times (non-negative
least squares) and report which model predicts held-out micro-batches better.

Packing is batch-closed: a global batch's samples are packed among themselves, and its loss is
normalised by its target count, so the plan changes the schedule, never the result.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np


class _SegmentTree:
    """Max over leaves 1..L; leaf s holds s when some open bin has exactly s tokens free."""

    def __init__(self, L: int) -> None:
        self.size = 1
        while self.size < L + 1:
            self.size *= 2
        self.tree = [0] * (2 * self.size)

    def set(self, s: int, on: bool) -> None:
        i = s + self.size
        self.tree[i] = s if on else 0
        while i > 1:
            i //= 2
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def smallest_at_least(self, need: int) -> int:
        """Smallest free space >= need in O(log L), or 0 if none."""
        if self.tree[1] < need:
            return 0
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= need else 2 * i + 1
        return self.tree[i]


def pack_bfd(lengths: dict[int, int], L: int) -> list[list[int]]:
    """Best-fit decreasing: each sample (longest first) goes to the open bin it fills the most."""
    too_long = {i: n for i, n in lengths.items() if n > L}
    if too_long:
        raise ValueError(
            f"sched.capacity = {L}: samples {too_long} are longer; raise sched.capacity"
        )
    tree, by_space = _SegmentTree(L), defaultdict(deque)
    bins: list[list[int]] = []
    free: list[int] = []
    for sid in sorted(lengths, key=lambda i: (-lengths[i], i)):
        n = lengths[sid]
        s = tree.smallest_at_least(n)
        if s == 0:
            bins.append([])
            free.append(L)
            b = len(bins) - 1
        else:
            b = by_space[s].popleft()
            if not by_space[s]:
                tree.set(s, False)
        bins[b].append(sid)
        free[b] -= n
        if free[b] > 0:
            by_space[free[b]].append(b)
            tree.set(free[b], True)
    return bins


def pack_bfd_naive(lengths: dict[int, int], L: int) -> list[list[int]]:
    """O(n * bins) reference best-fit decreasing, for tests."""
    bins: list[list[int]] = []
    free: list[int] = []
    for sid in sorted(lengths, key=lambda i: (-lengths[i], i)):
        n = lengths[sid]
        fits = [b for b in range(len(bins)) if free[b] >= n]
        if not fits:
            bins.append([])
            free.append(L)
            fits = [len(bins) - 1]
        b = min(fits, key=lambda j: free[j])
        bins[b].append(sid)
        free[b] -= n
    return bins


def pack_fifo(lengths: dict[int, int], L: int) -> list[list[int]]:
    """Next-fit in sample order: the no-scheduler baseline."""
    bins: list[list[int]] = [[]]
    used = 0
    for sid in sorted(lengths):
        if used + lengths[sid] > L and bins[-1]:
            bins.append([])
            used = 0
        bins[-1].append(sid)
        used += lengths[sid]
    return bins


# ------------------------------------------------------------------- cost models


def features(bin_lengths: list[int]) -> np.ndarray:
    """[sum(l), sum(l^2), l_max^2, sum(l)^2, 1] of one micro-batch. sum(l)^2 is there because
    our CPU attention is dense with a block-diagonal mask, so it pays for the whole T x T."""
    a = np.asarray(bin_lengths, dtype=np.float64)
    return np.array([a.sum(), (a**2).sum(), a.max() ** 2, a.sum() ** 2, 1.0])


def paper_cost(bin_lengths: list[int], L: int) -> float:
    """FlowTrain's Cost(B) = sum(l)/L + l_max^2/L^2 (dimensionless)."""
    return sum(bin_lengths) / L + max(bin_lengths) ** 2 / L**2


@dataclass
class CostFit:
    """Both cost models fitted on measured micro-batch seconds, scored on held-out micro-batches."""

    coef: list[float]
    """Fitted model: seconds = coef . [sum(l), sum(l^2), l_max^2, sum(l)^2, 1]."""
    paper_scale: list[float]
    """Paper model mapped to seconds: seconds = a * Cost(B) + b."""
    r2: dict[str, float]
    mape: dict[str, float]
    best: str

    def seconds(self, bin_lengths: list[int], L: int, model: str | None = None) -> float:
        if (model or self.best) == "fitted":
            return float(features(bin_lengths) @ np.asarray(self.coef))
        a, b = self.paper_scale
        return a * paper_cost(bin_lengths, L) + b


def fit_cost(
    bins: list[list[int]], seconds: list[float], L: int, holdout: float = 0.3, seed: int = 0
) -> CostFit:
    """NNLS fit of the feature model and a least-squares scale of the paper model."""
    from scipy.optimize import nnls

    X = np.stack([features(b) for b in bins])
    P = np.array([[paper_cost(b, L), 1.0] for b in bins])
    y = np.asarray(seconds)
    idx = np.random.default_rng(seed).permutation(len(y))
    n_test = max(1, int(len(y) * holdout))
    test, train = idx[:n_test], idx[n_test:]
    scale = X[train].max(axis=0)  # column scaling keeps NNLS well conditioned
    coef = nnls(X[train] / scale, y[train])[0] / scale
    paper = np.linalg.lstsq(P[train], y[train], rcond=None)[0]
    pred = {"fitted": X[test] @ coef, "paper": P[test] @ paper}
    r2, mape = {}, {}
    for k, p in pred.items():
        ss = ((y[test] - y[test].mean()) ** 2).sum()
        r2[k] = float(1 - ((y[test] - p) ** 2).sum() / ss) if ss > 0 else float("nan")
        mape[k] = float(np.mean(np.abs(p - y[test]) / y[test]))
    best = "fitted" if mape["fitted"] <= mape["paper"] else "paper"
    return CostFit(coef.tolist(), paper.tolist(), r2, mape, best)


# ------------------------------------------------------------------- dispatch


def dispatch(costs: list[float], ranks: int, how: str) -> list[list[int]]:
    """Micro-batch indices per rank. snake: sort by cost, deal 0..r-1, r-1..0, ...; lpt: each to
    the least-loaded rank; round_robin: in order. Each rank's list is in dealing order."""
    out: list[list[int]] = [[] for _ in range(ranks)]
    if how == "round_robin":
        for j in range(len(costs)):
            out[j % ranks].append(j)
        return out
    order = sorted(range(len(costs)), key=lambda j: (-costs[j], j))
    if how == "snake":
        for k, j in enumerate(order):
            lap, r = divmod(k, ranks)
            out[r if lap % 2 == 0 else ranks - 1 - r].append(j)
        return out
    if how == "lpt":
        load = [0.0] * ranks
        for j in order:
            r = min(range(ranks), key=lambda i: (load[i], i))
            out[r].append(j)
            load[r] += costs[j]
        return out
    raise ValueError(f"sched.dispatch = {how!r}: choose snake, lpt or round_robin")


@dataclass
class BatchPlan:
    """One global batch's schedule: rank_bins[r][j] = sample ids of rank r's j-th micro-batch.

    The encoder runs on batches the plan sizes: each micro-batch's samples of one visual shape
    (equal n_visual) form one encoder call, and calls are dealt to producers round robin.
    """

    step: int
    rank_bins: list[list[list[int]]]
    costs: list[list[float]]
    visual: dict[int, int] = field(default_factory=dict)
    """sample id -> visual tokens; empty: every sample is an encoder call of its own."""

    def _waves(self) -> Iterator[tuple[int, int, list[int]]]:
        """(wave j, rank r, micro-batch): micro-batch j of every rank before micro-batch j+1."""
        for j in range(max(len(b) for b in self.rank_bins)):
            for r, bins in enumerate(self.rank_bins):
                if j < len(bins):
                    yield j, r, bins[j]

    def consume_order(self) -> list[tuple[int, int]]:
        """(sample_id, rank) in the order the backbone ranks will need them (micro-batch j of
        every rank before micro-batch j+1); producers emit in this order."""
        return [(sid, r) for _, r, b in self._waves() for sid in b]

    def _calls(self) -> Iterator[tuple[int, int, list[int]]]:
        """(wave, rank, sample ids) of every encoder call, in consume order."""
        for j, r, b in self._waves():
            if not self.visual:
                yield from ((j, r, [sid]) for sid in b)
                continue
            run = [b[0]]
            for sid in b[1:]:  # the bin is ordered so that each shape's samples are contiguous
                if self.visual[sid] != self.visual[run[0]]:
                    yield j, r, run
                    run = []
                run.append(sid)
            yield j, r, run

    def encoder_batches(self) -> list[tuple[list[int], int]]:
        """(sample ids, destination rank) of every encoder call in consume order; producer p
        runs calls p, p + P, p + 2P, ..."""
        return [(sids, r) for _, r, sids in self._calls()]

    def owners(self, producers: int) -> dict[int, int]:
        """sample id -> the producer that encodes it."""
        return {
            sid: b % producers for b, (sids, _) in enumerate(self.encoder_batches()) for sid in sids
        }

    def wave_shares(self, producers: int) -> list[list[int]]:
        """Samples each producer encodes for each wave: [wave][producer]."""
        shares: list[list[int]] = []
        for b, (j, _, sids) in enumerate(self._calls()):
            while len(shares) <= j:
                shares.append([0] * producers)
            shares[j][b % producers] += len(sids)
        return shares


def _by_shape(b: list[int], visual: dict[int, int]) -> list[int]:
    """A micro-batch's samples with each visual shape's samples together (shapes in order of
    first appearance, samples in packing order within a shape)."""
    first: dict[int, int] = {}
    for i, sid in enumerate(b):
        first.setdefault(visual[sid], i)
    return sorted(b, key=lambda sid: first[visual[sid]])


def plan_batch(
    step: int,
    lengths: dict[int, int],
    *,
    L: int,
    ranks: int,
    policy: str,
    how: str,
    cost=None,
    visual: dict[int, int] | None = None,
) -> BatchPlan:
    """Pack one global batch and deal its micro-batches to `ranks` backbone replicas; with
    `visual` (sample id -> visual tokens) the encoder batches by shape within a micro-batch."""
    bins = pack_bfd(lengths, L) if policy == "bfd" else pack_fifo(lengths, L)
    if visual:
        bins = [_by_shape(b, visual) for b in bins]
    lens = [[lengths[s] for s in b] for b in bins]
    costs = [cost(x) if cost else paper_cost(x, L) for x in lens]
    if policy == "fifo":
        how = "round_robin"  # the FIFO ablation also drops cost-aware dispatch
    per_rank = dispatch(costs, ranks, how)
    return BatchPlan(
        step,
        [[bins[j] for j in js] for js in per_rank],
        [[costs[j] for j in js] for js in per_rank],
        dict(visual or {}),
    )


def packing_efficiency(plans: list[BatchPlan], lengths: dict[int, int], L: int) -> float:
    """Useful tokens / (micro-batches * L): 1 - padding if every micro-batch were padded to L."""
    used = n = 0
    for p in plans:
        for bins in p.rank_bins:
            for b in bins:
                used += sum(lengths[s] for s in b)
                n += 1
    return used / (n * L)


def rank_imbalance(plans: list[BatchPlan]) -> float:
    """Mean over batches of max/mean per-rank planned cost (1.0 is perfect)."""
    vals = []
    for p in plans:
        loads = [sum(c) for c in p.costs]
        vals.append(max(loads) / (sum(loads) / len(loads)) if sum(loads) else 1.0)
    return float(np.mean(vals))
