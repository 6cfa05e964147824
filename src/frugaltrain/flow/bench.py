"""Measurement: one run's metrics, the warm-up profile + allocator plan, and the interleaved
benchmark with ablations and the simulated projection. Every key says measured, predicted,
estimated or simulated; the machine may be shared, so modes are interleaved and compared as
ratios within a repetition.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from frugaltrain.config import build_config
from frugaltrain.flow.alloc import brute_force, even_split, profile, solve_milp
from frugaltrain.flow.config import FlowConfig
from frugaltrain.flow.data import DigitCaptions
from frugaltrain.flow.models import build_models, flops_per_token
from frugaltrain.flow.packing import CostFit, fit_cost, packing_efficiency, rank_imbalance
from frugaltrain.flow.runtime import RunResult, make_plans, min_slots, run
from frugaltrain.flow.sim import simulate, simulate_monolithic
from frugaltrain.flow.trace import calibrate_matmul_flops, plot_timeline, summarize

# Named workloads are plain override lists on top of a config (a variant edits a copy).
WORKLOADS = {
    # encoder ~1.3x the backbone's time per batch at one thread each (measured in `plan`)
    "encoder_heavy": [
        "model.enc_dim=192",
        "model.enc_layers=4",
        "model.enc_heads=6",
        "model.lm_dim=96",
        "model.lm_layers=2",
        "model.lm_heads=4",
    ],
    # backbone ~15x the encoder's
    "backbone_heavy": [
        "model.enc_dim=64",
        "model.enc_layers=2",
        "model.enc_heads=4",
        "model.lm_dim=160",
        "model.lm_layers=4",
        "model.lm_heads=4",
    ],
}


def with_sets(cfg: FlowConfig, sets: list[str]) -> FlowConfig:
    return build_config(FlowConfig, dataclasses.asdict(cfg), sets)


def measure(cfg: FlowConfig, plans, res: RunResult, peak_flops: float) -> dict:
    """Metrics of one run (measured), including the CPU MFU proxy (estimated)."""
    ds = DigitCaptions.from_config(cfg)
    enc, cons = build_models(cfg)
    steps = range(cfg.run.warmup_steps, cfg.run.steps)
    batch = [s for k in steps for s in ds.batch(k)]
    vis = sum(s.n_visual for s in batch)
    tok = sum(s.length for s in batch)
    # forward 2 FLOPs/param/token, backward 4; a frozen encoder runs forward only
    enc_mult = 6 if cfg.run.train_encoder else 2
    flops = enc_mult / 2 * flops_per_token(enc) * vis + 3 * flops_per_token(cons) * tok
    cores = (
        cfg.run.mono_threads
        if cfg.run.mode == "monolithic"
        else cfg.run.threads * (cfg.run.producers + cfg.run.consumers)
    )
    out = summarize(
        res.traces,
        samples=len(batch),
        tokens=tok,
        warmup_steps=cfg.run.warmup_steps,
        steps=cfg.run.steps,
        model_flops=flops,
        peak_flops=peak_flops,
        cores=cores,
    )
    lengths = {s.sample_id: s.length for k in range(cfg.run.steps) for s in ds.batch(k)}
    out["measured.packing_efficiency"] = packing_efficiency(plans, lengths, cfg.sched.capacity)
    out["predicted.rank_imbalance_max_over_mean"] = rank_imbalance(plans)
    out["measured.loss"] = res.losses
    out["measured.loadavg_1min"] = os.getloadavg()[0]  # the machine is shared: record its load
    consumers = [t for t in res.traces if t["role"].startswith("consumer")]
    if len(consumers) > 1:  # measured: max/mean backbone compute per step across ranks
        per = [
            [
                sum(b - a for k, a, b, st in t["events"] if k == "compute" and st == step)
                for t in consumers
            ]
            for step in range(cfg.run.warmup_steps, cfg.run.steps)
        ]
        out["measured.rank_imbalance_max_over_mean"] = float(
            np.mean([max(x) / (sum(x) / len(x)) for x in per if sum(x) > 0])
        )
    # Backbone all-reduce + step time per step, for the simulator.
    tr = res.traces[-1]
    out["measured.optim_s_per_step"] = (
        sum(b - a for k, a, b, _ in tr["events"] if k == "optim") / cfg.run.steps
    )
    return out


def _fitted_cost(cfg: FlowConfig, prof: dict) -> CostFit:
    return fit_cost(prof["bins"], prof["bin_seconds"], cfg.sched.capacity)


def train(cfg: FlowConfig) -> dict:
    """`frugaltrain flow train`: run, then write metrics.json, trace.json and timeline.png."""
    ds = DigitCaptions.from_config(cfg)
    cost = None
    if cfg.sched.cost in ("fitted", "auto"):
        fit = _fitted_cost(cfg, profile(cfg, 1, cfg.alloc.profile_steps))
        model = "fitted" if cfg.sched.cost == "fitted" else fit.best
        print(f"cost model: {model}; held-out MAPE {fit.mape} R2 {fit.r2} (measured)")
        cost = lambda lens: fit.seconds(lens, cfg.sched.capacity, model)  # noqa: E731
    plans = make_plans(cfg, ds, cost)
    res = run(cfg, plans)
    m = measure(cfg, plans, res, calibrate_matmul_flops())
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(m, indent=1))
    (out / "trace.json").write_text(json.dumps(res.traces))
    plot_timeline(res.traces, str(out / "timeline.png"), f"{cfg.run.mode} (measured)")
    return m


def plan(cfg: FlowConfig) -> dict:
    """`frugaltrain flow plan`: warm-up profile, both cost models' accuracy, the MILP plan."""
    prof = profile(cfg, cfg.alloc.max_threads, cfg.alloc.profile_steps)
    fit = _fitted_cost(cfg, prof)
    rho = prof["rho"]
    milp = solve_milp(rho, cfg.alloc.budget, cfg.data.global_batch)
    out = {
        "measured.rho_samples_per_s": rho,
        "measured.cost_fit": {
            "r2": fit.r2,
            "mape": fit.mape,
            "best": fit.best,
            "fitted_coef": fit.coef,
        },
        "plan": milp.to_dict(),
        "plan_brute_force_agrees": _same(
            milp, brute_force(rho, cfg.alloc.budget, cfg.data.global_batch)
        ),
        "even_split": even_split(rho, cfg.alloc.budget).to_dict(),
        "oversubscribed": cfg.alloc.budget > (os.cpu_count() or 1),
    }
    return out


