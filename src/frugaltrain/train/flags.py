"""The flags of `frugaltrain train`: --config, --set, and shortcuts for the common keys.

Every shortcut is a `--set section.key=value` in disguise; `overrides(args)` turns the parsed
flags into that list, so the config loader sees one kind of override.
"""

from __future__ import annotations

import argparse

from frugaltrain.config import FGD_PRESETS, ConfigError, add_set_flag

TRAIN_HELP = "train with an outer strategy on N local workers or torchrun"


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `frugaltrain train` (and `frugaltrain netlab run`)."""
    p.add_argument("--config", help="TOML config file (see examples/)")
    add_set_flag(p)
    p.add_argument("--workers", type=int, help="shortcut for --set run.workers=N")
    p.add_argument(
        "--shards", type=int, help="processes per worker, FSDP2 inside it (run.shards=N)"
    )
    p.add_argument("--outer", help="shortcut for --set outer.strategy=NAME")
    p.add_argument("--steps", type=int, help="shortcut for --set run.steps=N")
    p.add_argument("-H", type=int, dest="H", help="shortcut for --set outer.H=N")
    p.add_argument("--preset", help=f"fgd variant: {', '.join(FGD_PRESETS)} (outer.fgd.preset)")
    p.add_argument("--mix1", help="fgd Mix1 topology (outer.fgd.mix1)")
    p.add_argument("--mix2", help="fgd Mix2 topology (outer.fgd.mix2)")
    p.add_argument(
        "--mix2-params", help="fgd Mix2 tensors, e.g. embed+head+blocks:2 (outer.fgd.mix2_params)"
    )
    p.add_argument(
        "--momentum-policy",
        help="fgd outer momentum: local, mixed or reset (outer.fgd.momentum_policy)",
    )
    p.add_argument(
        "--codec",
        help="pseudo-gradient encoding: fp32, bf16, int8, e3m0, or sparse topk:F[+2bit] with "
        "error feedback, e.g. topk:0.01+2bit (outer.codec)",
    )
    p.add_argument(
        "--inner-optimizer",
        help="shortcut for --set optim.name=NAME: adamw, forge-adamw, forge-sgd or forge-lion",
    )
    p.add_argument(
        "--link-mbit",
        metavar="R[,R,...]",
        help="emulated links: pace each worker's traffic to R Mbit/s, one rate or one per worker "
        "(run.link_mbit; figures are labelled emulated)",
    )
    p.add_argument("--name", help="shortcut for --set run.name=NAME")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR")
    p.add_argument(
        "--baseline",
        metavar="STRATEGY",
        help="also run (or reuse a cached run of) the same config under STRATEGY, e.g. diloco, "
        "and print the two side by side",
    )
    p.add_argument(
        "--baseline-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of the baseline's config alone, e.g. outer.H=10 (repeatable)",
    )
    p.add_argument(
        "--inject",
        help="faults, e.g. 'kill:worker=2,round=5' (fault_tolerance.inject); turns on "
        "fault_tolerance.enabled",
    )


def overrides(args: argparse.Namespace) -> list[str]:
    """`--set` overrides of the shortcut flags, then the explicit `--set`s (which win)."""
    sets = []
    for flag, key in (
        ("workers", "run.workers"),
        ("shards", "run.shards"),
        ("outer", "outer.strategy"),
        ("steps", "run.steps"),
        ("name", "run.name"),
        ("H", "outer.H"),
        ("preset", "outer.fgd.preset"),
        ("mix1", "outer.fgd.mix1"),
        ("mix2", "outer.fgd.mix2"),
        ("mix2_params", "outer.fgd.mix2_params"),
        ("momentum_policy", "outer.fgd.momentum_policy"),
        ("codec", "outer.codec"),
        ("inner_optimizer", "optim.name"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            sets.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    if getattr(args, "link_mbit", None):
        sets.append(f"run.link_mbit={_rates(args.link_mbit)}")
    if getattr(args, "inject", None):
        sets += ["fault_tolerance.enabled=true", f"fault_tolerance.inject={args.inject!r}"]
    return sets + list(args.set)


def _rates(text: str) -> list[float]:
    """--link-mbit's rates: "20" or "20,20,20,5" (Mbit/s)."""
    try:
        return [float(r) for r in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--link-mbit {text!r}: give rates in Mbit/s, e.g. 20 or 20,20,20,5 (one per worker)"
        ) from None
