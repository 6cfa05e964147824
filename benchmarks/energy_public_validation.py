"""Validation on the public single-GPU measurement set (docs/energy.md).

    .venv/bin/python benchmarks/energy_public_validation.py      # ~1 min on one core

Data: data/energy/transformer_energy_single_gpu.csv (MIT, MansMayaki/MLEnergyConsumption):
1,576 training runs of custom BERT/GPT models on A100 and a second GPU ('grid'), energy
measured by CodeCarbon (GPU+CPU+RAM). Every split is group-disjoint: a configuration family
(model|layers|width) is never on both sides. Metrics are medians over 20 repeated 70/30 splits,
seed 2026, as in the research note's reference check. Everything reported is a prediction of
measured energy; nothing is simulated. Writes benchmarks/results/energy_public_validation.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import provenance

from frugaltrain.energy.models import (
    EnergyPredictor,
    LogLinearLaw,
    StepTimeModel,
    conformal_coverage,
    evaluate,
    log_rmse,
    mape,
    r2_log,
)
from frugaltrain.energy.records import derive, load_records

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "energy" / "transformer_energy_single_gpu.csv"
RESULTS = ROOT / "benchmarks" / "results"

# Research note 3.4 (its own quick check, 20 group-held-out splits): (R^2 on ln E, MAPE).
REFERENCE = {
    "flops_only": (0.63, 0.26),
    "flops_lnM": (0.69, 0.24),
    "flops_lnM_hw_model": (0.86, 0.15),
    "duration_only": (0.986, 0.04),
}


# 1. The log-linear models (key, label, numeric features, categorical features). 'FLOPs' is the
# data set's own flops_counts column (as in the reference check); the analytic training FLOPs F
# of proxies.py are shown too.
LOGLINEAR = [
    ("flops_only", "ln FLOPs (data set column)", ("flops_reported",), ()),
    ("flops_lnM", "+ ln M", ("flops_reported", "M"), ()),
    ("flops_lnM_hw_model", "+ hardware and model dummies", ("flops_reported", "M"),
     ("hardware", "arch")),
    ("duration_only", "measured duration alone (post-run)", ("seconds",), ()),
    ("analytic_F_only", "ln F (analytic training FLOPs)", ("F",), ()),
    ("paper_law_C_M_hw", "paper law ln C, ln M (+hw, model; eta = 1 here)", ("C", "M"),
     ("hardware", "arch")),
]  # fmt: skip


def variants() -> dict[str, list[str]]:
    """Every row's model and evaluation, as `key=value` strings (splits: 70/30, seed 2026)."""
    out = {
        key: ["model=LogLinearLaw", f"numeric={','.join(num)}", f"categorical={','.join(cat)}"]
        + ["splits=200", "seed_range_of_20_split_medians=2026-2030"]
        for key, _, num, cat in LOGLINEAR
    }
    out["time_model"] = ["model=StepTimeModel", "target=seconds", "splits=20"]
    for mode in ("pre", "post"):
        out[f"roofline_{mode}_run"] = ["model=EnergyPredictor", f"energy={mode}", "splits=20"]
    for method in ("split", "cv"):
        conformal = ["model=EnergyPredictor", "energy=pre", f"conformal={method}", "alpha=0.05"]
        out[f"conformal_pre_run_{method}"] = [*conformal, "splits=20"]
    shift = ["train=smallest 75% by F", "test=largest 25% by F"]
    out["scale_shift_pre_run"] = ["model=EnergyPredictor", "energy=pre", *shift]
    return out


def _loglinear(numeric, categorical):
    def fit_predict(train, test):
        return LogLinearLaw(numeric, categorical).fit(train).predict(test)

    return fit_predict


