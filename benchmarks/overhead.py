"""Overhead of frugaltrain's training loop versus a plain hand-written PyTorch loop.

Same model, batch, data and optimizer; one worker; the two variants alternate in one process
(A B A B ...) so machine noise hits both alike. Reports the median step time of each and their
ratio (target: frugaltrain / plain <= 1.05). All times measured wall clock.

    python benchmarks/overhead.py [--steps 60] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from frugaltrain.comm import LocalComm
from frugaltrain.config import Config, build_config
from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens, worker_seed
from frugaltrain.train.loop import build_model, train_worker
from frugaltrain.train.optim import build_inner_optimizer, build_schedule


def plain_loop(cfg: Config) -> float:
    """The loop a user would write by hand; returns seconds per step."""
    d = cfg.data
    corpus = load_corpus(d.path, d.max_bytes, d.val_fraction)
    sampler = BatchSampler(
        shard_tokens(corpus.train, 0, 1, 0, d.sharding),
        d.seq_len,
        d.batch_size,
        worker_seed(cfg.run.seed, 0),
    )
    model = build_model(cfg)
    opt = build_inner_optimizer(model, cfg.optim)
    sched = build_schedule(opt, cfg.optim, cfg.run.steps)
    t0 = time.perf_counter()
    for step in range(cfg.run.steps):
        x, y = sampler.batch(step)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return (time.perf_counter() - t0) / cfg.run.steps


def frugaltrain_loop(cfg: Config, out: Path) -> float:
    """One frugaltrain worker (DiLoCo with M = 1, so the outer step runs but moves no bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_worker(cfg, LocalComm(), out)
    return (time.perf_counter() - t0) / cfg.run.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/overhead.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = build_config(
        Config,
        {},
        [
            f"run.steps={args.steps}",
            "outer.H=20",
            "run.eval_every=0",
            "run.eval_batches=1",
            "run.progress=false",
            "data.max_bytes=1000000",
            "data.batch_size=16",
            "data.seq_len=128",
            "model.n_layer=4",
            "model.n_embd=256",
            "model.n_head=4",
        ],
    )
    # Setup (corpus read, model build) is inside both timings; warm both paths once first.
    plain_loop(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        frugaltrain_loop(cfg, Path(tmp) / "warm")
        plain, ours = [], []
        for rep in range(args.reps):
            plain.append(plain_loop(cfg))
            ours.append(frugaltrain_loop(cfg, Path(tmp) / f"rep{rep}"))
    p, o = statistics.median(plain), statistics.median(ours)
    rows = [
        ("plain PyTorch loop", p, min(plain), max(plain)),
        ("frugaltrain worker", o, min(ours), max(ours)),
    ]
    print(f"step time, measured, median of {args.reps} alternating reps x {args.steps} steps")
    print(f"{'variant':<22}{'median ms':>10}{'min ms':>9}{'max ms':>9}")
    for name, med, lo, hi in rows:
        print(f"{name:<22}{med * 1e3:>10.2f}{lo * 1e3:>9.2f}{hi * 1e3:>9.2f}")
    print(f"ratio frugaltrain / plain = {o / p:.3f} (target <= 1.05)")
    result = {
        "clock": "measured",
        "steps": args.steps,
        "reps": args.reps,
        "plain_s_per_step": plain,
        "frugaltrain_s_per_step": ours,
        "ratio_median": o / p,
        "target": 1.05,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