def _same(a, b) -> bool:
    return abs(a.G - b.G) <= 1e-6 * max(1, a.G) and abs(a.F - b.F) <= 1e-6 * max(1, a.G)


# ------------------------------------------------------------------- benchmark


def _stats(xs: list[float]) -> dict:
    q = np.percentile(xs, [25, 50, 75])
    return {
        "median": float(q[1]),
        "iqr": [float(q[0]), float(q[2])],
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def _boot_ratio(a: list[float], b: list[float], seed: int = 0) -> list[float]:
    """95% bootstrap interval of median(a)/median(b) (measured)."""
    r = np.random.default_rng(seed)
    a, b = np.asarray(a), np.asarray(b)
    vals = [np.median(r.choice(a, len(a))) / np.median(r.choice(b, len(b))) for _ in range(2000)]
    return [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))]


def _roles_mean(ms: list[dict]) -> dict:
    roles: dict[str, dict[str, list[float]]] = {}
    for m in ms:
        for role, d in m["measured.roles"].items():
            for k, v in d.items():
                roles.setdefault(role, {}).setdefault(k, []).append(v)
    return {r: {k: statistics.median(v) for k, v in d.items()} for r, d in roles.items()}


def _variants(cfg: FlowConfig, plans_slots: int) -> dict[str, list[str]]:
    return {
        "monolithic": ["run.mode='monolithic'"],
        # reference: the same process with one thread (half the cores of every other variant)
        "monolithic_1t": ["run.mode='monolithic'", "run.mono_threads=1"],
        "sync": ["run.mode='sync'"],
        "flow": ["run.mode='flow'"],
        # ablations (flow with one mechanism removed)
        "flow_no_pool": ["run.mode='flow'", f"pool.slots={plans_slots}"],
        "flow_fifo": ["run.mode='flow'", "sched.policy='fifo'"],
    }


