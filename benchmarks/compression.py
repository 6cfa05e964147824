"""Bytes on the wire against validation loss: every codec, DiLoCo and Factored Gossip DiLoCo.

Each method x codec x seed trains the byte-level GPT job of benchmarks/fgd_real_text.py (4
workers, stdlib text, 500 steps: equal tokens for all; H = 10 by default, 50 rounds) either in
the simulator (`--runtime sim`, the same computation as real processes:
tests/sim/test_sim_equality.py) or as real gloo processes (`--runtime real`). Runs are
interleaved (for each seed, every cell), so load on this shared machine falls on all alike, and
the JSON is rewritten after every run. Reported per cell: bytes each worker sends per round
(counted by the comm from the encoded payloads, indices and scales included), how many times
fewer than fp32 DiLoCo, the final validation loss (mean ± std over seeds), its ratio to fp32
DiLoCo paired by seed, and the compute utilization the simulator gives on a link where fp32
DiLoCo's all-reduce takes 1.774 rounds of compute (the FGD paper's 100 Mbit/s setting;
simulated; real runs report their measured utilization on this machine's loopback instead).

Each method steps with its own tuned outer optimizer (OUTER below, tuned on this job at H = 10
with the same grid, seed 0; docs/results/compression.md): dense codecs with DiLoCo's outer
Nesterov momentum, sparse codecs SparseLoCo's way, the error feedback in place of the outer
momentum (momentum 0, feedback decay 1) and a larger outer step (its lr grid: 0.5, 1, 2, 3).

    python benchmarks/compression.py                              # simulator, 3 seeds
    python benchmarks/compression.py --runtime real --seeds 0 --codecs fp32,topk:0.01+2bit
    python benchmarks/compression.py --H 50 --steps 2000 --codecs fp32,topk:0.01+2bit

FGD's Mix1 sends parameters, which top-k cannot thin (outer.param_codec, fp32 by default), so
FGD's bytes fall only by Mix2's share; `--set outer.param_codec=int8` thins Mix1 too.

The cells' figures come from table_format.compression_cells (with CODECS), which tables.py
lays out as docs/results/compression.md's Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402
from fgd_real_text import base_config, summarize  # noqa: E402  (the shared job)
from table_format import CODECS, compression_cells  # noqa: E402  (shared with tables.py)

from frugaltrain.codecs.grammar import is_sparse  # noqa: E402
from frugaltrain.config import Config, build_config  # noqa: E402
from frugaltrain.metrics.log import read_metrics  # noqa: E402
from frugaltrain.sim.compare import method_overrides  # noqa: E402

RATIO = 1.774  # fp32 DiLoCo's all-reduce in rounds of compute: the paper's 100 Mbit/s
SPARSE_OUTER = ["outer.momentum=0", "outer.feedback_decay=1.0", "outer.lr=2.0"]
OUTER = {  # (method, sparse codec?) -> the outer optimizer it steps with (the docstring)
    ("diloco", False): ["outer.lr=0.35", "outer.momentum=0.8"],
    ("GlobalM1LocalM2", False): ["outer.lr=0.5", "outer.momentum=0.8"],
    ("diloco", True): SPARSE_OUTER,
    ("GlobalM1LocalM2", True): SPARSE_OUTER,
}


def run_one(cfg: Config, runtime: str, out: Path) -> list[dict]:
    """Train `cfg` (real processes or the simulator); its round records."""
    run_dir = out / cfg.run.name
    if runtime == "sim":
        from frugaltrain.sim import SimSection, simulate

        return simulate(cfg, SimSection(ratio=RATIO), run_dir).records
    from frugaltrain.train import launch

    launch.check_data(cfg)
    run_dir.mkdir(parents=True)
    launch.run(cfg, run_dir)
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "round"]


def cell(records: list[dict]) -> dict:
    rounds = [r for r in records if r.get("kind", "round") == "round"]
    row = summarize(rounds)
    row["bytes_per_round"] = statistics.mean(r["comm/bytes_sent"] for r in rounds)
    return row


def _ms(xs: list[float], fmt: str) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):{fmt}} ± {sd:{fmt}}"


def table(rows: list[dict], methods: list[str], codecs: list[str]) -> str:
    """The runs as a plain-text table, each cell's figures from table_format.compression_cells
    (the docs' Markdown table of them: benchmarks/tables.py)."""
    lines = compression_cells(rows, methods, codecs)
    if not lines:
        return "(no fp32 DiLoCo run to compare with: add diloco and fp32 to --methods/--codecs)"
    head = f"{'method':<17}{'codec':<16}{'MB/round':>10}{'x fewer':>9}"
    head += f"{'val loss':>18}{'x DiLoCo fp32':>17}{'util':>7}"
    out = [head, "-" * len(head)]
    for x in lines:
        out.append(
            f"{x['method']:<17}{x['codec']:<16}{x['mb']:>10.4f}{x['fewer']:>9.1f}"
            f"{_ms(x['loss'], '.4f'):>18}{_ms(x['ratio'], '.4f'):>17}{x['util']:>7.3f}"
        )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="diloco,GlobalM1LocalM2")
    ap.add_argument("--codecs", default=CODECS)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--runtime", choices=("real", "sim"), default="sim")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--out", default="benchmarks/results/compression.json")
    ap.add_argument(
        "--table", nargs="+", metavar="JSON", help="print the table of earlier runs' JSONs, no run"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    methods, codecs = args.methods.split(","), args.codecs.split(",")
    if args.table:  # e.g. seeds run apart, one table
        rows = [r for f in args.table for r in json.loads(Path(f).read_text())["runs"]]
        print(table(rows, methods, codecs))
        return
    raw, rows = base_config("gpt", ""), []
    common = [f"run.steps={args.steps}", f"outer.H={args.H}", f"run.eval_every={args.steps}"]
    clock = "measured (real processes)" if args.runtime == "real" else "simulated runtime"
    seeds = [int(s) for s in args.seeds.split(",")]
    cell_sets = {  # each cell's overrides but the run's seed, name and temporary directory
        (m, c): [*method_overrides(m), *common, f"outer.codec={c!r}"]
        + [*OUTER.get((m, is_sparse(c)), []), *args.set]
        for m in methods
        for c in codecs
    }
    result = provenance.start(
        "measured" if args.runtime == "real" else "simulated",
        variants={f"{m} {c}": v for (m, c), v in cell_sets.items()},
    )
    result |= {
        "clock": clock,
        "utilization": f"simulated at r = {RATIO}" if args.runtime == "sim" else "measured",
        "steps": args.steps,
        "H": args.H,
        "outer": {f"{m} {'sparse' if k else 'dense'}": v for (m, k), v in OUTER.items()},
        "runs": rows,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for m in methods:
                for c in codecs:
                    name = f"{m}-{c}-s{seed}".replace(":", "_").replace("+", "-")
                    sets = [*common, f"run.seed={seed}", f"run.name={name!r}"]
                    sets += [f"outer.codec={c!r}", f"run.out_dir={tmp!r}"]
                    sets += [*OUTER.get((m, is_sparse(c)), []), *args.set]
                    cfg = build_config(Config, raw, [*method_overrides(m), *sets])
                    row = {"method": m, "codec": c, "seed": seed, "sets": sets}
                    row |= cell(run_one(cfg, args.runtime, Path(tmp)))
                    row["loadavg"] = os.getloadavg()
                    rows.append(row)
                    print(
                        f"[seed {seed}] {m} {c}: val {row['loss_val']:.4f}, "
                        f"{row['bytes_per_round'] / 1e6:.4f} MB/round",
                        flush=True,
                    )
                    write(result, args.out)
    print(f"\n{clock}: 4 workers, {args.steps} steps, H = {args.H}, GPT on stdlib bytes")
    print(
        "bytes: counted per worker per round; util: "
        + (f"simulated at r = {RATIO}" if args.runtime == "sim" else "measured on this machine")
    )
    print(table(rows, methods, codecs))
    provenance.finish(result)
    write(result, args.out)
    print(f"wrote {args.out}")


def write(result: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
