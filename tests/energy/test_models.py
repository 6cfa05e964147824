"""Fitting: synthetic recovery within 2 standard errors, conformal coverage, grouped splits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from frugaltrain.energy.models import (
    EnergyPredictor,
    EnergyRoofline,
    LogLinearLaw,
    StepTimeModel,
    conformal_coverage,
    evaluate,
    group_splits,
)
from frugaltrain.energy.records import derive, normalize


def _configs(rng: np.random.Generator, n: int) -> list[dict]:
    recs = []
    for i in range(n):
        L = int(rng.choice([2, 4, 6, 8, 12]))
        d = int(rng.choice([128, 256, 384, 512, 768, 1024]))
        strategy = str(rng.choice(["baseline", "ddp", "fsdp", "tp"]))
        recs.append(normalize({
            "n_layer": L, "n_embd": d, "n_head": int(rng.choice([2, 4, 8, 16])),
            "seq_len": int(rng.choice([64, 128, 512])),
            "batch_size": int(rng.choice([8, 16, 32])), "vocab_size": 0,
            "n_devices": 1 if strategy == "baseline" else int(rng.choice([2, 4])),
            "strategy": strategy, "hardware": "sim", "seconds": 1.0, "steps": 10,
            "group": f"g{i // 2}",
        }))  # fmt: skip
    return recs


def _within_2se(est: list[float], se: list[float], true: list[float]) -> None:
    for e, s, t in zip(est, se, true, strict=True):
        assert abs(e - t) <= 2 * s, f"estimate {e:.4g} +- {s:.2g} vs true {t:.4g}"


def test_energy_roofline_recovers_coefficients() -> None:
    rng = np.random.default_rng(7)
    recs = _configs(rng, 400)
    true = [60.0, 4e-13, 2e-11, 1e-10]  # W, J/FLOP, J/B, J/B (simulated device)
    for r in recs:
        f = derive(r)
        r["seconds"] = f["F"] / 1e14 * rng.uniform(1.0, 3.0)  # efficiency varies independently
        n = r["n_devices"]
        e = n * (true[0] * r["seconds"] + true[1] * f["F"] + true[2] * f["Q"] + true[3] * f["X"])
        r["energy_j"] = e * float(np.exp(rng.normal(0, 0.05)))
        r["energy_label"] = "simulated (known coefficients)"
    for r in recs:
        r["energy_label"] = "measured (simulated for the test)"  # the fitter only takes measured
    m = EnergyRoofline().fit(recs)
    _within_2se(m.coef["sim"], m.se["sim"], true)


def test_step_time_model_recovers_ceilings() -> None:
    rng = np.random.default_rng(3)
    recs = _configs(rng, 300)
    true = [1 / 2e13, 1 / 5e12, 1 / 4e11, 1 / 8e11, 1 / 1e12, 2e-3, 3e-4]  # TIME_TERMS
    model = StepTimeModel()
    X = model.design(recs)
    for r, x in zip(recs, X, strict=True):
        r["seconds"] = float(x @ true) * float(np.exp(rng.normal(0, 0.05)))
    model.fit(recs)
    key = "sim|gpt"
    _within_2se(model.coef[key], model.se[key], true)


def test_log_linear_law_recovers_exponents() -> None:
    rng = np.random.default_rng(11)
    recs = _configs(rng, 400)
    aC, aM, aEta, g = 0.3, 0.4, -1.0, {"ddp": 0.1, "fsdp": -0.3, "tp": -0.5}
    for r in recs:
        f = derive(r)
        r["eta"] = 1.0 if r["strategy"] == "baseline" else float(rng.uniform(0.2, 1.0))
        ln_e = -5 + aC * np.log(f["C"]) + aM * np.log(f["M"]) + aEta * np.log(r["eta"])
        r["energy_j"] = float(np.exp(ln_e + g.get(r["strategy"], 0.0) + rng.normal(0, 0.1)))
    law = LogLinearLaw(("C", "M", "eta"), ("strategy",)).fit(recs)
    assert law.names == ["intercept", "ln C", "ln M", "ln eta", "strategy=ddp", "strategy=fsdp",
                         "strategy=tp"]  # fmt: skip
    _within_2se(law.coef[1:], law.se[1:], [aC, aM, aEta, g["ddp"], g["fsdp"], g["tp"]])


def test_conformal_coverage_at_nominal_95() -> None:
    rng = np.random.default_rng(5)
    recs = _configs(rng, 600)
    for r in recs:
        f = derive(r)
        r["energy_j"] = float(0.01 * f["C"] ** 0.5 * np.exp(rng.normal(0, 0.1)))
        r["energy_label"] = "measured (simulated for the test)"

    def fit_predict(train, test):
        return LogLinearLaw(("C",), ()).fit(train).predict(test)

    cov = conformal_coverage(recs, fit_predict, alpha=0.05, n_repeats=10)
    assert 0.90 <= cov["coverage"] <= 0.99
    assert cov["half_width_factor"] == pytest.approx(np.exp(1.96 * 0.1), rel=0.15)


def test_group_splits_are_disjoint() -> None:
    groups = [f"g{i % 13}" for i in range(100)]
    for tr, te in group_splits(groups, n_repeats=5):
        assert not {groups[i] for i in tr} & {groups[i] for i in te}
        assert len(tr) + len(te) == 100


def test_predictor_drops_estimates_and_round_trips(tmp_path) -> None:
    rng = np.random.default_rng(1)
    recs = _configs(rng, 120)
    for r in recs:
        f = derive(r)
        r["seconds"] = f["F"] / 1e13 + 0.01 * r["steps"]
        r["energy_j"] = 80.0 * r["seconds"] * r["n_devices"] * float(np.exp(rng.normal(0, 0.03)))
        r["energy_label"] = "measured (simulated for the test)"
    junk = dict(recs[0], energy_j=1e9, energy_label="estimated (CPU time x 10 W/core)")
    pred = EnergyPredictor().fit([*recs, junk])
    again = EnergyPredictor.from_dict(json.loads(json.dumps(pred.to_dict())))
    e_pre = again.predict_energy(recs, "pre")
    assert np.allclose(e_pre, pred.predict_energy(recs, "pre"))
    assert np.median(np.abs(e_pre / np.array([r["energy_j"] for r in recs]) - 1)) < 0.1
    lo, hi = again.interval(e_pre, "pre")
    assert np.all(lo < e_pre) and np.all(e_pre < hi)
    res = evaluate(
        recs, lambda tr, te: EnergyPredictor().fit(tr).predict_energy(te, "post"), n_repeats=3
    )
    assert res["mape"] < 0.1