def bench(
    cfg: FlowConfig,
    *,
    reps: int = 5,
    workloads: list[str] | None = None,
    ablations: bool = True,
    log=print,
    partial: str | Path | None = None,
) -> dict:
    """Interleaved benchmark (A B C A B C ...) of the modes on each workload (measured), plus
    the simulator validated against the measurements and a projection (simulated)."""
    peak = calibrate_matmul_flops()
    result: dict = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "note": "shared machine; interleaved",
        },
        "measured.gemm_flops_per_core": peak,
        "config": dataclasses.asdict(cfg),
        "reps": reps,
        "workloads": {},
    }
    for wl in workloads or list(WORKLOADS):
        wcfg = with_sets(cfg, WORKLOADS[wl])
        plans = make_plans(wcfg, DigitCaptions.from_config(wcfg))
        fifo_plans = make_plans(
            with_sets(wcfg, ["sched.policy='fifo'"]), DigitCaptions.from_config(wcfg)
        )
        slots = min_slots(plans, 1, "flow")
        variants = _variants(wcfg, slots)
        if not ablations:
            variants = {k: v for k, v in variants.items() if not k.startswith("flow_")}
        log(f"[{wl}] profiling (measured warm-up)")
        prof = profile(wcfg, 2, wcfg.alloc.profile_steps)
        runs: dict[str, list[dict]] = {k: [] for k in variants}
        for rep in range(reps):
            for name, sets in variants.items():
                vcfg = with_sets(wcfg, sets)
                vplans = fifo_plans if name == "flow_fifo" else plans
                res = run(vcfg, vplans)
                m = measure(vcfg, vplans, res, peak)
                runs[name].append(m)
                log(
                    f"[{wl}] rep {rep} {name:13s} {m['measured.samples_per_s']:7.1f} samples/s "
                    "(measured)"
                )
                if rep == 0 and name in ("monolithic", "sync", "flow"):
                    out = Path(cfg.run.out_dir)
                    out.mkdir(parents=True, exist_ok=True)
                    plot_timeline(
                        res.traces,
                        str(out / f"timeline_{wl}_{name}.png"),
                        f"{wl} {name} (measured)",
                    )
        thr = {k: [m["measured.samples_per_s"] for m in v] for k, v in runs.items()}
        ratios = [f / m for f, m in zip(thr["flow"], thr["monolithic"], strict=True)]
        w = {
            "measured.samples_per_s": {k: _stats(v) for k, v in thr.items()},
            "measured.flow_over_monolithic_per_rep": ratios,
            "measured.flow_over_monolithic_median": statistics.median(ratios),
            "measured.flow_over_monolithic_boot95": _boot_ratio(thr["flow"], thr["monolithic"]),
            "measured.sync_over_monolithic_median": statistics.median(
                [s / m for s, m in zip(thr["sync"], thr["monolithic"], strict=True)]
            ),
            "measured.idle_breakdown": {k: _roles_mean(v) for k, v in runs.items()},
            "measured.packing_efficiency": {
                "bfd": runs["flow"][0]["measured.packing_efficiency"],
                **(
                    {"fifo": runs["flow_fifo"][0]["measured.packing_efficiency"]}
                    if "flow_fifo" in runs
                    else {}
                ),
            },
            "estimated.cpu_mfu_proxy": {
                k: statistics.median(m["estimated.cpu_mfu_proxy"] for m in v)
                for k, v in runs.items()
            },
            "measured.rho_samples_per_s": prof["rho"],
            "measured.loadavg_1min": _stats(
                [m["measured.loadavg_1min"] for v in runs.values() for m in v]
            ),
            "measured.loss_first_last": [
                runs["flow"][0]["measured.loss"][0],
                runs["flow"][0]["measured.loss"][-1],
            ],
        }
        w.update(_simulate(wcfg, plans, prof, runs, thr))
        result["workloads"][wl] = w
        if partial:
            write(result, partial)  # a later failure must not lose the finished workloads
    return result


