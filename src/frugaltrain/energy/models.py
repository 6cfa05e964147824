"""Energy and time models fitted from measurement records, with honest held-out evaluation.

Three models (research note 1.3 and 3.3):

  StepTimeModel   roofline time, fitted per hardware|arch by non-negative least squares on
                  relative error:  T = F_mm/Pi_mm + F_att/Pi_att + Q_act/B_act + Q_score/B_s
                                       + Q_w/B_w + steps*tau0 + L*steps*tau_L
                  (each 1/Pi, 1/B an effective ceiling; tau0 a fixed per-step overhead and
                  tau_L a per-layer one: kernel launches and dispatch scale with layers).
  EnergyRoofline  E = N*P_static*T + e_F*F + e_Q*Q + e_X*X, NNLS per hardware (Choi et al.,
                  IPDPS 2013, plus link bytes). Post-run mode uses the measured T, pre-run mode
                  the StepTimeModel's T: the time error and the energy error show up separately.
  LogLinearLaw    the paper's law (arXiv 2606.23546, artifact form):
                  ln E = b0 + a_C ln C + a_M ln M + a_eta ln eta + sum_k g_k 1[strategy = k]
                  by OLS on centred regressors, Duan smearing on the way back. Any numeric record
                  column can be a regressor (ln T gives the 'measured duration alone' baseline).

Evaluation: repeated group-disjoint splits (a configuration family is never on both sides),
MAPE, RMSE and R^2 on ln E, and split-conformal intervals on |ln residual|.
Records labelled 'estimated' or 'unavailable' are never fitting targets unless asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from frugaltrain.energy.records import derive, is_measured

TIME_TERMS = ("F_mm", "F_att", "Q_act", "Q_score", "Q_w", "steps", "layer_steps")
ENERGY_TERMS = ("NT", "F", "Q", "X")


def _col(records: list[dict], key: str) -> np.ndarray:
    out = []
    for r in records:
        if key in r:
            out.append(r[key])
        else:
            out.append(r.setdefault("_derived", derive(r))[key])
    return np.asarray(out, dtype=float)


def measured_only(records: list[dict]) -> list[dict]:
    """Records whose energy is a measurement (estimates are not fitting targets)."""
    return [r for r in records if is_measured(r)]


# ----------------------------------------------------------------------------------------------
# Metrics and splits


def mape(pred: np.ndarray, true: np.ndarray) -> float:
    return float(np.mean(np.abs(pred / true - 1.0)))


def log_rmse(pred: np.ndarray, true: np.ndarray) -> float:
    return float(np.sqrt(np.mean((np.log(pred) - np.log(true)) ** 2)))


def r2_log(pred: np.ndarray, true: np.ndarray) -> float:
    y, p = np.log(true), np.log(pred)
    return float(1.0 - np.sum((y - p) ** 2) / np.sum((y - y.mean()) ** 2))


def group_splits(
    groups: list[str], n_repeats: int = 20, test_frac: float = 0.3, seed: int = 2026
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Repeated group-disjoint splits: (train_idx, test_idx), ~test_frac of the groups held out."""
    g = np.asarray(groups)
    uniq = np.unique(g)
    n_test = max(1, int(round(test_frac * len(uniq))))
    if n_test >= len(uniq):
        raise ValueError(f"need at least 2 groups for a grouped split, got {len(uniq)}")
    rng = np.random.default_rng(seed)
    for _ in range(n_repeats):
        test_groups = rng.permutation(uniq)[:n_test]
        test = np.isin(g, test_groups)
        yield np.flatnonzero(~test), np.flatnonzero(test)


def conformal_quantile(abs_log_resid: np.ndarray, alpha: float = 0.05) -> float:
    """Split-conformal radius: the ceil((n+1)(1-alpha))-th smallest |ln residual| (inf: too few)."""
    n = len(abs_log_resid)
    k = math.ceil((n + 1) * (1 - alpha))
    if k > n:
        return math.inf
    return float(np.sort(abs_log_resid)[k - 1])


# ----------------------------------------------------------------------------------------------
# Non-negative fits with standard errors


