"""Plain data parallel: average gradients over all workers after every backward pass.

The baseline that never lets workers drift: one blocking all-reduce of the full gradient per inner
step. With one worker it is plain single-process training. It has no outer step, so it implements
the strategy calls directly rather than the shared outer round.
"""

from __future__ import annotations

from torch import nn

from frugaltrain.comm import Comm
from frugaltrain.outer.base import Diagnostics


class DDP:
    """Gradient all-reduce every step (synchronous data parallel).

    Args:
        model: this worker's replica (identically initialized on every worker).
        comm: communication endpoint.
        H: steps per logged round; it has no effect on the algorithm.
        seed: unused (every strategy takes one).
    """

    def __init__(self, model: nn.Module, comm: Comm, *, H: int, seed: int = 0) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm = comm
        self.H = H

    def before_step(self, step: int) -> None:
        pass

    def sync_grads(self) -> None:
        """Call after backward, before the inner optimizer step, on every worker."""
        grads = [p.grad for p in self.params if p.grad is not None]
        self.comm.all_reduce_mean_(grads, op="grads")

    def after_step(self, step: int) -> bool:
        """Call after each inner step with the number of steps done; True at a round boundary."""
        return step % self.H == 0

    def diagnostics(self) -> Diagnostics:
        """No outer momentum and nothing held back: the empty report."""
        return Diagnostics()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, own: bool = True) -> None:
        pass
