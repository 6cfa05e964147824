"""The producer and the consumer: built-in tiny modules, or transformers ones (flow/hf.py).

Tiny ViT encoder (producer) and tiny causal LM backbone with a projector (consumer), the fast
path of the tests; `build_encoder` / `build_consumer` pick them or the transformers modules by
model.encoder and model.backbone.

Legend: B samples of one encoder call, N visual tokens of one sample, T packed tokens of one
micro-batch, P = patch*patch, Dv encoder width, D backbone width, V vocabulary.

Packed micro-batches are one row of concatenated samples [visual | text] with a block-diagonal
causal mask and positions restarting per sample, so a packed micro-batch computes exactly what
the samples computed one by one would (up to float summation order). The loss is a SUM over
caption targets; callers divide by the global batch's target count, so packing never changes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from frugaltrain.flow.consumer_input import pack_samples, projector


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
    """Producer: patches of samples with one tile count [B, N, P] -> embeddings [B, N, Dv]."""

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

    def forward(self, patches_BNP: torch.Tensor) -> torch.Tensor:
        n_tiles = patches_BNP.shape[1] // self.tokens_per_tile
        pos_ND = (self.tile[:n_tiles, None, :] + self.pos[None]).reshape(-1, self.pos.shape[1])
        x = self.embed(patches_BNP) + pos_ND
        for b in self.blocks:
            x = b(x, None)
        return self.ln(x)


class Consumer(nn.Module):
    """Projector + causal LM backbone: packed [visual | text] samples -> summed caption loss."""

    def __init__(
        self, *, enc_dim: int, dim: int, layers: int, heads: int, vocab: int, max_len: int
    ) -> None:
        super().__init__()
        self.projector = projector(enc_dim, dim)
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(max_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def loss_sum(self, embs: list[torch.Tensor], texts: list[torch.Tensor]) -> torch.Tensor:
        """Sum of caption cross-entropies of the samples packed, in order, into one sequence."""
        x_TD, pos_T, seg_T, tgt_T = pack_samples(embs, texts, self.projector, self.tok)
        x = (x_TD + self.pos[pos_T])[None]
        T = seg_T.shape[0]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        mask_TT = causal & (seg_T[:, None] == seg_T[None, :])  # block-diagonal: no leakage
        for b in self.blocks:
            x = b(x, mask_TT)
        logits_TV = self.head(self.ln(x))[0]
        return F.cross_entropy(logits_TV, tgt_T, reduction="sum")


def build_encoder(cfg) -> nn.Module:
    """The producer from the run seed (every process builds bitwise-identical weights)."""
    m, d = cfg.model, cfg.data
    torch.manual_seed(cfg.run.seed)
    if m.encoder == "tiny":
        enc = TinyViT(
            patch_dim=d.patch**2,
            dim=m.enc_dim,
            layers=m.enc_layers,
            heads=m.enc_heads,
            tokens_per_tile=cfg.tokens_per_tile,
            max_tiles=d.max_tiles,
        )
    else:
        from frugaltrain.flow.hf import vision_tower

        enc = vision_tower(cfg)
    return enc.to(getattr(torch, cfg.run.dtype))


def build_consumer(cfg, ds) -> nn.Module:
    """Projector + backbone from the run seed; `ds` (a CaptionSet) sizes the vocabulary and,
    for the tiny backbone, the position table."""
    m = cfg.model
    torch.manual_seed(cfg.run.seed + 1)
    if m.backbone == "tiny":
        cons = Consumer(
            enc_dim=encoder_width(cfg),
            dim=m.lm_dim,
            layers=m.lm_layers,
            heads=m.lm_heads,
            vocab=ds.vocab_size,
            max_len=cfg.slot_tokens + ds.max_text_tokens,
        )
    else:
        from frugaltrain.flow.hf import llama_consumer

        cons = llama_consumer(cfg, ds, encoder_width(cfg))
    return cons.to(getattr(torch, cfg.run.dtype))


def build_models(cfg, ds) -> tuple[nn.Module, nn.Module]:
    """Both modules (see build_encoder and build_consumer)."""
    return build_encoder(cfg), build_consumer(cfg, ds)


def encoder_width(cfg) -> int:
    """d_v: model.enc_dim, or the hidden size of a pretrained tower (read, not loaded)."""
    if cfg.model.encoder_pretrained:
        from frugaltrain.flow.hf import pretrained_config

        config = pretrained_config(cfg.model.encoder_pretrained, "model.encoder_pretrained")
        # a tower's own directory, or a whole SigLIP/CLIP one whose tower config is nested
        return int(config.get("hidden_size") or config["vision_config"]["hidden_size"])
    return cfg.model.enc_dim


def flops_per_token(module: nn.Module) -> int:
    """2 * parameters: the matmul FLOPs of one token's forward (attention scores left out)."""
    return 2 * sum(p.numel() for p in module.parameters())
