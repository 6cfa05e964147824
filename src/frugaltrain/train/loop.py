"""The training loop of one worker, top to bottom: data, model, inner optimizer, outer strategy,
then inner steps with an outer round every H steps, evaluation, metrics and checkpoints.

Every worker runs this same function; worker 0 additionally writes metrics and shows progress.
Timing (all measured wall clock, per worker):
    compute_s  = time in forward, backward and the inner optimizer step
    blocking_s = time blocked in communication (Handle.wait), from the comm's own accounting
    utilization = compute_s / (compute_s + blocking_s)

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
        (energy.transformer_train_flops; "estimated", matmuls only; FORGE's second clipping
        backward and evaluation are not counted).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from frugaltrain.comm import Comm
from frugaltrain.config import Config, fgd_mixing
from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens, worker_seed
from frugaltrain.energy.meter import RaplMeter, open_meter
from frugaltrain.energy.proxies import transformer_train_flops
from frugaltrain.metrics.consensus import disagreement
from frugaltrain.metrics.log import MetricsLog
from frugaltrain.models.gpt import GPT, GPTConfig
from frugaltrain.outer import STRATEGIES
from frugaltrain.train import checkpoint
from frugaltrain.train.optim import build_inner_optimizer, build_schedule, is_forge


@dataclass
class WorkerResult:
    step: int
    round: int
    val_loss: float | None
    model: torch.nn.Module


def build_model(cfg: Config) -> GPT:
    m = cfg.model
    torch.manual_seed(cfg.run.seed)  # same init on every worker: DiLoCo needs one shared x
    return GPT(
        GPTConfig(
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_embd=m.n_embd,
            vocab_size=m.vocab_size,
            block_size=cfg.data.seq_len,
            dropout=m.dropout,
            bias=m.bias,
            tie_embeddings=m.tie_embeddings,
        )
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


def build_strategy(cfg: Config, model: torch.nn.Module, comm: Comm):
    """The outer strategy of `cfg` for this worker (outer/__init__.py lists the interface)."""
    o = cfg.outer
    cls = STRATEGIES[o.strategy]
    if o.strategy == "ddp":
        return cls(model, comm, H=o.H)
    outer_opt = {"H": o.H, "lr": o.lr, "momentum": o.momentum}
    if o.strategy == "diloco":
        return cls(model, comm, nesterov=o.nesterov, **outer_opt)
    if o.strategy == "fgd":
        return cls(
            model,
            comm,
            nesterov=o.nesterov,
            momentum_policy=o.momentum_policy,
            codec=o.codec,
            seed=cfg.run.seed,
            **fgd_mixing(o),
            **outer_opt,
        )
    if o.strategy == "noloco":
        return cls(
            model,
            comm,
            consensus_pull=o.consensus_pull,
            group_size=o.group_size,
            codec=o.codec,
            seed=cfg.run.seed,
            **outer_opt,
        )
    return cls(
        model,
        comm,
        nesterov=o.nesterov,
        fragments=o.fragments,
        overlap=o.overlap,
        merge_alpha=o.merge_alpha,
        codec=o.codec,
        **outer_opt,
    )


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was_training = model.training
    model.eval()
    total = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
    model.train(was_training)
    return total


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


def train_worker(cfg: Config, comm: Comm, run_dir: Path, resume_from: Path | None = None):
    """Train this worker to `run.steps` inner steps (or `run.stop_at_round`). Returns a
    WorkerResult. Call on every worker with the same config."""
    r, d = cfg.run, cfg.data
    rank, M = comm.rank, comm.world_size
    is_main = rank == 0
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # spawned locally: all on one host
    device = worker_device(cfg, rank)
    meter, meter_counts = open_energy_meter(device, local_rank)

    # ---- data: this worker's shard, and fixed validation batches shared by all workers
    corpus = load_corpus(d.path, d.max_bytes, d.val_fraction)
    shard = shard_tokens(corpus.train, rank, M, d.num_shards, d.sharding)
    sampler = BatchSampler(shard, d.seq_len, d.batch_size, worker_seed(r.seed, rank))
    val_sampler = BatchSampler(corpus.val, d.seq_len, d.batch_size, seed=10_007 + r.seed)
    val_batches = [tuple(t.to(device) for t in val_sampler.batch(i)) for i in range(r.eval_batches)]

    # ---- model, inner optimizer and schedule, outer strategy
    model = build_model(cfg).to(device)
    model.train()
    inner = build_inner_optimizer(model, cfg.optim)
    forge = is_forge(cfg.optim)
    schedule = build_schedule(inner, cfg.optim, r.steps)
    strategy = build_strategy(cfg, model, comm)
    torch.manual_seed(worker_seed(r.seed, rank))  # dropout differs per worker

    step, round_idx = 0, 0
    if resume_from is not None:
        state = checkpoint.load_worker(resume_from, rank, cfg)
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        schedule.load_state_dict(state["schedule"])
        strategy.load_state_dict(state["outer"])
        _set_rng_state(state["rng"], device)
        step, round_idx = state["step"], state["round"]  # step is also the data cursor

    def worker_state() -> dict:
        """Everything a checkpoint (or a rejoining peer) needs to continue this worker."""
        return {
            "model": model.state_dict(),
            "inner": inner.state_dict(),
            "schedule": schedule.state_dict(),
            "outer": strategy.state_dict(),
            "rng": _rng_state(device),
            "step": step,
            "round": round_idx,
        }

    # Fault tolerance (frugaltrain.ft): a restarted worker takes a live peer's state (not its
    # RNG: dropout stays per worker), injected faults fire per step, joins happen at round ends.
    ft = comm if hasattr(comm, "on_round_end") else None
    if ft is not None:

        def load_peer_state(state: dict) -> None:
            nonlocal step, round_idx
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["inner"])
            schedule.load_state_dict(state["schedule"])
            strategy.load_state_dict(state["outer"])
            step, round_idx = state["step"], state["round"]

        ft.rejoin(load_peer_state, worker_state)

    log = MetricsLog(
        run_dir / "metrics.jsonl",
        enabled=is_main,
        truncate_after_step=step if resume_from is not None else None,
    )
    bar = None
    if is_main and r.progress:
        from tqdm import tqdm

        bar = tqdm(
            total=r.steps, initial=step, desc=f"{cfg.outer.strategy} x{M}", unit="step", leave=False
        )

    tokens_per_step = d.batch_size * d.seq_len
    stop_round = r.stop_at_round or None
    val_loss = None
    t_start = time.perf_counter()
    round_compute, round_loss_sum, round_steps = 0.0, 0.0, 0
    stats_at_round_start = comm.stats.copy()
    pending: deque[tuple[dict, Callable[[], list[float]], bool]] = deque()
    step_records: list[tuple[int, float, float]] = []
    flops_per_token = transformer_train_flops(
        cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, d.seq_len, cfg.model.vocab_size, 1
    )

    def write_steps() -> None:
        """Write the buffered step records (once per round: no per-step file write)."""
        for step_, loss_, lr_ in step_records:
            log.write({"kind": "step", "step": step_, "loss/train": loss_, "lr": lr_})
        step_records.clear()

    def emit_rounds(everything: bool = False) -> None:
        """Write the pending round records whose means are in: under the fault-tolerant
        runtime those all members have posted (a straggler never holds a worker back), else
        all but the newest (waiting for round t's means once round t + 1 runs). `everything`
        waits for all of them (a checkpoint, the end)."""
        while pending:
            ready = getattr(pending[0][1], "ready", None)
            if not everything and not (ready() if ready else len(pending) > 1):
                return
            emit_round(*pending.popleft())

    def emit_round(record: dict, means: Callable[[], list[float]], has_val: bool) -> None:
        """Complete a round record with the workers' means and write it."""
        mean = means()
        compute, blocking = mean[1], mean[2]
        record.update(
            {
                "loss/train": mean[0],
                "time/compute_s": compute,
                "time/blocking_s": blocking,
                "util/compute": compute / (compute + blocking) if compute + blocking > 0 else None,
                "comm/bytes_sent": int(mean[3]),
                "comm/bytes_received": int(mean[4]),
            }
        )
        if mean[7] > 0:  # a reporting worker's meter gave no reading: no total, never a zero
            if not record["energy/label"].startswith("unavailable"):
                record["energy/label"] = f"unavailable: {int(round(mean[7] * M))} worker meter(s)"
        else:
            record["energy/joules"] = mean[6] * M  # the sum over reporting workers
        if has_val:
            record["loss/val"] = mean[5]
            if bar is not None:
                bar.set_postfix(val=f"{mean[5]:.3f}")
        log.write(record)
        log.flush()

    while step < r.steps:
        # ---- one inner step (compute), with the gradient sync of DDP counted as blocking
        t0 = time.perf_counter()
        blocked0 = comm.stats.blocking_s
        strategy.before_step(step)
        x, y = (t.to(device, non_blocking=True) for t in sampler.batch(step))
        _, loss = model(x, y)
        loss_value = loss.item()  # the step's one host sync (on a GPU: before backward starts)
        if not math.isfinite(loss_value):
            write_steps()
            raise FloatingPointError(
                f"[worker {rank} step {step}] non-finite loss {loss_value}; stopping before the "
                "update (lower optim.lr or raise optim.warmup_steps)"
            )
        if forge:
            # FORGE updates every weight inside backward (two passes for exact clipping when
            # optim.grad_clip > 0); no gradient exists afterwards, so nothing to sync or clip.
            inner.backward(loss)
        else:
            loss.backward()
            strategy.sync_grads()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        lr = inner.param_groups[0]["lr"]
        inner.step()
        schedule.step()
        inner.zero_grad(set_to_none=True)
        step += 1
        if ft is not None:  # an injected straggler computes `factor` times slower, counted here
            ft.on_step(step, time.perf_counter() - t0 - (comm.stats.blocking_s - blocked0))
        round_compute += time.perf_counter() - t0 - (comm.stats.blocking_s - blocked0)
        round_loss_sum += loss_value
        round_steps += 1
        if log.enabled:  # step records are written at the round boundary, not per step
            step_records.append((step, loss_value, lr))
        if bar is not None:
            bar.update(1)

        # ---- outer round (blocking communication is accounted inside the comm)
        if not strategy.after_step(step) and step < r.steps:
            continue
        round_idx += 1
        write_steps()
        due_eval = r.eval_every and (step // r.eval_every > (step - round_steps) // r.eval_every)
        record = {
            "kind": "round",
            "round": round_idx,
            "step": step,
            "strategy": cfg.outer.strategy,
            "workers": M,
            "clock": "measured",
            "tokens": step * tokens_per_step * M,
            "lr": lr,
            "time/wall_s": time.perf_counter() - t_start,
            "flops/train": flops_per_token * round_steps * tokens_per_step * M,
            "flops/label": "estimated (analytic)",
        }
        val_loss = None
        if due_eval or step == r.steps:
            # Evaluation rounds synchronize (the diagnostics need every worker's parameters);
            # their time is reported apart and is neither compute nor algorithm blocking.
            t_eval = time.perf_counter()
            val_loss = evaluate(model, val_batches)
            if M > 1:
                record.update(disagreement(model, comm, val_batches[0][0]))
            record["time/eval_s"] = time.perf_counter() - t_eval
        reading = meter.stop()  # this round's window: steps, eval and the outer step
        meter.start()
        record["energy/label"] = reading.label
        delta = comm.stats.minus(stats_at_round_start)
        means = comm.metric_mean_async(
            [
                round_loss_sum / round_steps,
                round_compute,
                delta.blocking_s,
                delta.bytes_sent,
                delta.bytes_received,
                val_loss if val_loss is not None else 0.0,
                (reading.joules or 0.0) if meter_counts else 0.0,
                float(meter_counts and reading.joules is None),
            ]
        )
        # Scalars of round t are logged once round t + 1 has started (or at a checkpoint or the
        # end), so logging never makes a worker wait for the others.
        if ft is not None and is_main:
            record.update(ft.round_fields())
        pending.append((record, means, val_loss is not None))
        emit_rounds()
        round_compute, round_loss_sum, round_steps = 0.0, 0.0, 0
        stats_at_round_start = comm.stats.copy()

        last = step >= r.steps or (stop_round is not None and round_idx >= stop_round)
        if last or (r.checkpoint_every and round_idx % r.checkpoint_every == 0):
            emit_rounds(everything=True)
            checkpoint.save_worker(run_dir, round_idx, rank, worker_state())
            # COMPLETE goes next to the files of each machine's workers (local rank 0 under
            # torchrun, so a machine without a shared file system can resume too).
            writer = local_rank == 0 if ft is None else rank == ft.members[0]
            if ft is not None and writer:
                # A worker that is down gets a stand-in: the state it would take on rejoining.
                for absent in sorted(set(range(M)) - set(ft.members)):
                    checkpoint.save_worker(run_dir, round_idx, absent, worker_state())
            comm.barrier()
            if writer:
                checkpoint.mark_complete(run_dir, round_idx, step, cfg)
        if ft is not None:
            ft.on_round_end(round_idx, worker_state)
            for rec in ft.drain_events():
                log.write(rec)
        if stop_round is not None and round_idx >= stop_round:
            break

    emit_rounds(everything=True)
    if bar is not None:
        bar.close()
    log.close()
    return WorkerResult(step=step, round=round_idx, val_loss=val_loss, model=model)
