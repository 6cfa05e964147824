"""The training loop of one worker, top to bottom: set up data, model, inner optimizer and outer
strategy; then rounds of H inner steps, each ended by the strategy's outer step, with evaluation,
metrics and checkpoints at round ends.

Every worker runs `train_worker` with the same config; worker 0 also writes metrics and shows
progress. The communication runtime (`Comm`) is the only thing that differs between one process,
torch.distributed workers and the fault-tolerant runtime. With run.shards = S > 1 a worker is a
replica of S processes that each run this loop on their shard (train/sharding.py): FSDP2 inside
the replica, the outer strategy on the local shards, across replicas.

Timing (all measured wall clock, per worker):
    compute_s  = time in forward, backward and the inner optimizer step
    blocking_s = time blocked in communication (Handle.wait), from the comm's own accounting
    utilization = compute_s / (compute_s + blocking_s)
With run.link_mbit the comm paces its transfers to emulated links (comm/pacing.py): blocking_s
and the wall clock are then those of the emulated links, and each round record says so
("links": "emulated 20 Mbit/s").
Each round record also holds every worker's own figures (peer/bytes_sent, peer/blocking_s, ...)
and the blocking time per named operation (comm/blocking_s/<op>): metrics/peers.py.

Energy and FLOPs (per round record, summed by `report`):
    energy/joules, energy/label = this round's energy from each worker process's meter
        (energy.open_meter: RAPL or NVML "measured", else the CPU-time "estimated"; the label says
        which, and an unavailable meter gives the label "unavailable: ..." and no joules, never
        0). RAPL counts a whole CPU package whatever runs on it, so only local rank 0 of each
        host reports it; NVML counts a whole GPU, so only the first worker on each GPU reports it;
        the CPU-time estimate is per process, so every worker reports its own. The total is the
        sum of the reporting workers. The window covers all of the round (steps, eval, outer
        step), and round 1 also the setup.
    flops/train = analytic forward + backward FLOPs of the round's tokens on all workers
        (models.train_flops_per_token; "estimated", matmuls only; FORGE's second clipping
        backward and evaluation are not counted).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from frugaltrain.comm import Comm
from frugaltrain.comm.pacing import links_label
from frugaltrain.comm.runtime import RoundEnd, Runtime, StateFn
from frugaltrain.config import Config, ConfigError
from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens, worker_seed
from frugaltrain.energy.meter import RaplMeter, open_meter
from frugaltrain.metrics.consensus import (
    GROUPS,
    averaged_model,
    logit_js,
    spread,
    squared_distance,
)
from frugaltrain.metrics.peers import blocking_ops, post_vector
from frugaltrain.metrics.sinks import open_sinks
from frugaltrain.models import autocast, build_model, evaluate, train_flops_per_token
from frugaltrain.optim import build_inner_optimizer, build_schedule
from frugaltrain.outer import Strategy, build_strategy
from frugaltrain.step import inner_step
from frugaltrain.train import checkpoint, sharded_checkpoint
from frugaltrain.train.round_log import RoundLog, RoundScalars
from frugaltrain.train.sharding import (
    Averaged,
    LocalShards,
    Shards,
    load_local_model,
    replica_mean,
    replica_sum,
    rewrap_optimizer_state,
    rows,
    shard_model,
    to_local,
)


@dataclass(frozen=True)
class Place:
    """Where this process sits in the run, computed once: its worker (replica) `worker`, its
    shard of that replica, its global rank (worker * run.shards + shard) and local rank."""

    worker: int
    shard: int
    rank: int
    local_rank: int


def place_of(comm: Comm, shards: Shards | None, shards_per_worker: int) -> Place:
    shard = shards.index if shards else 0
    rank = comm.rank * shards_per_worker + shard
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # spawned locally: all on one host
    return Place(comm.rank, shard, rank, local_rank)


@dataclass
class Worker:
    """One worker's training state and the parts that move it."""

    cfg: Config
    runtime: Runtime  # the loop's side of the runtime; `comm` is what the strategy sees
    place: Place
    device: torch.device
    model: torch.nn.Module
    inner: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    strategy: Strategy
    sampler: BatchSampler
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    shards: Shards | None = None  # this process's place in its replica (run.shards > 1)
    view: object = None  # what the strategy sees: the model, or its local shards
    step: int = 0  # inner steps done; also the data cursor (a batch is a function of the step)
    round: int = 0
    tokens: int = 0  # tokens the run trained so far, over the members of each round

    @property
    def comm(self) -> Comm:
        return self.runtime.comm

    def state(self) -> dict:
        """Everything a checkpoint (or a rejoining peer) needs to continue this worker; with
        shards, this process's shards as plain tensors (what a rejoining replica's shard takes)."""
        state = {
            "model": self.model.state_dict(),
            "inner": self.inner.state_dict(),
            "schedule": self.schedule.state_dict(),
            "outer": self.strategy.state_dict(),
            "rng": _rng_state(self.device),
            "data": self.sampler.state_dict(),
            "step": self.step,
            "round": self.round,
            "tokens": self.tokens,
        }
        return to_local(state) if self.shards else state

    def load(self, state: dict, own: bool = True, weights: bool = True) -> None:
        """Continue from `state`: this worker's checkpoint (`own`), or a live peer's state when
        rejoining, of which it takes neither the RNG (dropout stays its own) nor the data
        position (its shard and seed are its own; the step says where it reads). `weights`:
        False when the model and inner optimizer are already loaded (a DCP checkpoint)."""
        if weights and self.shards:
            load_local_model(self.model, state["model"])
            self.inner.load_state_dict(state["inner"])
            rewrap_optimizer_state(self.inner)
        elif weights:
            self.model.load_state_dict(state["model"])
            self.inner.load_state_dict(state["inner"])
        self.schedule.load_state_dict(state["schedule"])
        self.strategy.load_state_dict(state["outer"], own=own)
        self.step, self.round = state["step"], state["round"]
        tokens_per_step = self.cfg.data.batch_size * self.cfg.data.seq_len
        self.tokens = state.get("tokens", self.step * tokens_per_step * self.comm.world_size)
        if own:
            _set_rng_state(state["rng"], self.device)
            self.sampler.load_state_dict(state.get("data", self.sampler.state_dict()))
            if "data" in state and self.sampler.step != self.step:
                raise ConfigError(
                    f"checkpoint: data position {self.sampler.step} but step {self.step}; the "
                    "checkpoint is inconsistent: resume from an earlier one"
                )


