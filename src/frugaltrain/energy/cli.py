"""`frugaltrain energy`: measure a command, fit models to records, predict a run's energy.

    frugaltrain energy measure -- python train.py              # energy of any command
    frugaltrain energy measure --append recs.jsonl --tag n_layer=2 ... -- CMD   # build a data set
    frugaltrain energy fit data/energy/transformer_energy_single_gpu.csv --out fit.json
    frugaltrain energy predict --model fit.json --config examples/default.toml --hardware a100

Every number printed says whether it is measured, estimated or predicted.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import tomllib

from frugaltrain.config import ArgumentParser
from frugaltrain.energy.meter import open_meter
from frugaltrain.energy.models import (
    EnergyPredictor,
    LogLinearLaw,
    StepTimeModel,
    conformal_coverage,
    cross_fit,
    evaluate,
    measured_only,
)
from frugaltrain.energy.records import derive, load_records, normalize


def _parse_tags(tags: list[str]) -> dict:
    out = {}
    for t in tags:
        key, sep, value = t.partition("=")
        if not sep:
            raise ValueError(f"--tag {t!r}: use KEY=VALUE, e.g. --tag n_layer=2")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_measure(args: argparse.Namespace) -> int:
    if not args.cmd:
        print("frugaltrain energy measure: give a command after --", file=sys.stderr)
        return 2
    tags = _parse_tags(args.tag)
    meter = open_meter(args.device, args.watts_per_core, include_children=True)
    meter.start()
    rc = subprocess.call(args.cmd)
    r = meter.stop()
    joules = "n/a" if r.joules is None else f"{r.joules:.1f}"
    watts = "n/a" if r.watts is None else f"{r.watts:.1f}"
    print(f"{'command':<10} {' '.join(args.cmd)}")
    print(f"{'exit':<10} {rc}")
    print(f"{'time_s':<10} {r.seconds:.3f}  (measured)")
    print(f"{'energy_J':<10} {joules}  ({r.label})")
    print(f"{'power_W':<10} {watts}  ({r.source})")
    for dom, j in r.domains.items():
        print(f"  {dom:<24} {j:.1f} J")
    if r.notes:
        print(f"{'notes':<10} {r.notes}")
    if args.append:
        rec = {**tags, "energy_j": r.joules, "energy_label": r.label, "seconds": r.seconds}
        with open(args.append, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        print(f"appended a record to {args.append}")
    return rc


def _row(name: str, res: dict, what: str) -> str:
    return (
        f"{name:<44} {res['r2_log']:>7.3f} {100 * res['mape']:>7.1f}% "
        f"{res['log_rmse']:>8.3f}   {what}"
    )


def cmd_fit(args: argparse.Namespace) -> int:
    records = load_records(args.data)
    n_all = len(records)
    if not args.allow_estimates:
        records = measured_only(records)
    if len(records) < 10:
        print(
            f"frugaltrain energy fit: {len(records)} measured records of {n_all} in {args.data};"
            " need at least 10 (estimated energy is not a fitting target unless "
            "--allow-estimates)",
            file=sys.stderr,
        )
        return 2
    labels = sorted({r["energy_label"] for r in records})
    n_groups = len({r["group"] for r in records})
    print(f"{len(records)} records ({', '.join(labels)}), {n_groups} configuration families")
    print(f"held-out metrics: median of {args.splits} group-disjoint 70/30 splits\n")
    print(f"{'model':<44} {'R2(ln)':>7} {'MAPE':>8} {'RMSE(ln)':>8}   target")

    def pre(tr, te):
        return EnergyPredictor().fit(tr).predict_energy(te, "pre")

    def post(tr, te):
        return EnergyPredictor().fit(tr).predict_energy(te, "post")

    def time_model(tr, te):
        return StepTimeModel().fit(tr).predict(te)

    results = {
        "time_model": evaluate(records, time_model, "seconds", args.splits),
        "roofline_pre_run": evaluate(records, pre, n_repeats=args.splits),
        "roofline_post_run": evaluate(records, post, n_repeats=args.splits),
    }
    hw_cats = tuple(c for c in ("hardware", "arch", "strategy") if len({r[c] for r in records}) > 1)
    baselines = {
        "loglinear_F_M_config": (("F", "M"), hw_cats),
        "loglinear_duration_only": (("seconds",), ()),
    }
    for name, (num, cat) in baselines.items():
        results[name] = evaluate(
            records, lambda tr, te, n=num, c=cat: LogLinearLaw(n, c).fit(tr).predict(te),
            n_repeats=args.splits,
        )  # fmt: skip
    print(_row("step-time roofline (pre-run)", results["time_model"], "time, predicted"))
    print(_row("energy roofline, predicted T (pre-run)", results["roofline_pre_run"], "energy"))
    print(_row("energy roofline, measured T (post-run)", results["roofline_post_run"], "energy"))
    print(_row(f"log-linear ln F, ln M + {'/'.join(hw_cats) or '-'}",
               results["loglinear_F_M_config"], "energy"))  # fmt: skip
    print(_row("log-linear ln T only (post-run)", results["loglinear_duration_only"], "energy"))
    print()
    for method in ("split", "cv"):
        cov = conformal_coverage(records, pre, n_repeats=min(args.splits, 10), method=method)
        results[f"conformal_pre_run_{method}"] = cov
        print(
            f"conformal {100 * cov['nominal']:.0f}% intervals, pre-run, {method:<5}: coverage "
            f"{cov['coverage']:.3f} (IQR {cov['coverage_iqr'][0]:.2f}-"
            f"{cov['coverage_iqr'][1]:.2f}), half-width x/{cov['half_width_factor']:.2f}"
        )
    model = EnergyPredictor().calibrate(records, method="cv")
    print("\nfitted energy roofline (all records):")
    for key, c in model.energy.named().items():
        print(
            f"  {key}: P_static {c['P_static_W']:.1f} W, e_F {c['e_F_J_per_flop']:.3g} J/FLOP, "
            f"e_Q {c['e_Q_J_per_byte']:.3g} J/B, e_X {c['e_X_J_per_byte']:.3g} J/B"
        )
    if args.out:
        fit = {**model.to_dict(), "data": str(args.data), "cv": results, "labels": labels}
        Path(args.out).write_text(json.dumps(fit, indent=1))
        print(f"wrote {args.out}")
    if args.plot:
        oof = {m: cross_fit(records, f) for m, f in (("pre-run", pre), ("post-run", post))}
        plot_predicted_vs_measured(records, oof, args.plot, title=str(Path(args.data).name))
        print(f"wrote {args.plot}")
    return 0


def plot_predicted_vs_measured(
    records: list[dict], preds: dict[str, np.ndarray], path: str, title: str = ""
) -> None:
    """Log-log scatter of out-of-fold predicted against measured energy, one panel per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = np.array([r["energy_j"] for r in records])
    fig, axes = plt.subplots(1, len(preds), figsize=(5 * len(preds), 4.6), squeeze=False)
    for ax, (mode, p) in zip(axes[0], preds.items(), strict=True):
        for hw in sorted({r["hardware"] for r in records}):
            m = np.array([r["hardware"] == hw for r in records])
            ax.scatter(e[m], p[m], s=6, alpha=0.5, label=hw)
        lo, hi = e.min() * 0.8, e.max() * 1.25
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
        ax.set_xlabel("measured energy (J)")
        ax.set_ylabel(f"predicted energy, {mode} (J)")
        mape = np.mean(np.abs(p / e - 1))
        ax.set_title(f"{title}\n{mode}, out-of-fold by family: MAPE {100 * mape:.1f}%")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def record_from_run_config(path: str, hardware: str, arch: str = "gpt") -> dict:
    """A prediction record for a `frugaltrain train` TOML config (config/training.py defaults)."""
    with open(path, "rb") as fh:
        cfg = tomllib.load(fh)
    run, data, model = cfg.get("run", {}), cfg.get("data", {}), cfg.get("model", {})
    outer = cfg.get("outer", {})
    workers = int(run.get("workers", 1))
    strategy = outer.get("strategy", "diloco")
    return normalize({
        "n_layer": model.get("n_layer", 2), "n_embd": model.get("n_embd", 128),
        "n_head": model.get("n_head", 4), "vocab_size": model.get("vocab_size", 256),
        "seq_len": data.get("seq_len", 128), "batch_size": data.get("batch_size", 16),
        "steps": run.get("steps", 200), "n_devices": workers,
        "strategy": "ddp" if workers > 1 else "baseline",
        # DiLoCo all-reduces once per outer round of H inner steps; DDP every step.
        "comm_every": 1 if strategy == "ddp" else outer.get("H", 50),
        "hardware": hardware, "arch": arch, "seconds": 0.0,
    })  # fmt: skip


