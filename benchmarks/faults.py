"""What a fault costs on the fault-tolerant runtime, per strategy, and a soak under many faults.

Matrix: for each strategy x fault, a 3-worker run of the tiny byte-level GPT and the same run
without the fault, side by side. Every worker sleeps --sleep s after each inner step (no CPU
used), so a round lasts about what a real one would against the few seconds a recovery takes.
Reported, measured: the wall-time overhead (faulted / clean), worker-rounds lost (rounds a worker
was not a member of), the time lost to recovery per worker (the summary's line), and the final
validation loss against the clean run's.

Soak: --soak-rounds rounds on 4 workers with a fault every 10 rounds (kill, partition, stall or
corrupt, on workers 1-3, drawn from a seeded generator), against the clean run: the run must
finish (no hang), and the final loss is reported against the clean one (target: within 5%).

    python benchmarks/faults.py                               # matrix and soak
    python benchmarks/faults.py --strategies diloco,fgd --faults kill,stall --soak-rounds 0

The matrix's table (table_format.faults_table) is the one tables.py writes into
docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import provenance
from table_format import faults_table as table  # shared with tables.py

from frugaltrain.config import Config, build_config
from frugaltrain.metrics.log import read_metrics
from frugaltrain.train import launch

# A calm outer step (lr 0.5, momentum 0.5), as in the fault tests: with 0.7 / 0.9 Nesterov this
# tiny model's trajectory is chaotic enough that any change of membership moves the final loss
# by several percent either way, which would hide what the fault itself costs.
GENTLE = ["outer.lr=0.5", "outer.momentum=0.5"]
STRATEGIES = {
    "ddp": ["outer.strategy='ddp'"],
    "diloco": ["outer.strategy='diloco'", *GENTLE],
    "fgd": ["outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'", *GENTLE],
    "noloco": ["outer.strategy='noloco'", *GENTLE],
    "streaming": [
        "outer.strategy='streaming'",
        "outer.streaming.fragments=2",
        "outer.streaming.overlap=1",
        *GENTLE,
    ],
}
FAULTS = {  # worker 1, halfway through round 5
    "kill": "kill:worker=1,round=5",
    "hang": "hang:worker=1,round=5",
    "partition": "partition:worker=1,round=5,seconds=10",
    "stall": "stall:worker=1,round=5,seconds=20",
    "corrupt": "corrupt:worker=1,round=5,value=1e30",
}
SOAK_KINDS = ("kill", "partition", "stall", "corrupt")
JOB = [  # the tiny byte-level job of the fault tests
    "data.seq_len=32",
    "data.batch_size=4",
    "model.n_layer=2",
    "model.n_embd=48",
    "model.n_head=2",
    "outer.H=4",
    "optim.warmup_steps=2",
    "run.eval_batches=4",
    "run.threads=1",
    "run.progress=false",
    "fault_tolerance.enabled=true",
    "fault_tolerance.deadline_floor_s=5",
]


def run(sets: list[str], out_dir: str, name: str) -> dict:
    """Train one run; return what the tables need from its metrics."""
    cfg = build_config(Config, {}, [*JOB, *sets, f"run.out_dir={out_dir!r}", f"run.name={name!r}"])
    run_dir = launch.new_run_dir(cfg)
    t0 = time.monotonic()
    launch.run(cfg, run_dir)
    wall = time.monotonic() - t0
    records = read_metrics(run_dir / "metrics.jsonl")
    rounds = [r for r in records if r.get("kind") == "round"]
    vals = [r["loss/val"] for r in rounds if "loss/val" in r]
    return {
        "wall_s": wall,
        "rounds": len(rounds),
        "worker_rounds_lost": sum(
            cfg.run.workers - r.get("ft/members", cfg.run.workers) for r in rounds
        ),
        "recovery_s": sum(r.get("time/recovery_s", 0.0) for r in rounds),
        "loss_val": vals[-1] if vals else None,
        "left": [e["workers"] for e in records if e.get("event") == "left"],
        "rejected": sum(1 for r in records if r.get("kind") == "rejected"),
    }


def matrix_variants(args) -> dict[str, list[str]]:
    """Each matrix run's name -> its overrides (beside JOB): per strategy, clean then faults."""
    out = {}
    base = ["run.workers=3", f"run.steps={4 * args.rounds}", f"run.eval_every={4 * args.rounds}"]
    slow = f"slow:seconds={args.sleep}"
    for strategy in args.strategies.split(","):
        sets = [*base, *STRATEGIES[strategy]]
        out[f"{strategy}-clean"] = [*sets, f"fault_tolerance.inject={slow!r}"]
        for fault in args.faults.split(","):
            spec = f"{FAULTS[fault]};{slow}"
            out[f"{strategy}-{fault}"] = [*sets, f"fault_tolerance.inject={spec!r}"]
    return out


