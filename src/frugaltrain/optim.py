"""The inner optimizer and its learning-rate schedule (linear warmup, then cosine decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from frugaltrain.config import OptimSection


def decay_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Weight decay on matrices and embeddings (dim >= 2), none on norms and biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return decay, no_decay


# optim.name -> FORGE rule (docs/forge.md). FORGE updates each weight inside backward, so the loop
# calls `opt.backward(loss)` instead of `loss.backward()` + clip + step (see train/loop.py).
FORGE_RULES = {"forge-adamw": "adamw", "forge-sgd": "sgd", "forge-lion": "lion"}


def is_forge(cfg: OptimSection) -> bool:
    return cfg.name in FORGE_RULES


def build_inner_optimizer(model: nn.Module, cfg: OptimSection) -> torch.optim.Optimizer:
    """torch.optim.AdamW for optim.name = adamw; a FORGE optimizer installed on `model` for
    forge-adamw / forge-sgd (betas[0] is the momentum) / forge-lion. Both have the same two
    param groups (decay, no decay), so the LambdaLR schedule and state_dict work the same way.
    FORGE clips exactly in two backward passes when optim.grad_clip > 0 (one extra backward)."""
    if is_forge(cfg):
        from frugaltrain.forge import forge_optimizer

        rule = FORGE_RULES[cfg.name]
        # eps only matters to adamw; pass a user-set eps through so FORGE warns that it is unused.
        eps = cfg.eps if rule == "adamw" or cfg.eps != OptimSection().eps else 0.0
        return forge_optimizer(
            model,
            rule,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=eps,
            weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.grad_clip if cfg.grad_clip > 0 else None,
        )
    decay, no_decay = decay_split(model)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for inner step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


def build_schedule(
    optimizer: torch.optim.Optimizer, cfg: OptimSection, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's schedule over `total_steps`, or over optim.decay_steps where that is set."""
    span = cfg.decay_steps or total_steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, span, cfg.warmup_steps, cfg.min_lr_ratio)
    )
