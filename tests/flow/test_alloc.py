"""Allocator: the MILP's lexicographic optimum equals brute force on small budgets."""

import random

import pytest

from frugaltrain.flow.alloc import brute_force, even_split, options, solve_milp


def random_rho(r: random.Random) -> dict:
    return {
        "encoder": {1: r.uniform(1, 50), 2: r.uniform(1, 90)},
        "backbone": {1: r.uniform(1, 50), 2: r.uniform(1, 90), 4: r.uniform(1, 160)},
    }


@pytest.mark.parametrize("seed", range(60))
def test_milp_equals_brute_force(seed: int) -> None:
    r = random.Random(seed)
    rho, budget = random_rho(r), r.randint(2, 10)
    gb = r.choice([0, 16, 12])
    milp, ref = solve_milp(rho, budget, gb), brute_force(rho, budget, gb)
    assert milp.G == pytest.approx(ref.G, rel=1e-6)
    assert milp.F == pytest.approx(ref.F, rel=1e-6, abs=1e-6 * ref.G)
    assert milp.devices == ref.devices <= budget
    # lexicographic order: no feasible pair beats it on G, or ties on G and beats it on F
    for e in (o for o in options(rho, budget, gb) if o.module == "encoder"):
        for b in (o for o in options(rho, budget, gb) if o.module == "backbone"):
            if e.devices + b.devices <= budget:
                g = min(e.rate, b.rate)
                assert g <= milp.G * (1 + 1e-6)


def test_matching_beats_even_split_when_skewed() -> None:
    rho = {"encoder": {1: 10.0}, "backbone": {1: 40.0}}  # encoder-heavy
    plan = solve_milp(rho, 5)
    assert (plan.encoder.replicas, plan.backbone.replicas) == (4, 1)
    assert plan.G > even_split(rho, 5).G


def test_budget_too_small_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="alloc.budget"):
        solve_milp({"encoder": {2: 1.0}, "backbone": {2: 1.0}}, 3)
