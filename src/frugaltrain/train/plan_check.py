"""`frugaltrain plan --check`: the plan's pick and DiLoCo trained for a few inner steps of your
own job on emulated links at the plan's rates, and the pick's measured wall clock against
DiLoCo's beside the plan's estimate.

Each run is the config under the method's [outer] table at its H (DiLoCo's: the plan's
reference row), the workers' transfers paced in process to the plan's link rates
(run.link_mbit), stopped after the check's steps (run.stop_at_round: the job's own learning-rate
schedule, its first steps). The pick evaluates at every round end, DiLoCo at its last (each
worker's own model, no communication: run.eval_diagnostics = false), and evaluation time is
taken out of the wall clock, as benchmarks/time_to_loss.py does. The figure is the pick's time
to DiLoCo's validation loss at the last step over DiLoCo's wall clock (linear between the
pick's evaluations); where the pick does not reach that loss within the steps, its wall clock
over DiLoCo's at equal steps; the output says which. Every time figure is measured on emulated
links, and labelled so; shaped links (netlab) give the figures to publish. A few steps from the
start show what the links cost each method, not the step penalty, which the plan takes from
longer measured runs.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

from frugaltrain.config import AUTO_METHODS, Config, build_config, to_dict, to_toml
from frugaltrain.metrics.log import read_metrics
from frugaltrain.metrics.report import time_to
from frugaltrain.sim.plan import BASELINE, Plan

STEPS = 20
"""Inner steps per method by default (--check-steps), before rounding to whole rounds."""
TIME_TO_LOSS = "time to DiLoCo's loss"
EQUAL_STEPS = "wall clock at equal steps"


@dataclass
class CheckRun:
    """One method's short run."""

    method: str
    H: int
    wall_s: float
    """Seconds at the last step, evaluations out (measured, emulated links)."""
    val_loss: float
    """Validation loss at the last step, the workers' mean (measured)."""
    curve: tuple[list[float], list[float]]
    """(seconds, validation loss) at each evaluation, on the same clock."""
    run_dir: Path


@dataclass
class Check:
    steps: int
    rates_mbit: list[float]
    diloco: CheckRun
    pick: CheckRun
    x_diloco: float
    """The pick's seconds over DiLoCo's (measured, emulated links), by `measure`."""
    measure: str
    """TIME_TO_LOSS or EQUAL_STEPS."""
    estimate: float | None
    """The plan's x DiLoCo for the pick (estimated, over run.steps)."""


def check_steps(requested: int, Hs: list[int], run_steps: int) -> int:
    """`requested` inner steps rounded up to whole rounds of every method (a multiple of each
    H), at most run.steps (a multiple of each H already)."""
    every = math.lcm(*Hs)
    return min(math.ceil(requested / every) * every, run_steps)


def check_config(
    cfg: Config, table: dict, steps: int, rates_mbit: list[float], method: str
) -> Config:
    """`cfg` under the [outer] `table`, on emulated links at `rates_mbit`, stopped after `steps`
    inner steps, into RUN.OUT_DIR/plan-check/METHOD; the pick (not DiLoCo) evaluates at every
    round end."""
    raw = to_dict(cfg)
    raw["outer"] = copy.deepcopy(table)
    H = table["H"]
    raw["run"].update(
        name=method,
        out_dir=str(Path(cfg.run.out_dir) / "plan-check"),
        link_mbit=list(rates_mbit),
        stop_at_round=steps // H,
        eval_every=steps if method == BASELINE else H,
        eval_diagnostics=False,  # no communication in an evaluation: the links time training
        checkpoint_every=0,
        progress=False,
    )
    return build_config(Config, raw)


