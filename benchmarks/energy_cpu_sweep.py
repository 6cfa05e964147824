"""CPU sweep of tiny GPT/BERT training steps: fit the roofline step-time model on 70% of the
architectures, test on the rest (docs/energy.md: the CPU step-time check).

    .venv/bin/python benchmarks/energy_cpu_sweep.py            # ~3 min on 2 shared cores
    .venv/bin/python benchmarks/energy_cpu_sweep.py --quick    # a few configs, a smoke run

Step times are measured (wall clock, median of repeats, 1 torch thread). Host energy on this
machine is an estimate (CPU time x W/core, there is no RAPL here): it is written to the records
with its label and excluded from every fit. Writes benchmarks/results/energy_cpu_sweep.json
(summary) and .jsonl (one record per configuration).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np
import provenance
import torch
import torch.nn as nn
import torch.nn.functional as F

from frugaltrain.energy.meter import open_meter
from frugaltrain.energy.models import StepTimeModel, evaluate, mape
from frugaltrain.energy.proxies import calibrate_cpu_profile, roofline_time, step_proxies
from frugaltrain.energy.records import normalize, shape_of
from frugaltrain.models.gpt import GPT, GPTConfig

RESULTS = Path(__file__).parent / "results"
VOCAB = 256


class TinyBert(nn.Module):
    """A BERT-shaped encoder for timing: bidirectional attention, pre-norm blocks with a
    4x GELU MLP, and a 2-way classifier on the first token. x_BTC: batch, sequence, width."""

    def __init__(self, n_layer: int, n_embd: int, n_head: int, seq_len: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.tok = nn.Embedding(VOCAB, n_embd)
        self.pos = nn.Embedding(seq_len, n_embd)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(n_embd),
                    "qkv": nn.Linear(n_embd, 3 * n_embd),
                    "proj": nn.Linear(n_embd, n_embd),
                    "ln2": nn.LayerNorm(n_embd),
                    "fc": nn.Linear(n_embd, 4 * n_embd),
                    "out": nn.Linear(4 * n_embd, n_embd),
                }
            )  # fmt: skip
            for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd)
        self.cls = nn.Linear(n_embd, 2)

    def forward(self, idx_BT: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
        B, T = idx_BT.shape
        x_BTC = self.tok(idx_BT) + self.pos(torch.arange(T, device=idx_BT.device))
        for m in self.layers:
            q, k, v = m["qkv"](m["ln1"](x_BTC)).split(x_BTC.shape[-1], dim=2)
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, -1)
            x_BTC = x_BTC + m["proj"](y)
            x_BTC = x_BTC + m["out"](F.gelu(m["fc"](m["ln2"](x_BTC))))
        return F.cross_entropy(self.cls(self.ln_f(x_BTC)[:, 0]), labels_B)


def _configs(quick: bool) -> list[dict]:
    layers, widths = ((1, 2), (64, 128)) if quick else ((1, 2, 4), (64, 128, 256))
    shapes = ((32, 4), (128, 16)) if quick else ((32, 4), (32, 16), (128, 4), (128, 16))
    out = []
    for arch in ("gpt", "bert"):
        for L in layers:
            for d in widths:
                for s, b in shapes:
                    out.append(
                        {
                            "arch": arch,
                            "n_layer": L,
                            "n_embd": d,
                            "n_head": d // 32,
                            "seq_len": s,
                            "batch_size": b,
                        }
                    )
    return out


def variant_name(cfg: dict) -> str:
    L, d, s, b = (cfg[k] for k in ("n_layer", "n_embd", "seq_len", "batch_size"))
    return f"{cfg['arch']}-L{L}-d{d}-s{s}-b{b}"


def variant_sets(cfg: dict) -> list[str]:
    """A configuration as `key=value` strings (the variant's overrides)."""
    return [f"{k}={v}" for k, v in cfg.items()]


def _step_fn(cfg: dict):
    torch.manual_seed(0)
    L, d, h, s, b = (cfg[k] for k in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size"))
    idx = torch.randint(0, VOCAB, (b, s))
    if cfg["arch"] == "gpt":
        model = GPT(GPTConfig(n_layer=L, n_head=h, n_embd=d, vocab_size=VOCAB, block_size=s))
        loss_fn = lambda: model(idx, idx)[1]  # noqa: E731
    else:
        model = TinyBert(L, d, h, s)
        labels = torch.randint(0, 2, (b,))
        loss_fn = lambda: model(idx, labels)  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure_all(configs: list[dict], repeats: int, min_window_s: float, seed: int) -> list[dict]:
    """Time every configuration in `repeats` interleaved passes (each pass in a fresh random
    order), so a burst of load from other users of the machine hits different configurations
    in different passes instead of all repeats of one; the median over passes is reported."""
    steps, ks = [], []
    for cfg in configs:
        step = _step_fn(cfg)
        t0 = time.perf_counter()
        for _ in range(2):  # warmup: allocator, thread pool, first-call overheads
            step()
        per_step = (time.perf_counter() - t0) / 2
        steps.append(step)
        ks.append(max(2, int(min_window_s / max(per_step, 1e-4))))
    times = [[] for _ in configs]
    joules = [[] for _ in configs]
    label = ""
    rng = random.Random(seed)
    for _ in range(repeats):
        order = list(range(len(configs)))
        rng.shuffle(order)
        for i in order:
            meter = open_meter("cpu")
            meter.start()
            for _ in range(ks[i]):
                steps[i]()
            r = meter.stop()
            times[i].append(r.seconds / ks[i])
            if r.joules is not None:
                joules[i].append(r.joules / ks[i])
            label = r.label
    out = []
    for cfg, t, e, k in zip(configs, times, joules, ks, strict=True):
        out.append({
            **cfg,
            "vocab_size": VOCAB if cfg["arch"] == "gpt" else 0,
            "seconds": statistics.median(t),
            "seconds_min": min(t),
            "seconds_repeats": t,
            "steps": 1,
            "energy_j": statistics.median(e) if e else None,
            "energy_label": label,
            "hardware": "local-cpu",
            "steps_per_window": k,
        })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few configurations only")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timing passes")
    ap.add_argument("--min-window", type=float, default=0.2, help="s per timed repeat")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    configs = _configs(args.quick)
    variants = {variant_name(c): variant_sets(c) for c in configs}
    record = provenance.start("measured", variants=variants)
    torch.set_num_threads(1)  # 2 shared cores: one thread keeps the timings steadier
    prof = calibrate_cpu_profile(seconds=1.0, threads=1)
    print(
        f"local CPU profile (measured, 1 thread): {prof.peak_flops / 1e9:.1f} GFLOP/s fp32 "
        f"matmul, {prof.mem_bw / 1e9:.1f} GB/s copy"
    )
    random.Random(args.seed).shuffle(configs)  # decorrelate machine drift from configuration
    t0 = time.perf_counter()
    records = [normalize(r) for r in measure_all(configs, args.repeats, args.min_window, args.seed)]
    for i, rec in enumerate(records):
        print(
            f"[{i + 1:>2}/{len(configs)}] {rec['arch']:<4} L={rec['n_layer']} "
            f"d={rec['n_embd']:<3} s={rec['seq_len']:<3} b={rec['batch_size']:<2} "
            f"step {1e3 * rec['seconds']:8.2f} ms (measured)  "
            f"{rec['energy_j']:.3f} J ({rec['energy_label']})"
        )
    sweep_s = time.perf_counter() - t0

    def fit_time(tr, te):
        return StepTimeModel().fit(tr).predict(te)

    res = evaluate(records, fit_time, target="seconds", n_repeats=20, test_frac=0.3)
    # Risky regime: train on the two smaller widths, test on the largest.
    wmax = max(r["n_embd"] for r in records)
    small = [r for r in records if r["n_embd"] < wmax]
    large = [r for r in records if r["n_embd"] == wmax]
    t_large = np.array([r["seconds"] for r in large])
    extrap = mape(fit_time(small, large), t_large)
    # A plain roofline on the measured microbenchmark ceilings, no fitted efficiencies.
    t_meas = np.array([r["seconds"] for r in records])
    naive = np.array([roofline_time(step_proxies(shape_of(r)), prof) for r in records])
    naive_mape = mape(naive, t_meas)
    model = StepTimeModel().fit(records)

    print(
        f"\nsweep: {len(records)} configurations, {len({r['group'] for r in records})} "
        f"architectures, {sweep_s:.0f} s"
    )
    print(f"{'step-time model (held-out architectures)':<52} {'MAPE':>7} {'R2(ln)':>7}")
    print(
        f"{'70/30 by architecture, median of 20 splits':<52} {100 * res['mape']:>6.1f}% "
        f"{res['r2_log']:>7.3f}   IQR {100 * res['mape_iqr'][0]:.1f}-"
        f"{100 * res['mape_iqr'][1]:.1f}%"
    )
    print(f"{f'train d < {wmax}, test d = {wmax} (extrapolation)':<52} {100 * extrap:>6.1f}%")
    print(f"{'uncalibrated roofline on microbenchmark ceilings':<52} {100 * naive_mape:>6.1f}%")
    print("\nfitted ceilings (all records):")
    for key, row in model.ceilings().items():
        print(f"  {key}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if v is not None))
    print("energy: estimated only here (no RAPL) -> excluded from fits, not validated")

    RESULTS.mkdir(exist_ok=True)
    stem = "energy_cpu_sweep_quick" if args.quick else "energy_cpu_sweep"
    with (RESULTS / f"{stem}.jsonl").open("w") as fh:
        for r in records:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "_derived"}) + "\n")
    summary = {
        "what": "step time measured on this CPU; energy estimated (CPU time x W/core), unfitted",
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": 1,
                    "cpu_profile_measured": {"flops": prof.peak_flops, "copy_Bps": prof.mem_bw}},
        "n_configs": len(records),
        "sweep_seconds": sweep_s,
        "time_model_heldout_architectures": res,
        "time_model_extrapolation_mape": extrap,
        "uncalibrated_roofline_mape": naive_mape,
        "ceilings": model.ceilings(),
        "target_mape": 0.20,
    }  # fmt: skip
    provenance.finish(record)
    summary = record | summary | {"machine": record["machine"] | summary["machine"]}
    (RESULTS / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {RESULTS / stem}.json and .jsonl")


if __name__ == "__main__":
    main()
