"""Where metrics.jsonl's records also go: TensorBoard event files (`run.tensorboard = true`,
into RUN_DIR/tensorboard/) and an offline Weights & Biases run (`run.wandb = "offline"`, into
RUN_DIR/wandb/; nothing talks to the network, `wandb sync` uploads it later).

MetricsLog.write hands every record it writes to the sinks, so worker 0's log in the real
runtime and the simulator's log feed them through one path, and only the process that writes
metrics.jsonl writes them. The x axis is the inner step (`step`); what goes in (`scalars`):

    step records    step/loss/train, step/lr (worker 0's per step; the round records keep
                    loss/train and lr for their round means, so the two never share a tag)
    round records   every numeric key under its metrics.jsonl name, booleans as 0/1, and each
                    list of numbers (one per worker) as KEY/INDEX, e.g. loss/val_workers/3;
                    strings (labels, clock) and nulls (not measured) are left out
    other records   (membership, rejected) are counted in the round records, not drawn

A key a strategy or runtime adds to the round record later goes in without a change here. A
resumed run appends to the same directory; TensorBoard shows the last value logged per step.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Protocol

from frugaltrain.config import Config, ConfigError, to_dict

TENSORBOARD_DIR = "tensorboard"
# package -> (the setting that needs it, the setting that does without)
_EXTRAS = {
    "tensorboard": ("run.tensorboard = true", "run.tensorboard = false"),
    "wandb": ("run.wandb = 'offline'", "run.wandb = ''"),
}


class Sink(Protocol):
    def write(self, record: dict) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """The tags and values a record contributes (see the module docstring)."""
    kind = record.get("kind")
    if kind == "step":
        return {f"step/{k}": float(record[k]) for k in ("loss/train", "lr") if _number(record[k])}
    if kind != "round":
        return {}
    out = {}
    for key, value in record.items():
        if key == "step":  # the x axis
            continue
        if isinstance(value, (list, tuple)):
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value) if _number(v)})
        elif _number(value):
            out[key] = float(value)
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))


def _missing(package: str) -> str:
    on, off = _EXTRAS[package]
    return (
        f"{on} needs the {package} package, which is not installed: "
        f"pip install 'frugaltrain[{package}]' (or set {off})"
    )


def check_sinks(cfg: Config) -> None:
    """Refuse, before any work, a sink whose package is missing: one line naming the key and
    the extra that brings it."""
    for package, wanted in (("tensorboard", cfg.run.tensorboard), ("wandb", cfg.run.wandb)):
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(_missing(package))


def open_sinks(cfg: Config, run_dir: Path) -> list[Sink]:
    """The sinks `cfg.run` asks for, writing under `run_dir` (call on the writing process)."""
    sinks: list[Sink] = []
    if cfg.run.tensorboard:
        sinks.append(TensorBoardSink(Path(run_dir) / TENSORBOARD_DIR))
    if cfg.run.wandb:
        sinks.append(WandbSink(Path(run_dir), to_dict(cfg)))
    return sinks


class TensorBoardSink:
    """Scalars as TensorBoard events (torch.utils.tensorboard.SummaryWriter)."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(_missing("tensorboard")) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict) -> None:
        if "step" in record:
            for tag, value in scalars(record).items():
                self.writer.add_scalar(tag, value, global_step=int(record["step"]))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars into an offline wandb run under `run_dir`, plotted against `inner_step` (a
    round record arrives after the next round's step records, so wandb's own monotonic step
    cannot be the x axis)."""

    def __init__(self, run_dir: Path, config: dict) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(_missing("wandb")) from None
        self.run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project="frugaltrain",
            name=run_dir.name,
            config=config,
        )
        self.run.define_metric("inner_step")
        self.run.define_metric("*", step_metric="inner_step")

    def write(self, record: dict) -> None:
        values = scalars(record)
        if values and "step" in record:
            self.run.log({"inner_step": int(record["step"]), **values})

    def flush(self) -> None:
        pass  # the offline run writes its own files as it goes

    def close(self) -> None:
        self.run.finish()
