"""The rules, and their in-place rewrite used by the torch path."""

from __future__ import annotations

import pytest
import torch

from frugaltrain.forge import RULES, AllocationTracker
from frugaltrain.forge._inplace import inplace_variant

GROUP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
GROUP.update({"momentum": 0.9, "dampening": 0.1})


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("step", [1, 4])
def test_in_place_rewrite_is_bit_identical_to_the_rule(name, step):
    rule = RULES[name]
    tiles = [torch.randn(6, 10, dtype=torch.float64) for _ in range(4)]
    tiles[3] = tiles[3].abs()
    scalars = rule.scalars(GROUP, step)
    ref = rule.update(*(t.clone() for t in tiles), *scalars)
    s2 = tiles[3].clone() if len(rule.state_names) == 2 else None
    out = inplace_variant(rule.update)(*(t.clone() for t in tiles[:3]), s2, *scalars)
    for a, b in zip(ref[: 1 + len(rule.state_names)], out, strict=False):
        assert torch.equal(a, b)


def test_in_place_adamw_allocates_only_the_denominator():
    rule = RULES["adamw"]
    w, g, m, v = (torch.rand(64, 64) for _ in range(4))
    fn = inplace_variant(rule.update)
    with AllocationTracker() as t:
        out = fn(w, g, m, v, *rule.scalars(GROUP, 3))
    assert out[0] is w and out[1] is m and out[2] is v  # updated where they live
    assert t.largest_bytes == w.nbytes and t.peak_bytes == w.nbytes  # torch's one temporary
