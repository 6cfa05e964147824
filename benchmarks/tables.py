"""The results tables of the docs, regenerated from committed result files.

Each table sits in its Markdown between two markers,

    <!-- table NAME: python benchmarks/tables.py -->
    ...
    <!-- /table NAME -->

and is written here from the result files its entry in TABLES names; nothing between the
markers is typed by hand. Only the tables a user decides by are generated (the README's
headline, one or two per topic page); every other table in the docs is frozen Markdown that
names the results file it came from. `python benchmarks/tables.py` rewrites every generated
table; `--check` rewrites nothing and exits 1 naming each table whose doc differs
(tests/benchmarks/test_tables.py runs it, so a number edited by hand, or a result file changed
without its doc, fails the tests).

A table's code is here, or, for a table its benchmark script prints too, in table_format.py
(time_to_loss_analysis.py for time_to_loss.py's tables), which that script imports as well: the
benchmark scripts may use those modules, this one imports no benchmark script. Both are found
beside this file: Python puts a script's own directory first on its module search path.

    python benchmarks/tables.py            # rewrite the tables in README.md and docs/
    python benchmarks/tables.py --check    # compare only
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from table_format import (
    CODECS,
    compression_cells,
    data_prep_table,
    faults_table,
    machines_table,
    netlab_table,
    row,
    worker_start_table,
)
from time_to_loss_analysis import (
    PENALTY_FILES,
    analyze,
    diloco_r,
    fmt_ratios,
    penalties,
    plan_table,
)
from time_to_loss_analysis import table as time_to_loss_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Table:
    doc: str  # Markdown file, relative to the repository root
    files: tuple[str, ...]  # under benchmarks/results/, or from the root when a path (docs/...)
    render: Callable[[list[dict]], str]  # the files' JSON -> the table's Markdown


def _mb(x: float) -> str:
    """Megabytes to three decimals, or three significant digits below one."""
    return f"{x:.3f}" if x >= 1 else f"{x:#.3g}"


def _ms(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.4f} ± {sd:.4f}"


def compression(files: list[dict]) -> str:
    """Bytes per round against loss, every codec, DiLoCo and GlobalM1LocalM2 (three seeds)."""
    rows = [r for f in files for r in f["runs"]]
    names = {"diloco": "DiLoCo"}
    lines = [
        "| method | codec | MB/round per worker | x fewer than fp32 DiLoCo | val loss "
        "| x DiLoCo fp32 | util at 100 Mbit/s (simulated) |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in compression_cells(rows, ["diloco", "GlobalM1LocalM2"], CODECS.split(",")):
        lines.append(
            f"| {names.get(x['method'], x['method'])} | {x['codec']} | {_mb(x['mb'])} "
            f"| {x['fewer']:.1f} | {_ms(x['loss'])} | {_ms(x['ratio'])} | {x['util']:.3f} |"
        )
    return "\n".join(lines)


def ft_straggler(files: list[dict]) -> str:
    """Worker 0's time to its last round with and without a straggler, per method."""
    f = files[0]
    lines = [
        "| method | straggler | worker 0 s to round 19 | slowest worker then "
        "| Mix1 messages worker 0 dropped | final val loss | worker 0 time vs no straggler |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in f["rows"]:
        ratio = f["summary"][r["method"]]["worker0_time_ratio"] if r["straggler"] else 1.0
        lines.append(
            row(
                [
                    r["method"],
                    f"worker 1 at {f['factor']:g}x" if r["straggler"] else "no",
                    f"{r['worker0_s_to_last_round']:.1f}",
                    f"round {r['slowest_round_then']}",
                    str(r["mix1_late_worker0"]),
                    f"{r['val_loss']:.3f}",
                    f"**{ratio:.2f}x**" if r["straggler"] else f"{ratio:.2f}x",
                ]
            )
        )
    return "\n".join(lines)


ENERGY_ROOFLINE = (
    ("time_model", "step-time roofline, pre-run (**time**)"),
    ("roofline_pre_run", "energy roofline, predicted T (**pre-run**)"),
    ("roofline_post_run", "energy roofline, measured T (post-run)"),
    (
        "scale_shift_pre_run",
        "pre-run, scale shift (train on the smallest 75% of F, test on the rest)",
    ),
)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def energy_roofline(files: list[dict]) -> str:
    """The roofline models on the public set: the pre-run energy MAPE is the target's figure."""
    rows = files[0]["rows"]
    lines = [
        "| roofline models (20 splits) | R²(ln) | MAPE | RMSE(ln) |",
        "| --- | --- | --- | --- |",
    ]
    for key, label in ENERGY_ROOFLINE:
        r = rows[key]
        mape = f"**{_pct(r['mape'])}**" if key == "roofline_pre_run" else _pct(r["mape"])
        rmse = f"{r['log_rmse']:.3f}" if key != "scale_shift_pre_run" else ""
        lines.append(row([label, f"{r['r2_log']:.3f}", mape, rmse]))
    return "\n".join(lines)


# The H100 sweep's models and their targets: (key, label, MAPE at most, R²(ln) at least).
ENERGY_H100 = (
    ("time model (pre-run)", "time model (pre-run)", 0.12, None),
    ("energy, predicted T (pre-run)", "energy, predicted T (pre-run)", 0.15, 0.95),
    ("energy, measured T (post-run)", "energy, measured T (post-run)", 0.05, None),
    ("extrapolation_pre", "pre-run extrapolation (train on the smallest 75% of C)", 0.30, None),
)


def energy_h100(files: list[dict]) -> str:
    """The H100 sweep's models, 70/30 by architecture, each against its target."""
    f = files[0]
    lines = [
        "| 70/30 by architecture, 20 splits | R²(ln) | MAPE | target |",
        "| --- | --- | --- | --- |",
    ]
    for key, label, mape_max, r2_min in ENERGY_H100:
        r = f[key]
        met = r["mape"] <= mape_max and (r2_min is None or r["r2_log"] >= r2_min)
        target = f"≤ {100 * mape_max:g}%" + (f", R² ≥ {r2_min:g}" if r2_min else "")
        cells = [f"{r['r2_log']:.3f}", _pct(r["mape"]), f"{target}: {'met' if met else 'missed'}"]
        lines.append(row([label, *cells]))
    return "\n".join(lines)


def _hf_runs(files: list[dict]) -> dict[tuple[str, str, int], dict]:
    """{(method, corpus, seed): run} of hf_loss_gap.py files; the corpus is the token shard
    directory's name."""
    return {(r["method"], Path(f["data"]).name, r["seed"]): r for f in files for r in f["runs"]}


def hf_outer_choice(groups: tuple[tuple[str, ...], ...]) -> Callable[[list[dict]], str]:
    """Per group of variants (one method's outer steps): each seed's final validation loss (each
    worker's own model, mean over workers) and the mean, the lowest mean in bold."""

    def render(files: list[dict]) -> str:
        runs = _hf_runs(files)
        seeds = sorted({s for _, _, s in runs})
        head = " | ".join(f"seed {s}" for s in seeds)
        lines = [f"| variant | corpus | {head} | mean |", "|---" * (len(seeds) + 3) + "|"]
        for group in groups:
            corpus = next(c for m, c, _ in runs if m == group[0])
            means = {m: statistics.mean(runs[m, corpus, s]["loss_val"] for s in seeds)
                     for m in group}  # fmt: skip
            for m in group:
                cells = [f"{runs[m, corpus, s]['loss_val']:.4f}" for s in seeds]
                cells.append(f"{means[m]:.4f}")
                if means[m] == min(means.values()):
                    cells = [f"**{c}**" for c in cells]
                lines.append(row([m, corpus, *cells]))
        return "\n".join(lines)

    return render


def hf_pair_ratios(pairs: tuple[tuple[str, str], ...]) -> Callable[[list[dict]], str]:
    """Per (method, reference) pair and corpus: the method's final validation loss over the
    reference's of the same seed, each worker's own model and the averaged one: mean, worst."""

    def render(files: list[dict]) -> str:
        runs = _hf_runs(files)
        corpora = list(dict.fromkeys(c for _, c, _ in runs))
        seeds = sorted({s for _, _, s in runs})
        lines = [
            "| method / reference | corpus | each worker's own model, seeds "
            f"{', '.join(map(str, seeds))} | mean, worst | averaged model: mean, worst |",
            "|---|---|---|---|---|",
        ]
        for method, ref in pairs:
            for c in corpora:
                if not all((m, c, s) in runs for m in (method, ref) for s in seeds):
                    continue
                xs, avg = (
                    [runs[method, c, s][key] / runs[ref, c, s][key] for s in seeds]
                    for key in ("loss_val", "loss_val_avg_model")
                )
                cells = [", ".join(f"{x:.4f}" for x in xs)]
                cells += [f"{statistics.mean(x):.4f}, {max(x):.4f}" for x in (xs, avg)]
                lines.append(row([f"{method} / {ref}", c, *cells]))
        return "\n".join(lines)

    return render


def forge_memory_llama(files: list[dict]) -> str:
    """Memory per variant for the transformers Llama, by dtype, with the largest single
    allocation."""
    lines = [
        "| dtype | variant | resident | whole-step peak | ratio | transient | ratio | largest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in files[0]["rows"]:
        cells = [r["dtype"], r["variant"], f"{r['resident_MiB']:.0f}", f"{r['peak_MiB']:.0f}"]
        cells += [f"{r['peak_ratio']:.2f}", f"{r['transient_MiB']:.0f}"]
        lines.append(row([*cells, f"{r['transient_ratio']:.2f}", f"{r['largest_alloc_MiB']:.1f}"]))
    return "\n".join(lines)


def forge_speed_states(files: list[dict]) -> str:
    """Step time by state format, with each repetition's ratio to torch AdamW's."""
    lines = [
        "| size | dtype | variant | median s | min - max s | ratio of medians "
        "| paired ratio: median (min - max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in files[0]["rows"]:
        lo, hi = r["paired_ratio_min"], r["paired_ratio_max"]
        paired = f"{r['paired_ratio_median']:.2f}" + (f" ({lo:.2f} - {hi:.2f})" if lo != hi else "")
        cells = [r["size"], r["dtype"], r["variant"], f"{r['median_step_s']:.3f}"]
        cells.append(f"{r['min_step_s']:.3f} - {r['max_step_s']:.3f}")
        lines.append(row([*cells, f"{r['ratio']:.2f}", paired]))
    return "\n".join(lines)


def _by_shards(f: dict, part: str) -> dict[int, list[dict]]:
    """S -> the repetitions of `part` in a sharding.py result file."""
    out: dict[int, list[dict]] = {}
    for r in f["results"]:
        if r["part"] == part:
            out.setdefault(r["shards"], []).append(r)
    return dict(sorted(out.items()))


def _spread(xs: list[float], fmt: str) -> str:
    """Median [min, max]."""
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"


def sharding_memory(names: tuple[str, ...]) -> Callable[[list[dict]], str]:
    """Peak RSS (the largest of a case's processes) and step time per S, medians over the
    repetitions, one section per result file (its malloc setting); the ratios at S > 1 in bold
    for the peak (the targets)."""

    def render(files: list[dict]) -> str:
        lines = [
            "| S | peak RSS per process, MiB (measured) | x S=1 | estimate, MiB "
            "| step s (measured) | x S=1 |",
            "|---|---|---|---|---|---|",
        ]
        for name, f in zip(names, files, strict=True):
            runs = _by_shards(f, "memory")
            mmap = runs[min(runs)][0].get("malloc_mmap_threshold")
            malloc = f"`MALLOC_MMAP_THRESHOLD_={mmap}`" if mmap else "glibc's default malloc"
            lines.append(row([f"{malloc} (`benchmarks/results/{name}`)", *[""] * 5]))
            peak = {s: [max(r["peak_rss_MiB"]) for r in rs] for s, rs in runs.items()}
            step = {s: [r["step_s"] for r in rs] for s, rs in runs.items()}
            peak1, step1 = (statistics.median(x[min(runs)]) for x in (peak, step))
            for s, rs in runs.items():
                ratio = f"{statistics.median(peak[s]) / peak1:.3f}"
                cells = [str(s), _spread(peak[s], ".0f"), f"**{ratio}**" if s > 1 else ratio]
                cells += [f"{rs[0]['estimate_with_process_MiB']:.0f}", _spread(step[s], ".1f")]
                lines.append(row([*cells, f"{statistics.median(step[s]) / step1:.2f}"]))
        return "\n".join(lines)

    return render


def _corpora_runs(files: list[dict], model: str = "base") -> dict[tuple[str, str, int], dict]:
    """(method, corpus, seed) -> run of `model`, over fgd_corpora result files; a run found in
    two files must be the same to the bit (a baseline rerun), or this raises."""
    out: dict = {}
    for f in files:
        for r in f["runs"]:
            if r["model"] != model:
                continue
            key = (r["method"], r["corpus"], r["seed"])
            same = ("loss_val", "loss_val_avg_model")
            if key in out and any(out[key][k] != r[k] for k in same):
                raise ValueError(f"{key}: two different runs")
            out[key] = r
    return out


def fgd_pair_ratios(
    pairs: tuple[tuple[str, str], ...], model: str = "base"
) -> Callable[[list[dict]], str]:
    """Per (method, reference) pair and corpus: method's final validation loss over the
    reference's of the same seed, each seed, the mean and the worst, on each worker's own model
    and on the averaged one (fgd_corpora's `model`)."""

    def render(files: list[dict]) -> str:
        runs = _corpora_runs(files, model)
        corpora = sorted({c for _, c, _ in runs})
        seeds = sorted({s for _, _, s in runs})
        parts = []
        for key, what in (
            ("loss_val", "each worker's own model"),
            ("loss_val_avg_model", "averaged model"),
        ):
            head = " | ".join(f"seed {s}" for s in seeds)
            lines = [
                f"{what}, {model} model (simulated):\n",
                f"| method / reference | corpus | {head} | mean | worst |",
                "|---" * (len(seeds) + 4) + "|",
            ]
            for method, ref in pairs:
                for c in corpora:
                    got = [(method, c, s) in runs and (ref, c, s) in runs for s in seeds]
                    if not any(got):
                        continue
                    xs = [
                        runs[(method, c, s)][key] / runs[(ref, c, s)][key] if ok else None
                        for s, ok in zip(seeds, got, strict=True)
                    ]
                    have = [x for x in xs if x is not None]
                    cells = [f"{x:.4f}" if x is not None else "-" for x in xs]
                    cells += [f"{statistics.mean(have):.4f}", f"{max(have):.4f}"]
                    tuned = " (tuned)" if c == files[0]["tuned_on"] else ""
                    lines.append(row([f"{method} / {ref}", c + tuned, *cells]))
            parts.append("\n".join(lines) + "\n")
        return "\n".join(parts).rstrip()

    return render


RETUNE_ALL_PICKS = (  # what the rule chose for each (as shipped: GlobalM1)
    ("streaming-m0-lr1.26", "streaming"),
    ("noloco-m0-lr1.26", "noloco"),
    ("GlobalM1", "GlobalM1"),
    ("GlobalM1LocalM2-m0-lr1.26", "GlobalM1LocalM2"),
    ("subset-m0-lr1.0", "subset"),
    ("gossip-m0-lr1.0", "gossip"),
)
RETUNE_ALL_PAIRS = tuple((pick, "diloco-m0-lr1.26") for pick, _ in RETUNE_ALL_PICKS) + tuple(
    (pick, shipped) for pick, shipped in RETUNE_ALL_PICKS if pick != shipped
)  # each pick over retuned DiLoCo, then over its own shipped step


def _job_grid(method: str) -> tuple[tuple[str, ...], ...]:
    """A method's outer steps tried on the default job's stdlib: the job's earlier one, then
    momentum 0 at three lr."""
    return ((f"{method}-lr0.35-m0.8", *(f"{method}-m0-lr{lr}" for lr in ("1.0", "1.26", "1.6"))),)


DILOCO_RS_OVERLAP_JOB = "GlobalM2-4bit-H5-d1-rs"  # the default job: DiLoCo, rs, a step early
DILOCO_RS_OVERLAP_JOB_PAIRS = ((f"{DILOCO_RS_OVERLAP_JOB}-m0-lr1.0", "diloco-m0-lr1.0"),)
DILOCO_RS_OVERLAP_JOB_FILES = (
    "default_job_grid_globalm2_a.json",
    "default_job_grid_globalm2_b.json",
    "default_job_grid_rs_a.json",  # DiLoCo at the job's H = 16 on stdlib
    "default_job_report_diloco.json",
    "default_job_report_globalm2_doc.json",
    "default_job_report_include_diloco.json",
    "default_job_report_globalm2_include.json",
)


# docs/flow.md: benchmarks/flow.py's result files on the transformers parts (run 3 the quiet
# one; their fair baseline is `monolithic_dp`). The page's other tables (the idle breakdown, the
# simulator's sensitivity and validation, the earlier tiny parts on digits) are frozen there,
# each naming its results files.
FLOW_WORKLOADS = {"encoder_heavy": "encoder-heavy", "backbone_heavy": "backbone-heavy"}
FLOW_BASELINE = "monolithic_dp"  # the transformers runs' fair baseline

VLM_FILES = ("flow-vlm-run1.json", "flow-vlm-run2.json", "flow-vlm-quiet.json")
VLM_RUNS = ("1", "2", "3 (quiet)")  # the row label of each of VLM_FILES
VLM_GROUPS = ((0, 1), (2,))  # the loaded runs, then the quiet one, each by workload


def _header(cells: list[str]) -> list[str]:
    return ["| " + " | ".join(cells) + " |", "|---" * len(cells) + "|"]


def _vlm_rows(files: list[dict], groups=VLM_GROUPS):
    """(workload, row label, that workload's result) in the tables' order: each group of runs,
    by workload."""
    for group in groups:
        for wl, name in FLOW_WORKLOADS.items():
            for i in group:
                yield wl, f"{name}, {VLM_RUNS[i]}", files[i]["workloads"][wl]


def _median_boot(s: dict) -> str:
    lo, hi = s["boot95"]
    return f"{s['median']:.1f} [{lo:.1f}-{hi:.1f}]"


def _load_before(w: dict) -> str:
    """The 1-minute load average before every run of every variant: median [min-max]."""
    xs = [before for runs in w["measured.loadavg_1min_per_run"].values() for before, _ in runs]
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def vlm_runs(files: list[dict]) -> str:
    """Every variant's median samples/s with its 95% bootstrap interval, flow / the fair baseline
    (ratio of medians, in bold, with its interval) and the allocator's prediction of it."""
    lines = _header(
        [
            "Workload, run",
            "load before runs, median [min-max]",
            "monolithic_dp (fair baseline)",
            "monolithic, 1 process x 2 threads",
            "sync",
            "flow",
            "**flow / baseline** [95%]",
            "predicted flow / baseline",
        ]
    )
    for _, label, w in _vlm_rows(files):
        thr = w["measured.samples_per_s"]
        ratio = thr["flow"]["median"] / thr[FLOW_BASELINE]["median"]
        lo, hi = w[f"measured.over_{FLOW_BASELINE}"]["flow"]["boot95"]
        cells = [_median_boot(thr[v]) for v in (FLOW_BASELINE, "monolithic", "sync", "flow")]
        lines.append(
            row(
                [
                    label,
                    _load_before(w),
                    *cells,
                    f"**{ratio:.2f}** [{lo:.2f}-{hi:.2f}]",
                    f"{w['predicted']['predicted.flow_over_baseline']:.2f}",
                ]
            )
        )
    return "\n".join(lines)


def vlm_projection(files: list[dict]) -> str:
    """Simulated flow / data parallelism at every projected R, with the MILP plan (encoder +
    backbone); R = 8 and 64 in bold."""
    proj = files[0]["workloads"]["encoder_heavy"]["simulated.projection"]
    budgets = sorted(proj, key=int)
    lines = _header(["Workload, profile of run", *(f"R = {R}" for R in budgets)])
    for _, label, w in _vlm_rows(files):
        cells = []
        for R in budgets:
            at = w["simulated.projection"][R]
            x = f"{at['simulated.flow_over_baseline']:.2f}"
            plan = "+".join(map(str, at["milp_plan"]))
            cells.append(f"{f'**{x}**' if R in ('8', '64') else x} ({plan})")
        lines.append(row([label, *cells]))
    return "\n".join(lines)


HEADLINE = "time_to_loss_headline.json"
HEADLINE_ROWS = (  # (label, method) of README's headline, all from one run
    ("DiLoCo (32-bit, H = 10)", "diloco"),
    ("Streaming DiLoCo (2 fragments, 4-bit, H = 10)", "streaming"),
    ("**the default job** (DiLoCo, 4-bit, reduce-scatter, sent a step early, H = 5)",
     "default-job"),
)  # fmt: skip


def readme_headline(files: list[dict]) -> str:
    """README's headline: each method's wall clock to DiLoCo's final loss over DiLoCo's, and its
    loss at DiLoCo's last step over DiLoCo's, from one run over shaped links."""
    record = files[0]
    (case,) = record["cases"]
    r = diloco_r(record, case)
    lines = [
        f"| method | time to DiLoCo's final loss, x DiLoCo (mean, range over {len(record['seeds'])}"
        " seeds) | loss at DiLoCo's last step, x DiLoCo (mean, worst seed) |",
        "|---|---|---|",
    ]
    found = {a["method"]: a for a in analyze(record)}
    for label, method in HEADLINE_ROWS:
        a = found[method]
        final = a["final_x"]
        loss = f"{statistics.mean(final):.4f} ({max(final):.4f})" if final else "-"
        lines.append(f"| {label} | {fmt_ratios(a['ratios'])} | {loss} |")
    return "\n".join(lines) + f"\n\nDiLoCo's exchange took {r:.2f}x its compute per round here."


def _time_to_loss(file: str, render: Callable[[dict], str]) -> Table:
    """A table of docs/results/time_to_loss.md drawn from one time_to_loss.py results file."""
    return Table("docs/results/time_to_loss.md", (file,), lambda f: render(f[0]))


def _plan(file: str, penalty_files: tuple[str, ...] = PENALTY_FILES) -> Table:
    """The planner against one time_to_loss.py results file, with the step penalties drawn from
    `penalty_files` (the packaged ones by default)."""
    paths = [f"benchmarks/results/{name}" for name in penalty_files]

    def render(f: list[dict]) -> str:
        return plan_table(f[0], penalties(list(zip(paths, f[1:], strict=True))))

    return Table("docs/results/time_to_loss.md", (file, *penalty_files), render)


TABLES = {  # the headline tables; the docs' other tables are frozen text naming their files
    "readme-headline": Table("README.md", (HEADLINE,), readme_headline),
    "data-prep": Table("docs/data.md", ("data_prep.json",), lambda f: data_prep_table(f[0])),
    "machines": Table("docs/multihost.md", ("machines.json",), lambda f: machines_table(f[0])),
    "faults-matrix": Table("docs/reliability.md", ("faults.json",), lambda f: faults_table(f[0])),
    "sharding-memory": Table(
        "docs/sharding.md",
        ("sharding.json", "sharding_mmap128k.json"),
        sharding_memory(("sharding.json", "sharding_mmap128k.json")),
    ),
    "worker-start": Table(
        "docs/fault_tolerance.md", ("worker_start.json",), lambda f: worker_start_table(f[0])
    ),
    "ft-straggler": Table("docs/fault_tolerance.md", ("ft_straggler.json",), ft_straggler),
    "energy-public-roofline": Table(
        "docs/energy.md", ("energy_public_validation.json",), energy_roofline
    ),
    "energy-h100": Table("docs/energy.md", ("energy_gpu_h100_summary.json",), energy_h100),
    "flow-runs": Table("docs/flow.md", VLM_FILES, vlm_runs),
    "flow-projection": Table("docs/flow.md", VLM_FILES, vlm_projection),
    "forge-memory-llama": Table(
        "docs/forge.md", ("forge_memory_llama125M.json",), forge_memory_llama
    ),
    "forge-speed-states": Table("docs/forge.md", ("forge_speed_states.json",), forge_speed_states),
    "diloco-rs-overlap-job-choice": Table(
        "docs/models.md",
        DILOCO_RS_OVERLAP_JOB_FILES[:2],
        hf_outer_choice(_job_grid(DILOCO_RS_OVERLAP_JOB)),
    ),
    "diloco-rs-overlap-job-pairs": Table(
        "docs/models.md", DILOCO_RS_OVERLAP_JOB_FILES, hf_pair_ratios(DILOCO_RS_OVERLAP_JOB_PAIRS)
    ),
    "compression-h10": Table(
        "docs/results/compression.md",
        ("compression_h10_s0.json", "compression_h10_s12.json"),
        compression,
    ),
    "fgd-retune-all-pairs": Table(
        "docs/results/fgd.md",
        (
            "fgd_retune_all_grid.json",
            "fgd_retune_all_shipped.json",
            "fgd_retune_all_report.json",
        ),
        fgd_pair_ratios(RETUNE_ALL_PAIRS),
    ),
    "netlab-utilization": Table(
        "docs/results/netlab.md", ("docs/results/netlab.json",), lambda f: netlab_table(f[0])
    ),
    "time-to-loss-at-r": _time_to_loss("time_to_loss_at_r.json", time_to_loss_table),
    "time-to-loss-at-r-plan": _plan("time_to_loss_at_r.json"),
}


def _span(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- table {re.escape(name)}: python benchmarks/tables.py -->\n)(.*?)"
        rf"(^([ \t]*)<!-- /table {re.escape(name)} -->)",
        re.S | re.M,
    )


def _read(path: Path) -> dict:
    """A result file's JSON; a .jsonl file of records as {"records": [...]}."""
    if path.suffix == ".jsonl":
        return {"records": [json.loads(line) for line in path.read_text().splitlines() if line]}
    return json.loads(path.read_text())


def render(table: Table) -> str:
    """What `table` says, from its result files: the text between its markers."""
    files = [_read((ROOT if "/" in f else RESULTS) / f) for f in table.files]
    return table.render(files) + "\n"


def regenerate(text: str, name: str, table: Table, body: str | None = None) -> str:
    """`text` with table `name` written anew between its markers (ValueError without them),
    indented as the closing marker is (a table inside a list item); `body`: already rendered."""
    span = _span(name)
    if not span.search(text):
        raise ValueError(f"{table.doc}: no markers for table {name!r}; add them around it")
    body = render(table) if body is None else body
    return span.sub(lambda m: m.group(1) + textwrap.indent(body, m.group(4)) + m.group(3), text)


def stale(root: Path = ROOT, bodies: dict[str, str] | None = None) -> list[str]:
    """The tables whose doc under `root` differs from what their result files give; `bodies`:
    every table already rendered, to check many copies of the docs at the cost of one."""
    out = []
    for name, table in TABLES.items():
        text = (root / table.doc).read_text()
        if regenerate(text, name, table, bodies[name] if bodies else None) != text:
            out.append(f"{table.doc}: table {name}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 if any differs")
    args = ap.parse_args(argv)
    if args.check:
        differ = stale()
        for line in differ:
            print(f"{line} differs from its result files; run python benchmarks/tables.py")
        return 1 if differ else 0
    for name, table in TABLES.items():
        path = ROOT / table.doc
        path.write_text(regenerate(path.read_text(), name, table))
        print(f"wrote {table.doc}: table {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
