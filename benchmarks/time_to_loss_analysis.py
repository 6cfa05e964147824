"""What benchmarks/time_to_loss.py's result files give: the methods it runs (METHODS, each an
example config with overrides), each method's time to DiLoCo's final loss against DiLoCo's
(analyze) and its tables, the planner's step penalties measured by those runs (penalties), and
the planner against the runs (plan_table, check_against).

time_to_loss.py runs the methods and prints these tables (`--table`, `--penalties`,
`--check-against`); benchmarks/tables.py writes some of them into the docs. Neither is imported
here, nor torch: a script finds this module as `from time_to_loss_analysis import ...` (its own
directory is on sys.path when it runs as `python benchmarks/NAME.py`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from frugaltrain.config import load_config
from frugaltrain.metrics.report import time_to

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BASELINE = "diloco"
MIX1_DELTA_4BIT = ["outer.fgd.mix1_delta=true", "outer.param_codec='e3m0'"]
METHODS = {  # name -> (example config, extra overrides)
    "diloco": ("diloco", []),
    "diloco-int8": ("diloco", ["outer.codec='int8'"]),
    "diloco-e3m0": ("diloco", ["outer.codec='e3m0'"]),  # Streaming's 4-bit codec, whole model
    "streaming": ("streaming", []),
    # Each fragment's all-reduce overlapping 2 or 3 inner steps instead of 1: more time to hide
    # it, one or two more steps of staleness.
    "streaming-overlap2": ("streaming", ["outer.streaming.overlap=2"]),
    "streaming-overlap3": ("streaming", ["outer.streaming.overlap=3"]),
    "noloco": ("noloco", []),
    "GlobalM1": ("fgd_globalm1", []),
    "GlobalM1LocalM2": ("fgd_globalm1_localm2", []),
    "GlobalM1LocalM2-int8": ("fgd_globalm1_localm2_int8", []),
    # The same with Mix1's parameters in bf16: half Mix1's bytes, for links where its
    # all-reduce outlasts a round of compute.
    "GlobalM1LocalM2-int8-bf16": ("fgd_globalm1_localm2_int8", ["outer.param_codec='bf16'"]),
    # Mix1 coded as each worker's update against the last Mix1 mean, in 4 bits with error
    # feedback (outer.fgd.mix1_delta): an eighth of fp32's bytes. Mix2 in int8, or in 4 bits too.
    "GlobalM1LocalM2-int8-d4": ("fgd_globalm1_localm2_int8", MIX1_DELTA_4BIT),
    "GlobalM1LocalM2-4bit": ("fgd_globalm1_localm2_int8", [*MIX1_DELTA_4BIT, "outer.codec='e3m0'"]),
    # The same at its own H = 10 pick, lr 0.8 (docs/results/fgd.md, "Every method's outer step
    # at H = 10"); the method's override comes after --set.
    "GlobalM1LocalM2-4bit-lr0.8": (
        "fgd_globalm1_localm2_int8",
        [*MIX1_DELTA_4BIT, "outer.codec='e3m0'", "outer.lr=0.8"],
    ),
    "subset": ("fgd_subset", []),
    "ddp": ("ddp", []),
    # At their own H, rounds twice as often as DiLoCo's (H = 10): in 4 bits a round's bytes are
    # a quarter of DiLoCo's fp32 round per step; chosen on stdlib (docs/results/fgd.md, "Rounds
    # twice as often").
    "GlobalM1LocalM2-4bit-H5": (
        "fgd_globalm1_localm2_int8",
        [*MIX1_DELTA_4BIT, "outer.codec='e3m0'", "outer.H=5"],
    ),
    # Mix2 sent 1 step before the round's end, on the wire while the worker takes that step
    # (outer.fgd.mix2_delay; docs/results/fgd.md, "Mix2 sent a step early").
    "GlobalM1LocalM2-4bit-H5-d1": (
        "fgd_globalm1_localm2_int8",
        [*MIX1_DELTA_4BIT, "outer.codec='e3m0'", "outer.H=5", "outer.fgd.mix2_delay=1"],
    ),
    "diloco-e3m0-H5": ("diloco", ["outer.codec='e3m0'", "outer.H=5"]),
    # DiLoCo's round as an FGD (no Mix1, Mix2 complete) in 4 bits at H = 5, its all-gather sent
    # a step early and the step kept: DiLoCo in e3m0 with one step to hide its exchange.
    "GlobalM2-4bit-H5-d1": (
        "fgd_globalm1_localm2_int8",
        [
            "outer.fgd.preset='GlobalM2'",
            "outer.codec='e3m0'",
            "outer.H=5",
            "outer.fgd.mix2_delay=1",
        ],
    ),
    # The same two with their 4-bit average as a reduce-scatter then an all-gather of coded
    # chunks: half the bytes at 4 workers, the mean coded once more.
    "diloco-e3m0-H5-rs": (
        "diloco",
        ["outer.codec='e3m0'", "outer.H=5", "outer.coded_average='reduce_scatter'"],
    ),
    "GlobalM2-4bit-H5-d1-rs": (
        "fgd_globalm1_localm2_int8",
        [
            "outer.fgd.preset='GlobalM2'",
            "outer.codec='e3m0'",
            "outer.H=5",
            "outer.fgd.mix2_delay=1",
            "outer.coded_average='reduce_scatter'",
        ],
    ),
    # The default job's method as it is configured now (examples/default.toml's [outer] on the
    # byte-level job): the run above, bit for bit, as DiLoCo sent a step early.
    "default-job": (
        "diloco",
        [
            "outer.codec='e3m0'",
            "outer.H=5",
            "outer.coded_average='reduce_scatter'",
            "outer.diloco.overlap=1",
        ],
    ),
    "streaming-H4": ("streaming", ["outer.H=4"]),  # its fragments must divide H
    # diloco-e3m0-H5-rs's round in 2 bits, error feedback on both codings: 0.55x e3m0's bytes.
    "diloco-2bit-H5-rs": (
        "diloco",
        ["outer.codec='2bit'", "outer.H=5", "outer.coded_average='reduce_scatter'"],
    ),
}


def overrides(method: str, common: list[str]) -> tuple[str, list[str]]:
    example, extra = METHODS[method]
    return str(ROOT / "examples" / f"{example}.toml"), [*common, *extra]


def loss_at(t_s: float, t: list[float], loss: list[float]) -> float | None:
    """The curve's loss at wall clock `t_s` (linear between evaluations); None before its first
    evaluation or after its last."""
    for k in range(1, len(t)):
        if t[k - 1] <= t_s <= t[k]:
            return loss[k - 1] + (loss[k] - loss[k - 1]) * (t_s - t[k - 1]) / (t[k] - t[k - 1])
    return loss[0] if t and t_s == t[0] else None


def equal_wall_x(run: dict, diloco: dict) -> float | None:
    """The run's loss over DiLoCo's at the wall clock where the sooner of the two ended: a
    ranking of near ties that time to DiLoCo's final loss cannot give."""
    t_s = min(run["wall_s_measured"][-1], diloco["wall_s_measured"][-1])
    mine = loss_at(t_s, run["wall_s_measured"], run["val_loss"])
    theirs = loss_at(t_s, diloco["wall_s_measured"], diloco["val_loss"])
    return mine / theirs if mine is not None and theirs else None


