"""`frugaltrain flow train|plan`: each command builds a FlowConfig and calls one function.

frugaltrain flow train --config examples/flow.toml --set run.mode=flow
frugaltrain flow plan  --config examples/flow.toml --set alloc.budget=4

The benchmark is a script: python benchmarks/flow.py --help.
"""

from __future__ import annotations

import argparse
import json
import sys

from frugaltrain.config import ArgumentParser, ConfigError, add_set_flag
from frugaltrain.flow.config import load_flow_config
from frugaltrain.flow.plan import plan
from frugaltrain.flow.train import train


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="frugaltrain flow", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("train", "run one mode; write metrics, trace and timeline"),
        ("plan", "profile both modules, fit cost models, solve the allocator"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--config", help="TOML config file (see examples/flow.toml)")
        add_set_flag(s, "run.mode=flow")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_flow_config(args.config, args.set)
        if args.command == "train":
            m = train(cfg)
            roles = m.pop("measured.roles")
            print(json.dumps(m, indent=1, default=float))
            for role, d in roles.items():
                print(role, " ".join(f"{k}={v:.2f}" for k, v in d.items()), "(measured)")
            print(f"wrote {cfg.run.out_dir}/metrics.json, trace.json, timeline.png")
            return 0
        print(json.dumps(plan(cfg), indent=1, default=float))
        return 0
    except ConfigError as e:
        print(f"frugaltrain flow: error: {e}", file=sys.stderr)
        return 2
