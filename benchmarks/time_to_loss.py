"""Time to loss on real slow links: the wall clock each method needs to reach DiLoCo's final
validation loss, with every worker a real process in its own netlab namespace behind a shaped
link and held to a fixed CPU share (a cgroup quota), so one worker's compute speed does not
depend on whether the others are blocked.

    python benchmarks/time_to_loss.py --data /usr/share/doc --cases r1=22,r2=11,slow=22:8 \
        --seeds 0,1,2 --out benchmarks/results/time_to_loss.json
    python benchmarks/time_to_loss.py --table JSON              # the tables and the PNG again
    python benchmarks/time_to_loss.py --resimulate JSON [CASE]  # the simulator's curves again
    python benchmarks/time_to_loss.py --penalties benchmarks/results/penalties.json
                      # the planner's step penalties (`frugaltrain plan`), from PENALTY_FILES
                      # (the runs in PLANNER, under the names a user types)
    python benchmarks/time_to_loss.py --check-against JSON [--before]
                      # the planner against the runs (--before: with the first penalties)

A case is NAME=RATE (every link RATE Mbit/s) or NAME=RATE:SLOW (the last worker's link SLOW).
RATE may be rX instead: the rate at which DiLoCo's r (its all-reduce of the model over one
round of compute) is X on this host now. Before the cases DiLoCo runs 5 rounds under the same
CPU quota for its step time, on unshaped links and then on the links that step gives (where
it waits as in the runs), and a probe at the ring's nominal rate for that r scales it to the
rate gloo gets. The host's speed drifts by up to a quarter between hours, so a rate fixed
in Mbit/s puts r anywhere from 0.75 to 1 (the links table gives the r each run got).
Each method is its example config as shipped (examples/<file>.toml: its own outer step, tuned on
the standard-library corpus with the same grid as every method) with the shared overrides below
(steps, H, data, seed, an evaluation every --eval-rounds rounds). Runs are interleaved (for each
case and seed, every method), DiLoCo first: the target of a case and seed is DiLoCo's final
validation loss (mean over workers), and a method's time to it is read off its own curve (wall
clock since the workers started training, linear between evaluations); beside it, its loss over
DiLoCo's at equal wall clock (where the sooner of the two ended). An evaluation is each worker's
own model on the same validation batches with no communication (run.eval_diagnostics = false):
it costs every method the same compute and nothing waits on a transfer for it; the loss is the
workers' mean. The curves are on the training clock: each evaluation's time is taken out of the
wall clock after it (--clock with-evals counts it in, as runs before this option did). A method
still above the target when its wall clock passes --budget x DiLoCo's is stopped there (DDP on a
slow link) and reported as not reached. With --steps-x F every other method may run F x DiLoCo's
steps (the lr at its floor past DiLoCo's last step, so its first steps are those of a run as
long as DiLoCo's): a method that ends DiLoCo's steps a fraction of a percent above its loss gets
a time instead of "not reached". Beside each measured curve of seed 0, the simulator's
prediction: the same config on the simulated clock fed the probed links (the all-reduce's
effective bandwidth, the pair exchange's ratio to it) and the run's measured step time, its time
to its own DiLoCo's final loss read off the same way. Needs root (netlab, cgroups). Writes the
JSON (provenance, every run's curve) and a PNG of loss against wall clock, and prints the table.

The methods (METHODS) and what a results file gives (its tables, the planner's step penalties,
the plan against the runs) are in time_to_loss_analysis.py, which benchmarks/tables.py imports
too; this script runs the methods and prints them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import provenance
from time_to_loss_analysis import (
    BASELINE,
    METHODS,
    PENALTY_FILES,
    PENALTY_FILES_BEFORE,
    check_against,
    links_table,
    overrides,
    penalties,
    penalty_files,
    table,
    time_split_table,
)

# Read here by tests/train/test_plan.py, which loads this script; the script itself does not.
from time_to_loss_analysis import analyze as analyze
from time_to_loss_analysis import equal_wall_x as equal_wall_x
from time_to_loss_analysis import plan_cases as plan_cases

from frugaltrain.config import load_config, to_toml
from frugaltrain.metrics.log import read_metrics


def common_overrides(args, seed: int, out_dir: str, longer: bool = False) -> list[str]:
    """The overrides every run shares; `longer` runs go on past DiLoCo's steps (--steps-x) at
    the floor lr, repeating over DiLoCo's steps what a run of that length does."""
    steps = round(args.steps * args.steps_x) if longer else args.steps
    sets = [
        f"run.steps={steps}",
        f"optim.decay_steps={args.steps}",
        f"outer.H={args.H}",
        f"run.eval_every={args.eval_rounds * args.H}",
        f"run.eval_batches={args.eval_batches}",
        "run.checkpoint_every=0",
        "run.eval_diagnostics=false",  # no transfer at evaluations: nothing waits on them
        "run.progress=false",
        f"run.seed={seed}",
        f"run.out_dir={out_dir!r}",
    ]
    if args.data:
        sets.append(f"data.path={args.data!r}")
    return [*sets, *args.set]


