"""FORGE: the optimizer step fused into the backward pass; no full weight gradient ever exists.

See docs/forge.md. Public surface:
    ForgeOptimizer   torch.optim-like front (param groups, LR schedulers, state_dict)
    forge_optimizer  the training loop's builder (decay / no-decay groups, like torch AdamW)
    RULES            the element-wise rules (adamw, sgd, lion)
    AllocationTracker  storage-level allocation tracker used by the memory tests and benchmarks
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from frugaltrain.forge.memtrack import AllocationTracker
from frugaltrain.forge.optimizer import ForgeOptimizer
from frugaltrain.forge.rules import RULES

__all__ = ["AllocationTracker", "ForgeOptimizer", "RULES", "forge_optimizer"]


def forge_optimizer(
    model: nn.Module,
    rule: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    no_decay: Callable[[str], bool] | None = None,
    **options,
) -> ForgeOptimizer:
    """Install FORGE on `model` and return its optimizer (two groups: decay and no decay).

    Args:
        model: the module to train (its nn.Linear layers get the fused backward).
        rule: "adamw", "sgd" or "lion". For sgd, betas[0] is the momentum and betas[1] and eps
            are unused; lion ignores eps (both warn).
        lr: peak learning rate (schedulers scale `param_groups[i]["lr"]`).
        betas: (beta1, beta2).
        eps: Adam epsilon.
        weight_decay: decoupled (adamw, lion) or coupled (sgd) decay for the decay group.
        no_decay: parameter name -> True for no weight decay; default: parameters with dim < 2
            (norms and biases), like optim.decay_split.
        **options: ForgeOptimizer keywords: max_grad_norm, accumulation_steps, tile_rows, states,
            rounding, seed, exclude, backend.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if no_decay is None:
        decay = [p for n, p in named if p.dim() >= 2]
        plain = [p for n, p in named if p.dim() < 2]
    else:
        decay = [p for n, p in named if not no_decay(n)]
        plain = [p for n, p in named if no_decay(n)]
    if rule == "sgd":
        if eps != 0.0:
            warnings.warn(f"FORGE: eps={eps} has no effect with rule='sgd'", stacklevel=2)
        hyper = {"lr": lr, "momentum": betas[0]}
    elif rule == "lion":
        hyper = {"lr": lr, "betas": tuple(betas)}
    else:
        hyper = {"lr": lr, "betas": tuple(betas), "eps": eps}
    if rule == "lion" and eps != 0.0:
        warnings.warn(f"FORGE: eps={eps} has no effect with rule='lion'", stacklevel=2)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return ForgeOptimizer(model, [g for g in groups if g["params"]], rule=rule, **hyper, **options)
