"""Streaming DiLoCo (Douillard et al., arXiv 2501.18512): the parameters are split into P
fragments that synchronize at staggered offsets, each once per H steps, so the peak burst is 1/P
of DiLoCo's; each fragment's all-reduce overlaps tau inner steps (research note a.2).

Schedule inside a round of H steps (positions 1..H): fragment p is sent at position
(p+1) H/P - tau and lands (outer step + merge) at (p+1) H/P. The last fragment lands at the round
boundary, so nothing is in flight when a round ends (checkpoints stay exact), and P = 1, tau = 0
is DiLoCo. On landing, with the globally averaged fragment pseudo-gradient Delta_p:

    x_p <- outer Nesterov step of x_p with Delta_p
    theta_p <- alpha theta_p + (1 - alpha) x_p       (alpha = 0: replace; the tau local steps
                                                      on that fragment are discarded)

Delta_p was computed tau steps before it is applied: Streaming DiLoCo has temporal staleness, the
property Factored Gossip DiLoCo avoids. Only the schedule differs from the shared round
(outer.round): each fragment is a round of its own over its slice of the parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from frugaltrain.comm import Comm, Handle
from frugaltrain.config import ConfigError
from frugaltrain.models.parts import fragments
from frugaltrain.outer.round import OuterRound, outer_step


class StreamingDiLoCo(OuterRound):
    """Streaming DiLoCo for one worker.

    Args (besides outer.round.OuterRound's; H is the steps between two syncs of a fragment):
        fragments: P, the number of fragments (strided over blocks, models.parts.fragments).
        overlap: tau, inner steps between sending a fragment and applying it.
        merge_alpha: alpha of the merge.
        codec: encoding of the fragment pseudo-gradients (the paper sends e3m0).
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        *,
        fragments: int = 4,
        overlap: int = 1,
        merge_alpha: float = 0.0,
        **outer,
    ) -> None:
        super().__init__(model, comm, **outer)
        owner = self.fragment_of(self.names, fragments)
        self.P = fragments
        self.tau = overlap
        self.alpha = merge_alpha
        self.fragment_idx = [[i for i, f in enumerate(owner) if f == k] for k in range(fragments)]
        self._pending: dict[int, tuple[Handle, list[torch.Tensor]]] = {}

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        pos = step % self.H or self.H
        for k in range(self.P):
            lands = (k + 1) * self.H // self.P
            if pos == lands - self.tau:
                self._send(k)
            if pos == lands:
                self._land(k)
        if step % self.H:
            return False
        self.round += 1
        return True

    def _slice(self, k: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [tensors[i] for i in self.fragment_idx[k]]

    def _send(self, k: int) -> None:
        outer, inner = self._slice(k, self.outer), self._slice(k, self.params)
        deltas = [x - theta for x, theta in zip(outer, inner, strict=True)]
        handle = self.comm.all_reduce_mean_(
            deltas,
            blocking=False,
            codec=self.codec,
            feedback=self.feedback(f"fragment{k}"),
            op=f"fragment{k}",
        )
        self._pending[k] = (handle, deltas)

    def _land(self, k: int) -> None:
        handle, deltas = self._pending.pop(k)
        handle.wait()
        inner = self._slice(k, self.params)
        outer_step(self.opt, self.fragment_idx[k], deltas, inner, self.alpha)

    @staticmethod
    def fragment_of(names: list[str], P: int) -> list[int]:
        """The fragment of each parameter (models.parts.fragments); every fragment owns one."""
        owner = fragments(names, P)
        empty = sorted(set(range(P)) - set(owner))
        if empty:
            raise ConfigError(
                f"outer.streaming.fragments = {P}: fragments {empty} own no parameter; lower "
                "outer.streaming.fragments"
            )
        return owner

    def state_dict(self) -> dict:
        if self._pending:
            raise RuntimeError("checkpoint taken with fragments in flight; save at round ends")
        return super().state_dict()