def _simulate(cfg: FlowConfig, plans, prof: dict, runs: dict, thr: dict) -> dict:
    """Validate the simulator on the real 1+1 runs, then project (simulated)."""
    from scipy.optimize import nnls

    ds = DigitCaptions.from_config(cfg)
    n = np.asarray(prof["enc_tokens"], dtype=float)
    X = np.stack([n, n**2, np.ones_like(n)], 1)
    scale = X.max(0)
    a = nnls(X / scale, np.asarray(prof["enc_seconds"]))[0] / scale
    fit = fit_cost(prof["bins"], prof["bin_seconds"], cfg.sched.capacity)

    def enc_t(sid: int) -> float:  # fitted seconds per sample, linear + quadratic in tokens
        n_vis = ds.sample(sid).n_visual
        return float(a @ np.array([n_vis, n_vis**2, 1.0]))

    L = cfg.sched.capacity
    bin_t = lambda b: fit.seconds([ds.sample(s).length for s in b], L)  # noqa: E731
    rho = prof["rho"]
    sp_e = rho["encoder"][2] / rho["encoder"][1]  # measured 2-thread speed-ups
    sp_b = rho["backbone"][2] / rho["backbone"][1]
    optim = statistics.median(m["measured.optim_s_per_step"] for m in runs["flow"])
    kw = dict(enc_s=enc_t, bin_s=bin_t, optim_s=optim, warmup_steps=cfg.run.warmup_steps)
    sim = {
        "flow": simulate(plans, mode="flow", producers=1, slots=cfg.pool.slots, **kw),
        "sync": simulate(plans, mode="sync", producers=1, slots=cfg.pool.slots, **kw),
        "monolithic_1t": simulate_monolithic(plans, **kw),
        # uses the profile's 2-thread speed-ups, which a loaded machine makes unreliable
        "monolithic": simulate_monolithic(
            plans,
            enc_s=lambda s: enc_t(s) / sp_e,
            bin_s=lambda b: bin_t(b) / sp_b,
            optim_s=optim,
            warmup_steps=cfg.run.warmup_steps,
        ),
    }
    validation = {
        k: {
            "simulated.samples_per_s": v.samples_per_s,
            "measured.samples_per_s_median": statistics.median(thr[k]),
            "error": v.samples_per_s / statistics.median(thr[k]) - 1,
        }
        for k, v in sim.items()
        if k in thr
    }
    # Projection. The allocator gets the rates of the same per-sample models the simulator
    # uses, so plan and simulation agree on the workload; every plan at a given R sees the same
    # global batch (4 R samples); replicas run one thread each and scale linearly (assumed).
    ids = [i for k in range(cfg.run.steps) for i in ds.batch_ids(k)]
    rho_e = len(ids) / sum(enc_t(i) for i in ids)
    rho_b = len(ids) / sum(bin_t(b) for pl in plans for bins in pl.rank_bins for b in bins)
    r1 = {"encoder": {1: rho_e}, "backbone": {1: rho_b}}
    proj = {}
    for R in (2, 4, 8, 16, 32, 64):
        milp, even = solve_milp(r1, R), even_split(r1, R)
        row: dict = {
            "milp_plan": [milp.encoder.replicas, milp.backbone.replicas],
            "predicted.milp_G_samples_per_s": milp.G,
            "predicted.even_G_samples_per_s": even.G,
        }
        base = [f"data.global_batch={4 * R}", "run.steps=4", "run.warmup_steps=1"]
        for name, plan_ in (("milp", milp), ("even", even)):
            P, C = plan_.encoder.replicas, plan_.backbone.replicas
            pcfg = with_sets(cfg, [*base, f"run.consumers={C}", f"run.producers={P}"])
            pplans = make_plans(pcfg, DigitCaptions.from_config(pcfg))
            slots = max(min_slots(pplans, P, "sync"), cfg.pool.slots)
            kw2 = dict(kw, warmup_steps=1)
            row[f"simulated.flow_{name}_samples_per_s"] = simulate(
                pplans, mode="flow", producers=P, slots=slots, **kw2
            ).samples_per_s
            if name == "milp":
                row["simulated.sync_samples_per_s"] = simulate(
                    pplans, mode="sync", producers=P, slots=slots, **kw2
                ).samples_per_s
        # monolithic data parallelism: R one-thread replicas, each encoder + backbone
        mcfg = with_sets(cfg, [*base, f"run.consumers={R}"])
        mplans = make_plans(mcfg, DigitCaptions.from_config(mcfg))
        row["simulated.monolithic_1t_dp_samples_per_s"] = simulate_monolithic(
            mplans, replicas=R, **dict(kw, warmup_steps=1)
        ).samples_per_s
        proj[R] = row
    return {
        "simulated.validation": validation,
        "simulated.projection": proj,
        "measured.cost_fit": {"r2": fit.r2, "mape": fit.mape, "best": fit.best},
        "measured.profile": prof,
    }


