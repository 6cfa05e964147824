"""FORGE step time vs torch.optim.AdamW (single-tensor, foreach, fused) and optimizer-in-backward
hooks, on the GPT, with the variants alternating in one process (A B C ... A B C ...) so machine
noise hits all alike. Reports the median seconds per whole training step (forward, backward,
step) and the ratio to the first variant (torch.optim.AdamW(foreach=False), the CPU default).
Each repetition also gives a paired ratio (the variant's time over the first variant's time in
the same repetition); their median, minimum and maximum are the spread to read on a shared
machine. All times measured, wall clock. Also times FORGE's two-pass clipping (forge-clip), to
show what exact clipping costs, and FORGE with 8-bit (forge-int8) or bf16 (forge-bf16) states.
A case is size:tokens[:dtype] as in forge_memory.py (dtype bf16 converts every arm's model).

    python benchmarks/forge_speed.py [--cases 10M:512,10M:4096] [--reps 5]
        [--variants adamw,forge,forge-int8,forge-bf16]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import provenance
import torch
from forge_memory import BETAS, LR, WD, batch, build, make_model, settings, train_step

from frugaltrain.forge import ForgeOptimizer

VARIANTS = ("adamw", "adamw-foreach", "adamw-fused", "hooks", "forge", "forge-clip")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _build(variant: str, model):
    if variant == "forge-clip":
        return ForgeOptimizer(
            model, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0
        )
    return build(variant, model)[0]


def _settings(variant: str) -> list[str]:
    """What _build() makes of `variant`, as `key=value` strings (the variant's overrides)."""
    if variant == "forge-clip":
        kw = [f"lr={LR}", f"betas={BETAS}", f"weight_decay={WD}"]
        return ["optimizer=ForgeOptimizer", *kw, "max_grad_norm=1.0"]
    return settings(variant)


def _step(variant: str, model, opt, x, y) -> None:
    if variant == "forge-clip":
        opt.backward(model(x, y)[1])
        opt.step()
        opt.zero_grad()
    else:
        train_step(model, opt, x, y)


def bench(size: str, tokens: int, variants: list[str], reps: int, dtype: str = "fp32") -> list:
    arms = {}
    for v in variants:
        model = make_model(size, DTYPES[dtype])
        arms[v] = (model, _build(v, model))
    times = {v: [] for v in variants}
    for rep in range(reps + 1):  # rep 0 warms up (states, allocator, kernels)
        x, y = batch(tokens, rep, size)
        for v in variants:
            model, opt = arms[v]
            t0 = time.perf_counter()
            _step(v, model, opt, x, y)
            if rep:
                times[v].append(time.perf_counter() - t0)
    first = times[variants[0]]
    base = statistics.median(first)
    rows = []
    for v in variants:
        med = statistics.median(times[v])
        paired = [t / b for t, b in zip(times[v], first, strict=True)]
        rows.append({
            "size": size, "tokens": tokens, "dtype": dtype, "variant": v,
            "median_step_s": round(med, 4), "min_step_s": round(min(times[v]), 4),
            "max_step_s": round(max(times[v]), 4), "ratio": round(med / base, 3),
            "paired_ratio_median": round(statistics.median(paired), 3),
            "paired_ratio_min": round(min(paired), 3), "paired_ratio_max": round(max(paired), 3),
            "reps": reps, "step_s": [round(t, 4) for t in times[v]],
        })  # fmt: skip
        print(
            f"{size:>9} {tokens:>5} tok {dtype} {v:<14} median {med:7.3f} s"
            f"  min {min(times[v]):7.3f} s  max {max(times[v]):7.3f} s  ({med / base:.3f}x;"
            f" paired {statistics.median(paired):.3f}x, {min(paired):.3f}-{max(paired):.3f})",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases", default="10M:512,10M:4096,85M:512,wide200M:512", help="size:tokens,..."
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/forge_speed.json")
    args = ap.parse_args()
    variants = {v: _settings(v) for v in args.variants.split(",")}
    record = provenance.start("measured", variants=variants)
    torch.set_num_threads(args.threads)
    rows = []
    for case in args.cases.split(","):
        size, tokens, *dtype = case.split(":")
        rows += bench(size, int(tokens), args.variants.split(","), args.reps, *dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": f"cpu ({platform.processor() or platform.machine()}), {args.threads} threads",
        "torch": torch.__version__,
        "method": "median wall-clock seconds per training step, variants alternating; measured",
        "baseline": "the first variant (adamw: torch.optim.AdamW(foreach=False), the CPU default)",
    }
    provenance.finish(record)
    out.write_text(json.dumps(record | {"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
