"""The outer round every DiLoCo-family strategy shares, written once (research note a.1).

Per round, on every worker i, with outer parameters x_i and inner parameters theta_i:

    start_round()                 at the round's first step (fgd posts its non-blocking Mix1)
    H inner steps                 the training loop moves theta_i
    Delta_i = x_i - theta_i       the pseudo-gradient
    exchange(Delta)               the strategy's communication: an all-reduce, a gossip mix, ...
    x_i <- outer step with Delta  SGD with (Nesterov) momentum mu and learning rate gamma
                                  (outer/sgd.py)
    theta_i <- x_i                the next round starts from the result

A strategy may send its exchange tau = `overlap` inner steps before the round's end
(`send_early`), on the pseudo-gradient of the steps so far, and take the last tau steps while it
is on the wire, as Streaming DiLoCo sends a fragment tau steps before it lands. At the round's
end it steps with what arrived, and where Streaming discards those tau steps (theta_i <- x_i),
here the worker keeps them: theta_i <- x_i + (theta_i - theta_i at the send), so they count in
the next round's Delta_i. Only those tau steps are stale, never a round's average.

A strategy file holds only what makes it different: its exchange, its momentum policy, and (for
Streaming DiLoCo) its schedule. The training loop and the simulator drive every strategy through
the same calls (outer.base.Strategy): `before_step`, `sync_grads`, `after_step`, `diagnostics`,
`state_dict`, `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from frugaltrain.codecs.feedback import ErrorFeedback
from frugaltrain.codecs.grammar import keeps_residual
from frugaltrain.comm import Comm, Handle
from frugaltrain.outer.base import Diagnostics
from frugaltrain.outer.sgd import OuterSGD


@torch.no_grad()
def outer_step(
    opt: OuterSGD,
    indices: Iterable[int],
    pseudo_grads: list[torch.Tensor],
    inner: list[torch.Tensor],
    merge_alpha: float = 0.0,
) -> None:
    """One outer step of the outer parameters at `indices` with their pseudo-gradients, then
    restart the matching inner parameters from the result (theta <- alpha theta + (1-alpha) x;
    alpha = 0 copies, bit for bit). The other outer parameters and their momenta stay."""
    indices = list(indices)
    opt.step(indices, pseudo_grads)
    for i, theta in zip(indices, inner, strict=True):
        x = opt.params[i]
        if merge_alpha:
            theta.mul_(merge_alpha).add_(x, alpha=1 - merge_alpha)
        else:
            theta.copy_(x)


def dense_or_fp32(codec: str) -> str:
    """The codec for parameter traffic: `codec` if it sends everything, else fp32 (top-k, 2bit
    and 1bit cannot thin parameters: they lean on error feedback, which a mix of parameters
    has not)."""
    return "fp32" if keeps_residual(codec) else codec


@torch.no_grad()
def copy_all_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


@dataclass
class EarlyExchange:
    """A round's exchange sent `overlap` steps before the round's end, in flight."""

    handle: Handle
    sent: list[torch.Tensor]
    """What was sent; the exchange's result once `handle` is waited on. Its first
    len(indices) tensors are the pseudo-gradients of the parameters at `indices`."""
    indices: list[int]
    theta: list[torch.Tensor]
    """Those parameters at the send."""

    def land(self, deltas: list[torch.Tensor]) -> None:
        """Wait, and make the result the pseudo-gradients the round steps with."""
        self.handle.wait()
        for k, g in zip(self.indices, self.sent, strict=False):
            deltas[k].copy_(g)


class OuterRound:
    """The shared round of the DiLoCo family; subclasses implement `exchange`.

    Args:
        model: this worker's replica; its trainable parameters are theta_i.
        comm: communication endpoint.
        H: inner steps per outer round.
        lr: outer learning rate gamma.
        momentum: outer momentum mu.
        nesterov: Nesterov look-ahead.
        seed: seeds what a strategy draws at random (topologies, groups); the same everywhere.
        codec: encoding of the pseudo-gradients sent (comm.compress).
        feedback_decay: a codec's error feedback (top-k, 2bit, 1bit) carries this much of
            what was not sent into the next round (comm.feedback).
        coded_average: how the comm moves an average under a dense codec (Comm.coded_average:
            all_gather or reduce_scatter); it is the run's choice, set on the comm here.
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
        seed: int = 0,
        codec: str = "fp32",
        feedback_decay: float = 1.0,
        coded_average: str = "all_gather",
    ) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.comm = comm
        comm.coded_average = coded_average
        self.H = H
        self.seed = seed
        self.round = 0
        self.outer = [p.detach().clone() for p in self.params]  # x_i
        self.opt = OuterSGD(self.outer, lr, momentum, nesterov)
        self.codec = codec
        self.feedback_decay = feedback_decay
        self.feedbacks: dict[str, ErrorFeedback] = {}  # per operation, sparse codecs only
        self.overlap = 0  # tau; a strategy that sends early sets it and implements send_early
        self._early: EarlyExchange | None = None

    # ---- what a strategy overrides
    def start_round(self) -> None:
        """At the first inner step of a round."""

    def exchange(self, deltas: list[torch.Tensor]) -> None:
        """Turn this worker's pseudo-gradients into the ones it steps with (in place); may also
        replace the outer parameters (gossip). With an exchange sent early, land it here."""
        raise NotImplementedError

    def send_early(self) -> EarlyExchange:
        """Post the round's exchange `overlap` steps before the round's end, non-blocking."""
        raise NotImplementedError

    # ---- the round, driven by the training loop
    def before_step(self, step: int) -> None:
        """Before inner step `step` + 1."""
        if step % self.H == 0:
            self.start_round()

    def sync_grads(self) -> None:
        """After backward, before the inner optimizer step: nothing in the DiLoCo family."""

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        """After `step` inner steps; sends an early exchange `overlap` steps before a round's
        end, runs the outer round every H and returns True then."""
        if self.overlap and step % self.H == self.H - self.overlap:
            self._early = self.send_early()
        if step % self.H:
            return False
        kept = []  # (parameter index, its steps since an early send), added back after the step
        if self._early is not None:
            sent = zip(self._early.indices, self._early.theta, strict=True)
            kept = [(k, self.params[k] - theta) for k, theta in sent]
        deltas = [x - theta for x, theta in zip(self.outer, self.params, strict=True)]
        self.exchange(deltas)
        self._early = None
        outer_step(self.opt, range(len(deltas)), deltas, self.params)
        for k, steps in kept:
            self.params[k].add_(steps)
        self.round += 1
        return True

    def early_exchange(self, sent: list[torch.Tensor], handle: Handle) -> EarlyExchange:
        """The early exchange of `handle`, whose `sent` leads with the pseudo-gradients of the
        parameters it covers (`early_indices`), taken now."""
        idx = self.early_indices()
        return EarlyExchange(handle, sent, idx, [self.params[k].detach().clone() for k in idx])

    def early_indices(self) -> list[int]:
        """The parameters an early exchange covers (all of them unless a strategy says)."""
        return list(range(len(self.params)))

    def feedback(self, op: str) -> ErrorFeedback | None:
        """The error feedback of operation `op` under a codec that keeps a residual (None for
        one that sends everything)."""
        if not keeps_residual(self.codec):
            return None
        return self.feedbacks.setdefault(op, ErrorFeedback(self.feedback_decay))

    def feedback_norm(self) -> float:
        """Norm of everything not yet sent (0 for a codec that sends everything)."""
        return sum(f.norm() ** 2 for f in self.feedbacks.values()) ** 0.5

    def momenta(self) -> list[torch.Tensor] | None:
        """The outer momentum buffers m_i, or None before the first outer step."""
        bufs = self.opt.momenta
        return None if any(b is None for b in bufs) else list(bufs)

    def diagnostics(self) -> Diagnostics:
        return Diagnostics(momenta=self.momenta(), feedback_norm=self.feedback_norm())

    def state_dict(self) -> dict:
        """Outer parameters, outer optimizer, round counter and error feedback (taken at a round
        end)."""
        if self._early is not None:
            raise RuntimeError("checkpoint taken with an exchange in flight; save at round ends")
        return {
            "outer": [x.clone() for x in self.outer],
            "opt": self.opt.state_dict(),
            "round": self.round,
            "feedback": {op: f.state_dict() for op, f in self.feedbacks.items()},
        }

    def load_state_dict(self, state: dict, own: bool = True) -> None:
        """`own`: this worker's checkpoint. A peer's state (a restarted worker rejoining) gives
        everything but the error feedback, which starts empty (codecs/feedback.py says why)."""
        copy_all_(self.outer, state["outer"])
        self._early = None
        self.opt.load_state_dict(state["opt"])
        self.round = state["round"]
        self.feedbacks.clear()
        for op, fb in state.get("feedback", {}).items() if own else ():
            self.feedback(op).load_state_dict(fb)
