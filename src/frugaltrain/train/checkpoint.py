"""Checkpoints: all state of every worker, written atomically, refused loudly when they don't fit.

Layout: RUN_DIR/checkpoints/round_000010/worker_0.pt ... worker_{M-1}.pt, then COMPLETE (JSON).
Each file is written to a temporary name and renamed, and COMPLETE is written last by worker 0
after all workers finished, so a crash never leaves a half checkpoint that `--resume` would take.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from frugaltrain.config import Config, ConfigError, to_dict

# Keys that must match for a checkpoint to be resumable; run.steps, checkpointing and display
# settings may change between the original run and the resumed one.
_RUN_KEYS_THAT_MATTER = ("workers", "seed")


def config_fingerprint(cfg: Config) -> dict:
    d = to_dict(cfg)
    d["run"] = {k: d["run"][k] for k in _RUN_KEYS_THAT_MATTER}
    return d


def digest(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def round_dir(run_dir: Path, round_idx: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"round_{round_idx:06d}"


def save_worker(run_dir: Path, round_idx: int, rank: int, state: dict) -> None:
    d = round_dir(run_dir, round_idx)
    d.mkdir(parents=True, exist_ok=True)
    _atomic_write(d / f"worker_{rank}.pt", lambda f: torch.save(state, f))


def mark_complete(run_dir: Path, round_idx: int, step: int, cfg: Config) -> None:
    meta = {
        "round": round_idx,
        "step": step,
        "workers": cfg.run.workers,
        "fingerprint": digest(config_fingerprint(cfg)),
    }
    path = round_dir(run_dir, round_idx) / "COMPLETE"
    _atomic_write(path, lambda f: f.write(json.dumps(meta).encode()))


def latest_complete(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    done = sorted(p.parent for p in root.glob("round_*/COMPLETE")) if root.is_dir() else []
    return done[-1] if done else None


def check_resumable(ckpt_dir: Path, cfg: Config) -> dict:
    """The COMPLETE marker of `ckpt_dir` if `cfg` can resume from it; a ConfigError naming the
    mismatch otherwise. Called before any worker starts, and again by each worker."""
    meta_path = ckpt_dir / "COMPLETE"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"checkpoint {ckpt_dir}: unreadable COMPLETE marker ({e})") from e
    if meta["workers"] != cfg.run.workers:
        raise ConfigError(
            f"checkpoint {ckpt_dir} was written by {meta['workers']} workers but run.workers = "
            f"{cfg.run.workers}; resume with --set run.workers={meta['workers']}"
        )
    if meta["fingerprint"] != digest(config_fingerprint(cfg)):
        raise ConfigError(
            f"checkpoint {ckpt_dir} was written with a different model/data/optim/outer config or "
            "seed than the one given; resume without changing those sections"
        )
    return meta


def load_worker(ckpt_dir: Path, rank: int, cfg: Config) -> dict[str, Any]:
    """Load worker `rank`'s state from `ckpt_dir`, refusing mismatched or corrupt checkpoints."""
    check_resumable(ckpt_dir, cfg)
    path = ckpt_dir / f"worker_{rank}.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise ConfigError(
            f"checkpoint file {path} is corrupt or unreadable ({type(e).__name__}: {e}); "
            "delete that round's directory to resume from the previous checkpoint"
        ) from e