def run_check(cfg: Config, plan: Plan, requested: int) -> Check:
    """Train DiLoCo and the pick for `requested` inner steps (check_steps) each on emulated
    links at the plan's rates, and compare their wall clocks."""
    from frugaltrain.cluster.run_dir import new_run_dir
    from frugaltrain.train.launch import check_data, check_model, run

    base = next(r for r in plan.rows if r.method == BASELINE)
    pick = next(r for r in plan.rows if r.method == plan.pick)
    steps = check_steps(requested, [base.H, pick.H], cfg.run.steps)
    rates = [b / 1e6 for b in plan.links.bandwidth_bps]
    runs = {}
    for method, table in ((BASELINE, base.outer), (plan.pick, pick.outer)):
        mcfg = check_config(cfg, table, steps, rates, method)
        check_model(mcfg)
        check_data(mcfg)
        run_dir = new_run_dir(mcfg)
        (run_dir / "config.toml").write_text(to_toml(mcfg))
        print(f"check: {method}, {steps} inner steps on emulated links ({run_dir})", flush=True)
        run(mcfg, run_dir)
        runs[method] = _read(method, table["H"], run_dir)
    diloco, mine = runs[BASELINE], runs[plan.pick]
    reached = time_to(diloco.val_loss, *mine.curve)
    if reached is not None:
        x, measure = reached / diloco.wall_s, TIME_TO_LOSS
    else:
        x, measure = mine.wall_s / diloco.wall_s, EQUAL_STEPS
    return Check(steps, rates, diloco, mine, x, measure, pick.ratio)


def _read(method: str, H: int, run_dir: Path) -> CheckRun:
    """A run's evaluations against its wall clock, each evaluation's time taken out of the
    clock after it (a round's wall clock is taken before its own evaluation)."""
    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "round"]
    seconds, losses, spent = [], [], 0.0
    for r in rounds:
        if "loss/val" in r:
            seconds.append(r["time/wall_s"] - spent)
            losses.append(r["loss/val"])
        spent += r.get("time/eval_s", 0.0)
    assert rounds and "loss/val" in rounds[-1], f"{run_dir}: no evaluation at the last step"
    return CheckRun(method, H, seconds[-1], losses[-1], (seconds, losses), run_dir)


def format_check(c: Check, run_steps: int) -> str:
    """The two runs, each figure labelled, then the measured ratio beside the plan's."""
    rates = "/".join(f"{r:g}" for r in c.rates_mbit)
    each = "each worker" if len(c.rates_mbit) == 1 else "one per worker"
    lines = [
        f"check: {c.steps} inner steps of this job per method on emulated links ({rates} Mbit/s "
        f"{each}, run.link_mbit: transfers paced in process), evaluations out of the clock",
        "",
        "| method | what it is | outer.H | wall clock, s (measured, emulated links) "
        "| validation loss at the last step (measured) |",
        "|---|---|---|---|---|",
    ]
    for r, name in ((c.diloco, f"{BASELINE} (reference)"), (c.pick, c.pick.method)):
        label = AUTO_METHODS.get(r.method, "")
        lines.append(f"| {name} | {label} | {r.H} | {r.wall_s:.4g} | {r.val_loss:.4f} |")
    target = f"DiLoCo's loss at step {c.steps} ({c.diloco.val_loss:.4f})"
    if c.measure == TIME_TO_LOSS:
        got = f"{c.pick.method} reached {target} in {c.x_diloco:.2f}x DiLoCo's wall clock"
    else:
        got = (
            f"{c.pick.method} did not reach {target} in {c.steps} steps; its wall clock at equal "
            f"steps is {c.x_diloco:.2f}x DiLoCo's"
        )
    estimate = "-" if c.estimate is None else f"{c.estimate:.2f}x"
    lines.append(
        f"check: {got} (measured, emulated links); the plan estimated {estimate} "
        f"(time to DiLoCo's final loss over run.steps = {run_steps}, estimated)"
    )
    return "\n".join(lines)


def check_json(c: Check) -> dict:
    """The check as JSON, each figure under a key that says what it is."""

    def one(r: CheckRun) -> dict:
        return {
            "method": r.method,
            "H": r.H,
            "wall_s_measured_emulated": r.wall_s,
            "val_loss_measured": r.val_loss,
            "run_dir": str(r.run_dir),
        }

    return {
        "steps": c.steps,
        "link_mbit_emulated": c.rates_mbit,
        "runs": [one(c.diloco), one(c.pick)],
        "measure": c.measure,
        "x_diloco_measured_emulated": c.x_diloco,
        "x_diloco_estimated": c.estimate,
    }