def parse_case(spec: str) -> tuple[str, str, float | None]:
    """NAME=RATE[:SLOW]; RATE is Mbit/s, or rX (DiLoCo's r), resolved by `rate_for_r`."""
    name, _, rates = spec.partition("=")
    rate, _, slow = rates.partition(":")
    try:  # a bad number fails here, before any run
        float(rate.removeprefix("r"))
        return name, rate, float(slow) if slow else None
    except ValueError:
        raise ValueError(
            f"--cases: {spec!r}: use NAME=RATE, NAME=RATE:SLOW (Mbit/s) or NAME=rX (DiLoCo's r X)"
        ) from None


def calibrate_step_s(args, runs: str, workers: int, rate_mbit: float = 0) -> float:
    """DiLoCo's compute seconds per inner step under the workers' CPU quota: 5 rounds on links
    of `rate_mbit` (0: unshaped), the first round left out (the process's warm-up). Its 40
    steps read the step within about 20% on a 2-core host (docs/results/time_to_loss.md)."""
    cfg_path, sets = overrides(BASELINE, common_overrides(args, 0, runs))
    steps = 5 * args.H
    sets += [f"run.steps={steps}", f"run.eval_every={steps}", f"run.name='calibrate-{rate_mbit:g}'"]
    lab = {"rate_mbit": rate_mbit, "cpu_shares": [args.cpu_share] * workers,
           "cpu_period_us": round(args.cpu_period_ms * 1000)}  # fmt: skip
    run_dir = run_one(cfg_path, sets, lab, 600)
    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "round"]
    return sum(r["time/compute_s"] for r in rounds[1:]) / (rounds[-1]["step"] - rounds[0]["step"])


def rate_at_r(r: float, args, runs: str, M: int, S: int, unshaped_step_s: float) -> dict:
    """A case's link rate for DiLoCo's r: set from its step time on unshaped links, then again
    from its step time on those links, where it waits as it will in the runs (a worker that
    waits may compute at another speed than four that never do)."""
    measure = probed_allreduce_s(M, S, Path(runs))
    first = rate_for_r(r, unshaped_step_s, args.H, M, S, measure)
    step_s = calibrate_step_s(args, runs, M, first["rate_mbit"])
    return rate_for_r(r, step_s, args.H, M, S, measure) | {
        "unshaped_step_s_measured": unshaped_step_s,
        "first_rate_mbit": first["rate_mbit"],
    }


