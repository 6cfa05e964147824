"""A run beside its baseline: the same config under another outer strategy (e.g. DiLoCo beside
Factored Gossip DiLoCo), measured in the same command or reused from an earlier one.

    frugaltrain train --config examples/default.toml --baseline diloco
    frugaltrain train --config examples/default.toml --baseline diloco --baseline-set outer.H=10

The launcher prints both runs' figures side by side, with the wall clock each took to reach the
baseline's final validation loss as a ratio of the baseline's, and draws their validation loss
against wall clock into RUN_DIR/beside_STRATEGY.png. The baseline keeps the run's [run], so on
emulated links (run.link_mbit) it runs on the same ones, and both are labelled so.

The baseline's run directory is out_dir/baselines/STRATEGY-DIGEST, where DIGEST hashes the whole
config but the run's name, directory and progress bar, so a cached baseline is reused only for
the same config; any change runs it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from frugaltrain.config import (
    OUTER_KEYS,
    Config,
    ConfigError,
    build_config,
    outer_for,
    strategy_sections,
    to_dict,
    to_toml,
)
from frugaltrain.metrics.log import read_metrics
from frugaltrain.metrics.report import clock_label, plot_loss_vs_wall, report
from frugaltrain.train import checkpoint

EXACT = ("codec", "param_codec", "feedback_decay", "coded_average")
"""[outer] keys a baseline keeps at their defaults: it sends exact values (a codec chosen for the
run's own traffic, such as fgd's Mix2 in int8, is not the baseline's)."""


def check_baseline(strategy: str) -> None:
    """A baseline is one fixed method: any outer strategy but auto."""
    methods = [s for s in OUTER_KEYS if s != "auto"]
    if strategy not in methods:
        raise ConfigError(f"--baseline {strategy!r}: choose one of {', '.join(methods)}")


def baseline_config(cfg: Config, strategy: str, sets: Sequence[str] = ()) -> Config:
    """`cfg` under `strategy`, with the [outer] keys that strategy does not read, the codec
    keys (EXACT) and its own sub-section at their defaults: the method as its paper has it,
    at the run's H and outer step (DiLoCo's baseline of a DiLoCo run sent early blocks); then
    `sets` (`--baseline-set KEY=VALUE`: the baseline's own H, say), checked as any --set."""
    check_baseline(strategy)
    outer = outer_for(cfg.outer, strategy)
    exact = {f.name: f.default for f in dataclasses.fields(outer) if f.name in EXACT}
    own = strategy_sections().get(strategy)
    if own is not None:
        exact[strategy] = own()
    outer = dataclasses.replace(outer, **exact)
    run = dataclasses.replace(cfg.run, name=f"{cfg.run.name}-{strategy}", progress=False)
    base = dataclasses.replace(cfg, outer=outer, run=run)
    return build_config(Config, to_dict(base), list(sets)) if sets else base


def method_label(cfg: Config) -> str:
    """The outer strategy, its codec when it is not fp32, DiLoCo's overlap when it has one and
    H: what tells a run from its baseline when both are the same strategy."""
    o = cfg.outer
    label = o.strategy if o.codec == "fp32" else f"{o.strategy} {o.codec}"
    if o.strategy == "diloco" and o.diloco.overlap:
        label += f", sent {o.diloco.overlap} step{'s' if o.diloco.overlap > 1 else ''} early"
    return label if o.strategy == "ddp" else f"{label}, H = {o.H}"


def baseline_dir(cfg: Config) -> Path:
    keys = to_dict(cfg)
    for key in ("name", "out_dir", "progress"):
        keys["run"].pop(key)
    return Path(cfg.run.out_dir) / "baselines" / f"{cfg.outer.strategy}-{checkpoint.digest(keys)}"


def run_baseline(cfg: Config, strategy: str, run, sets: Sequence[str] = ()) -> tuple[dict, str]:
    """The baseline's summary, and whether it was measured now or cached (run(cfg, run_dir)
    trains; it is the launcher's)."""
    base = baseline_config(cfg, strategy, sets)
    run_dir = baseline_dir(base)
    if (run_dir / "summary.json").is_file():
        return report(run_dir, quiet=True), f"cached from an earlier run ({run_dir})"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(base))
    print(f"baseline: {strategy} on the same config ({run_dir})", flush=True)
    run(base, run_dir)
    return report(run_dir, quiet=True), f"measured now ({run_dir})"


def beside_records(
    cfg: Config, run_dir: Path, strategy: str, sets: Sequence[str] = ()
) -> tuple[list[dict], list[dict]]:
    """The run's and its baseline's metrics records."""
    base_dir = baseline_dir(baseline_config(cfg, strategy, sets))
    return read_metrics(run_dir / "metrics.jsonl"), read_metrics(base_dir / "metrics.jsonl")


def plot_beside(cfg: Config, run_dir: Path, strategy: str, sets: Sequence[str] = ()) -> Path:
    """The run's and its baseline's validation loss against wall clock, as run_dir/
    beside_STRATEGY.png (each on its own clock: measured, or on emulated links)."""
    ours, theirs = beside_records(cfg, run_dir, strategy, sets)
    base = baseline_config(cfg, strategy, sets)
    runs = [
        (f"{method_label(cfg)} ({run_dir.name}, {_clock(ours)})", ours),
        (f"{method_label(base)} (baseline, {_clock(theirs)})", theirs),
    ]
    return plot_loss_vs_wall(runs, run_dir / f"beside_{strategy}.png")


def _clock(records: list[dict]) -> str:
    """A run's clock from its last round record (report.clock_label)."""
    last = next((r for r in reversed(records) if r.get("kind") == "round"), {})
    return clock_label(last)
