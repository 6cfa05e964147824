"""Replicas x shards: per-process peak memory, step time and outer bytes at run.shards = 1, 2, 4.

Every case spawns fresh gloo processes on this machine (each peak is its own) laid out as the
launcher lays them out (train/sharding.py), runs the training loop and stops after the last
inner step (the final checkpoint, a write of several GB here, is not training memory). Figures:

    peak_rss_MiB    measured: the RSS high-water mark of each process (VmHWM of
                    /proc/self/status) at its last inner step; it covers a whole outer round
                    (round 1's outer step) and includes what torch itself holds
    base_rss_MiB    measured: each process's RSS after importing torch and frugaltrain, before
                    anything of the run exists (the floor every process pays)
    step_s          measured: median compute seconds of an inner step (forward, backward, inner
                    AdamW, FSDP2's in-replica gathers and reduce-scatters), first step excluded
    outer_bytes     counted by the comm's traffic model: outer bytes one process sent in one
                    round (ring all-reduce: 2 (M-1)/M x its payload)
    estimate_MiB    estimated before the run (models.memory_estimate, what `train` prints)

Part "memory": one replica (run.workers = 1) of a 24-block GPT (d 1024, 302M parameters), the
largest that fits S = 1 on this shared 24 GiB machine with room for the others using it. One
replica has no outer traffic, so part "bytes" runs two replicas of a small GPT (4 blocks, d 256).

glibc's malloc raises its mmap threshold as big blocks are freed (up to 32 MiB), after which
freed gradients, activations and FSDP2 buffers stay in its heap: the RSS peak then holds more
than the live tensors. `--mmap-threshold 131072` sets MALLOC_MMAP_THRESHOLD_ in every process (a
fixed threshold: every block of 128 KiB or more is returned on free), to see how much that is.

    python benchmarks/sharding.py [--shards 1,2,4] [--reps 3] [--mmap-threshold N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import provenance
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from frugaltrain.comm import LocalComm
from frugaltrain.comm.runtime import Runtime
from frugaltrain.comm.torchdist import TorchDistComm
from frugaltrain.config import Config, build_config, to_toml
from frugaltrain.models import memory_estimate, model_bytes
from frugaltrain.train.loop import train_worker
from frugaltrain.train.sharding import build_layout

_MIB = 1 << 20
PARTS = {
    "memory": ("run.workers=1", "model.n_layer=24", "model.n_embd=1024", "model.n_head=16"),
    "bytes": ("run.workers=2", "model.n_layer=4", "model.n_embd=256", "model.n_head=4"),
}
COMMON = (
    "data.seq_len=128",
    "data.batch_size=4",
    "run.steps=6",
    "outer.H=3",
    "run.eval_every=0",
    "run.eval_batches=1",
    "run.progress=false",
    "outer.strategy='diloco'",
)


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _Stop(Exception):
    """The last inner step is done: leave before the final outer step and checkpoint."""


class _Watched(Runtime):
    """The plain runtime, whose step hook (run after every inner step) keeps each step's
    compute time and, at the last step, the RSS high-water mark; then stops the run."""

    def __init__(self, comm, steps: int, record: dict) -> None:
        super().__init__(comm)
        self.steps, self.record = steps, record

    def on_step(self, step: int, compute_s: float) -> None:
        self.record["step_s"].append(compute_s)
        if step == self.steps:
            self.record["peak_rss"] = _status("VmHWM")
            raise _Stop


def _process(rank: int, world: int, port: int, cfg_toml: str, run_dir: str, out) -> None:
    import tomllib

    record = {"base_rss": _status("VmRSS"), "step_s": []}
    cfg = build_config(Config, tomllib.loads(cfg_toml))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    shards = None
    if world == 1:
        comm = LocalComm()
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(600))
        if cfg.run.shards > 1:
            shards, group = build_layout(cfg.run.workers, cfg.run.shards, "cpu")
            comm = TorchDistComm(group, shard_link=shards.link)
        else:
            comm = TorchDistComm()
    try:
        train_worker(cfg, _Watched(comm, cfg.run.steps, record), Path(run_dir), None, shards)
    except _Stop:
        pass
    record["outer_bytes"] = comm.stats.bytes_sent
    out[rank] = record
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(part: str, shards: int) -> list[str]:
    return [*PARTS[part], *COMMON, f"run.shards={shards}"]


def run_case(part: str, shards: int, root: Path, mmap_threshold: int = 0) -> dict:
    cfg = build_config(Config, {}, overrides(part, shards))
    world = cfg.run.workers * shards
    run_dir = root / f"{part}-{shards}-{time.monotonic_ns()}"
    run_dir.mkdir()
    out = mp.Manager().dict()
    if mmap_threshold:  # read by glibc at process start: the spawned processes inherit it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    args = (world, _free_port(), to_toml(cfg), str(run_dir), out)
    try:
        mp.start_processes(_process, args=args, nprocs=world, start_method="spawn")
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    procs = [out[r] for r in range(world)]
    est = memory_estimate(cfg)
    per_process = model_bytes(est) + est["process_bytes"]  # what `train` prints
    return {
        "part": part,
        "shards": shards,
        "workers": cfg.run.workers,
        "params": est["params"],
        "load_avg_1m_before": load,
        "malloc_mmap_threshold": mmap_threshold or "glibc default (dynamic)",
        "wall_s": time.perf_counter() - t0,
        "peak_rss_MiB": [p["peak_rss"] / _MIB for p in procs],
        "base_rss_MiB": [p["base_rss"] / _MIB for p in procs],
        "step_s": statistics.median(s for p in procs for s in p["step_s"][1:]),
        "outer_bytes": [p["outer_bytes"] for p in procs],
        "estimate_MiB": per_process / _MIB,
    }


def _spread(values: list[float]) -> str:
    mid = statistics.median(values)
    return f"{mid:9.1f} [{min(values):.1f}, {max(values):.1f}]"


def table(results: list[dict], shard_counts: list[int]) -> list[str]:
    """Per part and S: medians over repetitions [min, max], and ratios to S = 1."""
    lines = []
    for part in PARTS:
        runs = {
            s: [r for r in results if r["part"] == part and r["shards"] == s] for s in shard_counts
        }
        if not all(runs.values()):
            continue
        base = runs[shard_counts[0]]
        peak1 = statistics.median(max(r["peak_rss_MiB"]) for r in base)
        step1 = statistics.median(r["step_s"] for r in base)
        bytes1 = statistics.median(statistics.mean(r["outer_bytes"]) for r in base)
        lines.append(
            f"\n{part}: {base[0]['workers']} worker(s), {base[0]['params'] / 1e6:.0f}M parameters"
        )
        lines.append(
            "  S   peak RSS/process MiB (measured)   x S=1   estimate MiB   step s (measured)   "
            "x S=1   outer bytes/process/round (counted)   x S=1"
        )
        for s, rs in runs.items():
            peak = [max(r["peak_rss_MiB"]) for r in rs]
            step = [r["step_s"] for r in rs]
            sent = [statistics.mean(r["outer_bytes"]) for r in rs]
            ratio_b = f"{statistics.median(sent) / bytes1:6.3f}" if bytes1 else "     -"
            lines.append(
                f"  {s}   {_spread(peak):>31}   {statistics.median(peak) / peak1:5.3f}   "
                f"{rs[0]['estimate_MiB']:12.0f}   {_spread(step):>17}   "
                f"{statistics.median(step) / step1:5.3f}   {statistics.median(sent):35.0f}   "
                + ratio_b
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--parts", default="memory,bytes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--mmap-threshold", type=int, default=0, help="MALLOC_MMAP_THRESHOLD_ (0: unset)"
    )
    ap.add_argument("--out", default="benchmarks/results/sharding.json")
    args = ap.parse_args()
    shard_counts = [int(s) for s in args.shards.split(",")]
    env = [f"env.MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"] if args.mmap_threshold else []
    variants = {
        f"{part} S={s}": [*overrides(part, s), *env]
        for part in args.parts.split(",")
        for s in shard_counts
    }
    record = provenance.start("measured", variants=variants)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):  # S interleaved per repetition: drifts in load hit all alike
            for part in args.parts.split(","):
                for s in shard_counts:
                    r = run_case(part, s, Path(tmp), args.mmap_threshold)
                    r["rep"] = rep
                    results.append(r)
                    print(
                        f"rep {rep} {part} S={s}: peak {max(r['peak_rss_MiB']):.0f} MiB, step "
                        f"{r['step_s']:.2f} s, load {r['load_avg_1m_before']:.2f}",
                        flush=True,
                    )
    provenance.finish(record)
    lines = table(results, shard_counts)
    print("\n".join(lines))
    meta = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "labels": {
            "peak_rss_MiB": "measured (VmHWM per process)",
            "base_rss_MiB": "measured (VmRSS after imports)",
            "step_s": "measured (median inner-step compute, first step excluded)",
            "outer_bytes": "counted (comm traffic model), one round",
            "estimate_MiB": "estimated (models.memory_estimate)",
        },
    }
    Path(args.out).write_text(
        json.dumps(record | {"meta": meta, "results": results, "table": lines}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