def _nnls_relative(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """min ||(X c - y) / y|| subject to c >= 0; returns (c, standard errors).

    Columns are scaled to unit max before NNLS for conditioning. Standard errors are the
    weighted-least-squares ones on the active (non-zero) set; zeros get SE nan.
    """
    A = X / y[:, None]
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    c_scaled, _ = nnls(A / scale, np.ones(len(y)), maxiter=50 * X.shape[1])
    c = c_scaled / scale
    se = np.full(X.shape[1], np.nan)
    active = c > 0
    dof = len(y) - int(active.sum())
    if active.any() and dof > 0:
        resid = A @ c - 1.0
        sigma2 = float(resid @ resid) / dof
        Aa = A[:, active]
        try:
            cov = sigma2 * np.linalg.inv(Aa.T @ Aa)
            se[active] = np.sqrt(np.diag(cov))
        except np.linalg.LinAlgError:
            pass
    return c, se


def _key(rec: dict, by: tuple[str, ...]) -> str:
    return "|".join(str(rec[k]) for k in by)


def _by_key(records: list[dict], by: tuple[str, ...]) -> Iterator[tuple[str, list[dict]]]:
    """The records grouped by their `by` key (e.g. 'a100|gpt'), keys in sorted order."""
    for key in sorted({_key(r, by) for r in records}):
        yield key, [r for r in records if _key(r, by) == key]


def _predict_by_key(
    X: np.ndarray, records: list[dict], by: tuple[str, ...], coef: dict[str, list[float]], what: str
) -> np.ndarray:
    """Row i of the design X times the coefficients fitted for record i's key; a key with no
    fit raises, naming the model (`what`)."""
    out = np.empty(len(records))
    for i, r in enumerate(records):
        key = _key(r, by)
        if key not in coef:
            raise ValueError(f"no {what} model for {'|'.join(by)} = {key!r}")
        out[i] = X[i] @ np.asarray(coef[key])
    return out


@dataclass
class StepTimeModel:
    """Roofline step-time model (see module docstring), one coefficient set per `by` key."""

    by: tuple[str, ...] = ("hardware", "arch")
    terms: tuple[str, ...] = TIME_TERMS
    coef: dict[str, list[float]] = field(default_factory=dict)
    se: dict[str, list[float]] = field(default_factory=dict)

    def design(self, records: list[dict]) -> np.ndarray:
        return np.column_stack([_col(records, t) for t in self.terms])

    def fit(self, records: list[dict]) -> StepTimeModel:
        for key, sub in _by_key(records, self.by):
            c, se = _nnls_relative(self.design(sub), _col(sub, "seconds"))
            self.coef[key], self.se[key] = c.tolist(), se.tolist()
        return self

    def predict(self, records: list[dict]) -> np.ndarray:
        return _predict_by_key(self.design(records), records, self.by, self.coef, "time")

    def ceilings(self) -> dict[str, dict[str, float]]:
        """Effective ceilings per key: FLOP/s, bytes/s, tau0 in s/step, tau_layer in s per layer
        pass (None where NNLS left a term unused: that resource never limited the fit)."""
        units = {"F_mm": "flop/s", "F_att": "flop/s", "Q_act": "B/s", "Q_score": "B/s"}
        units.update({"Q_w": "B/s"})
        out = {}
        for key, c in self.coef.items():
            row = {}
            for t, v in zip(self.terms, c, strict=True):
                if t == "steps":
                    row["tau0_s"] = v
                elif t == "layer_steps":
                    row["tau_layer_s"] = v
                else:
                    row[f"{t}_{units[t]}"] = (1.0 / v) if v > 0 else None
            out[key] = row
        return out


@dataclass
class EnergyRoofline:
    """E = N*P_static*T + e_F*F + e_Q*Q + e_X*X per hardware, non-negative (J, W, J/FLOP, J/B)."""

    by: tuple[str, ...] = ("hardware",)
    coef: dict[str, list[float]] = field(default_factory=dict)
    se: dict[str, list[float]] = field(default_factory=dict)

    @staticmethod
    def design(records: list[dict], seconds: np.ndarray) -> np.ndarray:
        """Columns N*T, N*F, N*Q, N*X (the proxies are per device)."""
        n = _col(records, "n_devices")
        return n[:, None] * np.column_stack(
            [seconds, _col(records, "F"), _col(records, "Q"), _col(records, "X")]
        )

    def fit(self, records: list[dict]) -> EnergyRoofline:
        records = measured_only(records)
        for key, sub in _by_key(records, self.by):
            X = self.design(sub, _col(sub, "seconds"))
            c, se = _nnls_relative(X, _col(sub, "energy_j"))
            self.coef[key], self.se[key] = c.tolist(), se.tolist()
        return self

    def predict(self, records: list[dict], seconds: np.ndarray) -> np.ndarray:
        return _predict_by_key(self.design(records, seconds), records, self.by, self.coef, "energy")

    def named(self) -> dict[str, dict[str, float]]:
        names = ("P_static_W", "e_F_J_per_flop", "e_Q_J_per_byte", "e_X_J_per_byte")
        return {k: dict(zip(names, c, strict=True)) for k, c in self.coef.items()}


@dataclass
class LogLinearLaw:
    """ln E = b0 + sum_j a_j (ln x_j - mean) + sum_k g_k 1[cat = k], by OLS.

    Args:
        numeric: record columns entering as logarithms, e.g. ('C', 'M', 'eta').
        categorical: record columns entering as dummies (first level is the reference).
    """

    numeric: tuple[str, ...] = ("C", "M", "eta")
    categorical: tuple[str, ...] = ("strategy",)
    names: list[str] = field(default_factory=list)
    coef: list[float] = field(default_factory=list)
    se: list[float] = field(default_factory=list)
    means: list[float] = field(default_factory=list)
    levels: dict[str, list[str]] = field(default_factory=dict)
    smear: float = 1.0
    target: str = "energy_j"

    def _design(self, records: list[dict], fitting: bool) -> np.ndarray:
        cols, names = [], []
        for k in self.numeric:
            cols.append(np.log(np.array([_value(r, k) for r in records])))
            names.append(f"ln {k}")
        Xn = np.column_stack(cols) if cols else np.zeros((len(records), 0))
        if fitting:
            self.means = Xn.mean(axis=0).tolist()
            self.levels = {c: sorted({str(r[c]) for r in records}) for c in self.categorical}
        Xn = Xn - np.asarray(self.means)
        dummies = []
        for c in self.categorical:
            for lev in self.levels[c][1:]:
                dummies.append(np.array([str(r[c]) == lev for r in records], dtype=float))
                names.append(f"{c}={lev}")
        X = np.column_stack([np.ones(len(records)), Xn, *dummies])
        if fitting:
            self.names = ["intercept", *names]
        return X

    def fit(self, records: list[dict]) -> LogLinearLaw:
        X = self._design(records, fitting=True)
        y = np.log(_col(records, self.target))
        keep = np.ones(X.shape[1], dtype=bool)
        keep[1:] = X[:, 1:].std(axis=0) > 0  # a constant regressor (eta = 1 everywhere) drops
        beta = np.zeros(X.shape[1])
        beta[keep], *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        resid = y - X @ beta
        dof = max(1, len(y) - int(keep.sum()))
        sigma2 = float(resid @ resid) / dof
        se = np.full(X.shape[1], np.nan)
        se[keep] = np.sqrt(np.diag(sigma2 * np.linalg.pinv(X[:, keep].T @ X[:, keep])))
        self.coef, self.se = beta.tolist(), se.tolist()
        self.smear = float(np.mean(np.exp(resid)))  # Duan's smearing estimate
        return self

    def predict(self, records: list[dict]) -> np.ndarray:
        return np.exp(self._design(records, fitting=False) @ np.asarray(self.coef)) * self.smear


def _value(rec: dict, key: str) -> float:
    if key == "eta":
        return float(rec.get("eta") or 1.0)
    if key in rec:
        return float(rec[key])
    return float(rec.setdefault("_derived", derive(rec))[key])


# ----------------------------------------------------------------------------------------------
# The combined predictor and its evaluation


@dataclass
class EnergyPredictor:
    """Time model + energy roofline + conformal radius: what `energy fit` writes and
    `energy predict` reads. `predict` returns energy (J), time (s) and a 1-alpha interval."""

    time: StepTimeModel = field(default_factory=StepTimeModel)
    energy: EnergyRoofline = field(default_factory=EnergyRoofline)
    q_pre: float = math.inf
    q_post: float = math.inf
    alpha: float = 0.05
    calibration: str = "none"
    train_range: dict = field(default_factory=dict)

    def fit(self, records: list[dict]) -> EnergyPredictor:
        """Fit the time and energy models on the measured records (point predictions only)."""
        records = measured_only(records)
        self.time, self.energy = StepTimeModel().fit(records), EnergyRoofline().fit(records)
        lnF = np.log(_col(records, "F") / _col(records, "steps"))
        self.train_range = {"ln_flops_per_step": [float(lnF.min()), float(lnF.max())]}
        return self

    def calibrate(self, records: list[dict], method: str = "cv", k: int = 5) -> EnergyPredictor:
        """Set the conformal radii q_pre, q_post from held-out |ln residuals|.

        method 'cv': residuals of a group k-fold cross-fit over all records (every family is
        calibration data once; tighter and steadier than one split when families are few).
        method 'split': one group-disjoint 75/25 split, textbook split-conformal.
        The point models are then refitted on all records; the radii keep their calibration.
        """
        records = measured_only(records)
        e = _col(records, "energy_j")
        for mode in ("pre", "post"):

            def fp(tr, te, mode=mode):
                return EnergyPredictor().fit(tr).predict_energy(te, mode)

            if method == "cv":
                resid = np.abs(np.log(cross_fit(records, fp, k) / e))
            elif method == "split":
                tr, cal = next(group_splits([r["group"] for r in records], 1, 0.25, 0))
                resid = np.abs(
                    np.log(fp([records[i] for i in tr], [records[i] for i in cal]) / e[cal])
                )
            else:
                raise ValueError(f"method = {method!r}: use 'cv' or 'split'")
            setattr(self, f"q_{mode}", conformal_quantile(resid, self.alpha))
        self.calibration = method
        return self.fit(records)

    def predict_energy(self, records: list[dict], mode: str = "pre") -> np.ndarray:
        if mode == "post":
            return self.energy.predict(records, _col(records, "seconds"))
        if mode == "pre":
            return self.energy.predict(records, self.time.predict(records))
        raise ValueError(f"mode = {mode!r}: use 'pre' (predicted time) or 'post' (measured time)")

    def interval(self, energy: np.ndarray, mode: str = "pre") -> tuple[np.ndarray, np.ndarray]:
        q = self.q_pre if mode == "pre" else self.q_post
        return energy * math.exp(-q), energy * math.exp(q)

    def to_dict(self) -> dict:
        return {
            "kind": "frugaltrain.energy.EnergyPredictor/v1",
            "time": {"by": list(self.time.by), "terms": list(self.time.terms),
                     "coef": self.time.coef, "se": self.time.se},
            "energy": {"by": list(self.energy.by), "coef": self.energy.coef,
                       "se": self.energy.se, "named": self.energy.named()},
            "conformal": {"alpha": self.alpha, "method": self.calibration,  # null: uncalibrated
                          "q_pre": None if math.isinf(self.q_pre) else self.q_pre,
                          "q_post": None if math.isinf(self.q_post) else self.q_post},
            "train_range": self.train_range,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> EnergyPredictor:
        if d.get("kind") != "frugaltrain.energy.EnergyPredictor/v1":
            raise ValueError(f"not an energy fit file (kind = {d.get('kind')!r})")
        t, e, c = d["time"], d["energy"], d["conformal"]
        return cls(
            time=StepTimeModel(tuple(t["by"]), tuple(t["terms"]), t["coef"], t["se"]),
            energy=EnergyRoofline(tuple(e["by"]), e["coef"], e["se"]),
            q_pre=math.inf if c["q_pre"] is None else c["q_pre"],
            q_post=math.inf if c["q_post"] is None else c["q_post"],
            alpha=c["alpha"],
            calibration=c.get("method", "none"),
            train_range=d.get("train_range", {}),
        )


# fit_predict(train, test): fits a model on `train` records, returns its predictions on `test`.
FitPredict = Callable[[list[dict], list[dict]], np.ndarray]


def evaluate(
    records: list[dict],
    fit_predict: FitPredict,
    target: str = "energy_j",
    n_repeats: int = 20,
    test_frac: float = 0.3,
    seed: int = 2026,
) -> dict[str, float]:
    """Median (and IQR) held-out MAPE, log-RMSE and R^2(ln) over repeated group-disjoint splits.

    `fit_predict(train, test)` fits on train and returns predictions of `target` on test.
    """
    groups = [r["group"] for r in records]
    stats: dict[str, list[float]] = {"mape": [], "log_rmse": [], "r2_log": []}
    for tr, te in group_splits(groups, n_repeats, test_frac, seed):
        train, test = [records[i] for i in tr], [records[i] for i in te]
        pred, true = fit_predict(train, test), _col(test, target)
        stats["mape"].append(mape(pred, true))
        stats["log_rmse"].append(log_rmse(pred, true))
        stats["r2_log"].append(r2_log(pred, true))
    out = {}
    for k, v in stats.items():
        out[k] = float(np.median(v))
        out[f"{k}_iqr"] = [float(np.percentile(v, 25)), float(np.percentile(v, 75))]
    out["n_splits"] = n_repeats
    return out


def cross_fit(
    records: list[dict],
    fit_predict: FitPredict,
    k: int = 5,
    seed: int = 2026,
) -> np.ndarray:
    """Out-of-fold predictions from a group k-fold: each record predicted by a model that never
    saw its configuration family (for predicted-vs-measured plots)."""
    groups = np.asarray([r["group"] for r in records])
    uniq = np.random.default_rng(seed).permutation(np.unique(groups))
    out = np.full(len(records), np.nan)
    for fold in range(min(k, len(uniq))):
        test = np.isin(groups, uniq[fold::k])
        tr, te = np.flatnonzero(~test), np.flatnonzero(test)
        out[te] = fit_predict([records[i] for i in tr], [records[i] for i in te])
    return out


def conformal_coverage(
    records: list[dict],
    fit_predict: FitPredict,
    alpha: float = 0.05,
    n_repeats: int = 20,
    seed: int = 2026,
    method: str = "split",
) -> dict[str, float]:
    """Empirical coverage and multiplicative half-width of conformal intervals on held-out
    families, over repeated group-disjoint 70/30 splits.

    method 'split': the 70% is split again 50/20 into proper-train / calibration families.
    method 'cv': calibration residuals come from a group 5-fold cross-fit on the 70%, and the
    model predicting the test families is fitted on the whole 70%.
    """
    groups = [r["group"] for r in records]
    cov, width = [], []
    for tr, te in group_splits(groups, n_repeats, 0.3, seed):
        train = [records[i] for i in tr]
        test = [records[i] for i in te]
        if method == "split":
            p_idx, c_idx = next(group_splits([r["group"] for r in train], 1, 2 / 7, seed + 1))
            calib = [train[i] for i in c_idx]
            both = fit_predict([train[i] for i in p_idx], calib + test)
            pc, pt = both[: len(calib)], both[len(calib) :]
        elif method == "cv":
            calib = train
            pc, pt = cross_fit(train, fit_predict, 5, seed + 1), fit_predict(train, test)
        else:
            raise ValueError(f"method = {method!r}: use 'split' or 'cv'")
        q = conformal_quantile(np.abs(np.log(pc / _col(calib, "energy_j"))), alpha)
        cov.append(float(np.mean(np.abs(np.log(pt / _col(test, "energy_j"))) <= q)))
        width.append(math.exp(q))
    return {
        "coverage": float(np.median(cov)),
        "coverage_mean": float(np.mean(cov)),
        "coverage_iqr": [float(np.percentile(cov, 25)), float(np.percentile(cov, 75))],
        "half_width_factor": float(np.median(width)),
        "nominal": 1 - alpha,
        "method": method,
    }
