"""Element-wise optimizer rules, written once and shared by the torch path and the Triton kernel.

A rule maps one tile of (weight w, gradient g, states s1, s2) to the new (w, s1, s2) using only
arithmetic operators and the four helpers `_lerp`, `_addcmul`, `_addcdiv`, `_sign`, `_sqrt`
defined here for torch tensors. `triton_kernel.py` rebinds the very same function code to Triton
versions of those helpers and jits it, so there is one source of truth per rule.

Every rule takes eight scalar slots h0..h7 after the tiles; `Rule.scalars(group, step)` fills them
on the host (Python floats, so the torch path computes exactly what torch.optim computes). The op
order mirrors torch.optim's single-tensor implementations (foreach=False), which makes the fp64
torch path bit-identical to them.

Tiles: w, g, s1, s2 have the same shape (a block of rows of a parameter) and are float32 or
float64; the caller up-casts bf16 weights and dequantizes 8-bit states before calling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _lerp(a, b, weight):
    return torch.lerp(a, b, weight)


def _addcmul(a, b, c, value):
    return torch.addcmul(a, b, c, value=value)


def _addcdiv(a, b, c, value):
    return torch.addcdiv(a, b, c, value=value)


def _add(a, b, alpha):
    return torch.add(a, b, alpha=alpha)


def _sign(a):
    return torch.sign(a)


def _sqrt(a):
    return torch.sqrt(a)


def adamw_update(w, g, m, v, decay, one_m_b1, b2, one_m_b2, bc2_sqrt, eps, neg_step_size, h7):
    """AdamW (Loshchilov & Hutter, arXiv 1711.05101): decoupled decay, then the Adam step."""
    w = w * decay
    m = _lerp(m, g, one_m_b1)
    v = _addcmul(v * b2, g, g, one_m_b2)
    denom = _sqrt(v) / bc2_sqrt + eps
    w = _addcdiv(w, m, denom, neg_step_size)
    return w, m, v


def sgd_update(w, g, buf, s2, wd, keep, fresh, neg_lr, h4, h5, h6, h7):
    """SGD with heavy-ball momentum and coupled weight decay, as torch.optim.SGD.

    keep = momentum and fresh = 1 - dampening, except on the first step where keep = 0 and
    fresh = 1, which reproduces torch's `buf = clone(d_p)` exactly.
    """
    d = _add(g, w, wd)
    buf = _add(buf * keep, d, fresh)
    w = _add(w, buf, neg_lr)
    return w, buf, s2


def lion_update(w, g, m, s2, decay, one_m_b1, one_m_b2, neg_lr, h4, h5, h6, h7):
    """Lion (Chen et al., arXiv 2302.06675): sign of the beta1 lerp; beta2 for the state."""
    w = w * decay
    c = _lerp(m, g, one_m_b1)
    w = _add(w, _sign(c), neg_lr)
    m = _lerp(m, g, one_m_b2)
    return w, m, s2


def _adamw_scalars(group: dict, step: int) -> tuple[float, ...]:
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    bc1 = 1 - b1**step
    bc2 = 1 - b2**step
    return (1 - lr * wd, 1 - b1, b2, 1 - b2, bc2**0.5, eps, -(lr / bc1), 0.0)


def _sgd_scalars(group: dict, step: int) -> tuple[float, ...]:
    mu, damp = group["momentum"], group["dampening"]
    keep, fresh = (0.0, 1.0) if step == 1 or mu == 0 else (mu, 1 - damp)
    return (group["weight_decay"], keep, fresh, -group["lr"], 0.0, 0.0, 0.0, 0.0)


def _lion_scalars(group: dict, step: int) -> tuple[float, ...]:
    lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
    return (1 - lr * wd, 1 - b1, 1 - b2, -lr, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Rule:
    """One element-wise optimizer rule.

    Attributes:
        name: the rule's name ("adamw", "sgd", "lion").
        update: the element-wise function (see module docstring).
        state_names: names of the states it uses, as torch.optim names them, so fp32 state dicts
            are interchangeable with torch's.
        state_signed: per state, True for a signed state (absmax int8 codes), False for a
            non-negative one (stored as sqrt in uint8 codes in the 8-bit regime).
        scalars: (param group, 1-based step) -> the eight host scalars h0..h7.
        defaults: the param-group keys the rule reads, with default values.
    """

    name: str
    update: Callable
    state_names: tuple[str, ...]
    state_signed: tuple[bool, ...]
    scalars: Callable[[dict, int], tuple[float, ...]]
    defaults: dict


RULES: dict[str, Rule] = {
    "adamw": Rule(
        "adamw",
        adamw_update,
        ("exp_avg", "exp_avg_sq"),
        (True, False),
        _adamw_scalars,
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
    ),
    "sgd": Rule(
        "sgd",
        sgd_update,
        ("momentum_buffer",),
        (True,),
        _sgd_scalars,
        {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0},
    ),
    "lion": Rule(
        "lion",
        lion_update,
        ("exp_avg",),
        (True,),
        _lion_scalars,
        {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0},
    ),
}
