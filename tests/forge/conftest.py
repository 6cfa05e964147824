"""Shared pieces of the FORGE tests: a tiny GPT, a batch stream, and reference optimizers."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from frugaltrain.models.gpt import GPT, GPTConfig

VOCAB, T, B = 64, 16, 2


class LionReference(torch.optim.Optimizer):
    """Lion (arXiv 2302.06675) written plainly, as the parity reference (no torch.optim Lion)."""

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * wd)
                p.add_(torch.lerp(m, p.grad, 1 - b1).sign_(), alpha=-lr)
                m.lerp_(p.grad, 1 - b2)


def make_gpt(dtype=torch.float64, tie: bool = False, seed: int = 0, n_layer: int = 2) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(
        n_layer=n_layer, n_head=2, n_embd=32, vocab_size=VOCAB, block_size=T, tie_embeddings=tie
    )
    return GPT(cfg).to(dtype)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g))
        for _ in range(n)
    ]


def learnable_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Next token = a fixed function of the current one, so the loss can fall in a few steps."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, VOCAB, (B, T), generator=g) for _ in range(n)]
    return [(x, (3 * x + 1) % VOCAB) for x in xs]


def groups(model: torch.nn.Module, wd: float) -> list[dict]:
    """Decay on matrices, none on vectors (the training loop's split)."""
    ps = [p for p in model.parameters()]
    return [
        {"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
        {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
    ]


def reference(rule: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    if rule == "adamw":
        return torch.optim.AdamW(groups(model, 0.1), lr=lr, betas=(0.9, 0.95), foreach=False)
    if rule == "sgd":
        return torch.optim.SGD(groups(model, 0.01), lr=lr, momentum=0.9, foreach=False)
    return LionReference(groups(model, 0.1), lr=lr, betas=(0.9, 0.99))


HYPER = {
    "adamw": {"lr": 3e-3, "betas": (0.9, 0.95)},
    "sgd": {"lr": 3e-2, "momentum": 0.9},
    "lion": {"lr": 3e-4, "betas": (0.9, 0.99)},
}
WD = {"adamw": 0.1, "sgd": 0.01, "lion": 0.1}


def forge_groups(model: torch.nn.Module, rule: str) -> list[dict]:
    return groups(model, WD[rule])


def twin(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def backward(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """The training backward of either arm: opt.backward(loss) for FORGE (the only backward in
    which it updates), loss.backward() for torch.optim."""
    from frugaltrain.forge import ForgeOptimizer

    if isinstance(opt, ForgeOptimizer):
        opt.backward(loss)
    else:
        loss.backward()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture
def kit() -> types.SimpleNamespace:
    """The helpers above, handed to tests as a fixture (tests never import each other)."""
    return types.SimpleNamespace(
        HYPER=HYPER,
        backward=backward,
        LionReference=LionReference,
        batches=batches,
        learnable_batches=learnable_batches,
        forge_groups=forge_groups,
        make_gpt=make_gpt,
        reference=reference,
        twin=twin,
    )