def rate_for_r(r: float, step_s: float, H: int, M: int, S: int, allreduce_s) -> dict:
    """The uniform link rate (Mbit/s) at which the all-reduce of S bytes takes r rounds of
    compute: the ring's nominal rate (2(M-1)/M S over the link), scaled by what
    `allreduce_s(rate)` measured there, as gloo gets less than the link's rate."""
    round_s = r * H * step_s
    nominal = 2 * (M - 1) / M * S * 8 / 1e6 / round_s
    measured = allreduce_s(nominal)
    return {"r": r, "step_s_measured": step_s, "nominal_mbit": round(nominal, 2),
            "allreduce_s_at_nominal_measured": measured,
            "rate_mbit": round(nominal * measured / round_s, 2)}  # fmt: skip


def probed_allreduce_s(M: int, S: int, probe_dir: Path):
    """allreduce_s(rate) for `rate_for_r`: a probe of M workers' links at that rate."""

    def allreduce_s(rate: float) -> float:
        from frugaltrain.netlab.lab import NetLab
        from frugaltrain.netlab.run import probe

        with NetLab(M, rate) as lab:
            path = probe_dir / f"probe-at-{rate:.2f}.json"
            return probe(lab, S, 3, path)["allreduce_s_measured"]

    return allreduce_s


def curve(run_dir: Path, clock: str = "training") -> dict:
    """The run's evaluations against its wall clock. Evaluations are local (each worker's own
    model, run.eval_diagnostics = false). On the "training" clock their time is taken out (it
    is reported apart as eval_s_measured): they measure the run and are not part of it, so a
    larger validation sample does not slow the methods that need less time to the target. On
    the "with-evals" clock (every run before the clock was a choice) it is counted in."""
    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "round"]
    evals = [r for r in rounds if "loss/val" in r]
    wall_at_evals, spent = [], 0.0  # spent: the evaluations' time before this round's own
    for r in rounds:  # a round's wall is taken before its own evaluation
        if "loss/val" in r:
            own = r.get("time/eval_s", 0.0)
            wall_at_evals.append(r["time/wall_s"] + (own if clock == "with-evals" else -spent))
        spent += r.get("time/eval_s", 0.0)
    compute = sum(r["time/compute_s"] for r in rounds)
    blocking = sum(r["time/blocking_s"] for r in rounds)
    last_step = rounds[-1]["step"] if rounds else 0
    by_op: dict[str, float] = {}
    for r in rounds:
        for key, seconds in r.items():
            if key.startswith("comm/blocking_s/") and seconds:
                op = key.removeprefix("comm/blocking_s/")
                by_op[op] = by_op.get(op, 0.0) + seconds
    wall = rounds[-1]["time/wall_s"] if rounds else 0.0
    return {
        "wall_s_measured": wall_at_evals,
        "val_loss": [r["loss/val"] for r in evals],
        "step": [r["step"] for r in evals],
        "step_s_measured": compute / last_step if last_step else None,
        "eval_s_measured": sum(r.get("time/eval_s", 0.0) for r in evals),
        "U_measured": compute / (compute + blocking) if rounds else None,
        "steps_run": last_step,
        "blocking_s_by_op_measured": by_op,
        # Wall clock in neither compute, blocking nor evaluation: coding a mix before it is
        # posted, the outer step, the round's bookkeeping (worker 0's wall, the workers' mean
        # compute and blocking); a round's wall is taken before its own evaluation.
        "other_s_measured": wall
        - compute
        - blocking
        - sum(r.get("time/eval_s", 0.0) for r in rounds[:-1]),
    }


def run_one(cfg_path: str, sets: list[str], lab_args: dict, timeout_s: float) -> Path:
    from frugaltrain.netlab.lab import NetLab
    from frugaltrain.netlab.run import train
    from frugaltrain.train.launch import prepare

    cfg, run_dir, _ = prepare(cfg_path, sets, None)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    try:
        with NetLab(cfg.run.workers, **lab_args) as lab:
            train(lab, run_dir / "config.toml", run_dir, timeout_s=timeout_s)
    except TimeoutError:  # stopped at the budget: its curve so far is what it reached
        pass
    return run_dir