@dataclass
class WorkerResult:
    step: int
    round: int
    val_loss: float | None
    model: torch.nn.Module


def train_worker(
    cfg: Config,
    runtime: Runtime | Comm,
    run_dir: Path,
    resume_from: Path | None = None,
    shards: Shards | None = None,
):
    """Train this worker to `run.steps` inner steps (or `run.stop_at_round`). Returns a
    WorkerResult. Call on every worker with the same config; with run.shards > 1 on every
    process, with its `shards` and a runtime over its shard group. A bare `Comm` runs under
    the plain runtime (comm/runtime.py)."""
    r = cfg.run
    runtime = runtime if isinstance(runtime, Runtime) else Runtime(runtime)
    place = place_of(runtime.comm, shards, r.shards)
    device = worker_device(cfg, place.rank)
    meter, meter_counts = open_energy_meter(device, place.local_rank)
    w = setup(cfg, runtime, place, device, resume_from, shards)
    log = _round_log(cfg, w, run_dir, resumed=resume_from is not None)

    val_loss = None
    t_start = time.perf_counter()
    stats_at_start = w.comm.stats.copy()
    while w.step < r.steps:
        loss_sum, compute_s, steps, lr = run_round(w, log)
        log.write_steps()
        record = round_record(w, steps, lr, time.perf_counter() - t_start)
        val_loss = None
        if eval_due(cfg, w.step, steps):
            val_loss, fields = evaluate_round(w)
            record.update(fields)
        reading = meter.stop()  # this round's window: steps, eval and the outer step
        meter.start()
        record["energy/label"] = reading.label
        joules = (reading.joules or 0.0) if meter_counts else 0.0
        no_meter = float(meter_counts and reading.joules is None)
        sent = w.comm.stats.minus(stats_at_start)
        scalars = round_scalars(w, sent, loss_sum / steps, compute_s, log.ops)
        scalars.val, scalars.joules, scalars.no_meter = val_loss or 0.0, joules, no_meter
        stats_at_start = w.comm.stats.copy()  # a checkpoint's barrier counts in the next round

        stop = bool(r.stop_at_round) and w.round >= r.stop_at_round
        save = (
            stop
            or w.step >= r.steps
            or bool(r.checkpoint_every and w.round % r.checkpoint_every == 0)
        )
        close = close_round(w, log, run_dir, record, val_loss is not None, save)
        late = runtime.end_round(w.round, scalars.pack(), close)
        log.events([{"round": w.round, **e} for e in late])
        if stop or runtime.stopping:
            break
    log.close()
    return WorkerResult(step=w.step, round=w.round, val_loss=val_loss, model=w.model)


