"""Throughput-matching allocator: choose each module's parallel plan under a device budget R.

FlowTrain (arXiv 2606.23087, section on the heterogeneous parallel allocator) solves
lexmax(G, -F) with G = min(T_enc, T_bb) and F = |T_enc - T_bb|, from warm-up throughput proxies,
as a MILP. On CPU a "device" is a worker slot running one thread, and a module plan is
(threads per replica t, replicas n): threads stand in for tensor parallelism, replicas are data
parallelism. T = n * rho(t), with rho measured per replica in samples/s (linear in replicas: an
assumption that holds while R <= physical cores and is reported against measurements).

MILP (scipy.optimize.milp / HiGHS), binaries x_o (encoder option o) and y_o (backbone option o):
  sum x = 1, sum y = 1, sum x*n*t + sum y*n*t <= R, G <= T_enc, G <= T_bb,
  F >= T_enc - T_bb, F >= T_bb - T_enc.
Solve 1 maximizes G; solve 2 fixes G >= G* and minimizes F; solve 3 fixes both and minimizes the
devices used. `brute_force` enumerates the same options for tests.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

_TOL = 1e-6  # relative; HiGHS feasibility tolerance is ~1e-7, so ties within this are ties


@dataclass(frozen=True)
class Option:
    module: str
    threads: int
    """t: threads (devices) per replica."""
    replicas: int
    """n: data-parallel replicas."""
    rate: float
    """n * rho(t): the module's throughput in samples/s."""

    @property
    def devices(self) -> int:
        return self.threads * self.replicas


@dataclass(frozen=True)
class Plan:
    encoder: Option
    backbone: Option
    budget: int

    @property
    def G(self) -> float:
        return min(self.encoder.rate, self.backbone.rate)

    @property
    def F(self) -> float:
        return abs(self.encoder.rate - self.backbone.rate)

    @property
    def devices(self) -> int:
        return self.encoder.devices + self.backbone.devices

    def to_dict(self) -> dict:
        return {
            "encoder": {
                "threads": self.encoder.threads,
                "replicas": self.encoder.replicas,
                "predicted.samples_per_s": self.encoder.rate,
            },
            "backbone": {
                "threads": self.backbone.threads,
                "replicas": self.backbone.replicas,
                "predicted.samples_per_s": self.backbone.rate,
            },
            "predicted.G_samples_per_s": self.G,
            "predicted.F_samples_per_s": self.F,
            "devices_used": self.devices,
            "devices_idle": self.budget - self.devices,
        }