def simulated_curve(cfg_path: str, sets: list[str], step_s: float, link: dict, rates) -> dict:
    from frugaltrain.sim import SimSection, simulate
    from frugaltrain.sim.plan import links_from_probe

    cfg = load_config(cfg_path, sets)
    # The ring runs at its slowest link: each link keeps the share of its rate the probe found.
    links = links_from_probe(link, cfg.run.workers, rates)
    sim = SimSection(
        compute="fixed",
        step_s=step_s,
        bandwidth_bps=links.bandwidth_bps,
        p2p_bandwidth_ratio=links.p2p_ratio,
        latency_s=0.0,
    )
    evals = [r for r in simulate(cfg, sim).records if r.get("kind") == "round" and "loss/val" in r]
    return {
        "wall_s_simulated": [r["time/sim_s"] for r in evals],
        "val_loss": [r["loss/val"] for r in evals],
        "step": [r["step"] for r in evals],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="r1=22,r2=11,slow=22:8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("-H", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--eval-rounds", type=int, default=2, help="rounds between evaluations")
    ap.add_argument("--data", default="", help="data.path (empty: the examples' stdlib bytes)")
    ap.add_argument("--cpu-share", type=float, default=0.4, help="cores per worker (cgroup)")
    ap.add_argument("--cpu-period-ms", type=float, default=100.0, help="the quota's period")
    ap.add_argument("--budget", type=float, default=2.0, help="x DiLoCo's wall clock")
    clocks = ("training", "with-evals")  # the curves' clock: evaluations taken out, or counted in
    ap.add_argument("--clock", choices=clocks, default="training")
    ap.add_argument("--steps-x", type=float, default=1.0, help="other methods' steps x DiLoCo's")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator's curves")
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE for every run")
    ap.add_argument("--out", default="benchmarks/results/time_to_loss.json")
    args = ap.parse_args()

    from frugaltrain.netlab import cpu
    from frugaltrain.netlab.lab import NetLab, why_not_available
    from frugaltrain.netlab.run import probe

    reason = why_not_available() or cpu.why_not_available()
    if reason:
        print(f"time_to_loss: skipped: {reason}", file=sys.stderr)
        return 2
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or BASELINE not in methods:
        print(f"--methods: {unknown or 'no diloco'}; use {', '.join(METHODS)} (with diloco)")
        return 2
    methods = [BASELINE, *[m for m in methods if m != BASELINE]]
    seeds = [int(s) for s in args.seeds.split(",")]
    try:
        cases = [parse_case(c) for c in args.cases.split(",")]
    except ValueError as e:
        print(e)
        return 2
    variants = {m: [f"config=examples/{METHODS[m][0]}.toml", *METHODS[m][1]] for m in methods}
    record = provenance.start("measured", variants=variants, note="netlab, cgroup CPU quota")
    record |= {"methods": methods, "seeds": seeds, "steps": args.steps, "H": args.H,
               "steps_x": args.steps_x,
               "data": args.data or "stdlib bytes", "cpu_share": args.cpu_share,
               "cpu_period_ms": args.cpu_period_ms,
               "budget_x_diloco": args.budget, "clock": args.clock,
               "shared": common_overrides(args, 0, "RUNS"),
               "tuned_on": "stdlib (the examples' outer steps)", "cases": {},
               "outer_tables": {m: outer_table(m, args.set) for m in methods}}  # fmt: skip
    with tempfile.TemporaryDirectory() as runs:
        base = overrides(BASELINE, common_overrides(args, 0, runs))
        M, S = load_config(*base).run.workers, _param_bytes(base)
        labs, step_s, targets = {}, None, {}
        for name, spec, slow in cases:  # the links as gloo gets them, before any run
            if spec.startswith("r"):
                if step_s is None:
                    step_s = calibrate_step_s(args, runs, M)
                targets[name] = rate_at_r(float(spec[1:]), args, runs, M, S, step_s)
                rate = targets[name]["rate_mbit"]
            else:
                rate = float(spec)
            rates = [rate] * M if slow is None else [rate] * (M - 1) + [slow]
            labs[name] = {
                "rate_mbit": rate,
                "rates": rates,
                "cpu_shares": [args.cpu_share] * M,
                "cpu_period_us": round(args.cpu_period_ms * 1000),
            }
            with NetLab(M, rate, rates=rates) as lab:
                link = probe(lab, S, 3, Path(runs) / f"probe-{name}.json")
            record["cases"][name] = {"rates_mbit": rates, "probe": link, "runs": []}
            if name in targets:
                record["cases"][name]["target"] = targets[name]
        for seed in seeds:  # every case at one seed before the next seed
            for name, case in record["cases"].items():
                diloco_wall = None
                for m in methods:
                    longer = m != BASELINE
                    cfg_path, sets = overrides(m, common_overrides(args, seed, runs, longer))
                    sets.append(f"run.name='{name}-{m}-s{seed}'")
                    timeout = 3600 if diloco_wall is None else args.budget * diloco_wall + 30
                    c = curve(run_one(cfg_path, sets, labs[name], timeout), args.clock)
                    if m == BASELINE:
                        diloco_wall = c["wall_s_measured"][-1]
                    row = {"method": m, "seed": seed, **c}
                    if not args.no_sim and seed == seeds[0] and c["step_s_measured"]:
                        row["sim"] = simulated_curve(
                            cfg_path, sets, c["step_s_measured"], case["probe"], case["rates_mbit"]
                        )
                    case["runs"].append(row)
                    print(json.dumps({"case": name, "method": m, "seed": seed,
                                      "final": c["val_loss"][-1:],
                                      "wall": c["wall_s_measured"][-1:],
                                      "U": c["U_measured"]}), flush=True)  # fmt: skip
                    provenance.save(record, args.out)
    provenance.finish(record)
    provenance.save(record, args.out)
    print(table(record))
    print(time_split_table(record))
    plot(record, Path(args.out).with_suffix(".png"))
    return 0


