"""How long a launcher takes to have its workers ready to train, and a restarted one: each
process spawned (it imports torch itself) against each forked from the fork server that imported
torch once (processes.py, what the launcher and a machine's agent use).

A worker is ready once it has imported what a worker imports and built an optimizer (which
imports torch._dynamo). Each repetition is a fresh launcher process (so the fork server starts
cold), the two ways alternating; the table gives the median and the min-max.

    python benchmarks/worker_start.py [--workers 4] [--reps 3] [--out FILE]

The table (table_format.worker_start_table) is the one tables.py writes into
docs/fault_tolerance.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import provenance
from table_format import worker_start_table as table  # shared with tables.py

WAYS = ("spawn", "forkserver")


def ready(path: str) -> None:
    """A worker's start: its imports and a first optimizer; then when it was ready and the CPU
    it used since it began (a forked worker: since its fork)."""
    import torch

    import frugaltrain.train.supervisor  # noqa: F401  (what a worker process imports)

    torch.optim.AdamW(torch.nn.Linear(8, 8).parameters())
    Path(path).write_text(json.dumps({"at": time.time(), "cpu": time.process_time()}))


def _server_cpu() -> float:
    """CPU seconds of this process's fork server (its imports), from /proc."""
    from multiprocessing import forkserver

    fields = Path(f"/proc/{forkserver._forkserver._forkserver_pid}/stat").read_text().split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def launch(way: str, workers: int, tmp: Path) -> dict:
    """In a fresh launcher: start `workers` processes the `way` given, then one more once all
    are ready (a restart)."""
    from frugaltrain import processes
    from frugaltrain.train import supervisor

    def start(name: str):
        if way == "forkserver":
            return processes.start(ready, (str(tmp / name),), supervisor.PRELOAD)
        p = mp.get_context("spawn").Process(target=ready, args=(str(tmp / name),))
        p.start()
        return p

    t0 = time.time()
    procs = [start(f"w{i}") for i in range(workers)]
    for p in procs:
        p.join()
    first = [json.loads((tmp / f"w{i}").read_text()) for i in range(workers)]
    t1 = time.time()
    start("again").join()
    again = json.loads((tmp / "again").read_text())
    server = _server_cpu() if way == "forkserver" else 0.0
    return {
        "start_s": max(r["at"] for r in first) - t0,
        "start_cpu_s": sum(r["cpu"] for r in first) + server,
        "restart_s": again["at"] - t1,
        "restart_cpu_s": again["cpu"],
    }


def measure(workers: int, reps: int, tmp: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    for rep in range(reps):
        for way in WAYS:
            d = tmp / f"{way}{rep}"
            d.mkdir(parents=True)
            cmd = [sys.executable, __file__, "--launch", way, "--workers", str(workers), str(d)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[way].append(json.loads(out.splitlines()[-1]))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/worker_start.json")
    ap.add_argument("--launch", choices=WAYS, help=argparse.SUPPRESS)  # one launcher's run
    ap.add_argument("dir", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.launch:
        print(json.dumps(launch(args.launch, args.workers, Path(args.dir))))
        return
    import tempfile

    record = provenance.start("measured")
    record |= {"workers": args.workers, "reps": args.reps}
    with tempfile.TemporaryDirectory() as tmp:
        record["runs"] = measure(args.workers, args.reps, Path(tmp))
    provenance.report(record, args.out, table)


if __name__ == "__main__":
    main()
