"""`frugaltrain netlab ...`: training over real rate-limited links between network namespaces.

    frugaltrain netlab check --rate-mbit 50             # shape a 2-namespace link, measure it
    frugaltrain netlab run --rate-mbit 50 --workers 4 --outer diloco -H 20 --steps 200
                                                        # any `frugaltrain train` flags follow
    frugaltrain netlab cleanup                          # delete leftover ftl-* namespaces

Needs root (namespaces, tc); without it every verb prints why and exits with status 2.
"""

from __future__ import annotations

import sys

from frugaltrain.config import ArgumentParser, ConfigError, to_toml


def _train_overrides(rest: list[str]) -> tuple[str | None, list[str]]:
    from frugaltrain.train.flags import add_train_flags, overrides

    parser = ArgumentParser(prog="frugaltrain netlab run")
    add_train_flags(parser)
    args = parser.parse_args(rest)
    if args.resume:
        raise ConfigError("netlab run starts new runs only; drop --resume")
    return args.config, overrides(args)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="frugaltrain netlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("check", help="measure a shaped link between two namespaces")
    p.add_argument("--rate-mbit", type=float, default=50.0, help="link limit, Mbit/s")
    p.add_argument("--mbytes", type=float, default=8.0, help="bytes to send, MB")
    p = sub.add_parser("run", help="train with each worker in its own namespace")
    p.add_argument("--rate-mbit", type=float, required=True, help="each worker's link, Mbit/s")
    sub.add_parser("cleanup", help="delete namespaces a crashed netlab left behind")
    args, rest = parser.parse_known_args(argv)
    if rest and args.verb != "run":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    from frugaltrain.netlab.lab import NetLab, cleanup, why_not_available

    reason = why_not_available()
    if reason is not None:
        print(f"frugaltrain netlab: skipped: {reason}", file=sys.stderr)
        return 2
    if args.verb == "cleanup":
        gone = cleanup()
        print(f"deleted {len(gone)} namespace(s): {' '.join(gone) or '-'}")
        return 0
    from frugaltrain.netlab.run import measure_rate_mbit, train

    if args.verb == "check":
        with NetLab(2, args.rate_mbit) as lab:
            got = measure_rate_mbit(lab, 0, 1, int(args.mbytes * 1e6))
        print(f"limit {args.rate_mbit:g} Mbit/s, measured {got:.2f} Mbit/s TCP goodput")
        return 0
    try:
        from frugaltrain.metrics.report import report
        from frugaltrain.train.launch import prepare

        config, overrides = _train_overrides(rest)
        cfg, run_dir, _ = prepare(config, overrides, None)
        if cfg.fault_tolerance.enabled:
            raise ConfigError("netlab run uses the plain runtime; drop fault_tolerance.enabled")
        (run_dir / "config.toml").write_text(to_toml(cfg))
        print(f"run dir: {run_dir} ({cfg.outer.strategy}, {cfg.run.workers} workers, "
              f"{args.rate_mbit:g} Mbit/s links)")  # fmt: skip
        with NetLab(cfg.run.workers, args.rate_mbit) as lab:
            train(lab, run_dir / "config.toml", run_dir)
    except ConfigError as e:
        print(f"frugaltrain: error: {e}", file=sys.stderr)
        return 2
    report(run_dir)
    return 0
