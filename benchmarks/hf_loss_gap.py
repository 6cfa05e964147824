"""FGD against DiLoCo on real text with a transformers model: validation loss at equal tokens.

Each method x seed is a real run of 4 gloo worker processes (`train.launch.run`) of the default
job's setup: a small Llama (transformers) on a BPE-tokenized corpus of the Python standard
library's sources, the same steps, batches and inner optimizer for every method. Runs are
interleaved (for each seed, every method), so load on this shared machine falls on all alike.
Reported per method: the final per-token validation loss (mean over workers, and of the
workers' averaged model), mean and spread over seeds, the gap to DiLoCo paired by seed in %, and
the measured compute utilization. Prints a table and writes JSON.

    python benchmarks/hf_loss_gap.py [--data runs/data/stdlib-bpe2k] [--seeds 0,1,2] \
        [--steps 300] [-H 30] \
        [--methods diloco,GlobalM1,GlobalM1LocalM2,M2pairs:embed+head+blocks:1]

Method names are those of `frugaltrain compare` (sim/compare.py): `M2pairs:SUBSET` is FGD with a
global Mix1 and a pairwise Mix2 on SUBSET, i.e. GlobalM1LocalM2 on a tensor subset.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from frugaltrain.config import load_config
from frugaltrain.metrics.log import read_metrics
from frugaltrain.sim.compare import method_overrides
from frugaltrain.train import launch

DEFAULT = Path(__file__).resolve().parent.parent / "examples" / "default.toml"


def ensure_data(data: str, vocab: int) -> None:
    """Train the tokenizer and write the shards once (as `make run` does)."""
    if (Path(data) / "manifest.json").is_file():
        return
    cli = [sys.executable, "-m", "frugaltrain", "data"]
    tok = f"{data}-tokenizer"
    limit = ["--max-bytes", "4000000", "--force"]
    subprocess.run(
        [*cli, "tokenizer", "--vocab-size", str(vocab), "--out", tok, *limit], check=True
    )
    subprocess.run([*cli, "prepare", "--tokenizer", tok, "--out", data, *limit], check=True)


def one_run(method: str, seed: int, sets: list[str], out: Path) -> dict:
    """Train one method and seed; its final validation losses, utilization and wall time."""
    name = f"{method.replace(':', '_').replace('+', '-')}-s{seed}"
    cfg = load_config(
        DEFAULT, [*sets, *method_overrides(method), f"run.seed={seed}", f"run.name={name!r}"]
    )
    launch.check_data(cfg)
    run_dir = launch.new_run_dir(cfg)
    t0 = time.perf_counter()
    launch.run(cfg, run_dir)
    wall = time.perf_counter() - t0
    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "round"]
    last = [r for r in rounds if "loss/val" in r][-1]
    compute = sum(r["time/compute_s"] for r in rounds)
    blocking = sum(r["time/blocking_s"] for r in rounds)
    return {
        "method": method,
        "seed": seed,
        "loss_val": last["loss/val"],
        "loss_val_avg_model": last["loss/val_avg_model"],
        "consensus": last.get("consensus/total"),
        "util_compute": compute / (compute + blocking),
        "wall_s": wall,
        "tokens": last["tokens"],
    }


def _ms(xs: list[float], fmt: str = ".4f") -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):{fmt}} ± {sd:{fmt}}"


def table(rows: list[dict], methods: list[str], seeds: list[int]) -> str:
    by = {(r["method"], r["seed"]): r for r in rows}
    head = f"{'method':<32}{'val loss':>18}{'avg-model loss':>18}{'gap vs diloco %':>18}"
    lines = [head + f"{'util':>8}", "-" * (len(head) + 8)]
    for m in methods:
        vals = [by[m, s]["loss_val"] for s in seeds]
        avg = [by[m, s]["loss_val_avg_model"] for s in seeds]
        gaps = [100 * (by[m, s]["loss_val"] / by["diloco", s]["loss_val"] - 1) for s in seeds]
        util = statistics.mean(by[m, s]["util_compute"] for s in seeds)
        gap = _ms(gaps, "+.2f") if m != "diloco" else "-"
        lines.append(f"{m:<32}{_ms(vals):>18}{_ms(avg):>18}{gap:>18}{util:>8.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="runs/data/stdlib-bpe2k")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE size if --data must be made")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("-H", type=int, default=30, dest="H")
    ap.add_argument(
        "--methods", default="diloco,GlobalM1,GlobalM1LocalM2,M2pairs:embed+head+blocks:1"
    )
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--out", default="benchmarks/results/hf_loss_gap.json")
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    if "diloco" not in methods:
        methods.insert(0, "diloco")
    seeds = [int(s) for s in args.seeds.split(",")]
    ensure_data(args.data, args.vocab)
    sets = [f"data.path={args.data!r}", f"run.steps={args.steps}", f"outer.H={args.H}"]
    sets += [f"run.eval_every={args.steps}", "run.progress=false", "run.checkpoint_every=0"]
    sets += args.set
    load_before, rows = os.getloadavg(), []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for m in methods:
                rows.append(one_run(m, seed, [*sets, f"run.out_dir={tmp!r}"], Path(tmp)))
                r = rows[-1]
                print(f"[{m} seed {seed}] val {r['loss_val']:.4f}, util {r['util_compute']:.3f}")
    print(f"\nfinal validation loss, measured, 4 workers, {args.steps} steps, H = {args.H}")
    print(table(rows, methods, seeds))
    result = {
        "clock": "measured",
        "what": "final per-token validation loss at equal tokens, real gloo processes",
        "config": str(DEFAULT.name),
        "sets": sets,
        "seeds": seeds,
        "methods": methods,
        "runs": rows,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
