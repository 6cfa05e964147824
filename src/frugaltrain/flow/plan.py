"""`frugaltrain flow plan`: the warm-up profile, both backbone cost models' accuracy and the
allocator's plan for `alloc.budget` worker slots. Every key says measured or predicted.

The plan is only as good as the profile: when a replica with more threads measured slower than
one thread (the machine is busy, and threads wait for each other), the rates the allocator
matches are not what the run will see, and `plan` warns.
"""

from __future__ import annotations

import os
import warnings

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
    implausible = implausible_speedups(rho)
    for note in implausible:
        warnings.warn(note, stacklevel=2)
    milp = solve_milp(rho, cfg.alloc.budget, cfg.data.global_batch)
    return {
        "warnings": implausible,
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
        "even_split": even_split(rho, cfg.alloc.budget, cfg.data.global_batch).to_dict(),
        "oversubscribed": cfg.alloc.budget > (os.cpu_count() or 1),
    }


def implausible_speedups(rho: dict[str, dict[int, float]]) -> list[str]:
    """One line per (module, t) whose speed-up rho(t) / rho(1), which the allocator relies on,
    no undisturbed profile gives: below 1 (a t-thread replica slower than a 1-thread one: the
    machine is contended) or above t (t threads more than t times faster: the 1-thread pass was
    slowed, by another job or a burst of load)."""
    notes = []
    for module, per_t in rho.items():
        one = per_t.get(1)
        for t, r in sorted(per_t.items()):
            if not one or t == 1 or 1 <= r / one <= t:
                continue
            why = "the machine is contended" if r < one else "its 1-thread pass was slowed"
            notes.append(
                f"measured.rho_samples_per_s: the {module} with {t} threads ran at "
                f"{r / one:.2f}x its 1-thread rate ({r:.1f} vs {one:.1f} samples/s); {why}, "
                "so the plan's predictions will not hold: profile again on idle cores, or set "
                "alloc.max_threads = 1"
            )
    return notes


def _same(a: Plan, b: Plan) -> bool:
    """Equal objectives (G, then F) up to solver tolerance; ties may pick different plans."""
    return abs(a.G - b.G) <= 1e-6 * max(1, a.G) and abs(a.F - b.F) <= 1e-6 * max(1, a.G)
