"""Emulated links against shaped ones: does pacing in process (run.link_mbit, comm/pacing.py)
give the time to loss that tc-shaped links give?

`make run`'s pair, the default job and its DiLoCo baseline (fp32, H = 16), each run in netlab
namespaces with every worker held to the same CPU share (a cgroup quota), two ways per
repetition: behind tc tbf links of RATE Mbit/s ("shaped"), and behind unshaped links with
run.link_mbit = RATE ("emulated"). Within a repetition and a way, the target is that DiLoCo
run's final validation loss; each run's time to it is read off its own curve (linear between
evaluations, evaluation time taken out: time_to_loss.py's training clock). The table gives each
method's time on both ways and emulated / shaped, mean and range over the repetitions.

    python benchmarks/emulated_links.py --rate-mbit 16 --cpu-share 0.45 --reps 2 \
        --out benchmarks/results/emulated_links.json
    python benchmarks/emulated_links.py --table benchmarks/results/emulated_links.json

Needs root (netlab, cgroups) and `make run`'s data (runs/data/stdlib-bpe2k).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import provenance
from time_to_loss import curve, run_one, time_to

from frugaltrain.config import load_config, to_toml
from frugaltrain.train.baseline import baseline_config

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JOB = ROOT / "examples" / "default.toml"
BASELINE_SETS = ["outer.H=16"]  # make run's baseline: DiLoCo at this job's reference H
METHODS = ("diloco", "default job")  # DiLoCo first: its final loss is the target
WAYS = ("shaped", "emulated")


def configs(out_dir: str, extra: list[str]) -> dict[str, Path]:
    """The two methods' configs as TOML files (the default job, and its baseline as `make run`
    builds it), under `out_dir`."""
    sets = ["run.progress=false", "run.checkpoint_every=0", f"run.out_dir={out_dir!r}", *extra]
    job = load_config(str(DEFAULT_JOB), sets)
    base = baseline_config(job, "diloco", BASELINE_SETS)
    paths = {}
    for name, cfg in (("diloco", base), ("default job", job)):
        path = Path(out_dir) / f"{name.replace(' ', '_')}.toml"
        path.write_text(to_toml(cfg))
        paths[name] = path
    return paths


def run_way(way: str, path: Path, rep: int, args) -> dict:
    """One run of the config at `path` on `way`'s links; its curve."""
    shaped = way == "shaped"
    lab = {
        "rate_mbit": args.rate_mbit if shaped else 0,  # 0: unshaped namespace links
        "cpu_shares": [args.cpu_share] * 4,
        "cpu_period_us": 100_000,
    }
    sets = [f"run.name='{path.stem}-{way}-{rep}'"]
    if not shaped:
        sets.append(f"run.link_mbit=[{args.rate_mbit}]")
    run_dir = run_one(str(path), sets, lab, args.timeout_s)
    return {"run_dir": str(run_dir), **curve(run_dir)}


def analyze(record: dict) -> list[dict]:
    """Per repetition and way: each method's time to that way's DiLoCo final loss."""
    rows = []
    for rep in record["runs"]:
        for way in WAYS:
            target = rep[way]["diloco"]["val_loss"][-1]
            for method in METHODS:
                c = rep[way][method]
                t = time_to(target, c["wall_s_measured"], c["val_loss"])
                rows.append({"rep": rep["rep"], "way": way, "method": method, "time_s": t})
    return rows


def _span(xs: list[float], digits: int = 2) -> str:
    if not xs:
        return "not reached"
    return f"{statistics.mean(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def table(record: dict) -> str:
    """Per method: time to DiLoCo's final loss on each way and emulated / shaped; then what
    the pacing models, blocking seconds per worker, apart from the compute each run got."""
    rows = analyze(record)
    lines = [
        f"measured: {record['rate_mbit']:g} Mbit/s links, {record['cpu_share']:g} core per "
        f"worker, {len(record['runs'])} repetitions; mean (range)",
        "| method | time to DiLoCo's final loss, shaped (tc), s | emulated (in process), s "
        "| emulated / shaped | blocking s, shaped | blocking s, emulated | emulated / shaped "
        "| compute s per step, shaped | emulated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method in METHODS:
        t = {w: {r["rep"]: r["time_s"] for r in rows if r["method"] == method and r["way"] == w}
             for w in WAYS}  # fmt: skip
        ratios = [t["emulated"][k] / t["shaped"][k] for k in t["shaped"]
                  if t["shaped"][k] and t["emulated"].get(k)]  # fmt: skip
        runs = {w: [rep[w][method] for rep in record["runs"]] for w in WAYS}
        block = {w: [sum(c["blocking_s_by_op_measured"].values()) for c in runs[w]] for w in WAYS}
        step = {w: [c["step_s_measured"] for c in runs[w]] for w in WAYS}
        cells = [_span([x for x in t[w].values() if x is not None]) for w in WAYS]
        cells.append(_span(ratios, 3))
        cells += [_span(block["shaped"]), _span(block["emulated"])]
        cells.append(
            _span([e / s for e, s in zip(block["emulated"], block["shaped"], strict=True)], 3)
        )
        cells += [_span(step["shaped"], 3), _span(step["emulated"], 3)]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mbit", type=float, default=16.0, help="every worker's link")
    ap.add_argument("--cpu-share", type=float, default=0.45, help="cores per worker (a quota)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="the longest one run may take")
    ap.add_argument("--set", action="append", default=[], help="an override for every run")
    ap.add_argument("--table", default="", help="print the table of this results file")
    ap.add_argument("--out", default="benchmarks/results/emulated_links.json")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    variants = {w: [f"netlab rate {args.rate_mbit:g}" if w == "shaped" else
                    f"run.link_mbit=[{args.rate_mbit:g}]"] for w in WAYS}  # fmt: skip
    record = provenance.start("measured", variants=variants, note="netlab, cgroup CPU quota")
    record.update(rate_mbit=args.rate_mbit, cpu_share=args.cpu_share, sets=args.set, runs=[])
    with tempfile.TemporaryDirectory(prefix="emulated-links-") as out:
        paths = configs(out, args.set)
        for rep in range(args.reps):
            runs = {"rep": rep}
            for way in WAYS if rep % 2 == 0 else WAYS[::-1]:  # alternate which way goes first
                runs[way] = {m: run_way(way, paths[m], rep, args) for m in METHODS}
                for m in METHODS:  # the run directories go with the temporary folder
                    runs[way][m].pop("run_dir")
            record["runs"].append(runs)
            provenance.save(record, args.out)  # a cut run keeps the repetitions it finished
    provenance.save(provenance.finish(record), args.out)
    print(table(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
