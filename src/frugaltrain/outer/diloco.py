"""DiLoCo: H local AdamW steps, then one blocking all-reduce of the pseudo-gradients and an outer
Nesterov step (Douillard et al., arXiv 2311.08105).

Per round t, on every worker i (symbols as in the paper and research/diloco_family.md a.1):
    theta_i <- x;  H inner steps;  Delta_i = x - theta_i
    Delta = mean_i Delta_i                      (blocking all-reduce, counted as blocking time)
    m <- mu m + Delta;  x <- x - gamma (Delta + mu m)   (torch.optim.SGD, nesterov=True)
Inner AdamW states stay local. All workers hold the same x and m, so the outer step runs
replicated. On failure the all-reduce raises after run.timeout_s.
"""

from __future__ import annotations

import torch
from torch import nn

from frugaltrain.comm import Comm


def outer_sgd(params: list[torch.Tensor], lr: float, momentum: float, nesterov: bool):
    """Outer optimizer: SGD with (Nesterov) momentum; momentum 0 is plain SGD."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


@torch.no_grad()
def outer_step(
    opt: torch.optim.Optimizer,
    outer: list[torch.Tensor],
    pseudo_grads: list[torch.Tensor],
    inner: list[torch.Tensor],
    merge_alpha: float = 0.0,
) -> None:
    """One outer step: feed the pseudo-gradients to `opt` as gradients of the outer parameters,
    step, then restart the inner parameters from the result (theta <- alpha theta + (1-alpha) x;
    alpha = 0 copies, bit for bit)."""
    for x, g in zip(outer, pseudo_grads, strict=True):
        x.grad = g
    opt.step()
    for x, theta in zip(outer, inner, strict=True):
        x.grad = None
        if merge_alpha:
            theta.mul_(merge_alpha).add_(x, alpha=1 - merge_alpha)
        else:
            theta.copy_(x)


@torch.no_grad()
def copy_all_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


class DiLoCo:
    """DiLoCo outer loop for one worker.

    Args:
        model: this worker's replica; its parameters are the inner parameters theta_i.
        comm: communication endpoint.
        H: inner steps per outer round.
        lr: outer learning rate gamma (default 0.7).
        momentum: outer momentum mu (default 0.9).
        nesterov: Nesterov look-ahead (default True).
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        *,
        H: int,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm = comm
        self.H = H
        self.outer = [p.detach().clone() for p in self.params]  # x
        self.opt = outer_sgd(self.outer, lr, momentum, nesterov)

    def before_step(self, step: int) -> None:
        pass

    def sync_grads(self) -> None:
        pass

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        """Call after each inner step with the number of steps done; runs the outer step every H."""
        if step % self.H:
            return False
        deltas = [x - theta for x, theta in zip(self.outer, self.params, strict=True)]
        self.comm.all_reduce_mean_(deltas)
        outer_step(self.opt, self.outer, deltas, self.params)
        return True

    def state_dict(self) -> dict:
        return {"outer": [x.clone() for x in self.outer], "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        copy_all_(self.outer, state["outer"])
        self.opt.load_state_dict(state["opt"])
