"""`frugaltrain flow train`: run one mode, measure it, write metrics.json, trace.json and
timeline.png. Every metric key says measured, predicted or estimated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from frugaltrain.flow.alloc import profile
from frugaltrain.flow.config import FlowConfig
from frugaltrain.flow.data import build_dataset
from frugaltrain.flow.models import build_models, flops_per_token
from frugaltrain.flow.packing import BatchPlan, packing_efficiency, rank_imbalance
from frugaltrain.flow.plan import cost_fit
from frugaltrain.flow.runtime import RunResult, make_plans, run
from frugaltrain.flow.samples import CaptionSet, Sample
from frugaltrain.flow.trace import calibrate_matmul_flops, plot_timeline, summarize


def train(cfg: FlowConfig) -> dict:
    """Run `cfg.run.mode` with the configured dispatch cost, then write the run's files."""
    ds = build_dataset(cfg)
    plans = make_plans(cfg, ds, _dispatch_cost(cfg))
    res = run(cfg, plans)
    m = measure(cfg, plans, res, calibrate_matmul_flops())
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(m, indent=1))
    (out / "trace.json").write_text(json.dumps(res.traces))
    plot_timeline(res.traces, str(out / "timeline.png"), f"{cfg.run.mode} (measured)")
    return m


def _dispatch_cost(cfg: FlowConfig) -> Callable[[list[int]], float] | None:
    """sched.cost = fitted or auto: profile first and dispatch on the fitted seconds; paper: None
    (make_plans then uses the paper's cost model)."""
    if cfg.sched.cost not in ("fitted", "auto"):
        return None
    fit = cost_fit(cfg, profile(cfg, 1, cfg.alloc.profile_steps))
    model = "fitted" if cfg.sched.cost == "fitted" else fit.best
    print(f"cost model: {model}; held-out MAPE {fit.mape} R2 {fit.r2} (measured)")
    return lambda lens: fit.seconds(lens, cfg.sched.capacity, model)


def measure(
    cfg: FlowConfig,
    plans: list[BatchPlan],
    res: RunResult,
    peak_flops: float,
    ds: CaptionSet | None = None,
) -> dict:
    """Metrics of one run (measured), including the CPU MFU proxy (estimated).

    Args:
        peak_flops: single-core GEMM FLOP/s (`calibrate_matmul_flops`); 0 leaves the proxy out.
        ds: the run's dataset, if the caller has it (building one reads a folder again).
    """
    ds = ds or build_dataset(cfg)
    batch = [s for k in range(cfg.run.warmup_steps, cfg.run.steps) for s in ds.batch(k)]
    out = summarize(
        res.traces,
        samples=len(batch),
        tokens=sum(s.length for s in batch),
        warmup_steps=cfg.run.warmup_steps,
        steps=cfg.run.steps,
        model_flops=_model_flops(cfg, ds, batch),
        peak_flops=peak_flops,
        cores=_cores(cfg),
    )
    lengths = {s.sample_id: s.length for k in range(cfg.run.steps) for s in ds.batch(k)}
    out["measured.packing_efficiency"] = packing_efficiency(plans, lengths, cfg.sched.capacity)
    out["predicted.rank_imbalance_max_over_mean"] = rank_imbalance(plans)
    out["measured.loss"] = res.losses
    out["measured.loadavg_1min"] = os.getloadavg()[0]  # the machine is shared: record its load
    consumers = [t for t in res.traces if t["role"].startswith("consumer")]
    if len(consumers) > 1:
        out["measured.rank_imbalance_max_over_mean"] = _rank_imbalance(cfg, consumers)
    # Backbone all-reduce + step time per step, for the simulator.
    tr = res.traces[-1]
    out["measured.optim_s_per_step"] = (
        sum(b - a for k, a, b, _ in tr["events"] if k == "optim") / cfg.run.steps
    )
    return out


def _model_flops(cfg: FlowConfig, ds: CaptionSet, batch: list[Sample]) -> float:
    enc, cons = build_models(cfg, ds)
    vis = sum(s.n_visual for s in batch)
    tok = sum(s.length for s in batch)
    # forward 2 FLOPs/param/token, backward 4; a frozen encoder runs forward only
    enc_mult = 6 if cfg.run.train_encoder else 2
    return enc_mult / 2 * flops_per_token(enc) * vis + 3 * flops_per_token(cons) * tok


def _cores(cfg: FlowConfig) -> int:
    if cfg.run.mode == "monolithic":
        return cfg.run.mono_threads
    # monolithic_dp runs as many processes as sync and flow
    return cfg.run.threads * (cfg.run.producers + cfg.run.consumers)


def _rank_imbalance(cfg: FlowConfig, consumers: list[dict]) -> float:
    """Max over mean of backbone compute seconds across ranks, averaged over measured steps."""
    per = [
        [
            sum(b - a for k, a, b, st in t["events"] if k == "compute" and st == step)
            for t in consumers
        ]
        for step in range(cfg.run.warmup_steps, cfg.run.steps)
    ]
    return float(np.mean([max(x) / (sum(x) / len(x)) for x in per if sum(x) > 0]))
