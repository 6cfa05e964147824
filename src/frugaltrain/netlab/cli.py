"""`frugaltrain netlab ...`: training over real rate-limited links between network namespaces.

    frugaltrain netlab check --rate-mbit 50             # shape a 2-namespace link, measure it
    frugaltrain netlab probe --rate-mbit 28 --workers 4  # gloo all-reduce and pair exchange times
    frugaltrain netlab run --rate-mbit 50 --workers 4 --outer diloco -H 20 --steps 200
                                                        # any `frugaltrain train` flags follow
    frugaltrain netlab run --rate-mbit 28 --cpu-share 0.4 ...  # each worker held to 0.4 cores
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
    if args.link_mbit:  # paced on top of shaped links, each figure would be neither
        raise ConfigError(
            f"--link-mbit {args.link_mbit}: netlab shapes real links (--rate-mbit); drop "
            "--link-mbit, which emulates links in process"
        )
    return args.config, overrides(args)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="frugaltrain netlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("check", help="measure a shaped link between two namespaces")
    p.add_argument("--rate-mbit", type=float, default=50.0, help="link limit, Mbit/s")
    p.add_argument("--mbytes", type=float, default=8.0, help="bytes to send, MB")
    p = sub.add_parser("probe", help="time gloo's all-reduce and pair exchange on shaped links")
    p.add_argument("--rate-mbit", type=float, default=28.0, help="each worker's link, Mbit/s")
    p.add_argument("--workers", type=int, default=4, help="namespaces (even: pairs exchange)")
    p.add_argument("--mbytes", type=float, default=1.870336, help="message size S, MB")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (median kept)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p = sub.add_parser("run", help="train with each worker in its own namespace")
    p.add_argument("--rate-mbit", type=float, required=True, help="each worker's link, Mbit/s")
    p.add_argument(
        "--cpu-share", type=float, default=0.0, help="cores per worker (a cgroup quota; 0: none)"
    )
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
    if args.verb == "probe":
        return _probe(args)
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
        shares = [args.cpu_share] * cfg.run.workers if args.cpu_share else None
        with NetLab(cfg.run.workers, args.rate_mbit, cpu_shares=shares) as lab:
            train(lab, run_dir / "config.toml", run_dir)
    except ConfigError as e:
        print(f"frugaltrain: error: {e}", file=sys.stderr)
        return 2
    report(run_dir)
    return 0


def _probe(args) -> int:
    import json
    import tempfile
    from pathlib import Path

    from frugaltrain.comm.probe import TRANSFERS
    from frugaltrain.netlab.lab import NetLab
    from frugaltrain.netlab.run import probe

    if args.workers < 2 or args.workers % 2:
        print("frugaltrain netlab probe: --workers must be even and at least 2", file=sys.stderr)
        return 2
    nbytes = int(args.mbytes * 1e6) // 4 * 4
    with tempfile.TemporaryDirectory() as tmp, NetLab(args.workers, args.rate_mbit) as lab:
        got = probe(lab, nbytes, args.repeats, Path(tmp) / "probe.json")
    got["rate_mbit"] = args.rate_mbit
    shaped = args.rate_mbit * 1e6
    print(f"{args.workers} workers, {args.rate_mbit:g} Mbit/s links, S = {nbytes} bytes, "
          f"median of {args.repeats} (measured, slowest worker)")  # fmt: skip
    for name, (s_key, bps_key) in TRANSFERS.items():
        bps = got[bps_key]
        print(f"  {name:28s} {got[s_key]:7.3f} s  {bps / 1e6:6.2f} Mbit/s  {bps / shaped:5.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps(got, indent=1) + "\n")
    return 0