def round_scalars(w: Worker, sent, loss: float, compute_s: float, ops) -> RoundScalars:
    """This worker's logging scalars of the round (`sent`: its CommStats of the round);
    validation loss and energy are filled in by the caller."""
    comm = w.comm
    own = {"bytes_sent": sent.bytes_sent, "bytes_received": sent.bytes_received}
    own.update(blocking_s=sent.blocking_s, compute_s=compute_s)
    own["feedback_norm"] = w.strategy.diagnostics().feedback_norm
    return RoundScalars(
        loss=loss,
        compute_s=compute_s,
        blocking_s=sent.blocking_s,
        sent=sent.bytes_sent,
        received=sent.bytes_received,
        recovery_s=sent.recovery_s,
        peers=post_vector(comm.rank, comm.world_size, own, sent.blocking_by_op, ops),
    )


def close_round(
    w: Worker, log: RoundLog, run_dir: Path, record: dict, has_val: bool, save: bool
) -> Callable[[RoundEnd], StateFn]:
    """What the loop does inside the runtime's round end: log the round (its record waits for
    the workers' means) and, when `save`, write the checkpoint; hands back the state function a
    joining worker takes its state from."""

    def close(end: RoundEnd) -> StateFn:
        if log.enabled:
            record.update(end.fields)
        # This round's rejections (and failures) are counted in its own record.
        log.events([{"round": w.round, **e} for e in end.events])
        log.round(record, end.means, has_val)
        if save or w.runtime.stopping:  # stopping: the store is lost, this round is the last
            log.flush(everything=True)
            save_checkpoint(w, run_dir)
        return w.state

    return close


