"""torch.optim habits on a ForgeOptimizer: the constructor's first argument, zero_grad, LR
schedulers, and state_dict round trips with torch.optim.AdamW in both directions.

Tolerance: in fp64 FORGE is bit-identical to torch.optim.AdamW(foreach=False) (tile rows a
multiple of 8: MKL sums each dW row block as the full GEMM does; tests/forge/test_forge_parity.py),
so a run that switches between them is compared bitwise with one that never switched. The switch
itself hands over torch's own tensors (exp_avg, exp_avg_sq, step), so it adds nothing. fp32 is
asserted at the same 1e-6 relative as the fp32 parity test, because another BLAS may block the
GEMM differently.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from frugaltrain.forge import ForgeOptimizer


@pytest.mark.parametrize(
    "first",
    [
        lambda m: m.parameters(),
        lambda m: list(m.parameters()),
        lambda m: [{"params": list(m.parameters()), "lr": 1e-3}],
        lambda m: m[0].weight,
    ],
    ids=["generator", "list", "groups", "tensor"],
)
def test_parameters_instead_of_the_model_names_the_call(first):
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"ForgeOptimizer\(model, \.\.\.\)") as e:
        ForgeOptimizer(first(model), lr=1e-3)
    assert "\n" not in str(e.value)


def test_parameters_of_another_model_are_refused():
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(ValueError, match="not parameters of the model passed first"):
        ForgeOptimizer(model, other.parameters(), lr=1e-3)


def test_plain_backward_then_step_is_refused_and_names_opt_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    opt = ForgeOptimizer(model, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match=r"Call opt.backward\(loss\) instead of loss.backward"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not any(opt.state.values())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_after_a_plain_backward_restores_a_clean_step(kit, set_to_none):
    """A plain backward leaves nn.Linear's gradients; zero_grad(set_to_none=...) clears them
    (fused weights never keep one, even with set_to_none=False), and the next step equals the
    step of a model that never saw that backward."""
    a = kit.make_gpt()
    b = kit.twin(a)
    opt_a = ForgeOptimizer(a, kit.forge_groups(a, "adamw"), tile_rows=16, **kit.HYPER["adamw"])
    opt_b = ForgeOptimizer(b, kit.forge_groups(b, "adamw"), tile_rows=16, **kit.HYPER["adamw"])
    (x, y), (x2, y2) = kit.batches(2)
    a(x2, y2)[1].backward()  # gradients, no update
    with pytest.raises(ValueError, match=r"opt.zero_grad\(\) before opt.backward"):
        opt_a.backward(a(x, y)[1])
    opt_a.zero_grad(set_to_none=set_to_none)
    fused = {h.module.weight for h in opt_a._handles}
    for p in a.parameters():
        assert p.grad is None if (set_to_none or p in fused) else not p.grad.any()
    for m, o in ((a, opt_a), (b, opt_b)):
        o.backward(m(x, y)[1])
        o.step()
        o.zero_grad(set_to_none=set_to_none)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "make_sched",
    [
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4)),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=1e-4),
    ],
    ids=["LambdaLR", "CosineAnnealingLR"],
)
def test_lr_schedulers_drive_forge_as_torch_adamw(kit, make_sched):
    a = kit.make_gpt()
    b = kit.twin(a)
    ref = kit.reference("adamw", a, 3e-3)
    opt = ForgeOptimizer(b, kit.forge_groups(b, "adamw"), tile_rows=16, **kit.HYPER["adamw"])
    sched_a, sched_b = make_sched(ref), make_sched(opt)
    seen = set()
    for x, y in kit.batches(12):
        for m, o, s in ((a, ref, sched_a), (b, opt, sched_b)):
            kit.backward(o, m(x, y)[1])
            o.step()
            s.step()
            o.zero_grad()
        assert sched_a.get_last_lr() == sched_b.get_last_lr()
        seen.add(opt.param_groups[0]["lr"])
    assert len(seen) >= 3  # the schedule really moved the lr
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def _adamw(kit, model):
    return kit.reference("adamw", model, kit.HYPER["adamw"]["lr"])


def _forge(kit, model):
    return ForgeOptimizer(
        model, kit.forge_groups(model, "adamw"), tile_rows=16, **kit.HYPER["adamw"]
    )


def _train(kit, model, opt, sched, data):
    for x, y in data:
        kit.backward(opt, model(x, y)[1])
        opt.step()
        sched.step()
        opt.zero_grad()


def _lambda(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))


@pytest.mark.parametrize("first, second", [("torch", "forge"), ("forge", "torch")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_state_dict_switch_between_torch_adamw_and_forge(kit, first, second, dtype):
    """Train 5 steps with one optimizer, hand its state_dict (and the scheduler's) to the other,
    train 5 more; the result equals 10 steps of torch AdamW that never switched."""
    make = {"torch": _adamw, "forge": _forge}
    data = kit.batches(10)
    straight = kit.make_gpt(dtype)
    opt = _adamw(kit, straight)
    _train(kit, straight, opt, _lambda(opt), data)

    model = kit.make_gpt(dtype)
    opt = make[first](kit, model)
    sched = _lambda(opt)
    _train(kit, model, opt, sched, data[:5])
    saved, saved_sched = copy.deepcopy(opt.state_dict()), sched.state_dict()
    if first == "forge":
        opt.remove()  # the model's own nn.Linear backward again, for torch AdamW
    opt = make[second](kit, model)
    sched = _lambda(opt)
    opt.load_state_dict(saved)
    sched.load_state_dict(saved_sched)
    _train(kit, model, opt, sched, data[5:])
    for p, q in zip(straight.parameters(), model.parameters(), strict=True):
        if dtype == torch.float64:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(q, p, rtol=1e-6, atol=0)
    assert opt.state[next(model.parameters())]["step"].item() == 10


def test_torch_state_dict_with_amsgrad_is_refused(kit):
    model = kit.make_gpt(n_layer=1)
    ref = torch.optim.AdamW(kit.forge_groups(model, "adamw"), lr=1e-3, amsgrad=True)
    opt = _forge(kit, model)
    with pytest.raises(ValueError, match=r"\['amsgrad'\] set, which FORGE does not support"):
        opt.load_state_dict(ref.state_dict())
