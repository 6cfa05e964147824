"""Factored Gossip DiLoCo (Hewa Koneputugodage et al., arXiv 2606.22768): DiLoCo's outer
synchronization split into a non-blocking parameter mix (Mix1) and a blocking pseudo-gradient mix
(Mix2). Algorithm as reconstructed in research/diloco_family.md b.2; per round t on worker i:

    start Mix1:  y_i = sum_j W1[i, j] x_j            (non-blocking; runs during the inner steps)
    theta_i <- x_i;  H inner AdamW steps             (start at once from the worker's own x_i)
    Delta_i = x_i - theta_i
    Mix2:        g_i = sum_j W2[i, j] Delta_j        (blocking; only the chosen tensors, the
                                                      others keep g_i = Delta_i)
    wait Mix1
    m_i <- mu m_i + g_i;  x_i <- y_i - gamma (g_i + mu m_i)   (torch SGD, Nesterov)

Nothing from an earlier round enters round t's update, so there is no staleness: the only error
is that worker i's inner phase starts from x_i rather than the mean. With doubly stochastic W1
and W2 the mean of the x_i follows DiLoCo's outer recursion exactly.

Momentum policy "local" keeps m_i on the worker; "mixed" (the paper's GlobalM1S) sends m_i along
with x_i in Mix1, doubling its bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from frugaltrain.comm import Comm, Handle
from frugaltrain.comm.topology import mixing_matrix
from frugaltrain.outer.diloco import copy_all_, outer_sgd, outer_step
from frugaltrain.outer.params import select


class FactoredGossipDiLoCo:
    """Factored Gossip DiLoCo for one worker.

    Args:
        model: this worker's replica (its parameters are theta_i).
        comm: communication endpoint.
        H: inner steps per outer round.
        lr, momentum, nesterov: outer optimizer (defaults as DiLoCo: 0.7, 0.9, Nesterov).
        mix1, mix2: topologies (comm.topology) of the parameter and pseudo-gradient mixes.
        mix2_params: tensors Mix2 covers (outer.params.select).
        momentum_policy: "local" or "mixed".
        codec: encoding of everything sent (comm.compress).
        seed: seeds the random topologies (the same on every worker).
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
        mix1: str = "complete",
        mix2: str = "none",
        mix2_params: str = "all",
        momentum_policy: str = "local",
        codec: str = "fp32",
        seed: int = 0,
    ) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.comm = comm
        self.H = H
        self.mix1, self.mix2 = mix1, mix2
        self.in_mix2 = select(self.names, mix2_params) if mix2 != "none" else []
        self.momentum_policy = momentum_policy
        self.codec = codec
        self.seed = seed
        self.round = 0
        self.outer = [p.detach().clone() for p in self.params]  # x_i
        self.opt = outer_sgd(self.outer, lr, momentum, nesterov)
        self._mix1: tuple[Handle, list[torch.Tensor]] | None = None

    def _momenta(self) -> list[torch.Tensor] | None:
        bufs = [self.opt.state.get(x, {}).get("momentum_buffer") for x in self.outer]
        return None if any(b is None for b in bufs) else bufs

    def before_step(self, step: int) -> None:
        """At a round start, post Mix1 of the round's x_i (and m_i when mixed)."""
        if step % self.H or self._mix1 is not None:
            return
        payload = [x.clone() for x in self.outer]
        momenta = self._momenta() if self.momentum_policy == "mixed" else None
        if momenta is not None:
            payload += [m.clone() for m in momenta]
        w1 = mixing_matrix(self.mix1, len(self.comm.members), self.round, self.seed)
        handle = self.comm.mix_(payload, w1, codec=self.codec, blocking=False)
        self._mix1 = (handle, payload)

    def sync_grads(self) -> None:
        pass

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        if step % self.H:
            return False
        if self._mix1 is None:  # a caller that never calls before_step: mix now, blocking
            self.before_step(step - self.H)
        deltas = [x - theta for x, theta in zip(self.outer, self.params, strict=True)]
        if self.in_mix2:
            chosen = [d for d, keep in zip(deltas, self.in_mix2, strict=True) if keep]
            w2 = mixing_matrix(self.mix2, len(self.comm.members), self.round, self.seed + 1)
            self.comm.mix_(chosen, w2, codec=self.codec)
        handle, mixed = self._mix1
        handle.wait()
        self._mix1 = None
        n = len(self.outer)
        copy_all_(self.outer, mixed[:n])
        if len(mixed) > n:
            copy_all_(self._momenta(), mixed[n:])
        outer_step(self.opt, self.outer, deltas, self.params)
        self.round += 1
        return True

    def state_dict(self) -> dict:
        if self._mix1 is not None:
            raise RuntimeError("checkpoint taken with Mix1 in flight; save at round ends only")
        return {
            "outer": [x.clone() for x in self.outer],
            "opt": self.opt.state_dict(),
            "round": self.round,
        }

    def load_state_dict(self, state: dict) -> None:
        copy_all_(self.outer, state["outer"])
        self.opt.load_state_dict(state["opt"])
        self.round = state["round"]
