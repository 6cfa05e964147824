"""A straggler on the fault-tolerant runtime: who waits for it, measured.

Three gloo workers on this machine, `fault_tolerance.enabled = true`, the bundled corpus. Worker 1
is slowed by `--factor` (it sleeps so each inner step takes factor x its measured time). Each
method runs twice in one invocation, with and without the straggler:

- fgd GlobalM1: Mix1 is the only exchange between evaluations; a worker waits at most
  fault_tolerance.mix1_deadline_s for a late Mix1 message, then drops it (row renormalized).
- diloco: the outer all-reduce is blocking and every worker takes part in it.

Reported per run (all measured, wall clock): worker 0's time to its last round before the
final evaluation (which synchronizes everybody), how far the slowest worker had come by then,
the Mix1 messages worker 0 dropped at the deadline, and the final validation loss. The headline
is the ratio of worker 0's time with the straggler to without (1.0: the straggler costs the
others nothing; `factor`: they run at its pace).

    python benchmarks/ft_straggler.py [--factor 4] [--steps 200] [--deadline 0.1]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import provenance

from frugaltrain.config import Config, build_config
from frugaltrain.metrics.log import read_metrics
from frugaltrain.train import launch

METHODS = {
    "fgd GlobalM1": ["outer.strategy='fgd'", "outer.fgd.preset='GlobalM1'"],
    "diloco": ["outer.strategy='diloco'"],
}


def overrides(method: list[str], args: argparse.Namespace, straggler: bool) -> list[str]:
    """A run's config overrides, but its output directory."""
    sets = [
        "run.workers=3",
        f"run.steps={args.steps}",
        "outer.H=10",
        "run.eval_every=0",
        "run.eval_batches=2",
        "run.progress=false",
        "run.threads=1",
        "fault_tolerance.enabled=true",
        "run.timeout_s=120",
        f"fault_tolerance.mix1_deadline_s={args.deadline}",
        "data.max_bytes=1000000",
        "data.batch_size=8",
        "data.seq_len=64",
        "model.n_layer=2",
        "model.n_embd=64",
        "model.n_head=4",
        *method,
    ]
    if straggler:
        sets.append(f"fault_tolerance.inject='slow:worker=1,factor={args.factor}'")
    return sets


def config(out: Path, method: list[str], args: argparse.Namespace, straggler: bool) -> Config:
    sets = [f"run.out_dir={str(out)!r}", *overrides(method, args, straggler)]
    return build_config(Config, {}, sets)


def measure(cfg: Config) -> dict:
    run_dir = launch.new_run_dir(cfg)
    launch.run(cfg, run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    rounds = [r for r in records if r.get("kind") == "round"]
    before_final = rounds[-2]  # the final round evaluates, which waits for everybody
    return {
        "rounds": len(rounds),
        "worker0_s_to_last_round": before_final["time/wall_s"],
        "round_then": before_final["round"],
        "slowest_round_then": before_final.get("ft/slowest_round"),
        "mix1_late_worker0": sum(r.get("ft/mix1_late", 0) for r in rounds),
        "val_loss": rounds[-1]["loss/val"],
        "label": "measured",
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--deadline", type=float, default=0.1, help="fault_tolerance.mix1_deadline_s")
    p.add_argument("--out", default="benchmarks/results/ft_straggler.json")
    args = p.parse_args()
    variants = {
        f"{name}, straggler={straggler}": overrides(method, args, straggler)
        for name, method in METHODS.items()
        for straggler in (False, True)
    }
    record = provenance.start("measured", variants=variants)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, method in METHODS.items():
            for straggler in (False, True):
                cfg = config(
                    Path(tmp) / f"{name}-{straggler}".replace(" ", "_"), method, args, straggler
                )
                row = {"method": name, "straggler": straggler, **measure(cfg)}
                rows.append(row)
                print(json.dumps(row), flush=True)

    print()
    print(
        f"straggler: worker 1 at {args.factor:g}x its step time; Mix1 deadline {args.deadline:g} s"
    )
    print(
        f"{'method':<14} {'straggler':>9} {'w0 s to round':>14} {'slowest then':>13} "
        f"{'Mix1 late':>9} {'val loss':>9} {'w0 time vs none':>16}"
    )
    summary = {}
    for name in METHODS:
        base, slow = (
            next(r for r in rows if r["method"] == name and r["straggler"] == s)
            for s in (False, True)
        )
        ratio = slow["worker0_s_to_last_round"] / base["worker0_s_to_last_round"]
        summary[name] = {
            "worker0_time_ratio": ratio,
            "val_loss_delta": slow["val_loss"] - base["val_loss"],
        }
        for r in (base, slow):
            shown = f"{ratio:.2f}x" if r is slow else "1.00x"
            print(
                f"{name:<14} {str(r['straggler']):>9} "
                f"{r['worker0_s_to_last_round']:>9.1f} (r{r['round_then']:>2}) "
                f"{str(r['slowest_round_then']):>13} {r['mix1_late_worker0']:>9} "
                f"{r['val_loss']:>9.4f} {shown:>16}"
            )
    provenance.finish(record)
    out = record | {
        "what": "worker 0's wall time with a straggler vs without, fault-tolerant runtime",
        "label": "measured",
        "factor": args.factor,
        "mix1_deadline_s": args.deadline,
        "steps": args.steps,
        "rows": rows,
        "summary": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
