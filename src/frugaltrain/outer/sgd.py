"""The outer optimizer: SGD with (Nesterov) momentum over the outer parameters x, its momentum
buffers m in the open (`momenta`) for the strategies that mix, reset or report them.

It does torch.optim.SGD's arithmetic (dampening 0, no weight decay) on its single-tensor path,
op for op, so a run is bitwise the one torch's optimizer gives:

    first step:  m <- g                  later:  m <- mu m + g
    Nesterov:    d = g + mu m            else:   d = m           (momentum 0: d = g, no m)
    x <- x - lr d

Its state dict has torch SGD's layout ({"state": {i: {"momentum_buffer": m}}, "param_groups":
[...]}), so checkpoints written by either load in the other.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class OuterSGD:
    """SGD with momentum `momentum` (Nesterov look-ahead if `nesterov`) over `params`.

    Attributes:
        params: the outer parameters it steps (in place).
        momenta: one buffer per parameter, None until that parameter's first step (and always
            with momentum 0).
    """

    def __init__(self, params: list[torch.Tensor], lr: float, momentum: float, nesterov: bool):
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov and momentum > 0
        self.momenta: list[torch.Tensor | None] = [None] * len(params)

    @torch.no_grad()
    def step(self, indices: Iterable[int], grads: list[torch.Tensor]) -> None:
        """Step the parameters at `indices` with `grads`; the others and their momenta stay."""
        for i, g in zip(indices, grads, strict=True):
            if self.momentum != 0:
                m = self.momenta[i]
                if m is None:
                    m = self.momenta[i] = g.detach().clone()
                else:
                    m.mul_(self.momentum).add_(g, alpha=1)  # alpha = 1 - dampening, as torch
                g = g.add(m, alpha=self.momentum) if self.nesterov else m
            self.params[i].add_(g, alpha=-self.lr)

    def state_dict(self) -> dict:
        group = {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov}
        group.update(dampening=0, weight_decay=0, params=list(range(len(self.params))))
        state = {i: {"momentum_buffer": m} for i, m in enumerate(self.momenta) if m is not None}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state: dict) -> None:
        """Hyperparameters and momenta from `state_dict()` (or torch SGD's), on the parameters'
        device and dtype."""
        (group,) = state["param_groups"]
        self.lr, self.momentum, self.nesterov = group["lr"], group["momentum"], group["nesterov"]
        self.momenta = [None] * len(self.params)
        for i, s in state["state"].items():
            x = self.params[int(i)]
            self.momenta[int(i)] = s["momentum_buffer"].to(device=x.device, dtype=x.dtype).clone()
