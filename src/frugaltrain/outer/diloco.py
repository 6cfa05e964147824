"""DiLoCo (Douillard et al., arXiv 2311.08105): H local AdamW steps, then one blocking all-reduce
of the pseudo-gradients and an outer Nesterov step.

Per round t, on every worker i (symbols as in the paper and research/diloco_family.md a.1):
    theta_i <- x;  H inner steps;  Delta_i = x - theta_i
    Delta = mean_i Delta_i                      (blocking all-reduce, counted as blocking time)
    m <- mu m + Delta;  x <- x - gamma (Delta + mu m)   (outer/sgd.py, Nesterov)
Inner AdamW states stay local. All workers hold the same x and m, so the outer step runs
replicated. On failure the all-reduce raises after run.timeout_s.

With a sparse codec (topk) and outer momentum 0 this is SparseLoCo's outer step, up to its
chunking and value format: each worker sends the top-k of its pseudo-gradient plus its error
feedback, and steps with the mean of what was sent.
"""

from __future__ import annotations

import torch

from frugaltrain.outer.round import OuterRound


class DiLoCo(OuterRound):
    """DiLoCo outer loop for one worker (arguments: outer.round.OuterRound; defaults as the
    paper: gamma 0.7, mu 0.9, Nesterov)."""

    def exchange(self, deltas: list[torch.Tensor]) -> None:
        self.comm.all_reduce_mean_(deltas, codec=self.codec, feedback=self.feedback("outer"))
