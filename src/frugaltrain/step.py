"""One inner step, shared by the worker loop (train/loop.py) and the simulator (sim/engine.py).

    before_step   the strategy's hook (fgd posts its non-blocking Mix1 at a round's first step)
    forward       under run.dtype's autocast
    check         a non-finite loss stops the run here, before anything is updated
    backward      FORGE updates every weight inside it (two passes for exact clipping), so no
                  gradient exists afterwards: nothing to sync or clip
    sync_grads    the strategy's gradient sync (ddp's all-reduce; blocking time, not compute)
    clip, step    gradient clipping, the inner optimizer, the schedule

The simulator runs many workers on a few cores: it passes `compute`, a context that holds a
core for the two compute parts and releases it around the gradient sync, and it takes the
seconds spent inside those parts as the step's compute time.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from typing import Protocol

import torch

from frugaltrain.config import Config
from frugaltrain.models import autocast
from frugaltrain.optim import is_forge

Batch = tuple[torch.Tensor, torch.Tensor]


def worker_threads(cfg: Config) -> int:
    """torch threads per process: run.threads, or the cores shared out (at least 1)."""
    return cfg.run.threads or max(1, (os.cpu_count() or 1) // (cfg.run.workers * cfg.run.shards))


class Trainee(Protocol):
    """A worker's parts that one inner step moves."""

    model: torch.nn.Module
    inner: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    strategy: object


def inner_step(
    w: Trainee,
    cfg: Config,
    step: int,
    batch: Callable[[], Batch],
    *,
    device: torch.device,
    who: str,
    loss_value: Callable[[torch.Tensor], float] | None = None,
    compute: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[float, float, float]:
    """Inner step `step` + 1 of worker `w` on `batch()`. Returns (loss, lr, seconds inside
    `compute`). `loss_value`: the loss as a float (default `loss.item()`: the step's one host
    sync); `who` names the worker in the error of a non-finite loss."""
    forge = is_forge(cfg.optim)
    w.strategy.before_step(step)
    with compute():
        t0 = time.perf_counter()
        x, y = batch()
        with autocast(cfg, device):
            _, loss = w.model(x, y)
        value = loss_value(loss) if loss_value is not None else loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(
                f"[{who} step {step}] non-finite loss {value}; stopping before the update "
                "(lower optim.lr or raise optim.warmup_steps)"
            )
        if forge:
            w.inner.backward(loss)
        else:
            loss.backward()
        seconds = time.perf_counter() - t0
    if not forge:
        w.strategy.sync_grads()
    with compute():
        t0 = time.perf_counter()
        if cfg.optim.grad_clip > 0 and not forge:
            torch.nn.utils.clip_grad_norm_(w.model.parameters(), cfg.optim.grad_clip)
        lr = w.inner.param_groups[0]["lr"]
        w.inner.step()
        w.schedule.step()
        w.inner.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - t0
    return value, lr, seconds
