"""Precision regimes: stochastic rounding of bf16 weights, 8-bit blockwise optimizer states."""

from __future__ import annotations

import math

import torch
from torch import nn

from frugaltrain.forge import ForgeOptimizer, precision


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = torch.randn(1000) * 3
    n = 2000
    gen = torch.Generator().manual_seed(0)
    samples = precision.stochastic_round_to_bf16(x.expand(n, -1), gen).float()
    lo = x.to(torch.bfloat16).float()  # a neighbour; the bf16 spacing around x:
    ulp = (
        torch.nextafter(
            lo.abs().to(torch.bfloat16), torch.tensor(math.inf, dtype=torch.bfloat16)
        ).float()
        - lo.abs()
    )
    # each sample is one of the two neighbours: the mean's std is at most ulp / (2 sqrt(n))
    err = (samples.mean(0) - x).abs()
    assert (err <= 6 * ulp / (2 * math.sqrt(n))).all()
    nearest_bias = (x.to(torch.bfloat16).float() - x).abs().mean()
    assert err.mean() < nearest_bias / 5
    again = precision.stochastic_round_to_bf16(x.expand(n, -1), torch.Generator().manual_seed(0))
    assert torch.equal(again.float(), samples)
    nan = precision.stochastic_round_to_bf16(torch.tensor([float("nan"), 1.0]), gen)
    assert torch.isnan(nan[0]) and nan[1] == 1.0


def _bf16_drift(rounding: str, seed: int = 0) -> torch.Tensor:
    """1000 SGD steps of +1e-4 on bf16 weights at 1.0 (bf16 spacing there: 2^-7 = 0.0078)."""
    lin = nn.Linear(1, 64, bias=False).to(torch.bfloat16)
    nn.init.ones_(lin.weight)
    opt = ForgeOptimizer(lin, rule="sgd", lr=1e-4, rounding=rounding, seed=seed)
    x = torch.ones(1, 1, dtype=torch.bfloat16)
    for _ in range(1000):
        opt.backward(-lin(x).sum())  # dL/dW = -1: the update is +lr
        opt.step()
    return lin.weight.float()


def test_stochastic_rounding_does_not_stall_below_bf16_resolution():
    assert torch.equal(_bf16_drift("nearest"), torch.ones(64, 1))  # round-to-nearest stalls
    w = _bf16_drift("stochastic")
    # fp32 reference: 1.1. Per weight the SR walk has std ~ sqrt(1000 * 1e-4 * 2^-7) ~ 0.03,
    # so the mean of 64 weights is within ~0.004 of it.
    assert abs(w.mean().item() - 1.1) < 0.02
    assert torch.equal(w, _bf16_drift("stochastic"))  # seeded: reproducible
    assert not torch.equal(w, _bf16_drift("stochastic", seed=1))


def test_int8_quantization_round_trip_ragged_blocks():
    x = torch.randn(5, 150)  # 150 = 2 full blocks of 64 + 22
    codes, scale = precision.quantize(x, signed=True)
    assert codes.dtype == torch.int8 and scale.shape == (5, 3)
    back = precision.dequantize(codes, scale, signed=True)
    step = scale.repeat_interleave(precision.QBLOCK, dim=1)[:, :150]
    assert ((back - x).abs() <= step / 2 + 1e-7).all()
    v = x.square()
    codes, scale = precision.quantize(v, signed=False)
    assert codes.dtype == torch.uint8
    back = precision.dequantize(codes, scale, signed=False)
    step = scale.repeat_interleave(precision.QBLOCK, dim=1)[:, :150]
    assert ((back.sqrt() - v.sqrt()).abs() <= step / 2 + 1e-6).all()  # error in the sqrt domain


def test_int8_state_error_stays_within_the_ema_bound():
    """|m_q - m| <= s / (2 (1 - beta)), s the largest quantization step seen (research 1.10)."""
    torch.manual_seed(0)
    beta = 0.9
    m = torch.zeros(8, 128)
    codes, scale = precision.quantize(m, signed=True)
    s_max, err = 0.0, 0.0
    for _ in range(200):
        g = torch.randn(8, 128)
        m = torch.lerp(m, g, 1 - beta)
        m_q = torch.lerp(precision.dequantize(codes, scale, signed=True), g, 1 - beta)
        codes, scale = precision.quantize(m_q, signed=True)
        s_max = max(s_max, scale.max().item())
        err = max(err, (precision.dequantize(codes, scale, signed=True) - m).abs().max().item())
    assert err <= s_max / (2 * (1 - beta))


def test_int8_states_train_the_gpt(kit):
    a = kit.make_gpt(torch.float32)
    b = kit.twin(a)
    data = kit.learnable_batches(20)
    runs = []
    for model, states in ((a, "fp32"), (b, "int8")):
        opt = ForgeOptimizer(model, kit.forge_groups(model, "adamw"), states=states, lr=3e-3)
        losses = []
        for x, y in data:
            loss = model(x, y)[1]
            losses.append(loss.item())
            opt.backward(loss)
            opt.step()
        runs.append((losses, opt))
    (fp32_losses, _), (int8_losses, opt) = runs
    assert int8_losses[-1] < int8_losses[0] - 0.1
    assert abs(int8_losses[-1] - fp32_losses[-1]) < 0.05  # tracks the fp32-state run
    st = opt.state[b.blocks[0].mlp.fc.weight]
    assert st["exp_avg"].dtype == torch.int8 and st["exp_avg_sq"].dtype == torch.uint8
    assert st["exp_avg_scale"].shape == (128, 1)  # one scale per (row, 64 columns)


def test_bf16_model_trains_with_fp32_states(kit):
    model = kit.make_gpt(torch.bfloat16)
    opt = ForgeOptimizer(model, kit.forge_groups(model, "adamw"), lr=3e-3)
    losses = []
    for x, y in kit.learnable_batches(15):
        loss = model(x, y)[1]
        losses.append(loss.item())
        opt.backward(loss)
        opt.step()
    assert losses[-1] < losses[0] - 0.1
    assert opt.state[model.head.weight]["exp_avg"].dtype == torch.float32
