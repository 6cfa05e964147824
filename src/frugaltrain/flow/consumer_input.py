"""What both consumers put in front of their backbone: the projector from the encoder's width to
the backbone's, and a micro-batch's samples packed into one sequence. The tiny consumer
(flow/models.py) and the Llama one (flow/hf.py) share them, so both pack the same way.

Legend: N visual tokens of one sample, T packed tokens of one micro-batch, D backbone width.
"""

from __future__ import annotations

import torch
from torch import nn


def projector(enc_dim: int, dim: int) -> nn.Module:
    """The 2-layer MLP from the encoder's width to the backbone's (on the consumer's side, so it
    trains with a frozen encoder too)."""
    return nn.Sequential(nn.Linear(enc_dim, dim), nn.GELU(), nn.Linear(dim, dim))


def pack_samples(
    embs: list[torch.Tensor], texts: list[torch.Tensor], project: nn.Module, embed: nn.Module
) -> tuple[torch.Tensor, ...]:
    """Samples concatenated, in order, into one sequence [visual | text | visual | text ...]:
    inputs x_TD, positions pos_T (restarting at 0 per sample), segment ids seg_T and targets
    tgt_T (position n_visual + j predicts text token j + 1; everything else is -100)."""
    dev = embs[0].device
    parts, seg, pos, targets = [], [], [], []
    for i, (e_ND, t) in enumerate(zip(embs, texts, strict=True)):
        t = t.to(dev)
        n = e_ND.shape[0] + t.shape[0]
        parts += [project(e_ND), embed(t)]
        seg.append(torch.full((n,), i, device=dev))
        pos.append(torch.arange(n, device=dev))
        tgt = torch.full((n,), -100, dtype=torch.long, device=dev)
        tgt[e_ND.shape[0] : n - 1] = t[1:]
        targets.append(tgt)
    return torch.cat(parts), torch.cat(pos), torch.cat(seg), torch.cat(targets)