def main() -> None:
    record = provenance.start("estimated", variants=variants())
    records = load_records(DATA)
    print(
        f"{len(records)} records, {len({r['group'] for r in records})} configuration families, "
        f"energy {records[0]['energy_label']}\n"
    )
    out: dict = record | {
        "what": "held-out predictions vs energy measured by CodeCarbon (GPU+CPU+RAM)",
        "data": "data/energy/transformer_energy_single_gpu.csv",
        "rows": {},
    }

    # 1. Reproduce the reference figures (LOGLINEAR).
    # A median over 20 splits moves by ~+-0.02 R^2 with the seed, as large as the tolerance:
    # the comparison uses 200 splits, and the spread of 20-split medians over 5 seeds is shown.
    print(
        f"{'log-linear model (reproduction, 200 splits)':<50} {'R2(ln)':>7} {'MAPE':>7}  "
        f"reference  dR2     20-split medians, 5 seeds"
    )
    for key, name, num, cat in LOGLINEAR:
        res = evaluate(records, _loglinear(num, cat), n_repeats=200)
        seeds = [
            evaluate(records, _loglinear(num, cat), seed=s)["r2_log"] for s in range(2026, 2031)
        ]
        res["r2_log_20split_seed_range"] = [min(seeds), max(seeds)]
        out["rows"][key] = res
        ref = REFERENCE.get(key)
        ref_s = (
            f"{ref[0]:.3f}/{100 * ref[1]:.0f}%  {res['r2_log'] - ref[0]:+.3f}" if ref else " " * 18
        )
        if ref:
            res["reference"] = {"r2_log": ref[0], "mape": ref[1]}
            res["within_0.03"] = abs(res["r2_log"] - ref[0]) <= 0.03
        print(
            f"{name:<50} {res['r2_log']:>7.3f} {100 * res['mape']:>6.1f}%  {ref_s}  "
            f"{min(seeds):.3f}-{max(seeds):.3f}"
        )

    # 2. The roofline models, pre-run (predicted time) and post-run (measured time).
    def time_model(tr, te):
        return StepTimeModel().fit(tr).predict(te)

    def pre(tr, te):
        return EnergyPredictor().fit(tr).predict_energy(te, "pre")

    def post(tr, te):
        return EnergyPredictor().fit(tr).predict_energy(te, "post")

    print(f"\n{'roofline models':<50} {'R2(ln)':>7} {'MAPE':>7}  RMSE(ln)  target")
    for key, name, fp, target in (
        ("time_model", "step-time roofline (pre-run)", time_model, "seconds"),
        ("roofline_pre_run", "energy roofline, predicted T (pre-run)", pre, "energy_j"),
        ("roofline_post_run", "energy roofline, measured T (post-run)", post, "energy_j"),
    ):
        res = evaluate(records, fp, target=target)
        out["rows"][key] = res
        print(
            f"{name:<50} {res['r2_log']:>7.3f} {100 * res['mape']:>6.1f}%  "
            f"{res['log_rmse']:>8.3f}  {'time' if target == 'seconds' else 'energy'}"
        )
    best_config_only = out["rows"]["flops_lnM_hw_model"]["mape"]
    pre_mape = out["rows"]["roofline_pre_run"]["mape"]
    print(
        f"pre-run target: MAPE <= 12% and below the best configuration-only log-linear "
        f"({100 * best_config_only:.1f}%): {100 * pre_mape:.1f}% -> "
        f"{'met' if pre_mape <= 0.12 and pre_mape < best_config_only else 'missed'}"
    )

    # 3. Conformal intervals on held-out families.
    print()
    for method in ("split", "cv"):
        cov = conformal_coverage(records, pre, n_repeats=20, method=method)
        out["rows"][f"conformal_pre_run_{method}"] = cov
        print(
            f"conformal 95%, pre-run, {method:<5}: coverage median {cov['coverage']:.3f} "
            f"(mean {cov['coverage_mean']:.3f}, IQR {cov['coverage_iqr'][0]:.2f}-"
            f"{cov['coverage_iqr'][1]:.2f}), half-width x/{cov['half_width_factor']:.2f}"
        )

    # 4. Scale shift: train on the smallest 75% by FLOPs per row, test on the largest 25%.
    flops = np.array([derive(r)["F"] for r in records])
    cut = np.quantile(flops, 0.75)
    small = [r for r, f in zip(records, flops, strict=True) if f <= cut]
    large = [r for r, f in zip(records, flops, strict=True) if f > cut]
    e_large = np.array([r["energy_j"] for r in large])
    p_large = pre(small, large)
    shift = {
        "mape": mape(p_large, e_large),
        "r2_log": r2_log(p_large, e_large),
        "log_rmse": log_rmse(p_large, e_large),
        "n_test": len(large),
    }
    out["rows"]["scale_shift_pre_run"] = shift
    print(
        f"\nscale shift, pre-run (train smallest 75% of F, test the rest): MAPE "
        f"{100 * shift['mape']:.1f}%, R2(ln) {shift['r2_log']:.3f} (risky regime, reported "
        "separately)"
    )

    model = EnergyPredictor().fit(records)
    out["energy_roofline"] = model.energy.named()
    out["time_ceilings"] = model.time.ceilings()
    print("\nfitted energy roofline, all records (per hardware):")
    for key, c in model.energy.named().items():
        print(
            f"  {key}: P_static {c['P_static_W']:.1f} W, e_F {c['e_F_J_per_flop']:.3g} J/FLOP, "
            f"e_Q {c['e_Q_J_per_byte']:.3g} J/B"
        )
    provenance.finish(out)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "energy_public_validation.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
