"""GPU validation of the energy module on one NVIDIA GPU (docs/energy.md).

    python benchmarks/energy_gpu_validation.py --out DIR            # ~8 min on one H100
    python benchmarks/energy_gpu_validation.py --out DIR --smoke    # seconds, CPU ok (logic only)
    .venv/bin/python benchmarks/energy_gpu_validation.py \
        --analyze benchmarks/results/energy_gpu_h100.jsonl        # on the CPU machine

Phases (research note 3.4, shortened to fit one 10-minute command; settings are only read,
never changed):
  1. preflight: board, driver, power limit, clocks; is RAPL readable on this host; idle power.
  2. meter check: a bf16 GEMM loop, NVML energy counter delta vs 100 ms power samples
     integrated with the trapezoid rule; counter granularity from short windows.
  3. empirical energy roofline: GEMM (compute-bound) and copy (memory-bound) windows give
     attainable FLOP/s and bytes/s and, with idle power, J/FLOP and J/byte.
  4. a sweep of small GPT and BERT training steps (bf16 autocast, AdamW), energy from the
     NVML counter over a steady window after warmup; one JSON record per window.
`--analyze` fits the time and energy models on the sweep records with architecture-grouped
splits and prints the tables of docs/energy.md (runs on the CPU machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # TinyBert from the CPU sweep
import provenance  # noqa: E402
from energy_cpu_sweep import TinyBert, variant_name, variant_sets  # noqa: E402

from frugaltrain.energy.meter import NvmlMeter, _import_pynvml, open_meter  # noqa: E402
from frugaltrain.models.gpt import GPT, GPTConfig  # noqa: E402

VOCAB = 8192


def _log(out: Path, kind: str, **fields) -> None:
    rec = {"kind": kind, **fields}
    print(json.dumps(rec), flush=True)
    with (out / "gpu_validation.jsonl").open("a") as fh:
        fh.write(json.dumps(rec) + "\n")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def preflight(out: Path, dev: str) -> dict:
    info: dict = {"torch": torch.__version__, "device": dev}
    nv = _import_pynvml()
    if dev.startswith("cuda") and nv is not None:
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)

        def q(fn, *a):
            try:
                v = fn(h, *a)
                return v.decode() if isinstance(v, bytes) else v
            except Exception as e:  # NVMLError, or a call this pynvml version lacks
                return f"n/a ({e})"

        info.update(
            name=q(nv.nvmlDeviceGetName),
            driver=nv.nvmlSystemGetDriverVersion(),
            power_limit_mw=q(nv.nvmlDeviceGetEnforcedPowerLimit),
            sm_clock_mhz=q(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
            mem_clock_mhz=q(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
            temperature_c=q(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
            arch=q(nv.nvmlDeviceGetArchitecture),
        )
    rapl = Path("/sys/class/powercap/intel-rapl:0/energy_uj")
    info["rapl_readable"] = rapl.exists() and os.access(rapl, os.R_OK)
    _log(out, "preflight", **info)
    return info


def idle_power(out: Path, dev: str, seconds: float) -> float | None:
    _sync()
    m = open_meter(dev)
    m.start()
    time.sleep(seconds)
    r = m.stop()
    _log(out, "idle", seconds=r.seconds, joules=r.joules, label=r.label, watts=r.watts)
    return r.watts


class _PowerSampler:
    """Polls nvmlDeviceGetPowerUsage every period_s; integrates with the trapezoid rule."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.nv = _import_pynvml()
        self.h = self.nv.nvmlDeviceGetHandleByIndex(0)
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()

    def _run(self) -> None:
        while True:
            self.samples.append(
                (time.perf_counter(), self.nv.nvmlDeviceGetPowerUsage(self.h) / 1e3)
            )
            if self._stop.wait(self.period_s):
                break

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.samples.append((time.perf_counter(), self.nv.nvmlDeviceGetPowerUsage(self.h) / 1e3))

    def joules(self) -> float:
        s = self.samples
        return sum(
            0.5 * (s[i][1] + s[i - 1][1]) * (s[i][0] - s[i - 1][0]) for i in range(1, len(s))
        )


def _loop(fn, seconds: float) -> int:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        n += 10
        _sync()
    return n


