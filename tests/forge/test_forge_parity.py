"""FORGE against torch.optim (or the plain Lion reference) on the tiny GPT, and its semantics.

Tolerances: with tile_rows a multiple of 8, MKL's GEMM sums each dW row block in the same order
as the full dW, so the torch path is bit-identical to torch.optim (foreach=False) in fp64 and,
on this BLAS, in fp32 too; fp32 is still asserted at 1e-6 relative because another BLAS may
block differently. Tiles of 1 or 7 rows take another kernel (last-ulp differences), so tile
invariance is asserted at 1e-12 relative in fp64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from frugaltrain.forge import ForgeOptimizer, forge_optimizer
from frugaltrain.forge import linear as forge_linear


def _rel(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        ((p - q).abs().max() / p.abs().max()).item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def _train(model, opt, data, sched=None):
    for x, y in data:
        loss = model(x, y)[1]
        if isinstance(opt, ForgeOptimizer):
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def _lambda(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) / (1 + 0.05 * s))


@pytest.mark.parametrize("rule", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gpt_20_steps_match_torch(rule, dtype, kit):
    a = kit.make_gpt(dtype)
    b = kit.twin(a)
    ref = kit.reference(rule, a, kit.HYPER[rule]["lr"])
    opt = ForgeOptimizer(b, kit.forge_groups(b, rule), rule=rule, tile_rows=16, **kit.HYPER[rule])
    data = kit.batches(20)
    _train(a, ref, data, _lambda(ref))
    _train(b, opt, data, _lambda(opt))
    if dtype == torch.float64:
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q)
    else:
        assert _rel(a, b) <= 1e-6
    assert all(p.grad is None for p in b.parameters())
    # fused states are torch's: same names and values
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        for k, v in ref.state[p].items():
            torch.testing.assert_close(opt.state[q][k], v, rtol=1e-6, atol=0)


def test_tile_size_invariance(kit):
    a = kit.make_gpt()
    data = kit.batches(5)
    results = []
    for rows in (1, 7, 16, 10_000):
        m = kit.twin(a)
        _train(
            m,
            ForgeOptimizer(m, kit.forge_groups(m, "adamw"), tile_rows=rows, **kit.HYPER["adamw"]),
            data,
        )
        results.append(m)
    for m in results[1:]:
        assert _rel(results[0], m) <= 1e-12


def test_chain_rule_uses_old_weight(monkeypatch, kit):
    """A backward that updates W before computing dX must be caught by the parity check."""
    a = kit.make_gpt()
    b = kit.twin(a)
    data = kit.batches(3)
    _train(a, kit.reference("adamw", a, 3e-3), data)

    def mutated_backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy_BTV = dy.reshape(-1, dy.shape[-1])
        h = ctx.handle
        h.last = None
        h.owner._fused_linear_backward(h, h.module.weight, x.reshape(-1, x.shape[-1]), dy_BTV)
        return dy.matmul(weight), None, None, None  # weight shares storage: now the new W

    monkeypatch.setattr(forge_linear._ForgeLinearFn, "backward", staticmethod(mutated_backward))
    _train(
        b, ForgeOptimizer(b, kit.forge_groups(b, "adamw"), tile_rows=16, **kit.HYPER["adamw"]), data
    )
    assert _rel(a, b) > 1e-6


def test_unused_layer_is_not_updated_and_zero_grad_layer_decays(kit):
    torch.manual_seed(0)
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)}).double()
    opt = ForgeOptimizer(net, rule="adamw", lr=0.1, weight_decay=0.5)
    wa, wb = net["a"].weight.clone(), net["b"].weight.clone()
    x = torch.randn(3, 4, dtype=torch.float64)
    opt.backward((net["a"](x) * 0).sum())  # layer a gets a zero gradient, layer b no backward
    opt.step()
    assert torch.equal(net["b"].weight, wb) and not opt.state[net["b"].weight]
    assert torch.allclose(net["a"].weight, wa * (1 - 0.1 * 0.5))  # grad 0: decay only
    assert opt.state[net["a"].weight]["step"].item() == 1


def test_state_dict_round_trip_continues_identically(kit):
    a = kit.make_gpt()
    opt = ForgeOptimizer(a, kit.forge_groups(a, "adamw"), tile_rows=16, **kit.HYPER["adamw"])
    sched = _lambda(opt)
    data = kit.batches(8)
    _train(a, opt, data[:4], sched)
    snap_model = kit.twin(a)
    saved = copy.deepcopy(opt.state_dict())
    saved_sched = sched.state_dict()
    _train(a, opt, data[4:], sched)

    b = snap_model
    opt_b = ForgeOptimizer(b, kit.forge_groups(b, "adamw"), tile_rows=16, **kit.HYPER["adamw"])
    sched_b = _lambda(opt_b)
    opt_b.load_state_dict(saved)
    sched_b.load_state_dict(saved_sched)
    _train(b, opt_b, data[4:], sched_b)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_activation_checkpointing_is_identical(kit):
    class Ckpt(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, idx, targets):
            m = self.inner
            x = m.wte(idx) + m.wpe(torch.arange(idx.shape[1]))
            for block in m.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            logits = m.head(m.ln_f(x))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            return logits, loss

    a = kit.make_gpt()
    b = kit.twin(a)
    data = kit.batches(4)
    _train(
        a, ForgeOptimizer(a, kit.forge_groups(a, "adamw"), tile_rows=16, **kit.HYPER["adamw"]), data
    )
    c = Ckpt(b)
    _train(
        c, ForgeOptimizer(b, kit.forge_groups(b, "adamw"), tile_rows=16, **kit.HYPER["adamw"]), data
    )
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_forge_optimizer_builder_matches_torch_adamw_and_lambda_lr(kit):
    a = kit.make_gpt()
    b = kit.twin(a)
    ref = torch.optim.AdamW(
        [
            {"params": [p for p in a.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in a.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    opt = forge_optimizer(b, "adamw", 3e-3, (0.9, 0.95), 1e-8, 0.1, tile_rows=16)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    data = kit.batches(6)
    _train(a, ref, data, _lambda(ref))
    _train(b, opt, data, _lambda(opt))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


def test_mlp_with_biases_and_ragged_shapes_matches_torch():
    torch.manual_seed(0)
    a = torch.nn.Sequential(
        torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 29), torch.nn.LayerNorm(29),
        torch.nn.Linear(29, 5),
    ).double()  # fmt: skip
    b = copy.deepcopy(a)
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    opt = ForgeOptimizer(b, lr=1e-2, weight_decay=0.1, tile_rows=8)
    for _ in range(5):
        x = torch.randn(3, 4, 13, dtype=torch.float64)  # input without grad: first layer too
        a(x).square().mean().backward()
        opt.backward(b(x).square().mean())
        for o in (ref, opt):
            o.step()
            o.zero_grad()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_remove_restores_the_model():
    lin = torch.nn.Linear(4, 4)
    opt = ForgeOptimizer(lin, lr=1e-3)
    opt.remove()
    lin(torch.randn(2, 4)).sum().backward()
    assert lin.weight.grad is not None  # the standard backward again, no hook consumed it


def test_forge_optimizer_no_decay_callable_and_sgd_mapping(kit):
    m = kit.make_gpt()
    with pytest.warns(UserWarning, match="eps=1e-08 has no effect with rule='sgd'"):
        opt = forge_optimizer(
            m, "sgd", 0.1, (0.9, 0.99), 1e-8, 0.01, no_decay=lambda n: n.startswith("wte")
        )
    decay, plain = opt.param_groups
    assert plain["params"] == [m.wte.weight] and plain["weight_decay"] == 0.0
    assert decay["weight_decay"] == 0.01 and decay["momentum"] == 0.9