def setup(
    cfg: Config,
    runtime: Runtime,
    place: Place,
    device: torch.device,
    resume_from: Path | None,
    shards: Shards | None = None,
) -> Worker:
    """Data (this worker's shard, and validation batches shared by all), model (sharded over
    the replica's processes with shards), inner optimizer and schedule, outer strategy; then a
    checkpoint's or a live peer's state, if there is one."""
    r, d, comm = cfg.run, cfg.data, runtime.comm
    corpus = load_corpus(d.path, d.max_bytes, d.val_fraction, verify=False)  # the launcher did
    shard = shard_tokens(corpus.train, comm.rank, comm.world_size, d.num_shards, d.sharding)
    sampler = BatchSampler(shard, d.seq_len, d.batch_size, worker_seed(r.seed, comm.rank))
    val_sampler = BatchSampler(corpus.val, d.seq_len, d.batch_size, seed=10_007 + r.seed)
    val_batches = [tuple(t.to(device) for t in val_sampler.batch(i)) for i in range(r.eval_batches)]

    model = build_model(cfg).to(device)
    model.train()
    shard_model(model, shards, r.activation_checkpointing)
    inner = build_inner_optimizer(model, cfg.optim)
    schedule = build_schedule(inner, cfg.optim, r.steps)
    view = LocalShards(model) if shards else model
    strategy = build_strategy(cfg, view, comm)
    torch.manual_seed(worker_seed(r.seed, place.rank))  # dropout differs per process
    w = Worker(cfg, runtime, place, device, model, inner, schedule, strategy, sampler, val_batches)
    w.shards, w.view = shards, view
    if resume_from is not None:
        resume(w, resume_from)
    runtime.rejoin(lambda state: w.load(state, own=False), w.state)  # a restarted worker only
    return w


def resume(w: Worker, ckpt: Path) -> None:
    """Load this worker's state from checkpoint `ckpt`, whatever run.shards wrote it: worker
    files (cut to shards if this run has them) or a DCP checkpoint (resharded by DCP)."""
    checkpoint.check_resumable(ckpt, w.cfg)
    if checkpoint.is_sharded(ckpt):
        w.load(sharded_checkpoint.load(w, ckpt, w.comm.rank), weights=False)
        return
    state = checkpoint.load_worker(ckpt, w.comm.rank, w.cfg)
    if w.shards:
        state = sharded_checkpoint.shard_worker_state(state, w)
    w.load(state)


def run_round(w: Worker, log: RoundLog) -> tuple[float, float, int, float]:
    """Inner steps up to the strategy's next outer round (which runs inside `after_step`) or the
    run's end. Returns (sum of losses, compute seconds, steps, last lr)."""
    loss_sum, compute_s, steps = 0.0, 0.0, 0
    while True:
        loss, lr, seconds = worker_step(w, log)
        loss_sum, compute_s, steps = loss_sum + loss, compute_s + seconds, steps + 1
        log.step(w.step, loss, lr)
        # The outer round's blocking communication is accounted inside the comm.
        if w.strategy.after_step(w.step) or w.step >= w.cfg.run.steps:
            w.round += 1
            # Tokens the round trained: a worker that was down for it (or died in it) trained none.
            w.tokens += steps * w.cfg.data.batch_size * w.cfg.data.seq_len * len(w.comm.members)
            return loss_sum, compute_s, steps, lr


def worker_step(w: Worker, log: RoundLog) -> tuple[float, float, float]:
    """One inner step (step.inner_step); returns (loss, lr, compute seconds). DDP's gradient
    all-reduce inside it is blocking time, not compute."""
    t0 = time.perf_counter()
    blocked0 = w.comm.stats.blocking_s

    def batch():
        batch = w.sampler.batch(w.step)
        if w.shards:
            batch = tuple(rows(t, w.shards) for t in batch)
        return tuple(t.to(w.device, non_blocking=True) for t in batch)

    loss_value = (lambda loss: replica_mean(loss, w.shards)) if w.shards else None
    try:
        loss, lr, _ = inner_step(
            w,
            w.cfg,
            w.step,
            batch,
            device=w.device,
            who=f"worker {w.comm.rank}",
            loss_value=loss_value,
        )
    except FloatingPointError:
        log.write_steps()
        raise
    w.step += 1
    # An injected straggler (fault-tolerant runtime) computes slower: its sleep counts here.
    w.runtime.on_step(w.step, time.perf_counter() - t0 - (w.comm.stats.blocking_s - blocked0))
    return loss, lr, time.perf_counter() - t0 - (w.comm.stats.blocking_s - blocked0)


def eval_due(cfg: Config, step: int, round_steps: int) -> bool:
    """Evaluate when the round crossed a multiple of run.eval_every, and at the end."""
    every = cfg.run.eval_every
    crossed = every and step // every > (step - round_steps) // every
    return bool(crossed) or step == cfg.run.steps