def meter_check(out: Path, dev: str, seconds: float) -> None:
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    _loop(lambda: a @ b, 2.0)  # warm up clocks and cuBLAS
    m = open_meter(dev)
    with _PowerSampler(0.1) as ps:
        m.start()
        steps = _loop(lambda: a @ b, seconds)
        r = m.stop()
    integ = ps.joules()
    rel = None if r.joules is None else (integ - r.joules) / r.joules
    _log(out, "meter_check", seconds=r.seconds, counter_joules=r.joules, label=r.label,
         integrated_power_joules=integ, samples=len(ps.samples), rel_diff=rel,
         gemm_tflops=2 * n**3 * steps / r.seconds / 1e12)  # fmt: skip
    # Counter granularity: short windows during the same load.
    for window in (0.005, 0.02, 0.05, 0.2, 1.0):
        zeros, ratios = 0, []
        for _ in range(8 if window < 0.5 else 3):
            mm = NvmlMeter([0])
            p0 = mm.nvml.nvmlDeviceGetPowerUsage(next(iter(mm.handles.values()))) / 1e3
            mm.start()
            _loop(lambda: a @ b, window)
            rr = mm.stop()
            if rr.joules is None:
                zeros += 1
            else:
                ratios.append(rr.joules / (p0 * rr.seconds))
        _log(out, "granularity", window_s=window, unavailable=zeros, energy_over_p_t=ratios)


def energy_roofline(out: Path, dev: str, seconds: float, p_idle: float | None) -> None:
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    src = torch.empty(2**30, device=dev, dtype=torch.uint8)  # 1 GiB, far beyond L2
    dst = torch.empty_like(src)
    for name, fn, flops, nbytes in (
        ("gemm", lambda: a @ b, 2 * n**3, 3 * n * n * 2),
        ("copy", lambda: dst.copy_(src), 0, 2 * src.numel()),
    ):
        _loop(fn, 1.0)
        m = open_meter(dev)
        m.start()
        k = _loop(fn, seconds)
        r = m.stop()
        F, Q = flops * k, nbytes * k
        rec = {"seconds": r.seconds, "joules": r.joules, "label": r.label, "flops": F,
               "bytes": Q, "flops_per_s": F / r.seconds, "bytes_per_s": Q / r.seconds}  # fmt: skip
        if r.joules is not None and p_idle is not None:
            dyn = r.joules - p_idle * r.seconds
            rec["dynamic_joules"] = dyn
            rec["j_per_flop"] = dyn / F if F else None
            rec["j_per_byte_if_all_memory"] = dyn / Q
        _log(out, f"roofline_{name}", **rec)


def _sweep_configs(smoke: bool) -> list[dict]:
    if smoke:
        return [{"arch": "gpt", "n_layer": 1, "n_embd": 64, "n_head": 2, "seq_len": 32,
                 "batch_size": 2}, {"arch": "bert", "n_layer": 2, "n_embd": 64, "n_head": 2,
                 "seq_len": 32, "batch_size": 2}]  # fmt: skip
    import random

    rng = random.Random(2026)
    out = []
    # Corners plus a random fill of (L, d) x (s, b); heads = d / 64, d_ff = 4d.
    grid = [(L, d) for L in (2, 4, 8, 12) for d in (256, 512, 768, 1024)]
    for arch in ("gpt", "bert"):
        for L, d in grid:
            for s, b in rng.sample([(128, 8), (128, 32), (256, 8), (256, 32), (512, 8)], 2):
                out.append({"arch": arch, "n_layer": L, "n_embd": d, "n_head": d // 64,
                            "seq_len": s, "batch_size": b})  # fmt: skip
    rng.shuffle(out)
    return out


def sweep_variants(smoke: bool, dev: str) -> dict[str, list[str]]:
    """Every sweep configuration as `key=value` strings, with what _build_step adds."""
    step = [f"optimizer=torch.optim.AdamW(lr=1e-4, fused={dev.startswith('cuda')})"]
    step.append("autocast=bfloat16")
    out = {}
    for c in _sweep_configs(smoke):
        vocab = [f"vocab_size={VOCAB}"] if c["arch"] == "gpt" else []
        out[variant_name(c)] = [*variant_sets(c), *vocab, *step]
    return out


