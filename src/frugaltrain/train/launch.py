"""Start a training run: check the config and data, pick the run directory, then run its
workers: one in this process, N local processes (train/supervisor.py, plain or fault-tolerant),
or this process as one worker under torchrun.

    frugaltrain train --workers 4                    # 4 local processes, gloo on CPU
    torchrun --nnodes 2 --nproc-per-node 4 -m frugaltrain train --config my.toml
                                                     # across machines: torchrun sets RANK etc.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from frugaltrain.comm import LocalComm
from frugaltrain.config import Config, ConfigError, build_config, load_config, read_toml, to_toml
from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens
from frugaltrain.models import model_dims
from frugaltrain.train import checkpoint
from frugaltrain.train.loop import train_worker
from frugaltrain.train.supervisor import backend, run_local, worker_threads


def new_run_dir(cfg: Config) -> Path:
    base = Path(cfg.run.out_dir) / cfg.run.name
    path, i = base, 1
    while path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    path.mkdir(parents=True)
    return path


def check_data(cfg: Config) -> None:
    """Fail before starting workers if the model's files are missing, the data's tokens do not
    fit its vocabulary or sequences its positions, or the corpus or any worker's shard cannot
    serve batches."""
    d = cfg.data
    dims = model_dims(cfg)
    corpus = load_corpus(d.path, d.max_bytes, d.val_fraction)
    vocab = getattr(corpus, "vocab_size", None) or 256  # byte tokens: 256
    key = "model.pretrained" if cfg.model.pretrained else "model.vocab_size"
    if dims["vocab_size"] < vocab:
        value = cfg.model.pretrained or dims["vocab_size"]
        raise ConfigError(
            f"{key} = {value!r}: the model has {dims['vocab_size']} token ids but {corpus.source} "
            f"uses {vocab}; set model.vocab_size = {vocab}, or use a model and tokenizer that fit"
        )
    if dims["positions"] < d.seq_len:
        raise ConfigError(
            f"data.seq_len = {d.seq_len}: the model covers {dims['positions']} positions; "
            f"set data.seq_len <= {dims['positions']}"
        )
    for rank in range(cfg.run.workers):
        BatchSampler(
            shard_tokens(corpus.train, rank, cfg.run.workers, d.num_shards, d.sharding),
            d.seq_len,
            d.batch_size,
            0,
        )
    BatchSampler(corpus.val, d.seq_len, d.batch_size, 0)


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def _join_torchrun(cfg: Config) -> None:
    """Initialize the default process group from torchrun's environment (env://)."""
    dist.init_process_group(backend(cfg), timeout=timedelta(seconds=cfg.run.timeout_s))
    if dist.get_world_size() != cfg.run.workers:
        raise ConfigError(
            f"run.workers = {cfg.run.workers} but torchrun started "
            f"{dist.get_world_size()} processes; make them equal"
        )


def _shared_run_dir(cfg: Config) -> Path:
    """One run directory for all torchrun ranks: rank 0 picks it (runs/NAME, or NAME-1 ... if
    taken) and sends the path to the others, who create it too: on a second machine without a
    shared file system it then holds that machine's workers' checkpoints."""
    group = dist.new_group(backend="gloo")  # a CPU group, whatever the training backend
    path = [str(new_run_dir(cfg)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0, group=group)
    dist.destroy_process_group(group)
    run_dir = Path(path[0])
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def run(cfg: Config, run_dir: Path, resume_from: Path | None = None) -> None:
    """Run all workers of `cfg` to completion on this machine (or this torchrun rank)."""
    if under_torchrun():
        from frugaltrain.comm.torchdist import TorchDistComm

        owns_group = not dist.is_initialized()  # train_from_cli joins first; netlab workers don't
        if owns_group:
            _join_torchrun(cfg)
        try:
            comm = TorchDistComm(deterministic=cfg.run.deterministic_comm)
            train_worker(cfg, comm, run_dir, resume_from)
        finally:
            if owns_group:
                dist.destroy_process_group()
        return
    if cfg.run.workers == 1:
        torch.set_num_threads(worker_threads(cfg))
        train_worker(cfg, LocalComm(), run_dir, resume_from)
        return
    run_local(cfg, run_dir, resume_from)


def prepare(config_path: str | None, overrides: list[str], resume: str | None):
    """Build the config and run directory (new, or an existing one to resume)."""
    if resume:
        run_dir = Path(resume)
        saved = run_dir / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"--resume {resume}: no config.toml there; pass a run directory")
        # A resumed run goes to the end unless a new stop is asked for explicitly.
        cfg = build_config(Config, read_toml(saved), ["run.stop_at_round=0", *overrides])
        ckpt = checkpoint.latest_complete(run_dir)
        if ckpt is None:
            raise ConfigError(
                f"--resume {resume}: no complete checkpoint under "
                f"{run_dir / 'checkpoints'}; start a new run instead"
            )
        checkpoint.check_resumable(ckpt, cfg)  # here, not in N worker tracebacks
        check_data(cfg)
        if under_torchrun():  # every rank was given the same directory
            _join_torchrun(cfg)
        return cfg, run_dir, ckpt
    cfg = load_config(config_path, overrides)
    check_data(cfg)
    if under_torchrun():
        _join_torchrun(cfg)
        return cfg, _shared_run_dir(cfg), None
    return cfg, new_run_dir(cfg), None


def train_from_cli(
    config_path: str | None, overrides: list[str], resume: str | None, baseline: str | None = None
) -> int:
    from frugaltrain.metrics.report import format_comparison, report

    torchrun = under_torchrun()
    if baseline and torchrun:
        raise ConfigError("--baseline runs a second local run; launch the baseline on its own")
    cfg, run_dir, ckpt = prepare(config_path, overrides, resume)
    is_rank0 = int(os.environ.get("RANK", "0")) == 0
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine: what --resume reads there
        (run_dir / "config.toml").write_text(to_toml(cfg))
    if is_rank0:
        where = f", resuming from {ckpt.name}" if ckpt else ""
        print(f"run dir: {run_dir} ({cfg.outer.strategy}, {cfg.run.workers} workers{where})")
    try:
        run(cfg, run_dir, ckpt)
    finally:
        if torchrun:
            dist.destroy_process_group()
    if is_rank0:
        summary = report(run_dir)
        if baseline:
            from frugaltrain.train.baseline import run_baseline

            theirs, where = run_baseline(cfg, baseline, run)
            print(f"\n{cfg.outer.strategy} beside {baseline} (baseline {where}):")
            print(format_comparison(summary, theirs))
    return 0
