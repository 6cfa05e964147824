"""Start a training run: check the config and data, pick the run directory, then run its
workers: one in this process, N local processes (train/supervisor.py, plain or fault-tolerant),
or this process as one worker under torchrun.

    frugaltrain train --workers 4                    # 4 local processes, gloo on CPU
    frugaltrain train --workers 2 --set run.shards=2 # 2 replicas of 2 processes (FSDP2 inside)
    frugaltrain train --nodes 2 --node-rank K --rdzv HOST:PORT --config my.toml
                                                     # across machines: torchrun on each
                                                     # (train/nodes.py, docs/multihost.md)
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from frugaltrain.cluster.run_dir import new_run_dir
from frugaltrain.comm import LocalComm
from frugaltrain.config import (
    Config,
    ConfigError,
    build_config,
    flat_items,
    load_config,
    read_toml,
    to_dict,
    to_toml,
)
from frugaltrain.data.corpus import BatchSampler, Corpus, load_corpus, shard_tokens
from frugaltrain.data.shards import MANIFEST
from frugaltrain.metrics.sinks import check_sinks
from frugaltrain.models import build_model, memory_estimate, model_bytes, model_dims
from frugaltrain.models.parts import select
from frugaltrain.outer.streaming import StreamingDiLoCo
from frugaltrain.train import checkpoint
from frugaltrain.train.loop import train_worker
from frugaltrain.train.supervisor import backend, plain_comm, run_local, worker_threads
from frugaltrain.train.worker_errors import failure_of, report_failure


def check_data(cfg: Config) -> str:
    """Fail before starting workers if the model's files are missing, the data's tokens do not
    fit its vocabulary or sequences its positions, or the corpus or any worker's shard cannot
    serve batches. Returns the data's digest (`data_digest`)."""
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
    return data_digest(corpus, d.path)


def data_digest(corpus: Corpus, path: str) -> str:
    """A sha256 that is equal on two machines iff they train on the same tokens: of a token
    shard directory's manifest (which holds every shard's sha256, checked when it is opened),
    else of the train and validation tokens themselves."""
    h = hashlib.sha256()
    if corpus.tokenizer_dir is not None:
        h.update((Path(path).expanduser() / MANIFEST).read_bytes())
    else:
        for part in (corpus.train, corpus.val):
            h.update(part.contiguous().numpy().tobytes())  # byte tokens: a tensor
    return h.hexdigest()


_GB = 1 << 30


def check_model(cfg: Config) -> None:
    """The model builds as configured and the strategy's named parts exist in it (built on the
    meta device: nothing is allocated), and a GPU is there if the run asks for one."""
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device = 'cuda': torch sees no GPU; use run.device = 'cpu'")
    with torch.device("meta"):
        model = build_model(cfg)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    o = cfg.outer
    try:
        if o.strategy == "fgd":  # every part, even with Mix2 off: the strategy checks them too
            select(names, o.fgd.mix2_params)
        if o.strategy == "streaming":
            StreamingDiLoCo.fragment_of(names, o.streaming.fragments)
    except ValueError as e:  # a part that names nothing in this model
        raise ConfigError(str(e)) from None
    check_memory(cfg)


def memory_line(cfg: Config) -> str:
    """The memory estimate per process, as printed at the start of a run."""
    est = memory_estimate(cfg)
    shards = f" / {cfg.run.shards} shards" if cfg.run.shards > 1 else ""
    gathered, total = est["gathered_bytes"], model_bytes(est) + est["process_bytes"]
    return (
        f"{total / _GB:.2f} GB per process (estimated): {est['params'] / 1e6:.1f}M parameters"
        f"{shards}, {est['state_bytes'] / _GB:.2f} GB of weights, gradients and optimizer states"
        + (f", {gathered / _GB:.2f} GB gathered by FSDP2" if gathered else "")
        + f", {est['activation_bytes'] / _GB:.2f} GB of activations, "
        f"{est['process_bytes'] / _GB:.2f} GB for the process (torch, data)"
    )


