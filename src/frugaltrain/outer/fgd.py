"""Factored Gossip DiLoCo (Hewa Koneputugodage et al., arXiv 2606.22768): DiLoCo's outer
synchronization split into a non-blocking parameter mix (Mix1) and a blocking pseudo-gradient mix
(Mix2). Algorithm as reconstructed in research/diloco_family.md b.2; per round t on worker i:

    start Mix1:  y_i = sum_j W1[i, j] x_j            (non-blocking; runs during the inner steps)
    theta_i <- x_i;  H inner AdamW steps             (start at once from the worker's own x_i)
    Delta_i = x_i - theta_i
    Mix2:        g_i = sum_j W2[i, j] Delta_j        (blocking; only the chosen tensors, the
                                                      others keep g_i = Delta_i)
    wait Mix1
    m_i <- mu m_i + g_i;  x_i <- y_i - gamma (g_i + mu m_i)   (outer/sgd.py, Nesterov)

Nothing from an earlier round enters round t's update, so there is no staleness: the only error
is that worker i's inner phase starts from x_i rather than the mean. With doubly stochastic W1
and W2 the mean of the x_i follows DiLoCo's outer recursion exactly.

mix2_delay tau sends Mix2 tau inner steps before the round's end instead of at it (the shared
round's overlap, outer/round.py): Delta_i is taken there, the worker takes its last tau steps
while Mix2 is on the wire and keeps them, and at the round's end steps with the mix.

mix1_delta codes Mix1 as DiLoCo codes its outer gradient. With a complete Mix1 every worker
ends a Mix1 holding the same mean a, so it sends x_i - a (its last outer update, small, like a
pseudo-gradient) with error feedback instead of x_i, and takes y = a + mean(sent): a lossy
param_codec then costs what it costs on pseudo-gradients, not what it costs on parameters. Each
worker's own contribution is what it sent, so a stays the same on every worker.

Momentum policy "local" keeps m_i on the worker; "mixed" (the paper's GlobalM1S) sends m_i along
with x_i in Mix1, doubling its bytes; "reset" clears m_i before every outer step (an ablation:
no momentum carried across rounds). Two more ablation switches: mix1_weight alpha takes only part
of Mix1 (y_i = (1 - alpha) x_i + alpha (W1 x)_i), and mix2_momentum mixes the chosen tensors'
momentum in Mix2 too, i.e. their post-momentum update instead of the raw pseudo-gradient.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from frugaltrain.codecs.feedback import ErrorFeedback
from frugaltrain.comm import Comm, Handle
from frugaltrain.comm.topology import mixing_matrix
from frugaltrain.models.parts import select
from frugaltrain.outer.round import EarlyExchange, OuterRound, copy_all_, dense_or_fp32


class FactoredGossipDiLoCo(OuterRound):
    """Factored Gossip DiLoCo for one worker.

    Args (besides outer.round.OuterRound's):
        mix1, mix2: topologies (comm.topology) of the parameter and pseudo-gradient mixes.
        mix2_params: tensors Mix2 covers (models.parts.select); every part must select one.
        momentum_policy: "local", "mixed" or "reset".
        mix1_weight: alpha, the share of Mix1 a worker takes.
        mix2_momentum: Mix2 also mixes the chosen tensors' momentum.
        mix2_delay: Mix2 is sent this many inner steps before the round's end (above).
        param_codec: Mix1's encoding (a dense codec; "": outer.codec when dense, else fp32).
        mix1_delta: Mix1 sends x_i less the last Mix1 mean, with error feedback (above); needs
            a complete Mix1 taken whole.
        The pseudo-gradients of Mix2 go in `codec`, sparse ones with error feedback.
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        *,
        mix1: str = "complete",
        mix2: str = "none",
        mix2_params: str = "all",
        momentum_policy: str = "local",
        mix1_weight: float = 1.0,
        mix2_momentum: bool = False,
        mix2_delay: int = 0,
        param_codec: str = "",
        mix1_delta: bool = False,
        **outer,
    ) -> None:
        super().__init__(model, comm, **outer)
        self.mix1, self.mix2 = mix1, mix2
        chosen = select(self.names, mix2_params)  # checked even when unused: a typo is refused
        self.in_mix2 = chosen if mix2 != "none" else []
        self.momentum_policy = momentum_policy
        self.mix1_weight = mix1_weight
        self.mix2_momentum = mix2_momentum
        self.overlap = mix2_delay if self.in_mix2 else 0  # a delayed Mix2 (outer/round.py)
        self.param_codec = param_codec or dense_or_fp32(self.codec)
        self._mix1: tuple[Handle, list[torch.Tensor]] | None = None
        self.mix1_delta = mix1_delta
        self._anchor: list[torch.Tensor] | None = None  # the last Mix1 mean (mix1_delta)

    def start_round(self) -> None:
        """Post Mix1 of the round's x_i (and m_i when mixed)."""
        if self._mix1 is not None:
            return
        if self.mix1_delta:
            if self._anchor is None:  # round 0: every replica starts from the same x
                self._anchor = [x.clone() for x in self.outer]
            payload = [x - a for x, a in zip(self.outer, self._anchor, strict=True)]
        else:
            payload = [x.clone() for x in self.outer]
        momenta = self.momenta() if self.momentum_policy == "mixed" else None
        if momenta is not None:
            payload += [m.clone() for m in momenta]
        n = len(self.comm.members)
        w1 = mixing_matrix(self.mix1, n, self.round, self.seed)
        if self.mix1_weight < 1:
            w1 = (1 - self.mix1_weight) * np.eye(n) + self.mix1_weight * w1
        handle = self.comm.mix_(
            payload,
            w1,
            codec=self.param_codec,
            feedback=self.feedback("mix1"),
            blocking=False,
            op="mix1",
        )
        self._mix1 = (handle, payload)

    def feedback(self, op: str) -> ErrorFeedback | None:
        """Mix1's error feedback when it sends deltas (whatever its codec), else the base's."""
        if op == "mix1":
            return self.feedbacks.setdefault(op, ErrorFeedback()) if self.mix1_delta else None
        return super().feedback(op)

    def _w2(self) -> np.ndarray:
        """This round's Mix2 matrix (seeded apart from Mix1's)."""
        return mixing_matrix(self.mix2, len(self.comm.members), self.round, self.seed + 1)

    def _idx(self) -> list[int]:
        """The indices of the tensors Mix2 covers."""
        return [k for k, keep in enumerate(self.in_mix2) if keep]

    def early_indices(self) -> list[int]:
        return self._idx()

    def send_early(self) -> EarlyExchange:
        """Mix2 of the chosen pseudo-gradients (and momenta, with mix2_momentum), posted."""
        idx = self._idx()
        mixed = [self.outer[k] - self.params[k] for k in idx]
        if self.mix2_momentum and self.momenta() is not None:
            mixed += [self.momenta()[k].clone() for k in idx]
        w2 = self._w2()
        handle = self.comm.mix_(
            mixed, w2, codec=self.codec, feedback=self.feedback("mix2"), blocking=False, op="mix2"
        )
        return self.early_exchange(mixed, handle)

    def _land_mix2(self, deltas: list[torch.Tensor]) -> None:
        """The delayed Mix2 replaces the chosen pseudo-gradients (and momenta, with
        mix2_momentum); the tensors it left out keep the whole round's Delta_i."""
        early = self._early
        early.land(deltas)
        if len(early.sent) > len(early.indices):
            momenta = self.momenta()
            for k, g in zip(early.indices, early.sent[len(early.indices) :], strict=True):
                momenta[k].copy_(g)

    def exchange(self, deltas: list[torch.Tensor]) -> None:
        """Mix2 on the chosen pseudo-gradients, then take Mix1's result as x_i (and m_i)."""
        if self._mix1 is None:  # a caller that never calls before_step: mix now, blocking
            self.start_round()
        if self._early is not None:
            self._land_mix2(deltas)
        elif self.in_mix2:
            self._mix2(deltas)
        handle, mixed = self._mix1
        handle.wait()
        self._mix1 = None
        if self.mix1_delta:  # y = a + mean(sent), the next anchor
            for a, z in zip(self._anchor, mixed, strict=True):
                a.add_(z)
            mixed = self._anchor
        n = len(self.outer)
        copy_all_(self.outer, mixed[:n])
        if len(mixed) > n:
            copy_all_(self.momenta(), mixed[n:])
        if self.comm.take_rejection():  # the guard judged what this worker sent bad
            self._resync(deltas)
        if self.momentum_policy == "reset" and self.momenta() is not None:
            for m in self.momenta():
                m.zero_()

    def _resync(self, deltas: list[torch.Tensor]) -> None:
        """After the guard rejected this worker's contribution, it keeps only what its peers
        sent: x_i is already their mix, its unmixed pseudo-gradients and its outer momentum
        (built from what it sent) are dropped."""
        mixed = self.in_mix2 or [False] * len(deltas)
        for d, keep in zip(deltas, mixed, strict=True):
            if not keep:
                d.zero_()
        for m in self.momenta() or []:
            m.zero_()

    def _mix2(self, deltas: list[torch.Tensor]) -> None:
        chosen = [d for d, keep in zip(deltas, self.in_mix2, strict=True) if keep]
        momenta = self.momenta() if self.mix2_momentum else None
        if momenta is not None:
            chosen += [m for m, keep in zip(momenta, self.in_mix2, strict=True) if keep]
        w2 = self._w2()
        self.comm.mix_(chosen, w2, codec=self.codec, feedback=self.feedback("mix2"), op="mix2")

    def state_dict(self) -> dict:
        if self._mix1 is not None or self._early is not None:
            raise RuntimeError("checkpoint taken with a mix in flight; save at round ends only")
        state = super().state_dict()
        if self.mix1_delta and self._anchor is not None:
            state["mix1_anchor"] = [a.clone() for a in self._anchor]
        return state

    def load_state_dict(self, state: dict, own: bool = True) -> None:
        """A peer's Mix1 anchor is everyone's, so a rejoining worker takes it too."""
        super().load_state_dict(state, own)
        anchor = state.get("mix1_anchor")
        if self.mix1_delta and anchor is None and self.round > 0:
            raise ValueError(
                "outer.fgd.mix1_delta = True: the checkpoint holds no Mix1 anchor (it was written "
                "without mix1_delta); resume with outer.fgd.mix1_delta = false"
            )
        self._anchor = [a.clone() for a in anchor] if self.mix1_delta and anchor else None
        self._early = None