def evaluate_round(w: Worker) -> tuple[float, dict]:
    """Validation loss, and with several workers (run.eval_diagnostics) how far apart they are
    and the loss of their averaged model. Those evaluation rounds synchronize (the diagnostics
    need every worker's parameters); their time is reported apart and is neither compute nor
    algorithm blocking."""
    t0 = time.perf_counter()
    with autocast(w.cfg, w.device):
        val_loss = evaluate(w.model, w.val_batches)
        if w.comm.world_size == 1:
            fields = {"loss/val_avg_model": val_loss}
        elif w.cfg.run.eval_diagnostics:
            fields = disagreement(w, val_loss)
        else:  # no communication: the mean over workers comes with the round's scalars
            fields = {}
    fields["time/eval_s"] = time.perf_counter() - t0
    return val_loss, fields


@dataclass
class Agreement:
    """How far apart the workers are, as each worker posts it for one mean over the members:
    the sums of squared distances to the mean (total, then per metrics.consensus.GROUPS), the
    logit JS divergence, the outer momentum spread, and each worker's validation loss at its
    rank (times the member count, so the mean is that loss)."""

    consensus: list[float]  # total, then one per group
    logit_js: float
    momentum: float
    val_workers: list[float]

    def pack(self) -> list[float]:
        return [*self.consensus, self.logit_js, self.momentum, *self.val_workers]

    @classmethod
    def unpack(cls, values: list[float]) -> Agreement:
        k = 1 + len(GROUPS)
        return cls(values[:k], values[k], values[k + 1], values[k + 2 :])


def disagreement(w: Worker, val_loss: float) -> dict[str, float]:
    """How far apart the workers are (metrics.consensus): consensus distance in total and per
    group, logit JS on the first batch, the outer momentum spread, every worker's validation
    loss and the averaged model's. Through the runtime's diagnostic reductions; call on every
    worker at once. With shards, each shard group averages its shards, the sums of squares are
    summed over the replica's shards, and the averaged model is the replica's own sharded
    model holding the mean for a moment (Averaged)."""
    runtime, comm, model, batches = w.runtime, w.comm, w.model, w.val_batches
    params = list(w.view.parameters())
    mean = runtime.metric_mean_tensors(params)
    local = squared_distance(w.view, mean)
    momenta = w.strategy.diagnostics().momenta
    m_spread = spread(momenta, runtime.metric_mean_tensors(momenta)) if momenta else 0.0
    sums = replica_sum([sum(local.values()), *local.values(), m_spread], w.shards)
    averaged = Averaged(model, params, mean) if w.shards else averaged_model(model, mean)
    js = logit_js(model, averaged, batches[0][0])
    n = len(comm.members)
    own = [val_loss * n if r == comm.rank else 0.0 for r in range(comm.world_size)]
    posted = Agreement(consensus=sums[:-1], logit_js=js, momentum=sums[-1], val_workers=own)
    got = Agreement.unpack(runtime.metric_mean(posted.pack()))
    out = {"consensus/total": got.consensus[0]}
    out.update({f"consensus/{g}": v for g, v in zip(GROUPS, got.consensus[1:], strict=True)})
    out["disagreement/logit_js"] = got.logit_js
    if momenta:
        out["consensus/momentum"] = got.momentum
    out["loss/val_workers"] = [got.val_workers[r] for r in comm.members]
    out["loss/val_avg_model"] = evaluate(averaged, batches)  # the same on every worker
    return out


