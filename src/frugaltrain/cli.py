"""The `frugaltrain` command: each subcommand builds a config and calls one function.

    frugaltrain train --config examples/default.toml --workers 4 --set outer.H=50
    frugaltrain train --resume runs/default          # continue from the latest checkpoint
    frugaltrain report runs/default                  # re-render the summary table and plots
    frugaltrain energy ...                           # meters, fits, predictions (energy/cli.py)
    frugaltrain flow ...                             # FlowTrain vision-language (flow/cli.py)
    frugaltrain simulate CONFIG --set sim.ratio=0.887  # virtual workers, simulated clock
    frugaltrain compare CONFIG --methods diloco,GlobalM1 # methods side by side (sim/compare.py)

Subsystems with many verbs own their parser (`frugaltrain.<subsystem>.cli.main(argv) -> int`);
this file only routes to them, importing lazily so a missing optional extra never breaks `train`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from frugaltrain.config import ConfigError

# Subcommands whose parser lives in the subsystem's own cli module.
SUBSYSTEM_COMMANDS = {
    "energy": "frugaltrain.energy.cli",
    "flow": "frugaltrain.flow.cli",
    "netlab": "frugaltrain.netlab.cli",
    "simulate": "frugaltrain.sim.cli",
    "compare": "frugaltrain.sim.compare",
}


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train with an outer strategy on N local workers or torchrun")
    p.add_argument("--config", help="TOML config file (see examples/)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set outer.H=50 (repeatable)",
    )
    p.add_argument("--workers", type=int, help="shortcut for --set run.workers=N")
    p.add_argument("--outer", help="shortcut for --set outer.strategy=NAME")
    p.add_argument("--steps", type=int, help="shortcut for --set run.steps=N")
    p.add_argument("-H", type=int, dest="H", help="shortcut for --set outer.H=N")
    p.add_argument("--preset", help="fgd variant: GlobalM1 or GlobalM1LocalM2 (outer.preset)")
    p.add_argument("--mix1", help="fgd Mix1 topology (outer.mix1)")
    p.add_argument("--mix2", help="fgd Mix2 topology (outer.mix2)")
    p.add_argument("--mix2-params", help="fgd Mix2 tensors, e.g. embed+head+blocks:2")
    p.add_argument("--momentum-policy", help="fgd outer momentum: local or mixed")
    p.add_argument("--codec", help="outer traffic encoding: fp32, bf16, int8, e3m0")
    p.add_argument(
        "--inner-optimizer",
        help="shortcut for --set optim.name=NAME: adamw, forge-adamw, forge-sgd or forge-lion",
    )
    p.add_argument("--name", help="shortcut for --set run.name=NAME")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    p.add_argument(
        "--inject",
        help="faults, e.g. 'kill:worker=2,round=5'; turns on run.fault_tolerance (run.inject)",
    )


def _shortcuts(args: argparse.Namespace) -> list[str]:
    sets = []
    for flag, key in (
        ("workers", "run.workers"),
        ("outer", "outer.strategy"),
        ("steps", "run.steps"),
        ("name", "run.name"),
        ("H", "outer.H"),
        ("preset", "outer.preset"),
        ("mix1", "outer.mix1"),
        ("mix2", "outer.mix2"),
        ("mix2_params", "outer.mix2_params"),
        ("momentum_policy", "outer.momentum_policy"),
        ("codec", "outer.codec"),
        ("inner_optimizer", "optim.name"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            sets.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    if getattr(args, "inject", None):
        sets += ["run.fault_tolerance=true", f"run.inject={args.inject!r}"]
    return sets + list(args.set)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBSYSTEM_COMMANDS:
        module = importlib.import_module(SUBSYSTEM_COMMANDS[argv[0]])
        return module.main(argv[1:])

    parser = argparse.ArgumentParser(prog="frugaltrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    p = sub.add_parser("report", help="re-render the summary table and plots of a run")
    p.add_argument("run_dir")
    for name in SUBSYSTEM_COMMANDS:
        sub.add_parser(name, help=f"{name} subsystem (see `frugaltrain {name} --help`)")
    args = parser.parse_args(argv)

    try:
        if args.command == "train":
            from frugaltrain.train.launch import train_from_cli

            return train_from_cli(args.config, _shortcuts(args), args.resume)
        if args.command == "report":
            from frugaltrain.metrics.report import report

            report(args.run_dir)
            return 0
    except ConfigError as e:
        print(f"frugaltrain: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
