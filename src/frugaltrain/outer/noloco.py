"""NoLoCo (Kolehmainen et al., arXiv 2506.10911): no collective at all. Each round the workers
split into random groups of n (reseeded every round, the same draw everywhere); inside a group
they average pseudo-gradients and pull towards the group's mean outer parameters.

Update (research note a.3, in DiLoCo's sign convention, Delta = phi - theta):

    d_i   <- mu d_i - beta mean_G(Delta_j) + gamma (mean_G(phi_j) - phi_i)
    phi_i <- phi_i + d_i ;  theta_i <- phi_i

Heavy-ball momentum, no look-ahead. We run it through the outer SGD (outer/sgd.py; momentum mu,
no Nesterov, lr beta) with the gradient g = mean_G(Delta_j) - (gamma / beta) (mean_G(phi_j) -
phi_i), which is the same recursion with the momentum buffer scaled by -1/beta. With one group
of everyone and gamma = 0 it is DiLoCo with heavy-ball momentum.
"""

from __future__ import annotations

import torch
from torch import nn

from frugaltrain.comm import Comm
from frugaltrain.comm.topology import groups_matrix
from frugaltrain.outer.round import OuterRound, copy_all_, dense_or_fp32


class NoLoCo(OuterRound):
    """NoLoCo for one worker.

    Args (besides outer.round.OuterRound's, whose lr is beta and momentum mu; public configs:
    0.7 and 0.5; no Nesterov):
        consensus_pull: gamma, the pull towards the group mean (public code: gamma = beta).
        group_size: n, workers per group (public configs: 2).
        param_codec: encoding of the parameters sent for the pull (a dense codec; "":
            outer.codec when dense, else fp32). With a dense codec both travel in one
            exchange; with a sparse one the pseudo-gradients go in a second, with error
            feedback.
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        *,
        lr: float = 0.7,
        momentum: float = 0.5,
        consensus_pull: float = 0.7,
        group_size: int = 2,
        param_codec: str = "",
        **outer,
    ) -> None:
        super().__init__(model, comm, lr=lr, momentum=momentum, nesterov=False, **outer)
        self.lr = lr
        self.pull = consensus_pull
        self.group_size = group_size
        self.param_codec = param_codec or dense_or_fp32(self.codec)

    def exchange(self, deltas: list[torch.Tensor]) -> None:
        """Average the pseudo-gradients in this round's group; fold in the pull to its mean."""
        w = groups_matrix(len(self.comm.members), self.group_size, self.round, self.seed)
        if not self.pull:
            self.comm.mix_(deltas, w, codec=self.codec, feedback=self.feedback("outer"))
            if self.comm.take_rejection():
                for m in self.momenta() or []:
                    m.zero_()
            return
        means = [phi.clone() for phi in self.outer]
        if self.param_codec == self.codec:
            self.comm.mix_(deltas + means, w, codec=self.codec)  # one exchange for both
        else:
            self.comm.mix_(deltas, w, codec=self.codec, feedback=self.feedback("outer"))
            self.comm.mix_(means, w, codec=self.param_codec, op="pull")
        if self.comm.take_rejection():  # the guard judged what this worker sent bad: take the
            copy_all_(self.outer, means)  # group's values, drop its own momentum
            for m in self.momenta() or []:
                m.zero_()
        for d, phi, mean in zip(deltas, self.outer, means, strict=True):
            d.sub_(mean - phi, alpha=self.pull / self.lr)
