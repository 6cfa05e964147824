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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import provenance

from frugaltrain.config import load_config, to_toml
from frugaltrain.metrics.log import read_metrics
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


def outer_table(method: str, sets: list[str] = ()) -> dict:
    """The method's [outer] table as its example sets it, with `sets` (every run's --set) and
    the variant's overrides, and without H (a run keeps its own)."""
    return provenance.outer_table(*overrides(method, list(sets)))


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
SAME_SETUP = ("data", "tuned_on", "steps", "H", "seeds")
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