def check_memory(cfg: Config) -> None:
    """Refuse a run whose estimated memory (models.memory_estimate, per process, times the
    processes on this machine) exceeds the available RAM, or a GPU's free memory."""
    est = memory_estimate(cfg)
    per_worker = model_bytes(est)
    here = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.run.workers * cfg.run.shards))
    fix = "use a smaller model (model.n_layer, model.n_embd), fewer workers (run.workers), more "
    fix += "shards (run.shards) or a smaller batch (data.batch_size, data.seq_len)"
    parts = memory_line(cfg)
    if cfg.run.device == "cuda" and torch.cuda.is_available():
        per_gpu = per_worker * -(-here // torch.cuda.device_count())
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        if per_gpu > free:
            raise ConfigError(
                f"memory: estimated {per_gpu / _GB:.1f} GB per GPU ({parts}) but "
                f"{free / _GB:.1f} GB is free; {fix}"
            )
        per_worker = 0  # on the GPU, not in RAM
    need, available = here * (per_worker + est["process_bytes"]), _available_ram()
    if available is not None and need > available:
        raise ConfigError(
            f"memory: estimated {need / _GB:.1f} GB for {here} processes on this machine ({parts}) "
            f"but {available / _GB:.1f} GB of RAM is available; {fix}"
        )


def _available_ram() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else free physical pages; None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def check_torchrun(cfg: Config) -> None:
    """Refuse what a run under torchrun cannot do, before any worker joins."""
    if cfg.fault_tolerance.enabled:
        raise ConfigError(
            "fault_tolerance.enabled = true: under torchrun a failed worker makes torchrun restart "
            "every worker (torchrun --max-restarts N), and they resume from the newest "
            "checkpoint; the in-process fault-tolerant runtime needs the local launcher "
            "(frugaltrain train --workers N); set fault_tolerance.enabled = false and "
            "fault_tolerance.inject = ''"
        )


def _join_torchrun(cfg: Config) -> None:
    """Initialize the default process group from torchrun's environment (env://)."""
    check_torchrun(cfg)  # before the group: every rank refuses alike
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps its store across restarts without clearing the keys: restarted
        # workers would read the addresses of the dead ones
        raise ConfigError(
            f"torchrun --max-restarts {restarts} with torchrun's shared store: restarted workers "
            "would connect to the addresses of the ones they replace; start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment on every machine"
        )
    dist.init_process_group(backend(cfg), timeout=timedelta(seconds=cfg.run.timeout_s))
    if dist.get_world_size() != cfg.run.workers * cfg.run.shards:
        raise ConfigError(
            f"run.workers = {cfg.run.workers} x run.shards = {cfg.run.shards} processes but "
            f"torchrun started {dist.get_world_size()}; make them equal"
        )


_JOB_FILE = "torchrun_job"  # in a run directory: which torchrun agent started it


def _torchrun_job() -> str:
    """The torchrun agent this worker runs under, which is the same process across its restarts
    of the workers (this process's parent): its host, process id and log directory (a random
    name per agent: a process id alone comes back one day), and the rendezvous id."""
    logs = os.environ.get("TORCHELASTIC_ERROR_FILE", "").split("/attempt_")[0]
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"{socket.gethostname()} pid {os.getppid()} logs {logs} rdzv-id {job}\n"


def _restarted_run_dir(cfg: Config) -> Path | None:
    """The run directory this torchrun job started before torchrun restarted its workers."""
    base = Path(cfg.run.out_dir) / cfg.run.name
    path, i = base, 1
    while path.exists():
        if (path / _JOB_FILE).is_file() and (path / _JOB_FILE).read_text() == _torchrun_job():
            return path
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    return None


def _shared_run_dir(cfg: Config) -> tuple[Path, bool]:
    """One run directory for all torchrun ranks, and whether torchrun restarted them. Rank 0
    picks it on the first start (runs/NAME, or NAME-1 ... if taken), finds it again after a
    restart, and sends the path to the others, who create it too: on a second machine without
    a shared file system it then holds that machine's workers' checkpoints."""
    group = dist.new_group(backend="gloo")  # a CPU group, whatever the training backend
    picked: list = [None]
    if dist.get_rank() == 0:
        found = _restarted_run_dir(cfg)
        path = found or new_run_dir(cfg)
        (path / _JOB_FILE).write_text(_torchrun_job())
        picked = [(str(path), found is not None)]
    dist.broadcast_object_list(picked, src=0, group=group)
    dist.destroy_process_group(group)
    run_dir, restarted = Path(picked[0][0]), picked[0][1]
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, restarted


def _agreed_checkpoint(run_dir: Path, mine: Path | None) -> Path | None:
    """The checkpoint every torchrun rank resumes from: the oldest of the ranks' newest intact
    ones (machines without a shared file system each see their own), None if one has none."""
    group = dist.new_group(backend="gloo")
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, mine.name if mine else None, group=group)
    dist.destroy_process_group(group)
    if None in names:
        return None
    ckpt = Path(run_dir) / "checkpoints" / min(names)
    checkpoint.verify(ckpt)
    return ckpt


