"""A run beside its baseline: the same config under another outer strategy (e.g. DiLoCo beside
Factored Gossip DiLoCo), measured in the same command or reused from an earlier one.

    frugaltrain train --config examples/default.toml --baseline diloco

The launcher prints both runs' figures side by side and draws their validation loss against
wall clock into RUN_DIR/beside_STRATEGY.png.

The baseline's run directory is out_dir/baselines/STRATEGY-DIGEST, where DIGEST hashes the whole
config but the run's name, directory and progress bar, so a cached baseline is reused only for
the same config; any change runs it again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from frugaltrain.config import OUTER_KEYS, Config, ConfigError, outer_for, to_dict, to_toml
from frugaltrain.metrics.log import read_metrics
from frugaltrain.metrics.report import plot_loss_vs_wall, report
from frugaltrain.train import checkpoint

EXACT = ("codec", "param_codec", "feedback_decay", "coded_average")
"""[outer] keys a baseline keeps at their defaults: it sends exact values (a codec chosen for the
run's own traffic, such as fgd's Mix2 in int8, is not the baseline's)."""


def check_baseline(strategy: str) -> None:
    """A baseline is one fixed method: any outer strategy but auto."""
    methods = [s for s in OUTER_KEYS if s != "auto"]
    if strategy not in methods:
        raise ConfigError(f"--baseline {strategy!r}: choose one of {', '.join(methods)}")


def baseline_config(cfg: Config, strategy: str) -> Config:
    """`cfg` under `strategy`, with the [outer] keys that strategy does not read, and the codec
    keys (EXACT), at their defaults."""
    check_baseline(strategy)
    outer = outer_for(cfg.outer, strategy)
    exact = {f.name: f.default for f in dataclasses.fields(outer) if f.name in EXACT}
    outer = dataclasses.replace(outer, **exact)
    run = dataclasses.replace(cfg.run, name=f"{cfg.run.name}-{strategy}", progress=False)
    return dataclasses.replace(cfg, outer=outer, run=run)


def method_label(cfg: Config) -> str:
    """The outer strategy and, when it is not fp32, its codec: what tells a run from its
    baseline when both are the same strategy."""
    codec = cfg.outer.codec
    return cfg.outer.strategy if codec == "fp32" else f"{cfg.outer.strategy} {codec}"


def baseline_dir(cfg: Config) -> Path:
    keys = to_dict(cfg)
    for key in ("name", "out_dir", "progress"):
        keys["run"].pop(key)
    return Path(cfg.run.out_dir) / "baselines" / f"{cfg.outer.strategy}-{checkpoint.digest(keys)}"


def run_baseline(cfg: Config, strategy: str, run) -> tuple[dict, str]:
    """The baseline's summary, and whether it was measured now or cached (run(cfg, run_dir)
    trains; it is the launcher's)."""
    base = baseline_config(cfg, strategy)
    run_dir = baseline_dir(base)
    if (run_dir / "summary.json").is_file():
        return report(run_dir, quiet=True), f"cached from an earlier run ({run_dir})"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(base))
    print(f"baseline: {strategy} on the same config ({run_dir})", flush=True)
    run(base, run_dir)
    return report(run_dir, quiet=True), f"measured now ({run_dir})"


def plot_beside(cfg: Config, run_dir: Path, strategy: str) -> Path:
    """The run's and its baseline's validation loss against wall clock, as run_dir/
    beside_STRATEGY.png (each on its own measured clock)."""
    base = baseline_config(cfg, strategy)
    runs = [
        (
            f"{method_label(cfg)} ({run_dir.name}, measured)",
            read_metrics(run_dir / "metrics.jsonl"),
        ),
        (
            f"{method_label(base)} (baseline, measured)",
            read_metrics(baseline_dir(base) / "metrics.jsonl"),
        ),
    ]
    return plot_loss_vs_wall(runs, run_dir / f"beside_{strategy}.png")