def table(result: dict) -> str:
    """The printed summary: one row per workload x variant."""
    lines = [
        f"{'workload':15s} {'variant':13s} {'samples/s median':>17s} {'IQR':>15s} "
        f"{'x mono':>7s}  idle (consumer starv/barrier, producer backpr/barrier)"
    ]
    for wl, w in result["workloads"].items():
        mono = w["measured.samples_per_s"]["monolithic"]["median"]
        for name, s in w["measured.samples_per_s"].items():
            roles = w["measured.idle_breakdown"][name]
            idle = ""
            if "consumer0" in roles:
                c, p = roles["consumer0"], roles["producer0"]
                idle = (
                    f"c {c['starvation_frac']:.2f}/{c['barrier_frac']:.2f}  "
                    f"p {p['backpressure_frac']:.2f}/{p['barrier_frac']:.2f}"
                )
            lines.append(
                f"{wl:15s} {name:13s} {s['median']:17.1f} "
                f"{s['iqr'][0]:7.1f}-{s['iqr'][1]:<7.1f} {s['median'] / mono:7.2f}  "
                f"{idle}"
            )
    lines.append(
        "all throughput figures measured on this machine (median of "
        f"{result['reps']} interleaved repetitions)"
    )
    return "\n".join(lines)


def write(result: dict, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1, default=float))
    return p


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def alloc_check(cfg: FlowConfig, *, workload: str, budget: int, reps: int, log=print) -> dict:
    """Run the allocator's plan and the even split for real at `budget` worker slots, interleaved,
    and report predicted vs measured samples/s. Above the core count this oversubscribes, which
    the linear-replica model does not know about; the result says so."""
    wcfg = with_sets(cfg, WORKLOADS[workload])
    prof = profile(wcfg, 1, wcfg.alloc.profile_steps)
    rho = {"encoder": {1: prof["rho"]["encoder"][1]}, "backbone": {1: prof["rho"]["backbone"][1]}}
    plans_ = {"milp": solve_milp(rho, budget), "even": even_split(rho, budget)}
    out: dict = {
        "workload": workload,
        "budget": budget,
        "oversubscribed": budget > (os.cpu_count() or 1),
        "measured.rho_samples_per_s": rho,
    }
    thr: dict[str, list[float]] = {k: [] for k in plans_}
    for rep in range(reps):
        for name, p in plans_.items():
            vcfg = with_sets(
                wcfg,
                [
                    "run.mode='flow'",
                    f"run.producers={p.encoder.replicas}",
                    f"run.consumers={p.backbone.replicas}",
                ],
            )
            pl = make_plans(vcfg, DigitCaptions.from_config(vcfg))
            m = measure(vcfg, pl, run(vcfg, pl), 0.0)
            thr[name].append(m["measured.samples_per_s"])
            log(
                f"[alloc R={budget}] rep {rep} {name} {p.encoder.replicas}+{p.backbone.replicas}"
                f" {thr[name][-1]:.1f} samples/s (measured)"
            )
    for name, p in plans_.items():
        out[name] = {**p.to_dict(), "measured.samples_per_s": _stats(thr[name])}
    return out
