"""Tables for docs/flow.md from benchmarks/flow.py's committed result files
(benchmarks/results/flow*.json); benchmarks/tables.py writes them between their markers.

    python benchmarks/tables.py            # the tables in flow.md, with every other doc's

The transformers parts' runs: flow-vlm-run1.json, flow-vlm-run2.json and flow-vlm-quiet.json
(run 3), whose fair baseline is `monolithic_dp`.

Each render function takes the files' JSON in the order of its entry in tables.TABLES.
"""

from __future__ import annotations

import statistics

WORKLOADS = {"encoder_heavy": "encoder-heavy", "backbone_heavy": "backbone-heavy"}
BASELINE = "monolithic_dp"  # the transformers runs' fair baseline
VARIANTS = ("flow", "sync", "monolithic_dp", "monolithic")

VLM_FILES = ("flow-vlm-run1.json", "flow-vlm-run2.json", "flow-vlm-quiet.json")
VLM_RUNS = ("1", "2", "3 (quiet)")  # the row label of each of VLM_FILES
VLM_GROUPS = ((0, 1), (2,))  # the loaded runs, then the quiet one, each by workload


def _row(cells: list[str]) -> str:
    """A Markdown table row; an empty cell stays empty (`| |`)."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def _header(cells: list[str]) -> list[str]:
    return ["| " + " | ".join(cells) + " |", "|---" * len(cells) + "|"]


def _frac(x: float) -> str:
    """A fraction of the window: two decimals, three below 0.01."""
    return f"{x:.3f}" if x < 0.01 else f"{x:.2f}"


# ------------------------------------------------------------------- transformers parts


def _vlm_rows(files: list[dict], groups=VLM_GROUPS):
    """(workload, row label, that workload's result) in the tables' order: each group of runs,
    by workload."""
    for group in groups:
        for wl, name in WORKLOADS.items():
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
        ratio = thr["flow"]["median"] / thr[BASELINE]["median"]
        lo, hi = w[f"measured.over_{BASELINE}"]["flow"]["boot95"]
        cells = [_median_boot(thr[v]) for v in (BASELINE, "monolithic", "sync", "flow")]
        lines.append(
            _row(
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


def vlm_idle(files: list[dict]) -> str:
    """Flow's idle breakdown (medians over repetitions of the window's fractions) and flow / sync
    (ratio of medians), for each of `files`."""
    lines = _header(
        [
            "Workload, run",
            "producer busy",
            "producer backpressure",
            "consumer busy",
            "consumer starvation",
            "flow / sync",
        ]
    )
    groups = (tuple(range(len(files))),)
    for _, label, w in _vlm_rows(files, groups):
        p, c = (w["measured.idle_breakdown"]["flow"][r] for r in ("producer0", "consumer0"))
        thr = w["measured.samples_per_s"]
        fracs = [p["busy_frac"], p["backpressure_frac"], c["busy_frac"], c["starvation_frac"]]
        ratio = thr["flow"]["median"] / thr["sync"]["median"]
        lines.append(_row([label, *map(_frac, fracs), f"{ratio:.2f}"]))
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
            row = w["simulated.projection"][R]
            x = f"{row['simulated.flow_over_baseline']:.2f}"
            plan = "+".join(map(str, row["milp_plan"]))
            cells.append(f"{f'**{x}**' if R in ('8', '64') else x} ({plan})")
        lines.append(_row([label, *cells]))
    return "\n".join(lines)


def flow_sensitivity(files: list[dict]) -> str:
    """Simulated flow / data parallelism by samples per device per step, at R = 8 and 64; the
    largest in bold."""
    by = {
        wl: files[0]["workloads"][wl]["simulated.flow_over_baseline_by_samples_per_device"]
        for wl in WORKLOADS
    }
    per = sorted({int(k) for v in by.values() for k in v})
    best = max(
        x[R]["simulated.flow_over_baseline"] for v in by.values() for x in v.values() for R in x
    )
    lines = ["| Workload | R | " + " | ".join(map(str, per)) + " |", "|---" * (len(per) + 2) + "|"]
    for wl, name in WORKLOADS.items():
        for R in sorted({R for x in by[wl].values() for R in x}, key=int):
            vals = [by[wl][str(p)][R]["simulated.flow_over_baseline"] for p in per]
            cells = [f"**{v:.2f}**" if v == best else f"{v:.2f}" for v in vals]
            lines.append(_row([name, R, *cells]))
    return "\n".join(lines)


def flow_validation(files: list[dict]) -> str:
    """The simulator's error against each run's measured medians (runs 1 and 2, in order)."""
    lines = ["| Workload, run | " + " | ".join(VARIANTS) + " |", "|---" * 5 + "|"]
    for wl, name in WORKLOADS.items():
        for run, f in enumerate(files, 1):
            val = f["workloads"][wl]["simulated.validation"]
            lines.append(
                _row([f"{name}, {run}", *(f"{100 * val[v]['error']:+.0f}%" for v in VARIANTS)])
            )
    return "\n".join(lines)
