"""frugaltrain's DiLoCo against torchft's DiLoCo: same model, data, seeds, H and outer optimizer.

M replica groups of one process each train the frugaltrain GPT on the same per-worker shards with
the same inner AdamW and schedule and the same outer SGD (lr 0.7, momentum 0.9, Nesterov):
  - ours: `frugaltrain.train.launch.run` (gloo, local processes)
  - torchft: a Lighthouse (min_replicas = M), one Manager per replica (gloo, synchronous quorum)
    and `torchft.local_sgd.DiLoCo(sync_every=H)` hooking the inner optimizer
The two run alternately (ours, torchft, ours, torchft, ...) in one invocation; each reports the
final validation loss (same fixed batches) and tokens/s (all workers, measured wall clock from
the first step to the end). Needs `pip install frugaltrain[torchft]`.

    python benchmarks/vs_torchft.py --workers 2 --steps 200 -H 20 --reps 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import provenance
import torch


def _torchft(args) -> list[str]:
    """What the torchft side builds beside the config (_torchft_replica), as key=value."""
    return [
        "torchft.outer=torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)",
        f"torchft.local_sgd=DiLoCo(sync_every={args.H}, backup_device=cpu)",
        f"torchft.manager=Manager(min_replica_size={args.workers}, use_async_quorum=False)",
    ]


def _overrides(args) -> list[str]:
    """The config both implementations read (a run's output directory aside)."""
    return [
        f"run.workers={args.workers}",
        f"run.steps={args.steps}",
        f"outer.H={args.H}",
        "outer.strategy='diloco'",
        "outer.lr=0.7",
        "outer.momentum=0.9",
        "run.eval_every=0",
        f"run.eval_batches={args.eval_batches}",
        "run.progress=false",
        "data.batch_size=8",
        "data.seq_len=64",
    ]


def _config(args, out_dir: str):
    from frugaltrain.config import Config, build_config

    return build_config(Config, {}, [*_overrides(args), f"run.out_dir={out_dir!r}"])


def run_ours(args, out_dir: str) -> dict:
    from frugaltrain.metrics.log import read_metrics
    from frugaltrain.train import launch

    cfg = _config(args, out_dir)
    run_dir = launch.new_run_dir(cfg)
    launch.run(cfg, run_dir)
    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "round"]
    last = rounds[-1]
    train_s = last["time/wall_s"] - last.get("time/eval_s", 0.0)
    return {"val_loss": last["loss/val"], "tokens_per_s": last["tokens"] / train_s}


def _torchft_replica(rank: int, args, out_dir: str, lighthouse: str, result) -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens, worker_seed
    from frugaltrain.models import build_model, evaluate
    from frugaltrain.optim import build_inner_optimizer, build_schedule

    cfg = _config(args, out_dir)
    r, d = cfg.run, cfg.data
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // r.workers))
    corpus = load_corpus(d.path, d.max_bytes, d.val_fraction)
    shard = shard_tokens(corpus.train, rank, r.workers, d.num_shards, d.sharding)
    sampler = BatchSampler(shard, d.seq_len, d.batch_size, worker_seed(r.seed, rank))
    val_sampler = BatchSampler(corpus.val, d.seq_len, d.batch_size, seed=10_007 + r.seed)
    val_batches = [val_sampler.batch(i) for i in range(r.eval_batches)]
    model = build_model(cfg)
    inner = build_inner_optimizer(model, cfg.optim)
    schedule = build_schedule(inner, cfg.optim, r.steps)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    torch.manual_seed(worker_seed(r.seed, rank))

    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=lambda s: (
            model.load_state_dict(s["model"]),
            inner.load_state_dict(s["inner"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        min_replica_size=r.workers,
        use_async_quorum=False,
        replica_id=f"replica_{rank}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=60),
    )
    t0 = None
    with DiLoCo(
        manager, [model], inner, outer, sync_every=args.H, backup_device=torch.device("cpu")
    ):
        for step in range(r.steps):
            if step == 1:
                t0 = time.perf_counter()  # like ours: the wall clock excludes process start
            x, y = sampler.batch(step)
            _, loss = model(x, y)
            loss.backward()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            inner.step()  # DiLoCo's hook syncs every H steps
            schedule.step()
            inner.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    val = evaluate(model, val_batches)
    result[rank] = (val, elapsed)
    manager.shutdown(wait=False)


def run_torchft(args, out_dir: str) -> dict:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.workers)
    ctx = mp.get_context("spawn")
    result = ctx.Manager().dict()
    procs = [
        ctx.Process(target=_torchft_replica, args=(i, args, out_dir, lighthouse.address(), result))
        for i in range(args.workers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    lighthouse.shutdown()
    if len(result) != args.workers:
        raise RuntimeError(f"torchft replicas failed: exit codes {[p.exitcode for p in procs]}")
    vals = [result[i][0] for i in range(args.workers)]
    wall = max(result[i][1] for i in range(args.workers))
    tokens = args.workers * (args.steps - 1) * 8 * 64
    return {"val_loss": statistics.mean(vals), "tokens_per_s": tokens / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("-H", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/vs_torchft.json")
    args = ap.parse_args()
    variants = {"frugaltrain": _overrides(args), "torchft": [*_overrides(args), *_torchft(args)]}
    record = provenance.start("measured", variants=variants)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name, fn in (("frugaltrain", run_ours), ("torchft", run_torchft)):
                load = os.getloadavg()[0]
                row = {"impl": name, "rep": rep, **fn(args, tmp), "load_avg_1min_before": load}
                rows.append(row)
                print(json.dumps(row), flush=True)
    provenance.finish(record)
    summary = {}
    for name in ("frugaltrain", "torchft"):
        mine = [r for r in rows if r["impl"] == name]
        summary[name] = {
            "val_loss_mean": statistics.mean(r["val_loss"] for r in mine),
            "tokens_per_s_mean": statistics.mean(r["tokens_per_s"] for r in mine),
        }
    ours, theirs = summary["frugaltrain"], summary["torchft"]
    summary["val_loss_rel_diff"] = ours["val_loss_mean"] / theirs["val_loss_mean"] - 1
    summary["speed_ratio_ours_over_torchft"] = (
        ours["tokens_per_s_mean"] / theirs["tokens_per_s_mean"]
    )
    out = record | {"config": vars(args), "runs": rows, "summary": summary, "label": "measured"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
