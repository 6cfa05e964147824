"""`frugaltrain plan`: which outer method reaches DiLoCo's model quality soonest in wall clock on
your links, in seconds (sim/plan.py says how each figure is had and labelled), and the [outer]
table that runs it in your config.

    frugaltrain plan --config my.toml --link-mbit 22           # every worker's link, as stated
    frugaltrain plan --config my.toml --link-mbit 22,22,22,8   # or one rate per worker
    frugaltrain plan --config my.toml --link-json probe.json   # `frugaltrain netlab probe --out`
    frugaltrain plan --config my.toml --link-mbit 22 --methods diloco,streaming --json plan.json
    frugaltrain plan --config my.toml --link-mbit 22 --write picked.toml
                                        # my.toml with the pick's [outer]: `frugaltrain train
                                        # --config picked.toml` runs it
    frugaltrain plan --config my.toml --link-mbit 22 --check   # then train the pick and DiLoCo
                                        # for a few steps on emulated links (train/plan_check.py)
    torchrun --nnodes 4 --nproc-per-node 1 --rdzv-endpoint HOST:PORT -m frugaltrain plan \\
        --config my.toml                # on the workers: their own links, probed with the
                                        # model's bytes; worker 0 prints the plan

A config with outer.strategy = "auto" is planned on its [outer.auto] links and methods unless the
flags say otherwise: what `frugaltrain train` would pick.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from frugaltrain.config import (
    AUTO_METHODS,
    ArgumentParser,
    Config,
    ConfigError,
    add_set_flag,
    build_config,
    load_config,
    read_toml,
)
from frugaltrain.config.base import section_toml, with_overrides
from frugaltrain.sim.plan import (
    BASELINE,
    Links,
    Plan,
    StepTime,
    check_methods,
    format_plan,
    links_from_probe,
    links_given,
    load_penalties,
    make_plan,
    measure_step_time,
    plan_json,
    read_probe,
)
from frugaltrain.train.plan_check import STEPS, check_json, format_check, run_check

NO_LINKS = (
    "no links to plan on: pass --link-mbit RATE[,RATE...] (each worker's link, Mbit/s) or "
    "--link-json PROBE.json (written by `frugaltrain netlab probe --out`), or start the plan "
    "under torchrun on the workers to probe their links"
)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="frugaltrain plan", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    p.add_argument("--config", help="TOML training config (see examples/)")
    add_set_flag(p)
    p.add_argument("--link-mbit", metavar="R[,R,...]", help="each worker's link, Mbit/s (given)")
    p.add_argument("--link-json", metavar="PROBE.json", help="a link probe's JSON (measured rates)")
    p.add_argument(
        "--methods",
        metavar="A,B,...",
        help=f"methods to pick from: {', '.join(AUTO_METHODS)} (default: all)",
    )
    p.add_argument(
        "--penalties",
        metavar="FILE",
        help="the measured step penalties (default: outer.auto.penalties, "
        "benchmarks/results/penalties.json from the repository's root)",
    )
    p.add_argument("--json", metavar="OUT", help="also write the plan as JSON")
    p.add_argument(
        "--write", metavar="FILE", help="write the config (--config, --set) with the pick's [outer]"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="then train the pick and DiLoCo a few steps each on emulated links at these rates",
    )
    p.add_argument(
        "--check-steps",
        type=int,
        metavar="N",
        help="inner steps per method of --check, rounded up to whole rounds (default: 20)",
    )
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _plan(args)
    except ConfigError as e:
        print(f"frugaltrain: error: {e}", file=sys.stderr)
        return 2


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _plan(args) -> int:
    """Everything checked before any step is timed or any byte sent; then the plan."""
    if args.link_mbit and args.link_json:
        raise ConfigError("--link-mbit and --link-json both give the links; pass one of them")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else []
    check_methods(methods, "--methods")
    _check_flags(args)
    cfg = load_config(args.config, args.set)
    pen = load_penalties(args.penalties or cfg.outer.auto.penalties)
    links = _links(args, cfg)
    if links is None and not _under_torchrun():
        raise ConfigError(NO_LINKS)
    methods = methods or (cfg.outer.auto.methods if cfg.outer.strategy == "auto" else [])
    if _under_torchrun():
        links, step, is_rank0 = _on_the_workers(cfg, links)
    else:
        step, is_rank0 = measure_step_time(cfg), True
    plan = make_plan(cfg, links, step, methods or None, pen)
    if not is_rank0:
        return 0
    print(format_plan(plan), flush=True)
    out = plan_json(plan)
    if plan.outer is None and (args.write or args.check):
        flag = "--write" if args.write else "--check"
        raise ConfigError(f"{flag}: no method was picked ({plan.reason})")
    if args.write:
        Path(args.write).write_text(written_config(args, plan))
        print(f"wrote {args.write}: your config with the pick's [outer]")
    if args.check:
        out["check"] = _check(cfg, plan, args.check_steps or STEPS)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _check_flags(args) -> None:
    """--write and --check refused where they cannot work, before any work."""
    if args.check_steps is not None and not args.check:
        raise ConfigError("--check-steps sets the steps of --check; add --check")
    if args.check_steps is not None and args.check_steps < 1:
        raise ConfigError(f"--check-steps {args.check_steps}: give 1 or more inner steps")
    if args.check and _under_torchrun():
        raise ConfigError(
            "--check starts its own local workers; run the plan with --link-mbit or --link-json "
            "outside torchrun"
        )
    if args.write and Path(args.write).is_dir():
        raise ConfigError(f"--write {args.write}: a directory; give a file name, e.g. picked.toml")


def written_config(args, plan: Plan) -> str:
    """The user's config as given (the file's tables with --set applied) with the pick's [outer]
    in place of its own, as TOML that `frugaltrain train --config` reads back."""
    raw = with_overrides(read_toml(args.config) if args.config else {}, args.set)
    raw["outer"] = plan.outer
    build_config(Config, raw)  # the plan ran this method on this config: it must build
    label = AUTO_METHODS.get(plan.pick, plan.pick)
    head = (
        f"# {args.config or 'the default config'} with `frugaltrain plan`'s pick for "
        f"{plan.links.what} ({plan.links.label}): {plan.pick}, {label}\n"
    )
    return head + "".join(section_toml(name, table) for name, table in raw.items())


def _check(cfg: Config, plan: Plan, steps: int) -> dict | None:
    if plan.pick == BASELINE:
        print("check: the pick is DiLoCo itself, the reference; nothing to compare")
        return None
    print()
    checked = run_check(cfg, plan, steps)
    print(format_check(checked, cfg.run.steps))
    return check_json(checked)


def _links(args, cfg: Config) -> Links | None:
    """The links the flags (or the config's [outer.auto]) give; None: none given."""
    M, auto = cfg.run.workers, cfg.outer.auto if cfg.outer.strategy == "auto" else None
    if args.link_mbit:
        try:
            rates = [float(r) for r in args.link_mbit.split(",")]
        except ValueError:
            raise ConfigError(
                f"--link-mbit {args.link_mbit!r}: give rates in Mbit/s, e.g. 22 or 22,22,22,8"
            ) from None
        return links_given(rates, M)
    if args.link_json:
        return read_probe(args.link_json, M)
    if auto is not None and auto.link_json:
        return read_probe(auto.link_json, M, "outer.auto.link_json")
    if auto is not None and auto.link_mbit:
        return links_given(auto.link_mbit, M, "outer.auto.link_mbit")
    return None


def _on_the_workers(cfg: Config, links: Links | None) -> tuple[Links, StepTime, bool]:
    """Under torchrun: the links probed between the workers with the model's bytes (unless
    given), and the slowest worker's measured step time."""
    import torch
    import torch.distributed as dist

    from frugaltrain.comm.probe import measure
    from frugaltrain.sim.clock import trainable_sizes

    n = int(os.environ["WORLD_SIZE"])
    if links is None and (n < 2 or n % 2):
        raise ConfigError(
            f"WORLD_SIZE = {n}: the live probe pairs the workers up; start an even number "
            "(2 or more), or pass --link-mbit or --link-json"
        )
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.run.timeout_s))
    try:
        if links is None:
            nbytes = 4 * sum(trainable_sizes(cfg)[0].values())
            what = f"probed now: {nbytes} bytes between the {n} workers, median of 1 after 1"
            links = links_from_probe(measure(nbytes, repeats=1), cfg.run.workers, what=what)
        step = measure_step_time(cfg)
        slowest = torch.tensor([step.seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        step.seconds = float(slowest)
        step.label = step.label.replace("measured (", f"measured (the slowest of {n} workers, ")
        return links, step, dist.get_rank() == 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
