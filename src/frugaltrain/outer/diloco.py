"""DiLoCo (Douillard et al., arXiv 2311.08105): H local AdamW steps, then one blocking all-reduce
of the pseudo-gradients and an outer Nesterov step.

Per round t, on every worker i (symbols as in the paper and research/diloco_family.md a.1):
    theta_i <- x;  H inner steps;  Delta_i = x - theta_i
    Delta = mean_i Delta_i                      (blocking all-reduce, counted as blocking time)
    m <- mu m + Delta;  x <- x - gamma (Delta + mu m)   (outer/sgd.py, Nesterov)
Inner AdamW states stay local. All workers hold the same x and m, so the outer step runs
replicated. On failure the all-reduce raises after run.timeout_s.

With overlap tau the all-reduce is sent tau inner steps before the round's end and overlaps
them; those steps are kept (outer/round.py). With a 4-bit codec averaged as a reduce-scatter
this is the default job: at tau = 1 it blocks only for what the last step did not hide.

With a sparse codec (topk) and outer momentum 0 this is SparseLoCo's outer step, up to its
chunking and value format: each worker sends the top-k of its pseudo-gradient plus its error
feedback, and steps with the mean of what was sent.
"""

from __future__ import annotations

import torch
from torch import nn

from frugaltrain.comm import Comm
from frugaltrain.outer.round import EarlyExchange, OuterRound


class DiLoCo(OuterRound):
    """DiLoCo outer loop for one worker (arguments: outer.round.OuterRound, and `overlap`: tau,
    the inner steps between sending the round's average and applying it; defaults as the
    paper: gamma 0.7, mu 0.9, Nesterov, tau 0)."""

    def __init__(self, model: nn.Module, comm: Comm, *, overlap: int = 0, **outer) -> None:
        super().__init__(model, comm, **outer)
        self.overlap = overlap

    def send_early(self) -> EarlyExchange:
        sent = [x - theta for x, theta in zip(self.outer, self.params, strict=True)]
        handle = self.comm.all_reduce_mean_(
            sent, blocking=False, codec=self.codec, feedback=self.feedback("outer")
        )
        return self.early_exchange(sent, handle)

    def exchange(self, deltas: list[torch.Tensor]) -> None:
        if self._early is not None:
            self._early.land(deltas)
        else:
            self.comm.all_reduce_mean_(deltas, codec=self.codec, feedback=self.feedback("outer"))
