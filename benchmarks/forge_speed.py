"""FORGE step time vs torch.optim.AdamW (single-tensor, foreach, fused) and optimizer-in-backward
hooks, on the GPT, with the variants alternating in one process (A B C ... A B C ...) so machine
noise hits all alike. Reports the median seconds per whole training step (forward, backward,
step) and the ratio to torch.optim.AdamW(foreach=False), the CPU default. All times measured,
wall clock. Also times FORGE's two-pass clipping (forge-clip), to show what exact clipping costs.

    python benchmarks/forge_speed.py [--cases 10M:512,10M:4096] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from forge_memory import batch, build, make_model, train_step

from frugaltrain.forge import ForgeOptimizer

VARIANTS = ("adamw", "adamw-foreach", "adamw-fused", "hooks", "forge", "forge-clip")


def _build(variant: str, model):
    if variant == "forge-clip":
        return ForgeOptimizer(
            model, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0
        )
    return build(variant, model)[0]


def _step(variant: str, model, opt, x, y) -> None:
    if variant == "forge-clip":
        opt.backward(model(x, y)[1])
        opt.step()
        opt.zero_grad()
    else:
        train_step(model, opt, x, y)


def bench(size: str, tokens: int, variants: list[str], reps: int) -> list[dict]:
    arms = {}
    for v in variants:
        model = make_model(size)
        arms[v] = (model, _build(v, model))
    times = {v: [] for v in variants}
    for rep in range(reps + 1):  # rep 0 warms up (states, allocator, kernels)
        x, y = batch(tokens, rep)
        for v in variants:
            model, opt = arms[v]
            t0 = time.perf_counter()
            _step(v, model, opt, x, y)
            if rep:
                times[v].append(time.perf_counter() - t0)
    base = statistics.median(times[variants[0]])
    rows = []
    for v in variants:
        med = statistics.median(times[v])
        rows.append({
            "size": size, "tokens": tokens, "variant": v, "median_step_s": round(med, 4),
            "min_step_s": round(min(times[v]), 4), "ratio": round(med / base, 3), "reps": reps,
        })  # fmt: skip
        print(
            f"{size:>8} {tokens:>5} tok  {v:<14} median {med:7.3f} s  min {min(times[v]):7.3f} s"
            f"  ({med / base:.3f}x)",
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
    torch.set_num_threads(args.threads)
    rows = []
    for case in args.cases.split(","):
        size, tokens = case.split(":")
        rows += bench(size, int(tokens), args.variants.split(","), args.reps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": f"cpu ({platform.processor() or platform.machine()}), {args.threads} threads",
        "torch": torch.__version__,
        "method": "median wall-clock seconds per training step, variants alternating; measured",
        "baseline": "torch.optim.AdamW(foreach=False), the CPU default",
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
