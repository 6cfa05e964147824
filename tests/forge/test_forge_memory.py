"""Honest memory: no weight gradient larger than one tile is ever allocated during the step.

Measured with the storage-level dispatch tracker (tracemalloc does not see torch storages). The
shapes make a full weight gradient (256 x 256 fp32 = 256 KiB) 8x larger than any activation or
activation gradient (8 tokens x 1024 fp32 = 32 KiB), so "largest allocation" isolates dW.
"""

from __future__ import annotations

import torch
from torch import nn

from frugaltrain.forge import AllocationTracker, ForgeOptimizer

H, TOKENS, TILE_ROWS = 256, 8, 16
TILE_BYTES = TILE_ROWS * H * 4
FULL_BYTES = H * H * 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(H, H, bias=False), nn.GELU(), nn.Linear(H, H, bias=False), nn.GELU(),
        nn.Linear(H, H, bias=False),
    )  # fmt: skip


def _backward(opt, loss) -> None:
    if isinstance(opt, ForgeOptimizer):
        opt.backward(loss)
    else:
        loss.backward()


def _step_tracked(model, opt) -> AllocationTracker:
    x = torch.randn(TOKENS, H)
    opt.zero_grad()
    _backward(opt, model(x).square().mean())
    opt.step()  # warm-up: optimizer states exist before the measured step
    with AllocationTracker() as tracker:
        tracker.mark("forward")
        loss = model(x).square().mean()
        tracker.mark("backward+step")
        _backward(opt, loss)
        opt.step()
        opt.zero_grad()
    return tracker


def test_largest_weight_gradient_is_one_tile():
    model = _mlp()
    forge = _step_tracked(model, ForgeOptimizer(model, lr=1e-3, tile_rows=TILE_ROWS))
    assert all(p.grad is None for p in model.parameters())
    assert forge.phase_largest["backward+step"] <= TILE_BYTES
    model = _mlp()
    base = _step_tracked(model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    assert base.phase_largest["backward+step"] >= FULL_BYTES  # the tracker does see full dW
    # the whole gradient pool (3 full dW) is gone from the transient peak
    assert forge.phase_peak["backward+step"] <= base.phase_peak["backward+step"] - 2 * FULL_BYTES


def test_tracker_ignores_views_and_in_place_ops():
    with AllocationTracker() as t:
        a = torch.zeros(1000)
        a.add_(1)
        b = a.view(10, 100)[2:]
        assert t.live_bytes == 4000
        c = b * 2
        assert t.live_bytes == 4000 + c.nbytes
        del c
        assert t.live_bytes == 4000
    assert t.peak_bytes == 4000 + 3200 and t.largest_bytes == 4000
