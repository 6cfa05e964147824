"""FlowTrain benchmark: monolithic, sync and flow (plus ablations) interleaved A B C A B C ...

    python benchmarks/flow.py                 # 5 repetitions, both workloads
    python benchmarks/flow.py --reps 3 --workloads encoder_heavy
    python benchmarks/flow.py --reps 3 --alloc-check 3 --workloads encoder_heavy

Prints a table (medians and IQR of measured samples/s, ratio to monolithic, idle breakdown) and
writes the full JSON (per-run metrics, bootstrap interval of flow/monolithic, simulator
validation and the simulated projection) to benchmarks/results/. The machine may be shared:
interleaving and within-repetition ratios are the defence, and the JSON records the load.
Every key says measured, predicted, estimated or simulated. --config defaults to
examples/flow.toml; --set overrides its keys as in `frugaltrain flow train`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from frugaltrain.config import ConfigError, build_config
from frugaltrain.flow.alloc import even_split, profile, solve_milp
from frugaltrain.flow.config import FlowConfig, load_flow_config
from frugaltrain.flow.data import DigitCaptions
from frugaltrain.flow.packing import BatchPlan
from frugaltrain.flow.plan import cost_fit
from frugaltrain.flow.runtime import make_plans, min_slots, run
from frugaltrain.flow.sim import simulate, simulate_monolithic
from frugaltrain.flow.trace import calibrate_matmul_flops, plot_timeline
from frugaltrain.flow.train import measure

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
PROJECTION_BUDGETS = (2, 4, 8, 16, 32, 64)  # R: worker slots of the simulated projection


def with_sets(cfg: FlowConfig, sets: list[str]) -> FlowConfig:
    return build_config(FlowConfig, dataclasses.asdict(cfg), sets)


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


def _variants(slots: int, ablations: bool) -> dict[str, list[str]]:
    variants = {
        "monolithic": ["run.mode='monolithic'"],
        # reference: the same process with one thread (half the cores of every other variant)
        "monolithic_1t": ["run.mode='monolithic'", "run.mono_threads=1"],
        "sync": ["run.mode='sync'"],
        "flow": ["run.mode='flow'"],
        # ablations (flow with one mechanism removed)
        "flow_no_pool": ["run.mode='flow'", f"pool.slots={slots}"],
        "flow_fifo": ["run.mode='flow'", "sched.policy='fifo'"],
    }
    if not ablations:
        variants = {k: v for k, v in variants.items() if not k.startswith("flow_")}
    return variants


# ------------------------------------------------------------------- benchmark


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
        result["workloads"][wl] = _bench_workload(cfg, wl, reps, ablations, peak, log)
        if partial:
            write(result, partial)  # a later failure must not lose the finished workloads
    return result


def _bench_workload(
    cfg: FlowConfig, wl: str, reps: int, ablations: bool, peak: float, log: Callable
) -> dict:
    """One workload: warm-up profile, interleaved runs, their summary, the simulator."""
    wcfg = with_sets(cfg, WORKLOADS[wl])
    plans = make_plans(wcfg, DigitCaptions.from_config(wcfg))
    fifo_plans = make_plans(
        with_sets(wcfg, ["sched.policy='fifo'"]), DigitCaptions.from_config(wcfg)
    )
    variants = _variants(min_slots(plans, 1, "flow"), ablations)
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
            rate = m["measured.samples_per_s"]
            log(f"[{wl}] rep {rep} {name:13s} {rate:7.1f} samples/s (measured)")
            if rep == 0 and name in ("monolithic", "sync", "flow"):
                out = Path(cfg.run.out_dir)
                out.mkdir(parents=True, exist_ok=True)
                path = out / f"timeline_{wl}_{name}.png"
                plot_timeline(res.traces, str(path), f"{wl} {name} (measured)")
    thr = {k: [m["measured.samples_per_s"] for m in v] for k, v in runs.items()}
    w = _summarize_runs(runs, thr, prof["rho"])
    w.update(_simulate(wcfg, plans, prof, runs, thr))
    return w


def _summarize_runs(runs: dict[str, list[dict]], thr: dict[str, list[float]], rho: dict) -> dict:
    """Throughput statistics, mode ratios, idle breakdown and packing of a workload's runs, with
    the warm-up rates `rho` they ran under."""
    ratios = [f / m for f, m in zip(thr["flow"], thr["monolithic"], strict=True)]
    packing = {"bfd": runs["flow"][0]["measured.packing_efficiency"]}
    if "flow_fifo" in runs:
        packing["fifo"] = runs["flow_fifo"][0]["measured.packing_efficiency"]
    flow_loss = runs["flow"][0]["measured.loss"]
    return {
        "measured.samples_per_s": {k: _stats(v) for k, v in thr.items()},
        "measured.flow_over_monolithic_per_rep": ratios,
        "measured.flow_over_monolithic_median": statistics.median(ratios),
        "measured.flow_over_monolithic_boot95": _boot_ratio(thr["flow"], thr["monolithic"]),
        "measured.sync_over_monolithic_median": statistics.median(
            [s / m for s, m in zip(thr["sync"], thr["monolithic"], strict=True)]
        ),
        "measured.idle_breakdown": {k: _roles_mean(v) for k, v in runs.items()},
        "measured.packing_efficiency": packing,
        "estimated.cpu_mfu_proxy": {
            k: statistics.median(m["estimated.cpu_mfu_proxy"] for m in v) for k, v in runs.items()
        },
        "measured.rho_samples_per_s": rho,
        "measured.loadavg_1min": _stats(
            [m["measured.loadavg_1min"] for v in runs.values() for m in v]
        ),
        "measured.loss_first_last": [flow_loss[0], flow_loss[-1]],
    }


# ------------------------------------------------------------------- simulator


def _simulate(cfg: FlowConfig, plans: list[BatchPlan], prof: dict, runs: dict, thr: dict) -> dict:
    """Validate the simulator on the real 1+1 runs, then project (simulated)."""
    ds = DigitCaptions.from_config(cfg)
    enc_t = _encoder_seconds(prof, ds)
    fit = cost_fit(cfg, prof)

    def bin_t(b: list[int]) -> float:  # fitted seconds of a micro-batch (the better model)
        return fit.seconds([ds.sample(s).length for s in b], cfg.sched.capacity)

    optim = statistics.median(m["measured.optim_s_per_step"] for m in runs["flow"])
    kw = dict(enc_s=enc_t, bin_s=bin_t, optim_s=optim, warmup_steps=cfg.run.warmup_steps)
    sim = _simulate_variants(cfg, plans, prof["rho"], kw)
    validation = {
        k: {
            "simulated.samples_per_s": v.samples_per_s,
            "measured.samples_per_s_median": statistics.median(thr[k]),
            "error": v.samples_per_s / statistics.median(thr[k]) - 1,
        }
        for k, v in sim.items()
        if k in thr
    }
    return {
        "simulated.validation": validation,
        "simulated.projection": _project(cfg, plans, ds, kw),
        "measured.cost_fit": {"r2": fit.r2, "mape": fit.mape, "best": fit.best},
        "measured.profile": prof,
    }


def _encoder_seconds(prof: dict, ds: DigitCaptions) -> Callable[[int], float]:
    """Encoder seconds per sample id, fitted (NNLS) linear + quadratic in visual tokens."""
    from scipy.optimize import nnls

    n = np.asarray(prof["enc_tokens"], dtype=float)
    X = np.stack([n, n**2, np.ones_like(n)], 1)
    scale = X.max(0)
    a = nnls(X / scale, np.asarray(prof["enc_seconds"]))[0] / scale

    def enc_t(sid: int) -> float:
        n_vis = ds.sample(sid).n_visual
        return float(a @ np.array([n_vis, n_vis**2, 1.0]))

    return enc_t


def _simulate_variants(cfg: FlowConfig, plans: list[BatchPlan], rho: dict, kw: dict) -> dict:
    """The measured variants at 1+1 workers (simulated), to validate against the runs."""
    sp_e = rho["encoder"][2] / rho["encoder"][1]  # measured 2-thread speed-ups
    sp_b = rho["backbone"][2] / rho["backbone"][1]
    enc_t, bin_t = kw["enc_s"], kw["bin_s"]
    return {
        "flow": simulate(plans, mode="flow", producers=1, slots=cfg.pool.slots, **kw),
        "sync": simulate(plans, mode="sync", producers=1, slots=cfg.pool.slots, **kw),
        "monolithic_1t": simulate_monolithic(plans, **kw),
        # uses the profile's 2-thread speed-ups, which a loaded machine makes unreliable
        "monolithic": simulate_monolithic(
            plans,
            enc_s=lambda s: enc_t(s) / sp_e,
            bin_s=lambda b: bin_t(b) / sp_b,
            optim_s=kw["optim_s"],
            warmup_steps=kw["warmup_steps"],
        ),
    }


def _project(cfg: FlowConfig, plans: list[BatchPlan], ds: DigitCaptions, kw: dict) -> dict:
    """Projection to larger budgets R. The allocator gets the rates of the same per-sample models
    the simulator uses, so plan and simulation agree on the workload; every plan at a given R
    sees the same global batch (4 R samples); replicas run one thread each and scale linearly
    (assumed)."""
    enc_t, bin_t = kw["enc_s"], kw["bin_s"]
    ids = [i for k in range(cfg.run.steps) for i in ds.batch_ids(k)]
    rho_e = len(ids) / sum(enc_t(i) for i in ids)
    rho_b = len(ids) / sum(bin_t(b) for pl in plans for bins in pl.rank_bins for b in bins)
    r1 = {"encoder": {1: rho_e}, "backbone": {1: rho_b}}
    return {R: _projection_row(cfg, R, r1, dict(kw, warmup_steps=1)) for R in PROJECTION_BUDGETS}


def _projection_row(cfg: FlowConfig, R: int, r1: dict, kw: dict) -> dict:
    """At budget R: the allocator's plan and an even split, each simulated in flow mode (and the
    plan in sync mode), against R monolithic one-thread data-parallel replicas."""
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
        row[f"simulated.flow_{name}_samples_per_s"] = simulate(
            pplans, mode="flow", producers=P, slots=slots, **kw
        ).samples_per_s
        if name == "milp":
            row["simulated.sync_samples_per_s"] = simulate(
                pplans, mode="sync", producers=P, slots=slots, **kw
            ).samples_per_s
    # monolithic data parallelism: R one-thread replicas, each encoder + backbone
    mcfg = with_sets(cfg, [*base, f"run.consumers={R}"])
    mplans = make_plans(mcfg, DigitCaptions.from_config(mcfg))
    row["simulated.monolithic_1t_dp_samples_per_s"] = simulate_monolithic(
        mplans, replicas=R, **kw
    ).samples_per_s
    return row


# ------------------------------------------------------------------- allocator check


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


# ------------------------------------------------------------------- output


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/flow.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/flow.toml", help="TOML config file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set run.steps=4 (repeatable)",
    )
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    p.add_argument(
        "--workloads",
        default="encoder_heavy,backbone_heavy",
        help=f"comma-separated workload names ({', '.join(WORKLOADS)})",
    )
    p.add_argument("--no-ablations", action="store_true", help="only the three modes")
    p.add_argument("--out", default="", help="JSON path (default benchmarks/results/)")
    p.add_argument(
        "--alloc-check",
        type=int,
        default=0,
        metavar="R",
        help="instead: run the allocator's plan vs an even split at budget R",
    )
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = load_flow_config(args.config, args.set)
        if args.reps < 1:
            raise ConfigError(f"--reps = {args.reps}: must be at least 1")
        workloads = args.workloads.split(",")
        if args.alloc_check:
            res = alloc_check(cfg, workload=workloads[0], budget=args.alloc_check, reps=args.reps)
            print(json.dumps(res, indent=1, default=float))
            path = write(res, args.out or f"benchmarks/results/flow-alloc-{stamp()}.json")
        else:
            out = args.out or f"benchmarks/results/flow-{stamp()}.json"
            res = bench(
                cfg,
                reps=args.reps,
                workloads=workloads,
                ablations=not args.no_ablations,
                partial=out,
            )
            print(table(res))
            path = write(res, out)
        print(f"wrote {path}")
        return 0
    except ConfigError as e:
        print(f"benchmarks/flow.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