def run(cfg: Config, run_dir: Path, resume_from: Path | None = None) -> None:
    """Run all workers of `cfg` to completion on this machine (or this torchrun rank)."""
    if under_torchrun():
        owns_group = not dist.is_initialized()  # train_from_cli joins first; netlab workers don't
        if owns_group:
            _join_torchrun(cfg)
        try:
            comm, shards = plain_comm(cfg, dist.get_rank())
            train_worker(cfg, comm, run_dir, resume_from, shards)
        finally:
            if owns_group:
                dist.destroy_process_group()
        return
    if cfg.run.workers * cfg.run.shards == 1:
        torch.set_num_threads(worker_threads(cfg))
        try:
            train_worker(cfg, LocalComm(), run_dir, resume_from)
        except Exception as e:  # as from a worker process: one line, the traceback in a log
            raise failure_of(run_dir, 0, report_failure(run_dir, 0, e)) from e
        return
    run_local(cfg, run_dir, resume_from)


def prepare(config_path: str | None, overrides: list[str], resume: str | None):
    """Build the config and run directory (new, or an existing one to resume)."""
    if resume:
        cfg, run_dir, ckpt = _resumable(config_path, overrides, resume)
        check_sinks(cfg)
        if under_torchrun():  # every rank was given the same directory
            _join_torchrun(cfg)
            ckpt = _agreed_checkpoint(run_dir, ckpt)
        return cfg, run_dir, ckpt
    cfg = load_config(config_path, overrides)
    check_sinks(cfg)  # a missing TensorBoard or wandb package
    check_model(cfg)
    check_data(cfg)
    if under_torchrun():
        _join_torchrun(cfg)
        run_dir, restarted = _shared_run_dir(cfg)
        if cfg.outer.strategy == "auto":  # a restart keeps the pick its first start made
            cfg = _resolve_auto(cfg, run_dir, run_dir / "config.toml" if restarted else None)
        if not restarted:
            return cfg, run_dir, None
        # torchrun restarted every worker after a failure: go on from the newest checkpoint
        ckpt = _agreed_checkpoint(run_dir, checkpoint.latest_intact(run_dir))
        if ckpt is None and dist.get_rank() == 0:  # none yet: start over in the same directory
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        return cfg, run_dir, ckpt
    if cfg.outer.strategy == "auto":
        cfg, plan = _pick(cfg, None)
        run_dir = new_run_dir(cfg)
        _write_plan(run_dir, plan)
        return cfg, run_dir, None
    return cfg, new_run_dir(cfg), None


def _pick(cfg: Config, saved: Path | None) -> tuple[Config, dict | None]:
    """outer.strategy = 'auto' replaced by the method sim/plan.py picks for [outer.auto]'s links
    (printed in one line, with why), and the plan as JSON; or by the [outer] of `saved`, the
    config.toml of a run that already made its pick (None: no plan)."""
    if saved is not None and saved.is_file():
        outer, plan = read_toml(saved)["outer"], None
    else:
        from frugaltrain.sim.plan import plan_json, resolve_auto

        picked, made = resolve_auto(cfg)
        outer, plan = to_dict(picked)["outer"], plan_json(made)
        strategy = picked.outer.strategy
        name = made.pick if made.pick == strategy else f"{made.pick} ({strategy})"
        print(
            f"outer.strategy = 'auto': running {name} on {made.links.what} "
            f"({made.links.label}) with {made.step.seconds:.4g} s steps (measured): {made.reason}",
            flush=True,
        )
    raw = to_dict(cfg)
    raw["outer"] = outer
    return build_config(Config, raw), plan