ANALYSES = {  # analyze()'s summary rows -> their model and evaluation (70/30 by architecture)
    "time model (pre-run)": ["model=StepTimeModel", "target=seconds", "splits=20"],
    "energy, predicted T (pre-run)": ["model=EnergyPredictor", "energy=pre", "splits=20"],
    "energy, measured T (post-run)": ["model=EnergyPredictor", "energy=post", "splits=20"],
    "conformal_cv_pre": ["model=EnergyPredictor", "energy=pre", "conformal=cv", "splits=10"],
    "extrapolation_pre": [
        "model=EnergyPredictor",
        "energy=pre",
        "train=smallest 75% by C",
        "test=largest 25% by C",
    ],
}


def _peak_mem_gib(dev: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if dev.startswith("cuda") else None


def _build_step(cfg: dict, dev: str):
    """One training step (bf16 autocast, fused AdamW on GPU) of the configured model."""
    torch.manual_seed(0)
    L, d, h, s, b = (cfg[k] for k in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size"))
    if cfg["arch"] == "gpt":
        idx = torch.randint(0, VOCAB, (b, s), device=dev)
        model = GPT(GPTConfig(n_layer=L, n_head=h, n_embd=d, vocab_size=VOCAB, block_size=s))
        model.to(dev)

        def loss_fn():
            return model(idx, idx)[1]
    else:
        idx = torch.randint(0, 256, (b, s), device=dev)  # TinyBert has a byte vocabulary
        model = TinyBert(L, d, h, s).to(dev)
        labels = torch.randint(0, 2, (b,), device=dev)

        def loss_fn():
            return model(idx, labels)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.startswith("cuda"))

    def step() -> None:
        with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def sweep(out: Path, dev: str, window_s: float, budget_s: float, smoke: bool, info: dict) -> None:
    t_start = time.perf_counter()
    configs = _sweep_configs(smoke)
    repeats = configs[:6] if not smoke else []  # noise floor: the first 6 again at the end
    for i, cfg in enumerate(configs + repeats):
        if time.perf_counter() - t_start > budget_s:
            _log(out, "sweep_stopped", reason="time budget", done=i, planned=len(configs))
            break
        step = _build_step(cfg, dev)
        for _ in range(5):
            step()
        _sync()
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        _sync()
        per = (time.perf_counter() - t0) / 3
        k = max(3, math.ceil(window_s / max(per, 1e-5)))
        m = open_meter(dev)
        m.start()
        for _ in range(k):
            step()
        r = m.stop()  # synchronises before reading
        _log(out, "record", **cfg, vocab_size=VOCAB if cfg["arch"] == "gpt" else 0,
             steps=k, seconds=r.seconds, energy_j=r.joules, energy_label=r.label,
             hardware=str(info.get("name", dev)).lower().replace(" ", "-"),
             repeat=int(i >= len(configs)),
             peak_mem_gib=_peak_mem_gib(dev))  # fmt: skip
        del step
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def analyze(path: str) -> None:
    import numpy as np

    from frugaltrain.energy.models import (
        EnergyPredictor,
        StepTimeModel,
        conformal_coverage,
        cross_fit,
        evaluate,
        mape,
        r2_log,
    )
    from frugaltrain.energy.records import derive, normalize

    record = provenance.start("estimated", variants=ANALYSES)
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    for r in rows:
        if r["kind"] in ("preflight", "idle", "meter_check", "roofline_gemm", "roofline_copy"):
            print(r["kind"], {k: v for k, v in r.items() if k != "kind"})
        if r["kind"] == "granularity":
            print("granularity", r["window_s"], "s: unavailable", r["unavailable"],
                  "E/(P t)", [round(x, 2) for x in r["energy_over_p_t"]])  # fmt: skip
    keys = ("arch", "n_layer", "n_embd", "n_head", "seq_len", "batch_size", "vocab_size",
            "steps", "seconds", "energy_j", "energy_label", "hardware")  # fmt: skip
    recs = [normalize({k: r[k] for k in keys}) for r in rows if r["kind"] == "record"]
    base = [r for r, raw in zip(recs, [x for x in rows if x["kind"] == "record"], strict=True)
            if not raw["repeat"]]  # fmt: skip
    reps = {}
    for r in recs:
        reps.setdefault(tuple(r[k] for k in keys[:6]), []).append(r["energy_j"] / r["steps"])
    noise = [abs(v[1] / v[0] - 1) for v in reps.values() if len(v) > 1]
    print(f"\n{len(base)} sweep records ({recs[0]['energy_label']}), "
          f"{len({r['group'] for r in base})} architectures; repeat-to-repeat energy/step "
          f"difference median {100 * np.median(noise):.1f}% over {len(noise)} pairs")  # fmt: skip

    def pre(tr, te):
        return EnergyPredictor().fit(tr).predict_energy(te, "pre")

    def post(tr, te):
        return EnergyPredictor().fit(tr).predict_energy(te, "post")

    def tm(tr, te):
        return StepTimeModel().fit(tr).predict(te)

    summary = record | {
        "what": "held-out predictions vs energy measured by the NVML counter (H100 sweep)",
        "measured_provenance": next(  # the sweep's own, where its file has one
            (r["provenance"] for r in reversed(rows) if r["kind"] == "provenance"), None
        ),
    }
    print(f"{'model (70/30 by architecture, 20 splits)':<46} {'R2(ln)':>7} {'MAPE':>7}")
    for name, fp, target in (("time model (pre-run)", tm, "seconds"),
                             ("energy, predicted T (pre-run)", pre, "energy_j"),
                             ("energy, measured T (post-run)", post, "energy_j")):  # fmt: skip
        res = evaluate(base, fp, target=target)
        summary[name] = res
        print(f"{name:<46} {res['r2_log']:>7.3f} {100 * res['mape']:>6.1f}%")
    cov = conformal_coverage(base, pre, method="cv", n_repeats=10)
    summary["conformal_cv_pre"] = cov
    print(f"conformal 95% (cv, pre-run): coverage median {cov['coverage']:.3f} (mean "
          f"{cov['coverage_mean']:.3f}), half-width "
          f"x/{cov['half_width_factor']:.2f}")  # fmt: skip
    f = np.array([derive(r)["C"] for r in base])
    cut = np.quantile(f, 0.75)
    small = [r for r, c in zip(base, f, strict=True) if c <= cut]
    large = [r for r, c in zip(base, f, strict=True) if c > cut]
    e = np.array([r["energy_j"] for r in large])
    p = pre(small, large)
    summary["extrapolation_pre"] = {"mape": mape(p, e), "r2_log": r2_log(p, e)}
    print(f"extrapolation, pre-run (train smallest 75% of C): MAPE {100 * mape(p, e):.1f}%, "
          f"R2(ln) {r2_log(p, e):.3f}")  # fmt: skip
    model = EnergyPredictor().fit(base)
    print("energy roofline:", model.energy.named())
    summary["energy_roofline"] = model.energy.named()
    summary["time_ceilings"] = model.time.ceilings()
    oof = {"pre-run": cross_fit(base, pre), "post-run": cross_fit(base, post)}
    from frugaltrain.energy.cli import plot_predicted_vs_measured

    stem = Path(path).with_suffix("")
    plot_predicted_vs_measured(base, oof, f"{stem}.png", title="H100 sweep (measured, NVML)")
    provenance.finish(summary)
    Path(f"{stem}_summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {stem}.png and {stem}_summary.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory for gpu_validation.jsonl")
    ap.add_argument("--smoke", action="store_true", help="tiny and short: checks the logic")
    ap.add_argument("--budget", type=float, default=330.0, help="s for the sweep phase")
    ap.add_argument("--sweep-only", action="store_true", help="skip phases 2-3")
    ap.add_argument("--analyze", metavar="JSONL", help="fit and report on collected records")
    args = ap.parse_args()
    if args.analyze:
        analyze(args.analyze)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    scale = 0.05 if args.smoke else 1.0
    record = provenance.start("measured", variants=sweep_variants(args.smoke, dev))
    _log(out, "provenance", provenance=dict(record))
    info = preflight(out, dev)
    p_idle = idle_power(out, dev, 15.0 * scale)
    if dev.startswith("cuda") and not args.sweep_only:
        meter_check(out, dev, 30.0 * scale)
        energy_roofline(out, dev, 8.0 * scale, p_idle)
    sweep(out, dev, 3.0 * scale, args.budget, args.smoke, info)
    _log(out, "provenance", provenance=provenance.finish(record))  # the last one: complete


if __name__ == "__main__":
    main()
