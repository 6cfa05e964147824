"""The contract every outer strategy keeps: the calls the training loop, the simulator and
`wrap` make, and what a strategy reports about itself between rounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, kw_only=True)
class Diagnostics:
    """What a strategy reports for the consensus metrics; every strategy answers (ddp with the
    empty values)."""

    momenta: list[torch.Tensor] | None = None
    """The outer momentum buffers m_i, one per parameter; None: none yet (before the first outer
    step) or none at all (ddp, momentum 0)."""
    feedback_norm: float = 0.0
    """Norm of the error feedback not yet sent (0 for a codec that sends everything)."""


class Strategy(Protocol):
    """One worker's outer strategy, driven around every inner step."""

    H: int
    """Inner steps per outer round."""

    def before_step(self, step: int) -> None:
        """Before inner step `step` + 1 (fgd posts its non-blocking Mix1 at a round's start)."""

    def sync_grads(self) -> None:
        """After backward, before the inner optimizer step (ddp all-reduces here)."""

    def after_step(self, step: int) -> bool:
        """After `step` inner steps; True at an outer-round boundary."""

    def diagnostics(self) -> Diagnostics:
        """Outer momenta and error-feedback norm, for the consensus metrics."""

    def state_dict(self) -> dict:
        """Outer parameters, outer optimizer, round counter (taken at a round end)."""

    def load_state_dict(self, state: dict, own: bool = True) -> None:
        """`own`: this worker's checkpoint; otherwise a peer's state (a rejoining worker)."""
