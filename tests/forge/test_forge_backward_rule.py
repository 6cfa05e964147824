"""When FORGE updates: only in the backward of `opt.backward(loss)`. Every other backward through a
fused Linear is nn.Linear's backward: the same input gradients (bitwise), the weight's gradient
only where that backward asks for it, and weights and optimizer state bitwise unchanged. The
patterns that cannot be served are refused before anything changes.

Each test starts from a model FORGE has already stepped once (so optimizer state exists) and a
plain nn twin holding the same weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from frugaltrain.forge import ForgeOptimizer


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 5))


def _setup():
    """(FORGE model, its optimizer after one step, a plain twin with the same weights, x)."""
    model, ref = _mlp(), _mlp()
    opt = ForgeOptimizer(model, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    opt.backward(model(torch.randn(3, 4, 6, generator=g)).square().mean())
    opt.step()
    opt.zero_grad()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 4, 6, generator=g)
    return model, opt, ref, x


def _snapshot(model: nn.Module, opt: ForgeOptimizer) -> list[torch.Tensor]:
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [t.detach().clone() for t in [*model.parameters(), *state]]


def _unchanged(model: nn.Module, opt: ForgeOptimizer, before: list[torch.Tensor]) -> bool:
    now = _snapshot(model, opt)
    return len(now) == len(before) and all(map(torch.equal, now, before))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def test_autograd_grad_with_respect_to_the_input():
    model, opt, ref, x = _setup()
    before = _snapshot(model, opt)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ga,) = torch.autograd.grad(_loss(model, xa), xa)
    (gb,) = torch.autograd.grad(_loss(ref, xb), xb)
    assert torch.equal(ga, gb)
    assert _unchanged(model, opt, before)
    assert all(p.grad is None for p in model.parameters())


def test_backward_with_inputs_subset():
    model, opt, ref, x = _setup()
    before = _snapshot(model, opt)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    _loss(model, xa).backward(inputs=[xa])
    _loss(ref, xb).backward(inputs=[xb])
    assert torch.equal(xa.grad, xb.grad)
    assert _unchanged(model, opt, before)
    assert all(p.grad is None for p in model.parameters())


def test_retain_graph_second_pass_and_saliency_before_the_step():
    """Two input-gradient passes over one retained graph, then the training backward on the same
    graph: the passes change nothing, and the step equals one taken without them."""
    model, opt, ref, x = _setup()
    twin, twin_opt, _, _ = _setup()
    before = _snapshot(model, opt)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_a, loss_b = _loss(model, xa), _loss(ref, xb)
    for _ in range(2):
        (ga,) = torch.autograd.grad(loss_a, xa, retain_graph=True)
        (gb,) = torch.autograd.grad(loss_b, xb, retain_graph=True)
        assert torch.equal(ga, gb)
    assert _unchanged(model, opt, before)
    opt.backward(loss_a)
    opt.step()
    twin_opt.backward(_loss(twin, x))
    twin_opt.step()
    assert _unchanged(model, opt, _snapshot(twin, twin_opt))


def test_evaluation_time_saliency_with_a_plain_backward():
    """model.eval(); out[:, c].sum().backward(): nn.Linear's gradients everywhere (x.grad and the
    parameters' .grad), no update; step() then refuses to ignore the parameters' gradients, and
    zero_grad() drops them."""
    model, opt, ref, x = _setup()
    model.eval(), ref.eval()
    before = _snapshot(model, opt)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(xa)[..., 2].sum().backward()
    ref(xb)[..., 2].sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert _unchanged(model, opt, before)
    with pytest.raises(ValueError, match=r"not opt.backward\(loss\).*Nothing was updated"):
        opt.step()
    assert _unchanged(model, opt, before)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_autograd_grad_with_respect_to_a_fused_weight():
    model, opt, ref, x = _setup()
    before = _snapshot(model, opt)
    (ga,) = torch.autograd.grad(_loss(model, x), model[3].weight)
    (gb,) = torch.autograd.grad(_loss(ref, x), ref[3].weight)
    assert torch.equal(ga, gb)
    assert _unchanged(model, opt, before)


def test_double_backward_for_input_gradients():
    """create_graph=True for input gradients only (a second-order input gradient) is
    nn.Linear's; nothing is updated."""
    model, opt, ref, x = _setup()
    before = _snapshot(model, opt)
    out = []
    for m in (model, ref):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(_loss(m, xi), xi, create_graph=True)
        out.append(torch.autograd.grad(g.square().sum(), xi))
    assert torch.equal(out[0][0], out[1][0])
    assert _unchanged(model, opt, before)


def test_gradient_penalty_is_refused_before_any_update():
    model, opt, _, x = _setup()
    before = _snapshot(model, opt)
    xi = x.clone().requires_grad_()
    loss = _loss(model, xi)
    (g,) = torch.autograd.grad(loss, xi, create_graph=True)
    with pytest.raises(ValueError, match="create_graph=True.*nothing was updated.*exclude="):
        opt.backward(loss + g.square().sum())
    assert _unchanged(model, opt, before)
    assert all(p.grad is None for p in model.parameters())


def test_penalty_trains_with_the_layers_excluded():
    """The fix the refusal names: the Linears on the standard (hook) path, exact against torch."""
    model, ref = _mlp().double(), _mlp().double()
    with pytest.warns(UserWarning, match="standard"):
        opt = ForgeOptimizer(model, lr=1e-2, exclude=lambda n: True)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    for m, o in ((model, opt), (ref, torch_opt)):
        xi = x.clone().requires_grad_()
        loss = _loss(m, xi)
        (g,) = torch.autograd.grad(loss, xi, create_graph=True)
        if o is opt:
            opt.backward(loss + g.square().sum())
        else:
            (loss + g.square().sum()).backward()
        o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