def _write_plan(run_dir: Path, plan: dict | None) -> None:
    if plan is not None:
        (run_dir / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")


def _resolve_auto(cfg: Config, run_dir: Path, saved: Path | None) -> Config:
    """`_pick` under torchrun: rank 0 picks (every rank must run the same method) and sends
    the others its config."""
    group = dist.new_group(backend="gloo")
    box: list = [None, None]  # (the config, None) or (None, why rank 0 could not pick)
    if dist.get_rank() == 0:
        try:
            cfg, plan = _pick(cfg, saved)
            _write_plan(run_dir, plan)
            box = [cfg, None]
        except ConfigError as e:  # every rank stops with it, none waits for a pick
            box = [None, str(e)]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    if box[1] is not None:
        raise ConfigError(box[1])
    return box[0]


# What a resumed run may change: how long it runs and how it reports, not what it computes.
_RUN_MAY_CHANGE = (
    "steps",
    "eval_every",
    "eval_batches",
    "eval_diagnostics",
    "checkpoint_every",
    "stop_at_round",
)
_RUN_MAY_CHANGE += ("threads", "timeout_s", "progress", "tensorboard", "wandb")
# and how a replica is laid out: DCP reshards (docs/sharding.md)
_RUN_MAY_CHANGE += ("shards", "activation_checkpointing")
_FT_MAY_CHANGE = ("mix1_deadline_s", "deadline_factor", "deadline_floor_s", "max_restarts")
_FT_MAY_CHANGE += ("coordinator_wait_s",)
RESUME_MAY_CHANGE = tuple(f"run.{k}" for k in _RUN_MAY_CHANGE)
RESUME_MAY_CHANGE += tuple(f"fault_tolerance.{k}" for k in _FT_MAY_CHANGE)


def _resumable(config_path: str | None, overrides: list[str], resume: str):
    """The saved config (with the allowed changes), the run directory and the newest intact
    checkpoint, all checked before any worker starts."""
    run_dir = Path(resume)
    saved = run_dir / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"--resume {resume}: no config.toml there; pass a run directory")
    raw = read_toml(saved)
    if config_path:  # allowed only for keys a resumed run may change
        given, kept = to_dict(load_config(config_path)), to_dict(build_config(Config, raw))
        if given["outer"]["strategy"] == "auto":  # the run keeps the method it picked
            given["outer"] = kept["outer"]
        may_change = {*RESUME_MAY_CHANGE, "run.name", "run.out_dir"}
        old = flat_items(kept)
        changed = [
            key
            for key, value in flat_items(given).items()
            if old[key] != value and key not in may_change
        ]
        if changed:
            may = ", ".join(RESUME_MAY_CHANGE)
            raise ConfigError(
                f"--config {config_path} differs from {saved} in {', '.join(changed)}, which a "
                f"resumed run keeps; drop --config, or change only {may}"
            )
        for key in RESUME_MAY_CHANGE:
            section, name = key.split(".")
            raw.setdefault(section, {})[name] = given[section][name]
    # A resumed run goes to the end unless a new stop is asked for explicitly.
    cfg = build_config(Config, raw, ["run.stop_at_round=0", *overrides])
    ckpt = checkpoint.latest_intact(run_dir)
    if ckpt is None:
        what = "intact" if checkpoint.latest_complete(run_dir) else "complete"
        raise ConfigError(
            f"--resume {resume}: no {what} checkpoint under {run_dir / 'checkpoints'}; "
            "start a new run instead"
        )
    checkpoint.check_resumable(ckpt, cfg)  # here, not in N worker tracebacks
    check_model(cfg)
    check_data(cfg)
    return cfg, run_dir, ckpt


def train_from_cli(
    config_path: str | None,
    overrides: list[str],
    resume: str | None,
    baseline: str | None = None,
    baseline_sets: Sequence[str] = (),
) -> int:
    from frugaltrain.metrics.report import format_comparison, report

    torchrun = under_torchrun()
    if baseline:  # refused before any work starts
        from frugaltrain.train.baseline import check_baseline

        check_baseline(baseline)
    if baseline and torchrun:
        raise ConfigError("--baseline runs a second local run; launch the baseline on its own")
    if baseline_sets and not baseline:
        raise ConfigError("--baseline-set changes a baseline; add --baseline STRATEGY or drop it")
    cfg, run_dir, ckpt = prepare(config_path, overrides, resume)
    if baseline:  # its overrides are refused here too, before any work
        from frugaltrain.train.baseline import baseline_config

        baseline_config(cfg, baseline, baseline_sets)
    is_rank0 = int(os.environ.get("RANK", "0")) == 0
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine: what --resume reads there
        (run_dir / "config.toml").write_text(to_toml(cfg))
    if is_rank0:
        where = f", resuming from {ckpt.name}" if ckpt else ""
        where += f", {cfg.run.shards} shards each" if cfg.run.shards > 1 else ""
        print(f"run dir: {run_dir} ({cfg.outer.strategy}, {cfg.run.workers} workers{where})")
        print(f"memory: {memory_line(cfg)}")
    try:
        run(cfg, run_dir, ckpt)
    finally:
        if torchrun:
            dist.destroy_process_group()
    if is_rank0:
        summary = report(run_dir)
        if baseline:
            from frugaltrain.train.baseline import (
                baseline_config,
                beside_records,
                method_label,
                plot_beside,
                run_baseline,
            )

            theirs, where = run_baseline(cfg, baseline, run, baseline_sets)
            names = (method_label(cfg), method_label(baseline_config(cfg, baseline, baseline_sets)))
            records = beside_records(cfg, run_dir, baseline, baseline_sets)
            print(f"\n{names[0]} beside {names[1]} (baseline {where}):")
            print(format_comparison(summary, theirs, names, records))
            print(f"plot: {plot_beside(cfg, run_dir, baseline, baseline_sets)}")
    return 0
