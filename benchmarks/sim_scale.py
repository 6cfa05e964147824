"""Simulator speed: simulated worker-steps per real second for M = 4, 16, 64 virtual workers of
the ~0.5M-parameter GPT (2 layers, width 128, byte vocabulary; 4 x 64 tokens per step), for

    threads   the simulator as shipped: one thread per worker, sim.compute_threads = 2
    loop      a plain per-worker loop: the same, but one worker computes at a time (1 core)
    vmap      the batched alternative, kernel only: all M workers' forward/backward in one
              torch.func.vmap(functional_call) over stacked parameters, plus one AdamW over the
              stacked tensors (no strategy, no comm: an upper bound on what batching would give)

and ratios against `loop`, measured side by side in one process (after a warm-up run; loop and
threads alternate twice and each keeps its faster repetition). With --target it also runs the
scale target: 16 workers x 1,000 inner steps of DiLoCo, end to end (simulate()).

    python benchmarks/sim_scale.py --out benchmarks/results/sim_scale.json [--target]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import provenance
import torch
from torch.func import functional_call, vmap

from frugaltrain.models import build_model
from frugaltrain.sim import SimSection, load_sim_config, simulate

BASE = [
    "data.path='markov:order=1,symbols=256,branching=16,tokens=300000'",
    "data.seq_len=64",
    "data.batch_size=4",
    "model.n_layer=2",
    "model.n_embd=128",
    "model.n_head=4",
    "run.eval_every=0",
    "run.eval_batches=1",
    "outer.strategy='diloco'",
    "optim.warmup_steps=2",
]


CASES = ((4, 40), (16, 20), (64, 10))  # (M, steps)
TARGET = [
    *BASE,
    "run.workers=16",
    "run.steps=1000",
    "outer.H=50",
    "run.eval_every=500",
    "run.eval_batches=4",
]
VMAP = [  # vmap_rate's hand-written step (its model from BASE at M workers)
    "torch_threads=2",
    "optimizer=torch.optim.AdamW",
    "lr=0.003",
    "betas=(0.9, 0.95)",
    "weight_decay=0.1 (3-D stacked), 0.0 (the rest)",
]


def sim_overrides(M: int, steps: int) -> list[str]:
    return [*BASE, f"run.workers={M}", f"run.steps={steps}", f"outer.H={min(10, steps)}"]


def variants(target: bool) -> dict[str, list[str]]:
    """Every timed variant's overrides: the simulator's loop (one compute thread) and threads
    (two) per case, vmap per case, and the 16 x 1000 target."""
    out = {}
    for M, steps in CASES:
        for name, threads in (("loop", 1), ("threads", 2)):
            sim = ["sim.ratio=0.887", f"sim.compute_threads={threads}"]
            out[f"{name} M={M}"] = [*sim_overrides(M, steps), *sim]
        vmap = [f"timed_steps={max(2, steps // 4)}", *VMAP]
        out[f"vmap M={M}"] = [*BASE, f"run.workers={M}", "run.steps=10", "outer.H=10", *vmap]
    if target:
        out["target 16x1000"] = [*TARGET, "sim.ratio=0.887"]
    return out


def sim_rate(M: int, steps: int, threads: int) -> dict:
    cfg, _ = load_sim_config(None, sim_overrides(M, steps))
    t = time.perf_counter()
    simulate(cfg, SimSection(ratio=0.887, compute_threads=threads))
    dt = time.perf_counter() - t
    return {"worker_steps_per_s": M * steps / dt, "seconds": dt, "worker_steps": M * steps}


def vmap_rate(M: int, steps: int) -> dict:
    cfg, _ = load_sim_config(None, [*BASE, f"run.workers={M}", "run.steps=10", "outer.H=10"])
    torch.set_num_threads(2)
    model = build_model(cfg)
    stacked = {
        n: p.detach().unsqueeze(0).repeat(M, *[1] * p.dim()).requires_grad_(True)
        for n, p in model.named_parameters()
    }
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in stacked.values() if p.dim() >= 3], "weight_decay": 0.1},
            {"params": [p for p in stacked.values() if p.dim() < 3], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    x = torch.randint(0, 256, (M, 4, 64))
    y = torch.randint(0, 256, (M, 4, 64))

    def loss_fn(params, xb, yb):
        return functional_call(model, params, (xb, yb))[1]

    def step():
        vmap(loss_fn)(stacked, x, y).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        step()
    dt = time.perf_counter() - t
    torch.set_num_threads(1)
    return {"worker_steps_per_s": M * steps / dt, "seconds": dt, "worker_steps": M * steps}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/sim_scale.json")
    p.add_argument("--target", action="store_true", help="also run 16 workers x 1000 steps")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*batching rule.*")
    results = provenance.start("measured", variants=variants(args.target))
    results |= {
        "clock": "measured (real seconds of this machine)",
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "rows": [],
    }
    sim_rate(4, 10, 2)  # warm-up: generates the Markov corpus (cached) and warms torch
    for M, steps in CASES:
        # loop and threads alternate twice; each keeps its faster repetition (less noise)
        reps = {"loop": [], "threads": []}
        for _ in range(2):
            reps["loop"].append(sim_rate(M, steps, 1))
            reps["threads"].append(sim_rate(M, steps, 2))
        best = {k: max(v, key=lambda r: r["worker_steps_per_s"]) for k, v in reps.items()}
        row = {"M": M, **best, "vmap": vmap_rate(M, max(2, steps // 4))}
        base = row["loop"]["worker_steps_per_s"]
        row["ratio_threads_over_loop"] = row["threads"]["worker_steps_per_s"] / base
        row["ratio_vmap_over_loop"] = row["vmap"]["worker_steps_per_s"] / base
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
    if args.target:
        cfg, _ = load_sim_config(None, TARGET)
        t = time.perf_counter()
        simulate(cfg, SimSection(ratio=0.887))
        results["target_16x1000_s"] = time.perf_counter() - t
        print("16 workers x 1000 steps:", results["target_16x1000_s"], "s", flush=True)
    provenance.finish(results)
    results["num_params"] = build_model(load_sim_config(None, BASE)[0]).num_params()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