def round_record(w: Worker, steps: int, lr: float, wall_s: float) -> dict:
    """A round's record before the workers' means are in (RoundLog completes it)."""
    cfg, M = w.cfg, w.comm.world_size
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_token = train_flops_per_token(w.model, cfg)
    return {
        "kind": "round",
        "round": w.round,
        "step": w.step,
        "strategy": cfg.outer.strategy,
        "workers": M,
        "clock": "measured",
        "tokens": w.tokens,
        "lr": lr,
        "time/wall_s": wall_s,
        "flops/train": flops_per_token * steps * tokens_per_step * M,
        "flops/label": "estimated (analytic)",
        # Paced links (comm/pacing.py): every time figure of the run is on emulated links.
        **({"links": links_label(cfg.run.link_mbit)} if cfg.run.link_mbit else {}),
    }


def save_checkpoint(w: Worker, run_dir: Path) -> None:
    """Every worker writes its state; once all have, one per machine marks the round COMPLETE.
    A worker that is down (fault-tolerant runtime) gets a stand-in: the state it would take on
    rejoining."""
    comm, runtime = w.comm, w.runtime
    if w.shards:
        save_sharded_checkpoint(w, run_dir)
        return
    checkpoint.save_worker(run_dir, w.round, comm.rank, w.state())
    writer = runtime.writes_markers(w.place.local_rank)
    if writer:
        for absent in sorted(set(range(comm.world_size)) - set(comm.members)):
            checkpoint.save_worker(run_dir, w.round, absent, w.state())
    runtime.barrier()
    if writer:
        checkpoint.mark_complete(run_dir, w.round, w.step, w.cfg)


def save_sharded_checkpoint(w: Worker, run_dir: Path) -> None:
    """Each replica writes its DCP checkpoint (train/sharded_checkpoint.py); the lowest replica
    present in every shard group also writes the absent ones' stand-ins (all its shards agree
    on who that is through the replica's link); once all are written, one process per machine
    marks the round COMPLETE."""
    comm, d = w.comm, checkpoint.round_dir(run_dir, w.round)
    sharded_checkpoint.save(w, d, comm.rank)
    here = w.shards.link.count([r in comm.members for r in range(comm.world_size)])
    present = [r for r in range(comm.world_size) if here[r]]
    if comm.rank == present[0]:
        for absent in sorted(set(range(comm.world_size)) - set(present)):
            sharded_checkpoint.save(w, d, absent)
    w.runtime.barrier()
    if w.runtime.writes_markers(w.place.local_rank) and w.shards.index == 0:
        checkpoint.mark_complete(run_dir, w.round, w.step, w.cfg)


def _round_log(cfg: Config, w: Worker, run_dir: Path, resumed: bool) -> RoundLog:
    writes = w.runtime.writes_metrics(w.place.worker, w.place.shard)
    bar = None
    if writes and cfg.run.progress:
        from tqdm import tqdm

        desc = f"{cfg.outer.strategy} x{w.comm.world_size}"
        bar = tqdm(total=cfg.run.steps, initial=w.step, desc=desc, unit="step", leave=False)
    return RoundLog(
        run_dir / "metrics.jsonl",
        enabled=writes,
        resumed_at=w.step if resumed else None,
        workers=w.comm.world_size,
        bar=bar,
        ops=blocking_ops(cfg),
        sinks=open_sinks(cfg, run_dir) if writes else None,
    )


def worker_device(cfg: Config, rank: int) -> torch.device:
    """cpu, or cuda:(rank mod visible GPUs) for run.device = cuda."""
    if cfg.run.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("run.device = 'cuda' but torch sees no GPU; use run.device = 'cpu'")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def open_energy_meter(device: torch.device, local_rank: int):
    """Start this worker's energy meter; returns (meter, whether its readings count towards the
    run's total). See the module docstring for the attribution rule."""
    meter = open_meter(str(device) if device.type == "cuda" else "cpu")
    if isinstance(meter, RaplMeter):
        counts = local_rank == 0
    elif device.type == "cuda":
        counts = local_rank < torch.cuda.device_count()
    else:
        counts = True
    meter.start()
    return meter, counts


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":  # dropout on a GPU draws from that device's generator
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
