"""FORGE on a transformers model: a tiny Llama (grouped-query attention, RMSNorm, SwiGLU, untied
or tied head) built by frugaltrain.models.build_model, against torch.optim.AdamW.

Tolerances as for the GPT (tests/forge/test_forge_parity.py): fp64 bit-identical (tile rows a
multiple of 8, so MKL sums each dW row block as the full GEMM does); fp32 asserted at 1e-6
relative because another BLAS may block the GEMM differently (bit-identical on this one).
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import TINY_LLAMA

from frugaltrain.config import Config
from frugaltrain.config.base import build_config
from frugaltrain.forge import ForgeOptimizer, forge_optimizer
from frugaltrain.models import build_model

pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 16, 2
LLAMA = (*TINY_LLAMA, f"model.vocab_size={VOCAB}", f"data.seq_len={SEQ}")


def _llama(dtype: torch.dtype, *sets: str) -> torch.nn.Module:
    return build_model(build_config(Config, {}, [*LLAMA, *sets])).to(dtype)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Next token = 3 x + 1 (mod V): learnable, so the loss falls within the test."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]
    return [(x, (3 * x + 1) % VOCAB) for x in xs]


def _groups(model: torch.nn.Module) -> list[dict]:
    ps = list(model.parameters())
    return [
        {"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
    ]


def _train(model, opt, data) -> list[float]:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    losses = []
    for x, y in data:
        loss = model(x, y)[1]
        losses.append(loss.item())
        if isinstance(opt, ForgeOptimizer):
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tiny_llama_20_steps_match_torch_adamw(dtype):
    a, b = _llama(dtype), _llama(dtype)
    ref = torch.optim.AdamW(_groups(a), lr=3e-3, betas=(0.9, 0.95), foreach=False)
    opt = ForgeOptimizer(b, _groups(b), tile_rows=16, lr=3e-3, betas=(0.9, 0.95))
    assert len(opt._handles) == 2 * 7 + 1 and not opt.fallback  # q k v o gate up down, head
    data = _batches(20)
    losses_a, losses_b = _train(a, ref, data), _train(b, opt, data)
    assert losses_a[-1] < losses_a[0] - 0.1 and losses_b[-1] < losses_b[0] - 0.1
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if dtype == torch.float64:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(q, p, rtol=1e-6, atol=0)
    assert all(p.grad is None for p in b.parameters())


def test_tiny_llama_with_tied_embeddings_falls_back_exactly():
    """The tied head is the embedding's tensor, owned by two modules: it is found when the
    optimizer is built and kept on the hook path (exact), the rest stays fused."""
    a = _llama(torch.float64, "model.tie_embeddings=true")
    b = _llama(torch.float64, "model.tie_embeddings=true")
    assert a.hf.lm_head.weight is a.hf.model.embed_tokens.weight
    ref = torch.optim.AdamW(_groups(a), lr=3e-3, betas=(0.9, 0.95), foreach=False)
    with pytest.warns(UserWarning, match="hf.lm_head.weight"):
        opt = forge_optimizer(b, "adamw", 3e-3, (0.9, 0.95), 1e-8, 0.1, tile_rows=16)
    assert opt.fallback == {"hf.lm_head.weight": "tied or shared with another module"}
    data = _batches(6)
    _train(a, ref, data)
    _train(b, opt, data)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