def options(rho: dict[str, dict[int, float]], budget: int, global_batch: int = 0) -> list[Option]:
    """Every (module, t, n) that fits next to the other module's smallest plan. A backbone
    replica count must divide the global batch (when given), as in FlowTrain's pruning."""
    out = []
    for module, per_t in rho.items():
        other = min(t for t in rho["backbone" if module == "encoder" else "encoder"])
        for t, r in sorted(per_t.items()):
            for n in range(1, (budget - other) // t + 1):
                if module == "backbone" and global_batch and global_batch % n:
                    continue
                out.append(Option(module, t, n, n * r))
    return out


def solve_milp(rho: dict[str, dict[int, float]], budget: int, global_batch: int = 0) -> Plan:
    """Lexicographic MILP: max G, then min F, then min devices (HiGHS via scipy)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    opts = options(rho, budget, global_batch)
    enc = [o for o in opts if o.module == "encoder"]
    bb = [o for o in opts if o.module == "backbone"]
    if not enc or not bb:
        need = min(rho["encoder"]) + min(rho["backbone"])
        raise ValueError(
            f"alloc.budget = {budget}: too small for one replica of each module; "
            f"raise alloc.budget to at least {need}"
        )
    ne, nb = len(enc), len(bb)
    nv = ne + nb + 2  # x, y, G, F
    iG, iF = ne + nb, ne + nb + 1
    te = np.array([o.rate for o in enc])
    tb = np.array([o.rate for o in bb])
    dev = np.array([o.devices for o in enc] + [o.devices for o in bb], dtype=float)

    def row(x=None, y=None, g=0.0, f=0.0) -> np.ndarray:
        r = np.zeros(nv)
        if x is not None:
            r[:ne] = x
        if y is not None:
            r[ne : ne + nb] = y
        r[iG], r[iF] = g, f
        return r

    A = [
        row(x=np.ones(ne)),
        row(y=np.ones(nb)),
        np.r_[dev, 0, 0],
        row(x=-te, g=1),
        row(y=-tb, g=1),
        row(x=-te, y=tb, f=1),
        row(x=te, y=-tb, f=1),
    ]
    lo = [1, 1, -np.inf, -np.inf, -np.inf, 0, 0]
    hi = [1, 1, budget, 0, 0, np.inf, np.inf]
    integrality = np.r_[np.ones(ne + nb), 0, 0]
    bounds = Bounds(np.zeros(nv), np.r_[np.ones(ne + nb), np.inf, np.inf])

    def solve(c: np.ndarray, extra: list[tuple[np.ndarray, float, float]]) -> np.ndarray:
        rows = A + [e[0] for e in extra]
        cons = LinearConstraint(
            np.array(rows), lo + [e[1] for e in extra], hi + [e[2] for e in extra]
        )
        res = milp(c, constraints=cons, integrality=integrality, bounds=bounds)
        if not res.success:
            raise ValueError(f"alloc: no feasible plan within alloc.budget = {budget}")
        return res.x

    x = solve(-row(g=1.0), [])
    g_star = x[iG]
    tol = _TOL * max(1.0, g_star)
    x = solve(row(f=1.0), [(row(g=1.0), g_star - tol, np.inf)])
    f_star = x[iF]
    x = solve(
        np.r_[dev, 0, 0], [(row(g=1.0), g_star - tol, np.inf), (row(f=1.0), -np.inf, f_star + tol)]
    )
    return Plan(enc[int(np.argmax(x[:ne]))], bb[int(np.argmax(x[ne : ne + nb]))], budget)


def brute_force(rho: dict[str, dict[int, float]], budget: int, global_batch: int = 0) -> Plan:
    """Exhaustive reference: the same lexicographic order over every feasible pair."""
    opts = options(rho, budget, global_batch)
    pairs = [
        Plan(e, b, budget)
        for e, b in itertools.product(
            [o for o in opts if o.module == "encoder"], [o for o in opts if o.module == "backbone"]
        )
        if e.devices + b.devices <= budget
    ]
    if not pairs:
        raise ValueError(f"alloc: no feasible plan within alloc.budget = {budget}")
    g = max(p.G for p in pairs)
    pairs = [p for p in pairs if p.G >= g - _TOL * max(1.0, g)]
    f = min(p.F for p in pairs)
    pairs = [p for p in pairs if p.F <= f + _TOL * max(1.0, g)]
    return min(pairs, key=lambda p: p.devices)


def even_split(rho: dict[str, dict[int, float]], budget: int, global_batch: int = 0) -> Plan:
    """The ablation: as close to half the devices for each module as the rules allow, at each
    module's smallest profiled threads per replica; like every allocator option, the backbone's
    replica count divides the global batch (when given)."""
    te, tb = min(rho["encoder"]), min(rho["backbone"])
    splits = [
        (n_b, (budget - n_b * tb) // te)
        for n_b in range(1, budget // tb + 1)
        if (budget - n_b * tb) // te >= 1 and not (global_batch and global_batch % n_b)
    ]
    if not splits:
        raise ValueError(
            f"alloc.budget = {budget}: no split gives each module a replica of its smallest "
            f"profiled size ({te} + {tb} devices) with a backbone replica count dividing "
            f"data.global_batch = {global_batch}; raise alloc.budget"
        )
    # nearest to half the budget; on a tie the backbone gets the extra device
    n_b, n_e = min(splits, key=lambda s: (abs(2 * s[0] * tb - budget), -s[0]))
    return Plan(
        Option("encoder", te, n_e, n_e * rho["encoder"][te]),
        Option("backbone", tb, n_b, n_b * rho["backbone"][tb]),
        budget,
    )


# ------------------------------------------------------------------- profiling


def profile(cfg, max_threads: int, micro_batches: int) -> dict:
    """Warm-up profile in this process (measured): per-replica samples/s of each module at each
    thread count, the encoder calls' and the backbone micro-batches' times for cost fits.

    The encoder runs the calls the runtime would (one per visual shape per micro-batch of the
    plan); data preparation (image processing) is left out, as in the runtime's compute spans.
    """
    import torch

    from frugaltrain.flow.data import build_dataset
    from frugaltrain.flow.models import build_consumer, build_encoder
    from frugaltrain.flow.packing import pack_bfd, pack_fifo, plan_batch

    ds = build_dataset(cfg)
    enc, cons = build_encoder(cfg), build_consumer(cfg, ds)
    samples = [s for k in range(micro_batches) for s in ds.batch(10_000 + k)]  # unseen ids
    lengths = {s.sample_id: s.length for s in samples}
    visual = {s.sample_id: s.n_visual for s in samples}
    calls = [
        sids
        for k in range(micro_batches)
        for sids, _ in plan_batch(
            k,
            {i: lengths[i] for i in ds.batch_ids(10_000 + k)},
            L=cfg.sched.capacity,
            ranks=1,
            policy=cfg.sched.policy,
            how=cfg.sched.dispatch,
            visual=visual,
        ).encoder_batches()
    ]
    # Diverse micro-batches (BFD-full and FIFO-partial) so the cost fit sees a range of shapes.
    bins = pack_bfd(lengths, cfg.sched.capacity) + pack_fifo(lengths, cfg.sched.capacity)
    saved = torch.get_num_threads()
    out = {"rho": {"encoder": {}, "backbone": {}}, "threads": {}}
    try:
        for t in range(1, max_threads + 1):
            torch.set_num_threads(t)
            enc_s = _time_encoder(cfg, enc, ds, calls)
            out["rho"]["encoder"][t] = len(samples) / sum(enc_s)
            bin_s = _time_backbone(cfg, cons, ds, bins)
            # BFD and FIFO bins each hold every sample once, so this counts each sample twice
            # over twice the time: the rate is still samples per second of backbone work.
            out["rho"]["backbone"][t] = sum(len(b) for b in bins) / sum(bin_s)
            if t == 1:  # the cost fits use the one-thread times
                out["enc_calls"] = [[visual[i] for i in c] for c in calls]
                out["enc_call_seconds"] = enc_s
                out["bins"] = [[lengths[i] for i in b] for b in bins]
                out["bin_seconds"] = bin_s
    finally:
        torch.set_num_threads(saved)
    return out


def _time_encoder(cfg, enc, ds, calls: list[list[int]]) -> list[float]:
    """Seconds of each encoder call's forward (+ backward when trainable), measured on the
    second of two passes: the first warms up the allocator's caches."""
    import torch

    inputs = [ds.encoder_input(c, getattr(torch, cfg.run.dtype)) for c in calls]
    for _ in range(2):
        seconds = encoder_pass(cfg, enc, inputs)
    return seconds


def encoder_pass(cfg, enc, inputs: list) -> list[float]:
    """One timed pass over the encoder calls' inputs: seconds of each call's forward (+ backward
    when trainable)."""
    import torch

    train, seconds = cfg.run.train_encoder, []
    for x in inputs:
        t0 = time.perf_counter()
        with torch.set_grad_enabled(train):
            y = enc(x)
            if train:
                y.backward(torch.ones_like(y))
        seconds.append(time.perf_counter() - t0)
    return seconds


def _time_backbone(cfg, cons, ds, bins: list[list[int]]) -> list[float]:
    """Seconds of each micro-batch's backbone forward + backward on random embeddings, measured
    on the second of two passes."""
    import torch

    from frugaltrain.flow.models import encoder_width

    dtype, train, width = getattr(torch, cfg.run.dtype), cfg.run.train_encoder, encoder_width(cfg)
    for _ in range(2):
        seconds = []
        for b in bins:
            embs = [
                torch.randn(ds.sample(i).n_visual, width, dtype=dtype).requires_grad_(train)
                for i in b
            ]
            texts = [torch.tensor(ds.sample(i).tokens) for i in b]
            t0 = time.perf_counter()
            cons.loss_sum(embs, texts).backward()
            seconds.append(time.perf_counter() - t0)
    return seconds