def analyze(record: dict) -> list[dict]:
    """Per case and method: time to DiLoCo's final loss as a ratio to DiLoCo's (each seed against
    the DiLoCo run of its seed), seeds that reached it, and final loss at equal steps."""
    out = []
    for name, case in record["cases"].items():
        base = {r["seed"]: r for r in case["runs"] if r["method"] == BASELINE}
        for m in record["methods"]:
            ratios, final, sim_ratio, U, wall_x = [], [], [], [], []
            for r in (r for r in case["runs"] if r["method"] == m):
                d = base[r["seed"]]
                target = d["val_loss"][-1]
                wall_x.append(equal_wall_x(r, d) if r["wall_s_measured"] else None)
                t_d = time_to(target, d["wall_s_measured"], d["val_loss"])
                t_m = time_to(target, r["wall_s_measured"], r["val_loss"])
                ratios.append(t_m / t_d if t_m is not None else None)
                if d["step"][-1] in r["step"]:  # a longer run repeats DiLoCo's steps first
                    final.append(r["val_loss"][r["step"].index(d["step"][-1])] / target)
                U.append(r["U_measured"])
                if "sim" in r and "sim" in d:  # the same rule on the simulated runs
                    sd, sm = d["sim"], r["sim"]
                    sim_target = sd["val_loss"][-1]
                    ts_d = time_to(sim_target, sd["wall_s_simulated"], sd["val_loss"])
                    ts_m = time_to(sim_target, sm["wall_s_simulated"], sm["val_loss"])
                    sim_ratio.append(ts_m / ts_d if ts_m is not None and ts_d else None)
            if not ratios:  # not run (yet)
                continue
            out.append({"case": name, "method": m, "ratios": ratios, "final_x": final,
                        "U": U, "sim_ratio": sim_ratio, "wall_x": wall_x})  # fmt: skip
    return out


