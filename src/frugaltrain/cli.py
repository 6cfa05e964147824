"""The `frugaltrain` command: each subcommand builds a config and calls one function.

    frugaltrain train --config examples/default.toml --workers 4 --set outer.H=50
    frugaltrain train --resume runs/default          # continue from the latest checkpoint
    frugaltrain coordinator --config c.toml --port 29400 --token run.token  # machines come and go
    frugaltrain join HOST:29400 --token run.token --workers 2   # on each machine
    frugaltrain status runs/mach                     # a run's machines, slots, loss and bytes
    frugaltrain train --nodes 2 --node-rank K --rdzv HOST:29400 --config c.toml  # fixed cluster
    frugaltrain report runs/default                  # re-render the summary table and plots
    frugaltrain report runs/a runs/b --plot-bytes cmp.png   # loss vs bytes sent, one line each
    frugaltrain export runs/default --out my-model   # the averaged model, transformers format
    frugaltrain energy ...                           # meters, fits, predictions (energy/cli.py)
    frugaltrain flow ...                             # FlowTrain vision-language (flow/cli.py)
    frugaltrain simulate CONFIG --set sim.ratio=0.887  # virtual workers, simulated clock
    frugaltrain compare CONFIG --methods diloco,GlobalM1 # methods side by side (sim/compare.py)
    frugaltrain plan --config c.toml --link-mbit 22   # the method soonest to DiLoCo's loss

Subsystems with many verbs own their parser (`frugaltrain.<subsystem>.cli.main(argv) -> int`);
this file only routes to them, importing lazily so a missing optional extra never breaks `train`.
"""

from __future__ import annotations

import importlib
import sys

from frugaltrain.config import ArgumentParser, ConfigError
from frugaltrain.train.flags import TRAIN_HELP, add_train_flags, overrides
from frugaltrain.train.worker_errors import WorkerFailed

# Subcommands whose parser lives in the subsystem's own cli module.
SUBSYSTEM_COMMANDS = {
    "data": "frugaltrain.data.cli",
    "energy": "frugaltrain.energy.cli",
    "flow": "frugaltrain.flow.cli",
    "netlab": "frugaltrain.netlab.cli",
    "simulate": "frugaltrain.sim.cli",
    "compare": "frugaltrain.sim.compare",
    "plan": "frugaltrain.train.plan_cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBSYSTEM_COMMANDS:
        module = importlib.import_module(SUBSYSTEM_COMMANDS[argv[0]])
        return module.main(argv[1:])

    parser = ArgumentParser(prog="frugaltrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help=TRAIN_HELP)
    add_train_flags(p)
    p.add_argument(
        "--nodes",
        type=int,
        help="machines in the run: start this machine's share of run.workers under torchrun; "
        "the same command on every machine (docs/multihost.md)",
    )
    p.add_argument("--node-rank", type=int, help="with --nodes: this machine, 0 at --rdzv")
    p.add_argument(
        "--rdzv",
        metavar="HOST:PORT",
        help="with --nodes: machine 0's address and a free port there (the c10d rendezvous)",
    )
    _add_machine_commands(sub)
    p = sub.add_parser("status", help="a run's machines, slots, loss, bytes and last events")
    p.add_argument("run_dir", help="the coordinator's run directory (a local run's works too)")
    p = sub.add_parser("report", help="re-render the summary table and plots of runs")
    p.add_argument("run_dir", nargs="+", help="run directories (from train or simulate)")
    p.add_argument(
        "--plot-bytes",
        metavar="OUT.png",
        help="also draw every run's validation loss against its cumulative bytes sent per "
        "worker (log scale), one line per run, into OUT.png (.pdf, .svg)",
    )
    p = sub.add_parser("export", help="a run's final averaged model in the transformers format")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="directory for the model and its tokenizer")
    for name in SUBSYSTEM_COMMANDS:
        sub.add_parser(name, help=f"{name} subsystem (see `frugaltrain {name} --help`)")
    args = parser.parse_args(argv)

    try:
        where = (args.nodes, args.node_rank, args.rdzv) if args.command == "train" else ()
        if any(w is not None for w in where):
            from frugaltrain.train.nodes import launch_node

            return launch_node(args.config, overrides(args), args.resume, *where, argv[1:])
        if args.command == "train":
            from frugaltrain.train.launch import train_from_cli

            return train_from_cli(
                args.config, overrides(args), args.resume, args.baseline, args.baseline_set
            )
        if args.command in ("coordinator", "join"):
            return _machines(args)
        if args.command == "status":
            from frugaltrain.cluster.status import status_text

            print(status_text(args.run_dir))
            return 0
        if args.command == "report":
            from frugaltrain.metrics.report import report_runs

            report_runs(args.run_dir, args.plot_bytes)
            return 0
        if args.command == "export":
            from frugaltrain.train.export import export

            print(f"wrote {export(args.run_dir, args.out)} (load it with AutoModelForCausalLM)")
            return 0
    except ConfigError as e:
        print(f"frugaltrain: error: {e}", file=sys.stderr)
        return 2
    except WorkerFailed as e:  # raised in a worker; its traceback is in the run directory
        print(f"frugaltrain: error: {e}", file=sys.stderr)
        return e.exit_code
    parser.error(f"unknown command {args.command}")
    return 2


def _add_machine_commands(sub) -> None:
    """`coordinator` and `join`: a run across machines that come and go (docs/multihost.md)."""
    p = sub.add_parser("coordinator", help="hold a run that machines join (no training)")
    add_train_flags(p)
    p.add_argument(
        "--port", type=int, help="the port machines join at (29400; resumed: the run's own)"
    )
    p.add_argument("--bind", default="0.0.0.0", help="the address to listen on (default: all)")
    p.add_argument("--token", metavar="FILE", help="the run's token file (only its holders join)")
    p.add_argument(
        "--new-token", metavar="FILE", help="write a fresh run token to FILE (mode 600) and exit"
    )
    p = sub.add_parser("join", help="add this machine's workers to a coordinator's run")
    p.add_argument("address", metavar="HOST:PORT", help="the coordinator, as this machine sees it")
    p.add_argument("--token", metavar="FILE", required=True, help="the run's token file")
    p.add_argument("--workers", type=int, default=1, help="slots to fill on this machine")
    p.add_argument("--run-dir", help="where this machine keeps its logs and checkpoints")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default="",
        help="this machine's run directory, after the coordinator was away too long",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long to wait for a coordinator that does not listen yet (default 300)",
    )


def _machines(args) -> int:
    if args.command == "join":
        from frugaltrain.cluster.auth import Refused
        from frugaltrain.train.agent import run_join

        try:
            return run_join(
                args.address, args.token, args.workers, args.run_dir, args.resume, args.wait
            )
        except (Refused, ConnectionError) as e:  # one line: why this machine is not in
            print(f"frugaltrain: error: {e}", file=sys.stderr)
            return 2 if isinstance(e, Refused) else 1
    if args.new_token:
        from frugaltrain.cluster.auth import new_token

        token = new_token(args.new_token)
        print(
            f"wrote a new run token to {args.new_token}: copy it to every machine that joins; "
            f"its coordinator key {token.key_file} stays on this machine"
        )
        return 0
    if not args.token:
        raise ConfigError(
            "coordinator: --token FILE is required (only machines holding it may join); "
            "write one with `frugaltrain coordinator --new-token FILE`"
        )
    from frugaltrain.cluster.coordinator import run_coordinator

    return run_coordinator(
        args.config, overrides(args), args.token, args.port, args.bind, args.resume
    )


if __name__ == "__main__":
    sys.exit(main())
