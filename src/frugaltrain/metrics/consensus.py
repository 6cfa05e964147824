"""How far apart the workers are: consensus distance and logit Jensen-Shannon disagreement.

consensus distance  Xi^2 = (1/M) sum_i ||theta_i - theta_bar||^2, in total and per tensor group
                    (embed, blocks, head, other; outer.params.group_of)
logit JS            mean over workers and tokens of JS(p_i || p_bar), where p_i is worker i's
                    next-token distribution and p_bar that of the averaged model, on one fixed
                    held-out batch (natural log; 0 when the workers agree, at most ln 2)

Both need every worker's parameters, so they use the comm's diagnostic (uncounted) reductions and
run only at evaluation rounds.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from frugaltrain.comm import Comm
from frugaltrain.outer.params import group_of

GROUPS = ("embed", "blocks", "head", "other")


@torch.no_grad()
def disagreement(model: torch.nn.Module, comm: Comm, batch: torch.Tensor) -> dict[str, float]:
    """Consensus distance (total and per group) and logit JS of this worker set; call on every
    worker at the same point. `batch` is a [B, T] tensor of token ids, the same on every worker."""
    named = list(model.named_parameters())
    mean = comm.metric_mean_tensors([p for _, p in named])
    local = dict.fromkeys(GROUPS, 0.0)
    for (name, p), m in zip(named, mean, strict=True):
        local[group_of(name)] += (p.float() - m).pow(2).sum().item()

    averaged = copy.deepcopy(model)
    for (_, p), m in zip(averaged.named_parameters(), mean, strict=True):
        p.copy_(m)
    was_training = model.training
    model.eval()
    averaged.eval()
    log_p = F.log_softmax(model(batch)[0].float(), dim=-1)
    log_q = F.log_softmax(averaged(batch)[0].float(), dim=-1)
    model.train(was_training)
    log_m = torch.logaddexp(log_p, log_q) - torch.log(torch.tensor(2.0))
    js = 0.5 * ((log_p.exp() * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1))

    values = comm.metric_mean([sum(local.values()), *local.values(), js.mean().item()])
    out = {"consensus/total": values[0]}
    out.update({f"consensus/{g}": v for g, v in zip(GROUPS, values[1:-1], strict=True)})
    out["disagreement/logit_js"] = values[-1]
    return out
