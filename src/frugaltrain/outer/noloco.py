"""NoLoCo (Kolehmainen et al., arXiv 2506.10911): no collective at all. Each round the workers
split into random groups of n (reseeded every round, the same draw everywhere); inside a group
they average pseudo-gradients and pull towards the group's mean outer parameters.

Update (research note a.3, in DiLoCo's sign convention, Delta = phi - theta):

    d_i   <- mu d_i - beta mean_G(Delta_j) + gamma (mean_G(phi_j) - phi_i)
    phi_i <- phi_i + d_i ;  theta_i <- phi_i

Heavy-ball momentum, no look-ahead. We run it through torch's SGD (momentum mu, no Nesterov,
lr beta) with the gradient g = mean_G(Delta_j) - (gamma / beta) (mean_G(phi_j) - phi_i), which is
the same recursion with the momentum buffer scaled by -1/beta. With one group of everyone and
gamma = 0 it is DiLoCo with heavy-ball momentum.
"""

from __future__ import annotations

import torch
from torch import nn

from frugaltrain.comm import Comm
from frugaltrain.comm.topology import groups_matrix
from frugaltrain.outer.diloco import copy_all_, outer_sgd, outer_step


class NoLoCo:
    """NoLoCo for one worker.

    Args:
        model: this worker's replica.
        comm: communication endpoint.
        H: inner steps per outer round.
        lr: beta, the step on the group-mean pseudo-gradient (public configs: 0.7).
        momentum: mu (public configs: 0.5).
        consensus_pull: gamma, the pull towards the group mean (public code: gamma = beta).
        group_size: n, workers per group (public configs: 2).
        codec: encoding of what is sent.
        seed: seeds the groups.
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        *,
        H: int,
        lr: float = 0.7,
        momentum: float = 0.5,
        consensus_pull: float = 0.7,
        group_size: int = 2,
        codec: str = "fp32",
        seed: int = 0,
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm = comm
        self.H = H
        self.lr = lr
        self.pull = consensus_pull
        self.group_size = group_size
        self.codec = codec
        self.seed = seed
        self.round = 0
        self.outer = [p.detach().clone() for p in self.params]  # phi_i
        self.opt = outer_sgd(self.outer, lr, momentum, nesterov=False)

    def before_step(self, step: int) -> None:
        pass

    def sync_grads(self) -> None:
        pass

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        if step % self.H:
            return False
        n = len(self.comm.members)
        w = groups_matrix(n, self.group_size, self.round, self.seed)
        deltas = [phi - theta for phi, theta in zip(self.outer, self.params, strict=True)]
        if self.pull:
            means = [phi.clone() for phi in self.outer]
            self.comm.mix_(deltas + means, w, codec=self.codec)  # one exchange for both
            for d, phi, mean in zip(deltas, self.outer, means, strict=True):
                d.sub_(mean - phi, alpha=self.pull / self.lr)
        else:
            self.comm.mix_(deltas, w, codec=self.codec)
        outer_step(self.opt, self.outer, deltas, self.params)
        self.round += 1
        return True

    def state_dict(self) -> dict:
        return {
            "outer": [x.clone() for x in self.outer],
            "opt": self.opt.state_dict(),
            "round": self.round,
        }

    def load_state_dict(self, state: dict) -> None:
        copy_all_(self.outer, state["outer"])
        self.opt.load_state_dict(state["opt"])
        self.round = state["round"]
