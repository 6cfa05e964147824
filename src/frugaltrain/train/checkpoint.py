"""Checkpoints: all state of every worker, written atomically, verified before they are used.

Layout: RUN_DIR/checkpoints/round_000010/worker_0.pt ... worker_{M-1}.pt, a `.sha256` beside each
(hashed while it is written, not read back), then COMPLETE: a JSON manifest with the round, the
config fingerprint and the SHA-256 of every worker file, written last by one worker per machine
after all workers finished. Every file is written to a temporary name and renamed; a write that
fails removes its temporary file and leaves the files before it untouched. So a crash never
leaves a checkpoint that `--resume` would take half written, and a file changed afterwards (a
flipped bit) is caught by its hash: `--resume` then falls back to the newest intact checkpoint
and says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import warnings
from pathlib import Path
from typing import Any

import torch

from frugaltrain.codecs.grammar import keeps_residual
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


class _Hashing:
    """A file wrapper that hashes what is written through it."""

    def __init__(self, f) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _atomic_write(path: Path, write) -> str:
    """Write `path` through `write(file)` under a temporary name, fsync, rename; returns the
    SHA-256 of the bytes. On any failure the temporary file is removed and the error raised.
    The temporary name is the writer's own: on a shared file system two machines each write the
    same COMPLETE manifest, and the second rename must not find the first one's file gone."""
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}-{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            hashing = _Hashing(f)
            write(hashing)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return hashing.sha.hexdigest()


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def round_dir(run_dir: Path, round_idx: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"round_{round_idx:06d}"


def save_worker(run_dir: Path, round_idx: int, rank: int, state: dict) -> None:
    d = round_dir(run_dir, round_idx)
    d.mkdir(parents=True, exist_ok=True)
    sha = _atomic_write(d / f"worker_{rank}.pt", lambda f: torch.save(state, f))
    _atomic_write(d / f"worker_{rank}.pt.sha256", lambda f: f.write(sha.encode()))


def write_hash(path: Path) -> None:
    """The `.sha256` beside a file written by someone else (DCP: train/sharded_checkpoint.py),
    read back once to hash it."""
    sha = _sha256(path)
    _atomic_write(path.with_name(path.name + ".sha256"), lambda f: f.write(sha.encode()))


def mark_complete(run_dir: Path, round_idx: int, step: int, cfg: Config) -> None:
    """The manifest of this machine's files (their hashes from the `.sha256` beside them): worker
    files, or with shards each replica's DCP directory (train/sharded_checkpoint.py)."""
    d = round_dir(run_dir, round_idx)
    hashes = sorted(d.rglob("*.sha256"))
    files = {str(p.relative_to(d))[: -len(".sha256")]: p.read_text() for p in hashes}
    meta = {
        "round": round_idx,
        "step": step,
        "workers": cfg.run.workers,
        "shards": cfg.run.shards,
        "fingerprint": digest(config_fingerprint(cfg)),
        "files": files,
    }
    _atomic_write(d / "COMPLETE", lambda f: f.write(json.dumps(meta, indent=1).encode()))


def completed(run_dir: Path) -> list[Path]:
    """Round directories with a COMPLETE manifest, oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p.parent for p in root.glob("round_*/COMPLETE")) if root.is_dir() else []


def latest_complete(run_dir: Path) -> Path | None:
    done = completed(run_dir)
    return done[-1] if done else None


def verify(ckpt_dir: Path) -> None:
    """Every worker file of the manifest that is on this machine has its recorded SHA-256; a
    ConfigError names the first that does not (or that is missing while its hash file is not)."""
    meta = _manifest(ckpt_dir)
    for name, sha in meta.get("files", {}).items():
        path = ckpt_dir / name
        if not path.is_file():
            if (ckpt_dir / f"{name}.sha256").is_file():
                raise ConfigError(f"checkpoint file {path} is missing; its hash is there")
            continue  # another machine's worker: verified there
        if _sha256(path) != sha:
            raise ConfigError(
                f"checkpoint file {path} does not match its SHA-256 in {ckpt_dir / 'COMPLETE'} "
                "(changed or corrupted after it was written)"
            )


def latest_intact(run_dir: Path) -> Path | None:
    """The newest complete checkpoint whose files match their hashes; each newer one that does
    not is reported with a warning (resume falls back to the one before)."""
    for ckpt in reversed(completed(run_dir)):
        try:
            verify(ckpt)
            return ckpt
        except ConfigError as e:
            warnings.warn(f"{e}; falling back to the previous checkpoint", stacklevel=2)
    return None


def _manifest(ckpt_dir: Path) -> dict:
    try:
        return json.loads((ckpt_dir / "COMPLETE").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"checkpoint {ckpt_dir}: unreadable COMPLETE manifest ({e})") from e


def check_resumable(ckpt_dir: Path, cfg: Config) -> dict:
    """The manifest of `ckpt_dir` if `cfg` can resume from it; a ConfigError naming the
    mismatch otherwise. Called before any worker starts, and again by each worker."""
    meta = _manifest(ckpt_dir)
    if meta["workers"] != cfg.run.workers:
        raise ConfigError(
            f"checkpoint {ckpt_dir} was written by {meta['workers']} workers but run.workers = "
            f"{cfg.run.workers}; resume with --set run.workers={meta['workers']}"
        )
    saved = meta.get("shards", 1)
    if saved != cfg.run.shards and keeps_residual(cfg.outer.codec) and cfg.outer.feedback_decay > 0:
        raise ConfigError(
            f"checkpoint {ckpt_dir} was written with run.shards = {saved} and "
            f"outer.codec = {cfg.outer.codec!r} keeps each shard's unsent residual (error "
            f"feedback), which does not reshard; resume with --set run.shards={saved}"
        )
    if meta["fingerprint"] != digest(config_fingerprint(cfg)):
        raise ConfigError(
            f"checkpoint {ckpt_dir} was written with a different model/data/optim/outer config or "
            "seed than the one given; resume without changing those sections"
        )
    return meta


def is_sharded(ckpt_dir: Path) -> bool:
    """Whether `ckpt_dir` holds DCP replica directories (written with run.shards > 1)."""
    return _manifest(ckpt_dir).get("shards", 1) > 1


def load_worker(ckpt_dir: Path, rank: int, cfg: Config) -> dict[str, Any]:
    """Load worker `rank`'s state from `ckpt_dir`, refusing mismatched or corrupt checkpoints."""
    check_resumable(ckpt_dir, cfg)
    path = ckpt_dir / f"worker_{rank}.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise ConfigError(
            f"checkpoint file {path} is corrupt or unreadable ({type(e).__name__}: {e}); "
            "delete that round's directory to resume from the previous checkpoint"
        ) from e
    missing = {"model", "inner", "schedule", "outer", "rng", "step", "round"} - set(state)
    if missing:
        raise ConfigError(
            f"checkpoint file {path} lacks {', '.join(sorted(missing))}: not a frugaltrain "
            "worker state; resume from a checkpoint this version wrote"
        )
    return state
