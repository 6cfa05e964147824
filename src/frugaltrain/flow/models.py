"""Tiny ViT encoder (producer) and tiny causal LM backbone with a projector (consumer).

Legend: N visual tokens of one sample, T packed tokens of one micro-batch, P = patch*patch,
Dv encoder width, D backbone width, V vocabulary.

Packed micro-batches are one row of concatenated samples [visual | text] with a block-diagonal
causal mask and positions restarting per sample, so a packed micro-batch computes exactly what
the samples computed one by one would (up to float summation order). The loss is a SUM over
caption targets; callers divide by the global batch's target count, so packing never changes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block; attention honours an optional boolean mask (True = attend)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x_BTD: torch.Tensor, mask_TT: torch.Tensor | None) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(self.ln1(x_BTD)).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask_TT
        )
        x_BTD = x_BTD + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x_BTD + self.mlp(self.ln2(x_BTD))


class TinyViT(nn.Module):
    """Producer: patches of one sample [N, P] -> visual embeddings [N, Dv] (full attention)."""

    def __init__(
        self,
        *,
        patch_dim: int,
        dim: int,
        layers: int,
        heads: int,
        tokens_per_tile: int,
        max_tiles: int,
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(patch_dim, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(tokens_per_tile, dim))
        self.tile = nn.Parameter(0.02 * torch.randn(max_tiles, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.tokens_per_tile = tokens_per_tile

    def forward(self, patches_NP: torch.Tensor) -> torch.Tensor:
        n_tiles = patches_NP.shape[0] // self.tokens_per_tile
        pos_ND = (self.tile[:n_tiles, None, :] + self.pos[None]).reshape(-1, self.pos.shape[1])
        x = (self.embed(patches_NP) + pos_ND)[None]
        for b in self.blocks:
            x = b(x, None)
        return self.ln(x)[0]


class Consumer(nn.Module):
    """Projector + causal LM backbone: packed [visual | text] samples -> summed caption loss."""

    def __init__(
        self, *, enc_dim: int, dim: int, layers: int, heads: int, vocab: int, max_len: int
    ) -> None:
        super().__init__()
        self.projector = nn.Sequential(nn.Linear(enc_dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(max_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def loss_sum(self, embs: list[torch.Tensor], texts: list[torch.Tensor]) -> torch.Tensor:
        """Sum of caption cross-entropies of the samples packed, in order, into one sequence."""
        parts, seg, pos, targets = [], [], [], []
        for i, (e_ND, t) in enumerate(zip(embs, texts, strict=True)):
            n = e_ND.shape[0] + t.shape[0]
            parts += [self.projector(e_ND), self.tok(t)]
            seg.append(torch.full((n,), i))
            pos.append(torch.arange(n))
            # Position n_visual + j predicts text token j + 1; everything else is ignored.
            tgt = torch.full((n,), -100, dtype=torch.long)
            tgt[e_ND.shape[0] : n - 1] = t[1:]
            targets.append(tgt)
        seg_T, pos_T = torch.cat(seg), torch.cat(pos)
        x = (torch.cat(parts) + self.pos[pos_T])[None]
        T = seg_T.shape[0]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask_TT = causal & (seg_T[:, None] == seg_T[None, :])  # block-diagonal: no leakage
        for b in self.blocks:
            x = b(x, mask_TT)
        logits_TV = self.head(self.ln(x))[0]
        return F.cross_entropy(logits_TV, torch.cat(targets), reduction="sum")


def build_models(cfg) -> tuple[TinyViT, Consumer]:
    """Both modules from the run seed, so every process builds bitwise-identical weights."""
    from frugaltrain.flow.data import max_text_tokens, vocab

    dtype = getattr(torch, cfg.run.dtype)
    m, d = cfg.model, cfg.data
    torch.manual_seed(cfg.run.seed)
    enc = TinyViT(
        patch_dim=d.patch**2,
        dim=m.enc_dim,
        layers=m.enc_layers,
        heads=m.enc_heads,
        tokens_per_tile=cfg.tokens_per_tile,
        max_tiles=d.max_tiles,
    )
    torch.manual_seed(cfg.run.seed + 1)
    cons = Consumer(
        enc_dim=m.enc_dim,
        dim=m.lm_dim,
        layers=m.lm_layers,
        heads=m.lm_heads,
        vocab=len(vocab()),
        max_len=cfg.slot_tokens + max_text_tokens(),
    )
    return enc.to(dtype), cons.to(dtype)


def flops_per_token(module: nn.Module) -> int:
    """2 * parameters: the matmul FLOPs of one token's forward (attention scores left out)."""
    return 2 * sum(p.numel() for p in module.parameters())