def cmd_predict(args: argparse.Namespace) -> int:
    fit = json.loads(Path(args.model).read_text())
    model = EnergyPredictor.from_dict(fit)
    keys = sorted(model.energy.coef)
    hardware = args.hardware or (keys[0] if len(keys) == 1 else None)
    if hardware not in keys:
        print(
            f"frugaltrain energy predict: --hardware {args.hardware!r} is not in the fit; "
            f"choose one of {keys}",
            file=sys.stderr,
        )
        return 2
    rec = record_from_run_config(args.config, hardware, args.arch)
    if f"{hardware}|{args.arch}" not in model.time.coef:
        print(
            f"frugaltrain energy predict: no time model for {hardware}|{args.arch}; "
            f"the fit has {sorted(model.time.coef)} (--arch)",
            file=sys.stderr,
        )
        return 2
    f = derive(rec)
    t = float(model.time.predict([rec])[0])
    e = float(model.predict_energy([rec], "pre")[0])
    lo, hi = model.interval(np.array([e]), "pre")
    c = model.energy.named()[hardware]
    print(f"config {args.config} on {hardware} ({rec['n_devices']} device(s), {args.arch})")
    print(f"{'params':<28} {f['params']:,}  (analytic)")
    print(f"{'training FLOPs per device':<28} {f['F']:.3e}  (analytic)")
    print(f"{'memory traffic per device':<28} {f['Q']:.3e} B  (analytic proxy)")
    print(f"{'comm bytes per device':<28} {f['X']:.3e} B  (analytic proxy)")
    print(f"{'time':<28} {t:.1f} s  (predicted, roofline time model)")
    band = "" if math.isinf(model.q_pre) else f"  [{lo[0]:.0f}, {hi[0]:.0f}] at 95%"
    rng = model.train_range.get("ln_flops_per_step")
    ln_fps = math.log(f["F"] / rec["steps"])
    if rng and not rng[0] <= ln_fps <= rng[1]:
        print(
            f"warning: extrapolating: {math.exp(ln_fps):.2e} FLOPs per step is outside the fit's "
            f"range [{math.exp(rng[0]):.2e}, {math.exp(rng[1]):.2e}]; the interval does not cover "
            "this"
        )
    print(f"{'energy':<28} {e:.0f} J{band}  (predicted, pre-run)")
    n = rec["n_devices"]
    parts = {
        "static (N P_static T)": n * c["P_static_W"] * t,
        "compute (e_F F)": n * c["e_F_J_per_flop"] * f["F"],
        "memory (e_Q Q)": n * c["e_Q_J_per_byte"] * f["Q"],
        "communication (e_X X)": n * c["e_X_J_per_byte"] * f["X"],
    }
    for name, j in parts.items():
        print(f"  {name:<26} {j:.0f} J")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="frugaltrain energy", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("measure", help="energy of a command (measured, or a labelled estimate)")
    m.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    m.add_argument(
        "--watts-per-core",
        type=float,
        default=None,
        help="per-core W for the CPU-time estimate when no counter (default 10)",
    )
    m.add_argument("--append", metavar="FILE.jsonl", help="append the reading as a record")
    m.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="record field for --append, e.g. --tag n_layer=2 (repeatable)",
    )
    m.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    f = sub.add_parser("fit", help="fit time/energy models to records, grouped CV, plot")
    f.add_argument("data", help="records: .csv or .jsonl")
    f.add_argument("--out", default="energy_fit.json", help="fit file (default energy_fit.json)")
    f.add_argument("--plot", default="energy_fit.png", help="predicted-vs-measured PNG")
    f.add_argument("--splits", type=int, default=20, help="group-disjoint 70/30 splits")
    f.add_argument(
        "--allow-estimates",
        action="store_true",
        help="also fit records whose energy is an estimate (not recommended)",
    )
    r = sub.add_parser("predict", help="predict time and energy of a run config before running")
    r.add_argument("--model", required=True, help="fit file written by `energy fit`")
    r.add_argument("--config", required=True, help="run config TOML (as for `frugaltrain train`)")
    r.add_argument("--hardware", help="hardware key of the fit (default: the only one)")
    r.add_argument("--arch", default="gpt", help="architecture key of the time model")
    return p  # fmt: skip


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.verb == "measure":
        args.cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        return {"measure": cmd_measure, "fit": cmd_fit, "predict": cmd_predict}[args.verb](args)
    except ValueError as e:
        print(f"frugaltrain energy: error: {e}", file=sys.stderr)
        return 2
