"""Models the strategies train: the built-in GPT (models/gpt.py) and named model parts
(models/parts.py: embed, blocks, head), which Mix2 subsets, Streaming fragments and the
consensus metrics address."""

from __future__ import annotations

import torch

from frugaltrain.config import Config
from frugaltrain.models.gpt import GPT, GPTConfig


def build_model(cfg: Config) -> GPT:
    """The model of `cfg`, initialized from run.seed (the same on every worker: DiLoCo needs
    one shared starting point)."""
    m = cfg.model
    torch.manual_seed(cfg.run.seed)
    return GPT(
        GPTConfig(
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_embd=m.n_embd,
            vocab_size=m.vocab_size,
            block_size=cfg.data.seq_len,
            dropout=m.dropout,
            bias=m.bias,
            tie_embeddings=m.tie_embeddings,
        )
    )


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of `model` over `batches`, in eval mode (dropout off); restores the mode."""
    was_training = model.training
    model.eval()
    total = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
    model.train(was_training)
    return total


__all__ = ["GPT", "GPTConfig", "build_model", "evaluate"]
