"""Compute utilization and bytes per round of every outer method on 4 real gloo workers.

All methods run the same model, data, seeds and H, interleaved (A B C ... A B C ...) so machine
noise hits them alike. Reports per method the measured compute utilization (compute / (compute +
blocking), blocking = time inside waits on Mix2, an unfinished Mix1, an all-reduce), blocking
and compute seconds per round, bytes sent per worker per round (model-counted), and the final
validation loss. The links are loopback: real processes and real transfers, but fast links; for
rate-limited links see `frugaltrain netlab` and docs/results/netlab.md.

    python benchmarks/overlap.py [--reps 2] [--steps 100] [--H 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import provenance

from frugaltrain.config import Config, build_config, to_toml
from frugaltrain.metrics.log import read_metrics
from frugaltrain.metrics.report import summarize
from frugaltrain.train.launch import new_run_dir, run

METHODS = {
    "ddp": ["outer.strategy='ddp'"],
    "diloco": ["outer.strategy='diloco'"],
    "fgd GlobalM1": ["outer.strategy='fgd'", "outer.fgd.preset='GlobalM1'"],
    "fgd GlobalM1LocalM2": ["outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'"],
    "fgd M2 embed+head+blocks:1": [
        "outer.strategy='fgd'",
        "outer.fgd.mix2='pairs'",
        "outer.fgd.mix2_params='embed+head+blocks:1'",
    ],
    "noloco": ["outer.strategy='noloco'", "outer.momentum=0.5"],
    "streaming P2 e3m0": [
        "outer.strategy='streaming'",
        "outer.streaming.fragments=2",
        "outer.codec='e3m0'",
    ],
}


def base_overrides(steps: int, H: int) -> list[str]:
    """Every method's job (a run's output directory aside)."""
    return [
        "run.workers=4",
        f"run.steps={steps}",
        "run.eval_every=0",
        "run.progress=false",
        f"outer.H={H}",
        "data.max_bytes=2000000",
        "data.seq_len=128",
        "data.batch_size=8",
        "model.n_layer=2",
        "model.n_embd=128",
        "model.n_head=4",
    ]


def run_method(sets: list[str], out: Path, steps: int, H: int) -> dict:
    base = [f"run.out_dir={str(out)!r}", *base_overrides(steps, H)]
    cfg = build_config(Config, {}, base + sets)
    run_dir = new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    run(cfg, run_dir)
    s = summarize(read_metrics(run_dir / "metrics.jsonl"))
    return {
        "util": s["util/compute"],
        "compute_s_per_round": s["time/compute_s"] / s["rounds"],
        "blocking_s_per_round": s["time/blocking_s"] / s["rounds"],
        "bytes_sent_per_round": s["comm/bytes_sent"] / s["rounds"],
        "val_loss": s["loss/val_last"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--H", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/overlap.json")
    args = ap.parse_args()
    base = base_overrides(args.steps, args.H)
    variants = {m: [*base, *sets] for m, sets in METHODS.items()}
    record = provenance.start("measured", variants=variants)
    results: dict[str, list[dict]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name, sets in METHODS.items():
                results[name].append(run_method(sets, Path(tmp) / f"r{rep}", args.steps, args.H))
                print(f"rep {rep} {name}: util {results[name][-1]['util']:.4f}", flush=True)
    provenance.finish(record)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    header = (
        f"{'method (4 gloo workers, loopback, measured)':<30} {'util':>7} {'block s/rd':>10} "
        f"{'compute s/rd':>12} {'block/compute':>13} {'MB sent/rd':>10} {'val loss':>8}"
    )
    print(header)
    rows = {}
    for name in METHODS:
        row = {k: med(name, k) for k in results[name][0]}
        row["blocking_over_compute"] = row["blocking_s_per_round"] / row["compute_s_per_round"]
        rows[name] = row
        print(
            f"{name:<30} {row['util']:>7.4f} {row['blocking_s_per_round']:>10.4f} "
            f"{row['compute_s_per_round']:>12.3f} {row['blocking_over_compute']:>13.4f} "
            f"{row['bytes_sent_per_round'] / 1e6:>10.3f} {row['val_loss']:>8.4f}"
        )
    payload = record | {
        "what": "4 real gloo workers on loopback; medians over interleaved repetitions",
        "label": "measured",
        "steps": args.steps,
        "H": args.H,
        "reps": args.reps,
        "median": rows,
        "runs": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
