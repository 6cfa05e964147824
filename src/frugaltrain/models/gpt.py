"""A small GPT in one file, nanoGPT-style: pre-norm blocks, causal self-attention, GELU MLP.

Sizes span ~0.1M to ~100M parameters by config, e.g. (byte vocabulary, untied head):
    n_layer=2,  n_embd=64,  n_head=4   ->   0.14M   (tests)
    n_layer=2,  n_embd=128, n_head=4   ->   0.48M   (default job)
    n_layer=6,  n_embd=384, n_head=6   ->  10.9M
    n_layer=12, n_embd=768, n_head=12  ->  85.4M
Shapes: B batch, T sequence, C width (n_embd), V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True)
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    vocab_size: int = 256
    block_size: int = 128  # longest sequence the position table covers
    dropout: float = 0.0
    bias: bool = False
    tie_embeddings: bool = False  # untied by default: Mix2 subsets treat embedding and head apart


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        q, k, v = self.qkv(x_BTC).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Parameter names are stable and grouped for tensor subsets: `wte`/`wpe` (embeddings),
    `blocks.{i}.*`, `ln_f`, `head`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the stream stays O(1).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx_BT.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds model block_size {self.cfg.block_size}")
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTC = self.drop(self.wte(idx_BT) + self.wpe(pos_T))
        for block in self.blocks:
            x_BTC = block(x_BTC)
        logits_BTV = self.head(self.ln_f(x_BTC))
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())
        return logits_BTV, loss
