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


def test_even_split_keeps_the_divisibility_rule() -> None:
    """Half of 10 is 5 backbone replicas, which do not divide a batch of 16: the nearest split
    that does is taken, as the allocator's own options require."""
    rho = {"encoder": {1: 10.0}, "backbone": {1: 10.0}}
    plan = even_split(rho, 10, 16)
    assert 16 % plan.backbone.replicas == 0
    assert (plan.encoder.replicas, plan.backbone.replicas) == (6, 4)
    assert (even_split(rho, 5).encoder.replicas, even_split(rho, 5).backbone.replicas) == (2, 3)


def test_even_split_uses_the_profiled_thread_counts() -> None:
    """A profile without a one-thread entry: replicas of the smallest profiled size."""
    rho = {"encoder": {2: 30.0, 4: 50.0}, "backbone": {2: 20.0}}
    plan = even_split(rho, 8, 16)
    assert (plan.encoder.threads, plan.backbone.threads) == (2, 2)
    assert plan.devices == 8 and plan.G == pytest.approx(min(2 * 30.0, 2 * 20.0))
    with pytest.raises(ValueError, match="alloc.budget = 3"):
        even_split(rho, 3)


def _plan_on(rho: dict, monkeypatch):
    """`flow plan` on a profile with these rates (and a backbone cost fit that works)."""
    from frugaltrain.flow import load_flow_config, plan

    prof = {
        "rho": rho,
        "bins": [[10 + i, 20] for i in range(12)],
        "bin_seconds": [0.01 + 1e-4 * i for i in range(12)],
    }
    monkeypatch.setattr(plan, "profile", lambda *a: prof)
    return plan.plan(load_flow_config(None, []))


def test_plan_warns_when_more_threads_measured_slower(monkeypatch) -> None:
    """A 2-thread replica slower than a 1-thread one (a busy machine): the plan's predictions
    will not hold, and `flow plan` says so."""
    rho = {"encoder": {1: 100.0, 2: 40.0}, "backbone": {1: 80.0, 2: 150.0}}
    with pytest.warns(UserWarning, match="encoder with 2 threads ran at 0.40x"):
        out = _plan_on(rho, monkeypatch)
    assert len(out["warnings"]) == 1  # the backbone sped up: no warning for it


def test_plan_warns_when_more_threads_measured_more_than_that_many_times_faster(monkeypatch):
    """Two threads 3.45x faster than one (the 1-thread pass slowed by a burst of load, as in
    one of docs/flow.md's runs): the 1-thread rates are not to be trusted, and the plan says so."""
    rho = {"encoder": {1: 53.4, 2: 184.5}, "backbone": {1: 80.0, 2: 150.0}}
    with pytest.warns(UserWarning, match="encoder with 2 threads ran at 3.46x .*1-thread pass"):
        out = _plan_on(rho, monkeypatch)
    assert len(out["warnings"]) == 1  # the backbone's 1.88x is plausible
