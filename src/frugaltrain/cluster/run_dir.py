"""A run's directory: RUN.OUT_DIR/RUN.NAME, or the first free `NAME-i` beside it. Without torch,
so the coordinator can make one."""

from __future__ import annotations

from pathlib import Path

from frugaltrain.config import Config


def new_run_dir(cfg: Config) -> Path:
    base = Path(cfg.run.out_dir) / cfg.run.name
    path, i = base, 1
    while path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    path.mkdir(parents=True)
    return path
