"""`frugaltrain flow train|plan|bench`: each command builds a FlowConfig and calls one function.

frugaltrain flow train --config examples/flow.toml --set run.mode=flow
frugaltrain flow plan  --config examples/flow.toml --set alloc.budget=4
frugaltrain flow bench --config examples/flow.toml --reps 5
"""

from __future__ import annotations

import argparse
import json
import sys

from frugaltrain.config import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="frugaltrain flow", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("train", "run one mode; write metrics, trace and timeline"),
        ("plan", "profile both modules, fit cost models, solve the allocator"),
        ("bench", "interleaved benchmark of the modes, ablations, projection"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--config", help="TOML config file (see examples/flow.toml)")
        s.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set run.mode=flow (repeatable)",
        )
        if name == "bench":
            s.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
            s.add_argument(
                "--workloads",
                default="encoder_heavy,backbone_heavy",
                help="comma-separated workload names",
            )
            s.add_argument("--no-ablations", action="store_true", help="only the three modes")
            s.add_argument("--out", default="", help="JSON path (default benchmarks/results/)")
            s.add_argument(
                "--alloc-check",
                type=int,
                default=0,
                metavar="R",
                help="instead: run the allocator's plan vs an even split at budget R",
            )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from frugaltrain.flow import bench
    from frugaltrain.flow.config import load_flow_config

    try:
        cfg = load_flow_config(args.config, args.set)
        if args.command == "train":
            m = bench.train(cfg)
            roles = m.pop("measured.roles")
            print(json.dumps(m, indent=1, default=float))
            for role, d in roles.items():
                print(role, " ".join(f"{k}={v:.2f}" for k, v in d.items()), "(measured)")
            print(f"wrote {cfg.run.out_dir}/metrics.json, trace.json, timeline.png")
            return 0
        if args.command == "plan":
            print(json.dumps(bench.plan(cfg), indent=1, default=float))
            return 0
        if args.command == "bench":
            if args.reps < 1:
                raise ConfigError(f"--reps = {args.reps}: must be at least 1")
            if args.alloc_check:
                res = bench.alloc_check(
                    cfg,
                    workload=args.workloads.split(",")[0],
                    budget=args.alloc_check,
                    reps=args.reps,
                )
                print(json.dumps(res, indent=1, default=float))
                stamp = bench.stamp()
                path = bench.write(res, args.out or f"benchmarks/results/flow-alloc-{stamp}.json")
                print(f"wrote {path}")
                return 0
            out = args.out or f"benchmarks/results/flow-{bench.stamp()}.json"
            res = bench.bench(
                cfg,
                reps=args.reps,
                workloads=args.workloads.split(","),
                ablations=not args.no_ablations,
                partial=out,
            )
            print(bench.table(res))
            path = bench.write(res, out)
            print(f"wrote {path}")
            return 0
    except ConfigError as e:
        print(f"frugaltrain flow: error: {e}", file=sys.stderr)
        return 2
    return 2
