"""Error feedback for codecs that send only part of a payload, the sparse ones, 2bit and 1bit
(SparseLoCo; Karimireddy et al., "Error Feedback Fixes SignSGD"): what a worker did not send of
one operation's payload is added to that operation's next payload, so nothing is lost, only
delayed. In a reduce-scatter average the chunk mean a worker codes again has its own residual
(`of_mean`).

Per round t, on one worker, with payload p_t (its flat pseudo-gradient) and decay beta:

    a_t = p_t + beta e_(t-1)      what the worker would like to send
    s_t = C(a_t)                  what the sparse codec sends (and the worker counts as its own)
    e_t = a_t - s_t               kept for the next round

With beta = 1, s_1 + ... + s_R + e_R = p_1 + ... + p_R exactly (up to fp32 rounding). The
residual is this worker's alone: a checkpoint keeps it; a restarted worker that takes a peer's
state starts from zero (the dead worker's unsent part died with it; taking the peer's would
send the peer's twice).
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """The unsent residual e of one operation's payload (a flat fp32 tensor, or None before the
    first round)."""

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = decay
        self.residual: torch.Tensor | None = None
        self._mean: ErrorFeedback | None = None

    def of_mean(self) -> ErrorFeedback:
        """The feedback of the mean this worker codes in a reduce-scatter average (its chunk's
        mean, coded again for the all-gather): that coding's unsent rest, carried likewise."""
        if self._mean is None:
            self._mean = ErrorFeedback(self.decay)
        return self._mean

    def compensate(self, flat: torch.Tensor) -> torch.Tensor:
        """a = p + beta e: the payload with what earlier rounds did not send."""
        if self.residual is None or self.decay == 0:
            return flat
        if self.residual.numel() != flat.numel():
            raise ValueError(
                f"error feedback holds {self.residual.numel()} values, the payload has "
                f"{flat.numel()}: one ErrorFeedback per operation"
            )
        return flat.add(self.residual, alpha=self.decay)

    def keep(self, unsent: torch.Tensor) -> None:
        """e = a - s, after sending s."""
        self.residual = unsent if self.decay > 0 else None

    def reset(self) -> None:
        self.residual = None
        self._mean = None

    def norm(self) -> float:
        own = 0.0 if self.residual is None else float(self.residual.norm())
        return own if self._mean is None else (own**2 + self._mean.norm() ** 2) ** 0.5

    def state_dict(self) -> dict:
        state = {"residual": None if self.residual is None else self.residual.clone()}
        if self._mean is not None:
            state["mean"] = self._mean.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        residual = state["residual"]
        self.residual = None if residual is None else residual.clone()
        self._mean = None
        if "mean" in state:
            self.of_mean().load_state_dict(state["mean"])