def _param_bytes(cfg_and_sets) -> int:
    from frugaltrain.models import build_model

    cfg = load_config(*cfg_and_sets)
    return 4 * sum(p.numel() for p in build_model(cfg).parameters())


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(record["cases"])
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    seed0 = record["seeds"][0]
    for ax, name in zip(axes[0], cases, strict=True):
        case = record["cases"][name]
        for k, m in enumerate(record["methods"]):
            for r in (r for r in case["runs"] if r["method"] == m and r["seed"] == seed0):
                col = colors[k % len(colors)]
                ax.plot(r["wall_s_measured"], r["val_loss"], color=col, label=m)
                if "sim" in r:
                    ax.plot(r["sim"]["wall_s_simulated"], r["sim"]["val_loss"], color=col,
                            linestyle=":", linewidth=1)  # fmt: skip
        for r in (r for r in case["runs"] if r["method"] == BASELINE and r["seed"] == seed0):
            ax.axhline(r["val_loss"][-1], color="grey", linewidth=0.6, label="DiLoCo's final loss")
        measured = [t for r in case["runs"] if r["seed"] == seed0 for t in r["wall_s_measured"]]
        if measured:  # the simulated tails of runs stopped early would squash the rest
            ax.set_xlim(0, 1.15 * max(measured))
        rates = case["rates_mbit"]
        ax.set_title(f"{name}: links {'/'.join(f'{x:g}' for x in sorted(set(rates)))} Mbit/s")
        ax.set_xlabel("training wall clock, s (measured; dotted: simulated)")
        ax.set_ylabel("validation loss (mean over workers)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def outer_table(method: str, sets: list[str] = ()) -> dict:
    """The method's [outer] table as its example sets it, with `sets` (every run's --set) and
    the variant's overrides, and without H (a run keeps its own)."""
    return provenance.outer_table(*overrides(method, list(sets)))


PLANNER = {
    "diloco": "diloco",
    "diloco-e3m0-H5-rs": "diloco-4bit",
    "GlobalM2-4bit-H5-d1-rs": "diloco-overlap",
    "streaming": "streaming",
    "noloco": "noloco",
    "GlobalM1LocalM2-4bit": "fgd",
    "ddp": "ddp",
}
"""The runs whose penalties `frugaltrain plan` ships, each under the name a user types
(config.AUTO_METHODS), in its order. The others stay here: the plan tables of the results files
(plan_table) plan every method a file measured, by its run name."""


def packaged_penalties(files: list[tuple[str, dict]]) -> dict:
    """The planner's table as it ships (benchmarks/results/penalties.json): `penalties` of the
    runs in PLANNER under their users' names, each [outer] table as a user writes it
    (as_written); the run's name stays as provenance ("run")."""
    lab = penalties(files)
    methods = {}
    for run, name in PLANNER.items():
        entry = lab["methods"][run]
        methods[name] = {"run": run, **entry, "outer": as_written(entry["outer"])}
    made = {  # how this file was made, from where (the runs' machine), each method's [outer]
        "command": "python benchmarks/time_to_loss.py --penalties "
        "benchmarks/results/penalties.json",
        "machine": files[0][1]["machine"],
        "outer_tables": {name: m["outer"] for name, m in methods.items()},
    }
    return {**made, **lab, "methods": methods}


def as_written(outer: dict) -> dict:
    """A measured [outer] table as a user writes the same training: fgd's GlobalM2 (no Mix1, a
    complete Mix2 over every tensor) with Mix2 sent tau steps early is DiLoCo with
    [outer.diloco] overlap = tau, step for step; the parameter codec it never read goes."""
    fgd = outer.get("fgd", {})
    globalm2 = fgd.get("preset") == "GlobalM2" and set(fgd) <= {"preset", "mix2_delay"}
    if outer["strategy"] != "fgd" or not globalm2:
        return outer
    same = {k: v for k, v in outer.items() if k not in ("strategy", "param_codec", "fgd")}
    overlap = fgd.get("mix2_delay", 0)
    return {"strategy": "diloco", **same, **({"diloco": {"overlap": overlap}} if overlap else {})}


def resimulate(path: Path, only: list[str]) -> None:
    """Recompute the simulator's curves of a results file, of the cases named in `only` (all if
    empty); its measured runs are kept."""
    record = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as runs:
        for name, case in record["cases"].items():
            if only and name not in only:
                continue
            for row in (r for r in case["runs"] if "sim" in r):
                shared = [s.replace("'RUNS'", repr(runs)) for s in record["shared"]]
                shared = [s for s in shared if not s.startswith("run.seed=")]
                cfg_path, sets = overrides(row["method"], [*shared, f"run.seed={row['seed']}"])
                row["sim"] = simulated_curve(
                    cfg_path, sets, row["step_s_measured"], case["probe"], case["rates_mbit"]
                )
                print(f"{name} {row['method']}: resimulated", flush=True)
    provenance.save(record, path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--resimulate"]:
        resimulate(Path(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1:2] == ["--penalties"]:
        out = Path(sys.argv[2])
        out.write_text(json.dumps(packaged_penalties(penalty_files()), indent=1) + "\n")
        print(f"wrote {out}")
    elif sys.argv[1:2] == ["--check-against"]:
        # --before: with the penalties of PENALTY_FILES_BEFORE (the plan tables of those runs)
        names = PENALTY_FILES_BEFORE if "--before" in sys.argv[3:] else PENALTY_FILES
        pen = penalties(penalty_files(names=names))
        print(check_against(json.loads(Path(sys.argv[2]).read_text()), pen))
    elif sys.argv[1:2] == ["--table"]:
        rec = json.loads(Path(sys.argv[2]).read_text())
        print(links_table(rec))
        print(table(rec))
        print(time_split_table(rec))
        plot(rec, Path(sys.argv[2]).with_suffix(".png"))
    else:
        sys.exit(main())
