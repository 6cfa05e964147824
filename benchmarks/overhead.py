"""Overhead of frugaltrain's training loop versus a plain hand-written PyTorch loop.

Same model, batch, data and optimizer; one worker. What is compared is the marginal cost of a
step: each variant runs S and 2S steps from scratch, and (T(2S) - T(S)) / S is its time per step.
Fixed costs (corpus read, model build, the final evaluation and checkpoint of a frugaltrain run)
cancel; everything frugaltrain does per step or per round (outer step every H, metrics records,
the energy meter, the progress bookkeeping) stays in. The variants alternate (plain, frugaltrain,
plain, frugaltrain, ...) so load on this shared machine hits both alike. Reported: the median of
the per-repetition ratios (the headline: each ratio's four runs ran back to back) and the ratio
of the medians (target: frugaltrain / plain <= 1.05). All times measured wall clock; the load
average before and after is recorded.

    python benchmarks/overhead.py [--steps 40] [--reps 5]
    python benchmarks/overhead.py --model llama --data runs/data/stdlib-bpe4k   # transformers

With --model llama the model is a transformers Llama (4 blocks of width 256, grouped-query
attention) and the plain loop calls it the way a transformers user would
(`model(input_ids=x).logits`, cross-entropy), on byte tokens or on token shards (--data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import provenance
import torch

from frugaltrain.comm import LocalComm
from frugaltrain.config import Config, build_config
from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens, worker_seed
from frugaltrain.models import build_model
from frugaltrain.optim import build_inner_optimizer, build_schedule
from frugaltrain.train.loop import train_worker


def plain_loop(cfg: Config) -> float:
    """The loop a user would write by hand; returns its wall-clock seconds, setup included."""
    t0 = time.perf_counter()
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
    hf = getattr(model, "hf", None)  # a transformers model: called as its users call it
    for step in range(cfg.run.steps):
        x, y = sampler.batch(step)
        if hf is None:
            _, loss = model(x, y)
        else:
            logits = hf(input_ids=x, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return time.perf_counter() - t0


def frugaltrain_loop(cfg: Config, out: Path) -> float:
    """One frugaltrain worker (DiLoCo with M = 1, so the outer step runs but moves no bytes);
    returns its wall-clock seconds, setup, final evaluation and checkpoint included."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_worker(cfg, LocalComm(), out)
    return time.perf_counter() - t0


def _overrides(steps: int, model: str, data: str) -> list[str]:
    family = [] if model == "gpt" else ["model.family='llama'", "model.n_kv_head=2"]
    vocab = []
    if data:
        from frugaltrain.data.corpus import load_corpus

        vocab = [f"model.vocab_size={load_corpus(data).vocab_size}"]
    return [
        *family,
        *vocab,
        f"data.path={data!r}",
        f"run.steps={steps}",
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
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="S: each variant runs S and 2S steps")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--data", default="", help="token shard directory (default: byte tokens)")
    ap.add_argument("--out", help="default benchmarks/results/overhead[_llama].json")
    args = ap.parse_args()
    out = args.out or f"benchmarks/results/overhead{'' if args.model == 'gpt' else '_llama'}.json"
    torch.set_num_threads(2)
    sets = {n: _overrides(n, args.model, args.data) for n in (args.steps, 2 * args.steps)}
    short, long = (build_config(Config, {}, s) for s in sets.values())
    loops = ("plain PyTorch loop", "frugaltrain worker")
    record = provenance.start(
        "measured", variants={f"{loop}, {n} steps": s for loop in loops for n, s in sets.items()}
    )
    plain, ours = [], []  # marginal seconds per step, one per repetition
    with tempfile.TemporaryDirectory() as tmp:
        plain_loop(short)  # warm both paths once (allocator, caches, lazy imports)
        frugaltrain_loop(short, Path(tmp) / "warm")
        for rep in range(args.reps):
            p1, o1 = plain_loop(short), frugaltrain_loop(short, Path(tmp) / f"s{rep}")
            p2, o2 = plain_loop(long), frugaltrain_loop(long, Path(tmp) / f"l{rep}")
            plain.append((p2 - p1) / args.steps)
            ours.append((o2 - o1) / args.steps)
            print(
                f"rep {rep}: plain {plain[-1] * 1e3:.1f} ms/step, frugaltrain {ours[-1] * 1e3:.1f}"
            )
    provenance.finish(record)
    p, o = statistics.median(plain), statistics.median(ours)
    paired = statistics.median(b / a for a, b in zip(plain, ours, strict=True))
    print(
        f"\nmarginal step time, measured, {args.reps} alternating reps of {args.steps} and "
        f"{2 * args.steps} steps"
    )
    print(f"{'variant':<22}{'median ms':>10}{'min ms':>9}{'max ms':>9}")
    for name, xs in (("plain PyTorch loop", plain), ("frugaltrain worker", ours)):
        print(
            f"{name:<22}{statistics.median(xs) * 1e3:>10.2f}{min(xs) * 1e3:>9.2f}"
            f"{max(xs) * 1e3:>9.2f}"
        )
    print(
        f"frugaltrain / plain: median of per-rep ratios {paired:.3f}, ratio of medians "
        f"{o / p:.3f} (target <= 1.05)"
    )
    before, after = record["loadavg_before"], record["loadavg_after"]
    print(f"load average 1/5/15 min: before {before}, after {after}")
    result = record | {
        "clock": "measured",
        "model": args.model,
        "data": args.data or "byte tokens of the standard library",
        "method": "marginal step time: (T(2S) - T(S)) / S per variant, alternating",
        "steps_S": args.steps,
        "reps": args.reps,
        "plain_s_per_step": plain,
        "frugaltrain_s_per_step": ours,
        "ratio_median_of_reps": paired,
        "ratio_of_medians": o / p,
        "target": 1.05,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
