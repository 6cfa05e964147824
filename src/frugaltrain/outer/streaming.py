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
property Factored Gossip DiLoCo avoids.
"""

from __future__ import annotations

import torch
from torch import nn

from frugaltrain.comm import Comm, Handle
from frugaltrain.outer.diloco import copy_all_, outer_sgd, outer_step
from frugaltrain.outer.params import fragments


class StreamingDiLoCo:
    """Streaming DiLoCo for one worker.

    Args:
        model: this worker's replica.
        comm: communication endpoint.
        H: inner steps between two syncs of the same fragment.
        lr, momentum, nesterov: outer optimizer (one per fragment).
        fragments: P, the number of fragments (strided over blocks, outer.params.fragments).
        overlap: tau, inner steps between sending a fragment and applying it.
        merge_alpha: alpha of the merge.
        codec: encoding of the fragment pseudo-gradients (the paper sends e3m0).
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
        fragments: int = 4,
        overlap: int = 1,
        merge_alpha: float = 0.0,
        codec: str = "fp32",
    ) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        owner = _fragment_of([n for n, _ in named], fragments)
        self.comm = comm
        self.H = H
        self.P = fragments
        self.tau = overlap
        self.alpha = merge_alpha
        self.codec = codec
        self.params = [
            [p for (_, p), f in zip(named, owner, strict=True) if f == k] for k in range(fragments)
        ]
        self.outer = [[p.detach().clone() for p in ps] for ps in self.params]
        self.opts = [outer_sgd(xs, lr, momentum, nesterov) for xs in self.outer]
        self._pending: dict[int, tuple[Handle, list[torch.Tensor]]] = {}

    def before_step(self, step: int) -> None:
        pass

    def sync_grads(self) -> None:
        pass

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        pos = step % self.H or self.H
        for k in range(self.P):
            lands = (k + 1) * self.H // self.P
            if pos == lands - self.tau:
                self._send(k)
            if pos == lands:
                self._land(k)
        return step % self.H == 0

    def _send(self, k: int) -> None:
        deltas = [x - theta for x, theta in zip(self.outer[k], self.params[k], strict=True)]
        handle = self.comm.all_reduce_mean_(deltas, blocking=False, codec=self.codec)
        self._pending[k] = (handle, deltas)

    def _land(self, k: int) -> None:
        handle, deltas = self._pending.pop(k)
        handle.wait()
        outer_step(self.opts[k], self.outer[k], deltas, self.params[k], self.alpha)

    def state_dict(self) -> dict:
        if self._pending:
            raise RuntimeError("checkpoint taken with fragments in flight; save at round ends")
        return {
            "outer": [[x.clone() for x in xs] for xs in self.outer],
            "opts": [opt.state_dict() for opt in self.opts],
        }

    def load_state_dict(self, state: dict) -> None:
        for xs, saved in zip(self.outer, state["outer"], strict=True):
            copy_all_(xs, saved)
        for opt, s in zip(self.opts, state["opts"], strict=True):
            opt.load_state_dict(s)


def _fragment_of(names: list[str], P: int) -> list[int]:
    owner = fragments(names, P)
    empty = sorted(set(range(P)) - set(owner))
    if empty:
        raise ValueError(f"streaming fragments {empty} own no parameter; lower outer.fragments")
    return owner
