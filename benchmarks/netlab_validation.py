"""Compute utilization on real rate-limited links (netlab) against predictions.

For each link rate and method (diloco, fgd GlobalM1, fgd GlobalM1LocalM2), alternating, it runs
a real 4-worker training job with every worker in its own network namespace behind a tbf-shaped
link, measures compute utilization U = compute / (compute + blocking) per worker from the run's
metrics (rounds 2.. ; round 1 holds connection setup), and predicts U for the same measured
inner-step time c and the same link rate B with
  - the simulator (frugaltrain.sim, compute = fixed at the measured c, bandwidth B), and
  - closed forms with r = T_AR / (H c): DiLoCo 1 / (1 + r); GlobalM1 1 / max(1, r);
    GlobalM1LocalM2 H c / (H c + T_pair + max(0, T_AR - H c)) (Mix2 is a blocking pair exchange
    of S bytes after Mix1's all-reduce),
each twice: with the nominal link (T_AR = 2 (M-1)/M S / B, T_pair = S / B, S = fp32 parameter
bytes) and with the link as measured by a gloo probe before the runs at that rate (T_AR and
T_pair timed with nothing else running; the simulator then gets the all-reduce's effective
bandwidth).
The simulator is also run with the measured inputs it can take (U_simulated_measured_inputs):
bandwidth = the probed all-reduce's effective bandwidth, sim.p2p_bandwidth_ratio = the probed
pair exchange's effective bandwidth over the all-reduce's, and sim.compute = "trace" replaying
the run's measured per-round compute (rounds 2.., mean over workers). The simulated run has as
many rounds as the trace and U is taken over all of them: with these three methods a round's
blocking depends only on that round (Mix1 is posted at the round start and waited at its end),
so simulated round k stands for measured round k + 1.
Needs root. Writes a JSON with every figure labelled measured / simulated / estimated:
{"provenance": command, date, machine, each case's overrides, load; "rows": one per case} (files
written before provenance was recorded are the bare list of rows; `rows()`
(table_format.netlab_rows) reads both).

    python benchmarks/netlab_validation.py --rates 28,14 --out docs/results/netlab.json
    # recompute the simulator's measured-input prediction from a results file (no root, no
    # netlab): adds U_simulated_measured_inputs to each case, rewrites the JSON and the plot
    python benchmarks/netlab_validation.py --reanalyze docs/results/netlab.json
    # the utilization table of a results file (table_format.netlab_table; tables.py writes it
    # into docs/results/netlab.md)
    python benchmarks/netlab_validation.py --table docs/results/netlab.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import provenance
from table_format import netlab_rows as rows
from table_format import netlab_table

METHODS = {
    "diloco": ["outer.strategy='diloco'"],
    "GlobalM1": ["outer.strategy='fgd'", "outer.fgd.preset='GlobalM1'"],
    "GlobalM1LocalM2": ["outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'"],
}


def predicted_blocking(method: str, compute_s: float, t_ar: float, t_pair: float) -> float:
    """Blocking seconds of one round with `compute_s` of inner steps (closed form)."""
    if method == "diloco":
        return t_ar
    if method == "GlobalM1":
        return max(0.0, t_ar - compute_s)
    return t_pair + max(0.0, t_ar - compute_s)


def closed_form(method: str, rounds: list[float], t_ar: float, t_pair: float) -> float:
    """U predicted round by round from each round's measured compute time: the max() in the
    overlap terms makes the prediction at the mean step time wrong when step times vary."""
    blocking = sum(predicted_blocking(method, c, t_ar, t_pair) for c in rounds)
    return sum(rounds) / (sum(rounds) + blocking)


def measured(run_dir: Path) -> dict:
    from frugaltrain.metrics.log import read_metrics

    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "round"]
    body = rounds[1:]
    compute = sum(r["time/compute_s"] for r in body)
    blocking = sum(r["time/blocking_s"] for r in body)
    steps = body[-1]["step"] - rounds[0]["step"]
    return {
        "U": compute / (compute + blocking),
        "round_compute_s": [r["time/compute_s"] for r in body],
        "round_blocking_s": [r["time/blocking_s"] for r in body],
        "step_s": compute / steps,
        "blocking_per_round_s": blocking / len(body),
        "rounds_measured": len(body),
        "val_loss": rounds[-1].get("loss/val"),
    }


def simulated(cfg, c: float, B_bits: float) -> float:
    from frugaltrain.sim import SimSection, simulate

    sim = SimSection(compute="fixed", step_s=c, bandwidth_bps=[B_bits], latency_s=0.0)
    result = simulate(cfg, sim)
    rounds = [r for r in result.records if r.get("kind") == "round"][1:]
    compute = sum(r["time/compute_s"] for r in rounds)
    blocking = sum(r["time/blocking_s"] for r in rounds)
    return compute / (compute + blocking)


def simulated_measured_inputs(cfg, m: dict, link: dict) -> dict:
    """The simulator fed with what was measured: the probed all-reduce bandwidth, the probed pair
    exchange's share of it, and the run's per-round compute (one simulated round per measured
    round; U over all of them)."""
    import copy

    from frugaltrain.sim import SimSection, simulate

    trace = list(m["round_compute_s"])
    cfg = copy.deepcopy(cfg)
    cfg.run.steps = len(trace) * cfg.outer.H
    B, ratio = (
        link["allreduce_effective_bps"],
        link["pair_effective_bps"] / link["allreduce_effective_bps"],
    )
    sim = SimSection(
        compute="trace",
        compute_trace_s=trace,
        bandwidth_bps=[B],
        p2p_bandwidth_ratio=ratio,
        latency_s=0.0,
    )
    rounds = [r for r in simulate(cfg, sim).records if r.get("kind") == "round"]
    compute = sum(r["time/compute_s"] for r in rounds)
    blocking = sum(r["time/blocking_s"] for r in rounds)
    return {
        "U_simulated_measured_inputs": compute / (compute + blocking),
        "sim_measured_inputs": {
            "bandwidth_bps": B,
            "p2p_bandwidth_ratio": ratio,
            "compute_trace_s": "measured.round_compute_s",
            "rounds_simulated": len(rounds),
            "round_compute_s_simulated": [r["time/compute_s"] for r in rounds],
            "round_blocking_s_simulated": [r["time/blocking_s"] for r in rounds],
        },
    }


def common_overrides(H: int, steps: int, runs: str) -> list[str]:
    return [
        "run.workers=4",
        f"outer.H={H}",
        f"run.steps={steps}",
        "run.eval_every=0",
        "run.eval_batches=2",
        "run.progress=false",
        "data.batch_size=8",
        "data.seq_len=64",
        f"run.out_dir={runs!r}",
    ]


def reanalyze(path: Path, runs: str) -> None:
    """Add the measured-input simulator prediction to every case of a results file (the measured
    figures and the earlier predictions are kept as they are) and redraw its plot."""
    from frugaltrain.config import load_config

    data = json.loads(path.read_text())
    results = rows(data)
    if isinstance(data, dict):  # a bare list (an older file) stays as it is
        data["reanalyzed"] = provenance.start("simulated")
    for row in results:
        steps = (row["measured"]["rounds_measured"] + 1) * row["H"]  # as run: round 1 + measured
        cfg = load_config(None, [*common_overrides(row["H"], steps, runs), *METHODS[row["method"]]])
        row.update(simulated_measured_inputs(cfg, row["measured"], row["link_probe_measured"]))
        print(
            json.dumps(
                {
                    "method": row["method"],
                    "rate_mbit": row["rate_mbit"],
                    "U_measured": row["measured"]["U"],
                    "U_simulated_probe": row.get("U_simulated_probe"),
                    "U_simulated_measured_inputs": row["U_simulated_measured_inputs"],
                    "U_closed_form_probe_estimated": row["U_closed_form_probe_estimated"],
                }
            ),
            flush=True,
        )
    if isinstance(data, dict):
        provenance.finish(data["reanalyzed"])
    path.write_text(json.dumps(data, indent=1) + "\n")
    plot(results, path.with_suffix(".png"))


def plot(results: list[dict], path: Path) -> None:
    """Bars: measured U and its predictions, per method and link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method']}\n{r['rate_mbit']:g} Mbit/s" for r in results]
    series = [
        ("measured", [r["measured"]["U"] for r in results]),
        ("closed form, probed link", [r["U_closed_form_probe_estimated"] for r in results]),
        ("simulator, probed link", [r.get("U_simulated_probe", float("nan")) for r in results]),
        (
            "simulator, measured inputs",
            [r.get("U_simulated_measured_inputs", float("nan")) for r in results],
        ),
        ("closed form, nominal link", [r["U_closed_form_nominal_estimated"] for r in results]),
    ]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(results))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(results)), labels, fontsize=8)
    ax.set_ylabel("compute utilization")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title("netlab: 4 workers, tbf-shaped links (measured vs predicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="28,14", help="link rates, Mbit/s, comma-separated")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("-H", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="docs/results/netlab.json")
    ap.add_argument("--runs", default="/tmp/netlab-runs", help="parent of the run directories")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator predictions")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the plot of a results file")
    ap.add_argument("--table", metavar="JSON", help="only print the table of a results file")
    ap.add_argument(
        "--reanalyze",
        metavar="JSON",
        help="add the simulator's measured-input prediction to a results file (no netlab)",
    )
    args = ap.parse_args()
    if args.table:
        print(netlab_table(json.loads(Path(args.table).read_text())))
        return 0
    if args.plot:
        plot(rows(json.loads(Path(args.plot).read_text())), Path(args.plot).with_suffix(".png"))
        return 0
    if args.reanalyze:
        reanalyze(Path(args.reanalyze), args.runs)
        return 0

    from frugaltrain.config import to_toml
    from frugaltrain.netlab.lab import NetLab, why_not_available
    from frugaltrain.netlab.run import train
    from frugaltrain.train.launch import prepare

    reason = why_not_available()
    if reason:
        print(f"skipped: {reason}")
        return 2
    common = common_overrides(args.H, args.steps, args.runs)
    rates = [float(x) for x in args.rates.split(",")]
    variants = {
        f"{method}-{rate:g}mbit": [
            *common,
            *METHODS[method],
            f"run.name='{method}-{rate:g}mbit'",
            f"netlab.rate_mbit={rate:g}",
        ]
        for rate in rates
        for method in args.methods.split(",")
    }
    record = provenance.start("measured", variants=variants, note="netlab namespaces, tc tbf")
    results = []
    from frugaltrain.models import build_model
    from frugaltrain.netlab.run import probe

    cfg0, _, _ = prepare(None, [*common, *METHODS["diloco"], "run.name='probe'"], None)
    S = 4 * sum(p.numel() for p in build_model(cfg0).parameters())
    for rate in rates:
        # What the shaped links deliver to gloo, with nothing else running (measured).
        with NetLab(4, rate) as lab:
            link = probe(lab, S, 3, Path(args.runs) / f"probe-{rate:g}.json")
        print(json.dumps({"rate_mbit": rate, "probe": link}), flush=True)
        for method in args.methods.split(","):
            name = f"{method}-{rate:g}mbit"
            cfg, run_dir, _ = prepare(None, [*common, *METHODS[method], f"run.name={name!r}"], None)
            (run_dir / "config.toml").write_text(to_toml(cfg))
            load0 = os.getloadavg()[0]
            t0 = time.monotonic()
            with NetLab(cfg.run.workers, rate) as lab:
                train(lab, run_dir / "config.toml", run_dir)
            m = measured(run_dir)
            B = rate * 1e6 / 8
            t_ar_nominal, t_pair_nominal = 1.5 * S / B, S / B
            row = {
                "method": method,
                "rate_mbit": rate,
                "H": args.H,
                "workers": 4,
                "param_bytes": S,
                "measured": m,
                "link_probe_measured": link,
                "r_nominal_estimated": t_ar_nominal / (args.H * m["step_s"]),
                "r_probe_estimated": link["allreduce_s_measured"] / (args.H * m["step_s"]),
                "U_closed_form_nominal_estimated": closed_form(
                    method, m["round_compute_s"], t_ar_nominal, t_pair_nominal
                ),
                "U_closed_form_probe_estimated": closed_form(
                    method,
                    m["round_compute_s"],
                    link["allreduce_s_measured"],
                    link["pair_exchange_s_measured"],
                ),
                "wall_s_measured": time.monotonic() - t0,
                "load_avg_1min_before": load0,
                "run_dir": run_dir.name,
            }
            if not args.no_sim:
                row["U_simulated_probe"] = simulated(
                    cfg, m["step_s"], link["allreduce_effective_bps"]
                )
                row.update(simulated_measured_inputs(cfg, m, link))
            results.append(row)
            print(json.dumps(row), flush=True)
    provenance.finish(record)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"provenance": record, "rows": results}, indent=1) + "\n")
    plot(results, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
