"""How far apart the workers are: consensus distance and logit Jensen-Shannon disagreement.

consensus distance  Xi^2 = (1/M) sum_i ||theta_i - theta_bar||^2, in total and per tensor group
                    (embed, blocks, head, other; models.parts.group_of)
momentum spread     (1/M) sum_i ||m_i - m_bar||^2 of the outer momenta (DiLoCo family), which a
                    local momentum policy lets grow up to 1/(1 - mu^2) times a round's spread
logit JS            mean over workers and tokens of JS(p_i || p_bar), where p_i is worker i's
                    next-token distribution and p_bar that of the averaged model, on one fixed
                    held-out batch (natural log; 0 when the workers agree, at most ln 2)

Both need every worker's parameters: the real runtime gets their mean through the comm's
diagnostic (uncounted) reductions at evaluation rounds, the simulator has them all at hand. The
functions here are the per-worker arithmetic both share.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from frugaltrain.models.parts import group_of

GROUPS = ("embed", "blocks", "head", "other")


@torch.no_grad()
def squared_distance(model: torch.nn.Module, mean: list[torch.Tensor]) -> dict[str, float]:
    """||theta_i - theta_bar||^2 of this worker, per tensor group (`mean` in parameter order)."""
    out = dict.fromkeys(GROUPS, 0.0)
    for (name, p), m in zip(model.named_parameters(), mean, strict=True):
        out[group_of(name)] += (p.float() - m).pow(2).sum().item()
    return out


@torch.no_grad()
def spread(tensors: list[torch.Tensor], mean: list[torch.Tensor]) -> float:
    """||t - mean||^2 summed over a list of tensors (one worker's part of a spread)."""
    return sum((t.float() - m).pow(2).sum().item() for t, m in zip(tensors, mean, strict=True))


@torch.no_grad()
def averaged_model(model: torch.nn.Module, mean: list[torch.Tensor]) -> torch.nn.Module:
    """A copy of `model` holding the workers' mean parameters."""
    averaged = copy.deepcopy(model)
    for p, m in zip(averaged.parameters(), mean, strict=True):
        p.copy_(m)
    return averaged


@torch.no_grad()
def logit_js(model: torch.nn.Module, averaged: torch.nn.Module, batch: torch.Tensor) -> float:
    """Mean over tokens of JS(p_model || p_averaged) on `batch` ([B, T] token ids), eval mode."""
    was_training = model.training
    model.eval()
    averaged.eval()
    log_p = F.log_softmax(model(batch)[0].float(), dim=-1)
    log_q = F.log_softmax(averaged(batch)[0].float(), dim=-1)
    model.train(was_training)
    log_m = torch.logaddexp(log_p, log_q) - torch.log(torch.tensor(2.0))
    js = 0.5 * ((log_p.exp() * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1))
    return js.mean().item()