def fmt_ratios(ratios: list) -> str:
    got = [r for r in ratios if r is not None]
    if not got:
        return f"not reached (0/{len(ratios)})"
    text = f"{statistics.mean(got):.2f} ({min(got):.2f}-{max(got):.2f})"
    return text if len(got) == len(ratios) else f"{text}, {len(got)}/{len(ratios)} reached"


def table(record: dict) -> str:
    first = record.get("seeds", [0])[0]  # the simulator runs beside the first seed only
    lines = [
        "| case | method | time to DiLoCo's loss, x DiLoCo (mean, min-max over seeds) "
        f"| simulator's prediction (seed {first}) "
        "| final loss x DiLoCo, equal steps (mean, worst) "
        "| loss x DiLoCo, equal wall clock (mean, worst) | U measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in analyze(record):
        sim = ", ".join("-" if s is None else f"{s:.2f}" for s in a["sim_ratio"]) or "-"
        fin = (f"{statistics.mean(a['final_x']):.4f}, {max(a['final_x']):.4f}"
               if a["final_x"] else "stopped early")  # fmt: skip
        W = [w for w in a["wall_x"] if w is not None]
        wall = f"{statistics.mean(W):.4f}, {max(W):.4f}" if W else "-"
        U = [u for u in a["U"] if u is not None]
        u = f"{statistics.mean(U):.2f}" if U else "-"
        lines.append(f"| {a['case']} | {a['method']} | {fmt_ratios(a['ratios'])} | {sim} "
                     f"| {fin} | {wall} | {u} |")  # fmt: skip
    return "\n".join(lines)


def time_split_table(record: dict) -> str:
    """Where each method's wall clock went, per inner step (mean over seeds): compute, the
    blocking of each named operation, and the rest (coding before a post, the outer step, the
    round's bookkeeping). Runs written before the split was kept have no row."""
    lines = [
        "| case | method | compute s/step | blocking s/step, by operation | other s/step | U |",
        "|---|---|---|---|---|---|",
    ]
    for name, case in record["cases"].items():
        for m in record["methods"]:
            runs = [r for r in case["runs"] if r["method"] == m and "other_s_measured" in r]
            if not runs:
                continue

            def per_step(seconds, runs=runs) -> float:  # seconds(run) over its steps, mean
                return statistics.mean(seconds(r) / _steps_run(r) for r in runs)

            ops = sorted({op for r in runs for op in r["blocking_s_by_op_measured"]})
            by_op = ", ".join(
                f"{op} {per_step(lambda r, op=op: r['blocking_s_by_op_measured'].get(op, 0.0)):.3f}"
                for op in ops
            )
            compute = statistics.mean(r["step_s_measured"] for r in runs)
            other = per_step(lambda r: r["other_s_measured"])
            U = statistics.mean(r["U_measured"] for r in runs)
            lines.append(
                f"| {name} | {m} | {compute:.3f} | {by_op or '-'} | {other:.3f} | {U:.2f} |"
            )
    return "\n".join(lines)


def _steps_run(run: dict) -> int:
    """The run's inner steps; in files written before they were kept, its last evaluation's
    (the same in a run that was not stopped at the budget: evaluations divide the steps)."""
    return run.get("steps_run") or run["step"][-1]


def diloco_r(record: dict, case: str) -> float | None:
    """DiLoCo's r in a case: the probed all-reduce over its H steps' measured compute (None
    where DiLoCo did not run)."""
    c = record["cases"][case]
    steps = [r["step_s_measured"] for r in c["runs"] if r["method"] == BASELINE]
    if not steps:
        return None
    return c["probe"]["allreduce_s_measured"] / (record["H"] * statistics.mean(steps))


def links_table(record: dict) -> str:
    """The links as probed, and DiLoCo's r they gave its runs; with a case at DiLoCo's r
    (NAME=rX), the r asked and the step time it was set from."""
    asked = any("target" in case for case in record["cases"].values())
    extra = " DiLoCo's r asked (its step, s, before the runs) |" if asked else ""
    lines = [
        "| case | links, Mbit/s | all-reduce of S, s | pair exchange of S, s | DiLoCo's r |"
        + extra,
        "|---|---|---|---|---|" + ("---|" if asked else ""),
    ]
    for name, case in record["cases"].items():
        p = case["probe"]
        rates = "/".join(f"{x:g}" for x in case["rates_mbit"])
        r = diloco_r(record, name)
        t = case.get("target")
        target = (f" {t['r']:g} ({t['step_s_measured']:.3f}) |" if t else " - |") if asked else ""
        lines.append(
            f"| {name} | {rates} | {p['allreduce_s_measured']:.3f} | "
            f"{p['pair_exchange_s_measured']:.3f} | {'-' if r is None else f'{r:.2f}'} |{target}"
        )
    return "\n".join(lines)


def _steps_to(record: dict, method: str) -> dict[int, list]:
    """{seed: what each case's run of `method` got}: the fraction of DiLoCo's steps (same case
    and seed) at which its validation loss first reached DiLoCo's final one (linear between
    evaluations), "not reached" after all its steps, or ("stopped", fraction of the steps run)
    when the wall-clock budget stopped it first."""
    got: dict[int, list] = {}
    for case in record["cases"].values():
        base = {r["seed"]: r for r in case["runs"] if r["method"] == BASELINE}
        for r in (r for r in case["runs"] if r["method"] == method):
            d = base[r["seed"]]
            steps = time_to(d["val_loss"][-1], r["step"], r["val_loss"])
            if steps is not None:
                value = steps / d["step"][-1]
            elif r["step"][-1] < d["step"][-1]:
                value = ("stopped", r["step"][-1] / d["step"][-1])
            else:
                value = "not reached"
            got.setdefault(r["seed"], []).append(value)
    return got


PENALTY_FILES = (
    "time_to_loss_past_h10.json",
    "time_to_loss_past_h10_rest.json",
    "time_to_loss_mix1_delta.json",
    "time_to_loss_h5.json",
    "time_to_loss_h5_d1.json",
    "time_to_loss_globalm2.json",
    "time_to_loss_reduce_scatter.json",
    "time_to_loss_reduce_scatter_slow.json",
)
"""The results the planner's penalties come from (under benchmarks/results/), in order: a method
measured in more than one takes the first's. Every method at DiLoCo's outer step for H = 10
(lr 1.0, momentum 0), the others running past DiLoCo's steps (--steps-x 1.5); a method at its
own H (H = 5 in 4 bits) gets the fraction of DiLoCo's H it ran at (H_fraction)."""
PENALTY_FILES_BEFORE = ("time_to_loss.json", "time_to_loss_int8_fgd.json")
"""Those of the planner's first penalties (each method at its example's outer step of the time,
the others stopped at DiLoCo's steps): the plan tables of those runs are drawn with them."""
SAME_SETUP = ("data", "tuned_on", "steps", "H", "seeds")  # of every penalties file


def penalties(files: list[tuple[str, dict]]) -> dict:
    """Every run's step penalties from results files, (path, record) each, all of one setup
    (packaged_penalties picks the planner's from them): per method, the [outer] table it was
    measured with (the file's `outer_tables`: its example's at the time, with the variant's
    overrides; H is the run's own), the file it was measured in and the fraction of DiLoCo's
    steps it needs to reach DiLoCo's final loss: the mean over seeds. A seed's curve is the
    same in every case (its losses do not depend on the links), so each seed counts once:
    reached if any case's run reached it, else "not reached", or "stopped" (at the budget,
    before all its steps) with the fraction it had run."""
    first = files[0][1]
    for path, record in files[1:]:
        for key in SAME_SETUP:
            if record[key] != first[key]:
                raise ValueError(f"{path}: {key} = {record[key]!r}, not {first[key]!r}: "
                                 "penalties must come from one setup")  # fmt: skip
    methods = {}
    for path, record in files:
        for m in record["methods"]:
            if m not in methods:
                methods[m] = {**_penalty(record, m), "source": path}
    base = load_config(*overrides(BASELINE, []))
    return {
        "kind": "measured",
        "source": ", ".join(path for path, _ in files),
        "date": max(record["date"] for _, record in files),
        "measured_on": first["data"],
        "tuned_on": first["tuned_on"],
        "workers": base.run.workers,
        "steps": first["steps"],
        "H": first["H"],
        "seeds": first["seeds"],
        "rule": "fraction of DiLoCo's steps at which the method's validation loss first reached "
        "DiLoCo's final one (same case and seed, linear between evaluations), mean over the "
        "seeds that reached it",
        "methods": methods,
    }


def _penalty(record: dict, m: str) -> dict:
    """Method `m`'s entry of the planner's table from one results file."""
    seeds = {}
    for seed, got in sorted(_steps_to(record, m).items()):
        reached = [g for g in got if isinstance(g, float)]
        stopped = [g[1] for g in got if isinstance(g, tuple)]
        if reached:
            seeds[str(seed)] = statistics.mean(reached)
        elif "not reached" in got:
            seeds[str(seed)] = "not reached"
        else:
            seeds[str(seed)] = f"stopped by the budget at {max(stopped):.2f} of the steps"
    fractions = [v for v in seeds.values() if isinstance(v, float)]
    example, extra = METHODS[m]
    outer = dict(record["outer_tables"][m])
    own_H = {"H_fraction": outer.pop("H") / record["H"]} if "H" in outer else {}
    return {
        "example": f"examples/{example}.toml",
        "overrides": extra,
        "outer": outer,
        **own_H,
        "steps_fraction": statistics.mean(fractions) if fractions else None,
        "reached": f"{len(fractions)}/{len(seeds)}",
        "seeds": seeds,
    }


def penalty_files(
    results: Path = RESULTS, names: tuple[str, ...] = PENALTY_FILES
) -> list[tuple[str, dict]]:
    """`names` (PENALTY_FILES) as `penalties` takes them (paths relative to the repository)."""
    return [(f"benchmarks/results/{name}", json.loads((results / name).read_text()))
            for name in names]  # fmt: skip


def plan_cases(record: dict, pen: dict | None = None) -> list[dict]:
    """Per case, the planner fed the case's probe (with its links' nominal rates) and DiLoCo's
    measured step time (mean over seeds): its estimated time to DiLoCo's loss as a ratio to
    DiLoCo's per method, beside the measured ratios and the simulator's (seed 0, trained); its
    pick and the measured fastest (lowest mean ratio over the seeds that reached the loss). The
    step penalties come from these same runs, so this checks the clock and the composition, not
    how the penalties carry over to other configs. `pen`: the penalties' table (default: every
    run of PENALTY_FILES, by its run name)."""
    from frugaltrain.sim.plan import StepTime, links_from_probe, make_plan

    shared = [s for s in record["shared"] if not s.startswith("run.seed=")]
    cfg = load_config(*overrides(BASELINE, shared))
    found = {(a["case"], a["method"]): a for a in analyze(record)}
    pen = pen or penalties(penalty_files())
    out = []
    for name, case in record["cases"].items():
        steps = [r["step_s_measured"] for r in case["runs"] if r["method"] == BASELINE]
        step = StepTime(statistics.mean(steps), "measured (DiLoCo's runs of the case)")
        links = links_from_probe(
            case["probe"], cfg.run.workers, case["rates_mbit"], f"the {name} probe"
        )
        plan = make_plan(cfg, links, step, record["methods"], pen)
        rows = [(r, found[(name, r.method)]) for r in plan.rows]
        means = {r.method: statistics.mean(got) for r, a in rows
                 if (got := [x for x in a["ratios"] if x is not None])}  # fmt: skip
        fastest = min(means, key=means.get)
        out.append({"case": name, "rates": case["rates_mbit"], "step_s": step.seconds,
                    "rows": rows, "pick": plan.pick, "near_tie": plan.near_tie,
                    "fastest": fastest})  # fmt: skip
    return out


_PLAN_TABLES: dict[str, str] = {}  # tables.py renders every table once per check: plan once


def plan_table(record: dict, pen: dict | None = None) -> str:
    """`plan_cases` as one table: the pick column marks the plan's pick and the measured
    fastest."""
    from frugaltrain.sim.plan import seed_span

    key = json.dumps([record, pen], sort_keys=True)
    if key in _PLAN_TABLES:
        return _PLAN_TABLES[key]
    lines = [
        "| case | method | plan, x DiLoCo (estimated; fastest-slowest seed's penalty) "
        "| measured, x DiLoCo (mean, min-max over seeds) | simulator, x DiLoCo (seed 0) "
        "| plan's pick / measured fastest |",
        "|---|---|---|---|---|---|",
    ]
    for c in plan_cases(record, pen):
        for r, a in c["rows"]:
            plan = f"{r.ratio:.2f}" if r.ratio is not None else "-"
            if r.seeds_ratio is not None:
                plan += f" ({seed_span(r.seeds_ratio, '.2f')})"
            if r.steps_fraction is None:
                plan = "not reached"
            sim = ", ".join("-" if x is None else f"{x:.2f}" for x in a["sim_ratio"]) or "-"
            marks = [
                w
                for w, m in (
                    ("pick", c["pick"]),
                    ("near tie", c["near_tie"]),
                    ("fastest", c["fastest"]),
                )
                if m == r.method
            ]
            lines.append(f"| {c['case']} | {r.method} | {plan} | {fmt_ratios(a['ratios'])} "
                         f"| {sim} | {' / '.join(marks)} |")  # fmt: skip
    _PLAN_TABLES[key] = "\n".join(lines)
    return _PLAN_TABLES[key]


def check_against(record: dict, pen: dict | None = None) -> str:
    """The plan table, then per case its links, step time and whether the pick is the
    measured fastest (`pen`: as in plan_cases)."""
    lines = [plan_table(record, pen), ""]
    for c in plan_cases(record, pen):
        rates = "/".join(f"{x:g}" for x in c["rates"])
        same = "the same" if c["pick"] == c["fastest"] else "not the same"
        if c["near_tie"]:
            same += f"; a near tie with {c['near_tie']} over the seeds"
        lines.append(f"{c['case']}: links {rates} Mbit/s, step {c['step_s']:.4f} s: pick "
                     f"{c['pick']}, measured fastest {c['fastest']} ({same})")  # fmt: skip
    return "\n".join(lines)