def matrix(args, tmp: str) -> list[dict]:
    """Each strategy x fault, --reps times; a repetition runs the clean run, then every fault, so
    each faulted run is compared with the clean run measured just before it."""
    variants = matrix_variants(args)
    rows = {
        (s, f): {"strategy": s, "fault": f, "reps": []}
        for s in args.strategies.split(",")
        for f in args.faults.split(",")
    }
    for rep in range(args.reps):
        for strategy in args.strategies.split(","):
            clean = run(variants[f"{strategy}-clean"], tmp, f"{strategy}-clean-{rep}")
            for fault in args.faults.split(","):
                got = run(variants[f"{strategy}-{fault}"], tmp, f"{strategy}-{fault}-{rep}")
                one = {"clean": clean, "faulted": got, "overhead": got["wall_s"] / clean["wall_s"]}
                one["loss_ratio"] = got["loss_val"] / clean["loss_val"]
                rows[strategy, fault]["reps"].append(one)
                print_row(strategy, fault, one)
    return list(rows.values())


def print_row(strategy: str, fault: str, one: dict) -> None:
    f = one["faulted"]
    print(
        f"{strategy:<10} {fault:<10} {one['overhead']:8.2f}x "
        f"{f['worker_rounds_lost']:6d} {f['recovery_s']:9.1f} {one['loss_ratio']:9.4f}  "
        f"left {f['left']} rejected {f['rejected']}",
        flush=True,
    )


def soak_spec(rounds: int, seed: int, workers: int) -> str:
    """A fault every 10 rounds, from round 5 to rounds - 10 (so the last one can rejoin)."""
    rng = random.Random(seed)
    specs = []
    for r in range(5, rounds - 9, 10):
        kind, w = rng.choice(SOAK_KINDS), rng.randrange(1, workers)
        extra = {"partition": ",seconds=8", "stall": ",seconds=15", "corrupt": ",value=1e30"}
        specs.append(f"{kind}:worker={w},round={r}{extra.get(kind, '')}")
    return ";".join(specs)


def soak_variants(args) -> dict[str, list[str]]:
    """The soak's two runs (clean, faulted) -> their overrides (beside JOB)."""
    rounds, workers = args.soak_rounds, 4
    sets = [f"run.workers={workers}", f"run.steps={4 * rounds}", f"run.eval_every={4 * rounds}"]
    sets.append(f"fault_tolerance.max_restarts={rounds // 10}")  # a worker may meet every fault
    sets += STRATEGIES[args.soak_strategy]
    slow = f"slow:seconds={args.sleep}"
    spec = soak_spec(rounds, args.seed, workers)
    return {
        "soak-clean": [*sets, f"fault_tolerance.inject={slow!r}"],
        "soak-faulted": [*sets, f"fault_tolerance.inject={spec + ';' + slow!r}"],
    }


def soak(args, tmp: str) -> dict:
    rounds, variants = args.soak_rounds, soak_variants(args)
    spec = soak_spec(rounds, args.seed, 4)
    clean = run(variants["soak-clean"], tmp, "soak-clean")
    got = run(variants["soak-faulted"], tmp, "soak-faulted")
    out = {"strategy": args.soak_strategy, "rounds": rounds, "spec": spec, "clean": clean}
    out |= {"faulted": got, "overhead": got["wall_s"] / clean["wall_s"]}
    out["loss_ratio"] = got["loss_val"] / clean["loss_val"]
    print(
        f"soak {args.soak_strategy}, {rounds} rounds, {spec.count(';') + 1} faults: finished "
        f"{got['rounds']} rounds, wall {out['overhead']:.2f}x clean, worker-rounds lost "
        f"{got['worker_rounds_lost']}, recovery {got['recovery_s']:.1f} s/worker, final loss "
        f"{got['loss_val']:.4f} vs {clean['loss_val']:.4f} ({out['loss_ratio']:.4f}x)",
        flush=True,
    )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--faults", default="kill,hang,partition,stall,corrupt")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per matrix run")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every matrix cell")
    ap.add_argument("--sleep", type=float, default=0.1, help="seconds slept per inner step")
    ap.add_argument("--soak-rounds", type=int, default=200, help="0: no soak")
    ap.add_argument("--soak-strategy", default="diloco", choices=list(STRATEGIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/faults.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    variants = matrix_variants(args) if args.faults and args.strategies else {}
    variants |= soak_variants(args) if args.soak_rounds else {}
    result = provenance.start("measured", variants={k: [*JOB, *v] for k, v in variants.items()})
    result |= {"clock": "measured", "args": vars(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.faults and args.strategies:
            print(f"{'strategy':<10} {'fault':<10} {'overhead':>9} {'lost':>6} "
                  f"{'recovery':>9} {'loss/clean':>9}")  # fmt: skip
            result["matrix"] = matrix(args, tmp)
            Path(args.out).write_text(json.dumps(result, indent=1))  # kept if the soak fails
        if args.soak_rounds:
            result["soak"] = soak(args, tmp)
    provenance.finish(result)
    if result.get("matrix"):
        print(table(result))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
