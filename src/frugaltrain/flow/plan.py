"""`frugaltrain flow plan`: the warm-up profile, both backbone cost models' accuracy and the
allocator's plan for `alloc.budget` worker slots. Every key says measured or predicted.
"""

from __future__ import annotations

import os

from frugaltrain.flow.alloc import Plan, brute_force, even_split, profile, solve_milp
from frugaltrain.flow.config import FlowConfig
from frugaltrain.flow.packing import CostFit, fit_cost


def cost_fit(cfg: FlowConfig, prof: dict) -> CostFit:
    """Both backbone cost models fitted to a warm-up profile's micro-batch times (measured)."""
    return fit_cost(prof["bins"], prof["bin_seconds"], cfg.sched.capacity)


def plan(cfg: FlowConfig) -> dict:
    """Profile both modules, fit the cost models, solve the allocator (and check it)."""
    prof = profile(cfg, cfg.alloc.max_threads, cfg.alloc.profile_steps)
    fit = cost_fit(cfg, prof)
    rho = prof["rho"]
    milp = solve_milp(rho, cfg.alloc.budget, cfg.data.global_batch)
    return {
        "measured.rho_samples_per_s": rho,
        "measured.cost_fit": {
            "r2": fit.r2,
            "mape": fit.mape,
            "best": fit.best,
            "fitted_coef": fit.coef,
        },
        "plan": milp.to_dict(),
        "plan_brute_force_agrees": _same(
            milp, brute_force(rho, cfg.alloc.budget, cfg.data.global_batch)
        ),
        "even_split": even_split(rho, cfg.alloc.budget).to_dict(),
        "oversubscribed": cfg.alloc.budget > (os.cpu_count() or 1),
    }


def _same(a: Plan, b: Plan) -> bool:
    """Equal objectives (G, then F) up to solver tolerance; ties may pick different plans."""
    return abs(a.G - b.G) <= 1e-6 * max(1, a.G) and abs(a.F - b.F) <= 1e-6 * max(1, a.G)
