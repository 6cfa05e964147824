"""Tables for docs/flow.md from benchmarks/flow.py's committed result files on the transformers
parts (flow-vlm-run1.json, flow-vlm-run2.json and flow-vlm-quiet.json, run 3; their fair
baseline is `monolithic_dp`); benchmarks/tables.py writes them between their markers.

    python benchmarks/tables.py            # the tables in flow.md, with every other doc's

The page's other tables (the idle breakdown, the simulator's sensitivity and validation, and
the earlier tiny parts on digits) are frozen there, each naming its results files.

Each render function takes the files' JSON in the order of its entry in tables.TABLES.
"""

from __future__ import annotations

import statistics

WORKLOADS = {"encoder_heavy": "encoder-heavy", "backbone_heavy": "backbone-heavy"}
BASELINE = "monolithic_dp"  # the transformers runs' fair baseline

VLM_FILES = ("flow-vlm-run1.json", "flow-vlm-run2.json", "flow-vlm-quiet.json")
VLM_RUNS = ("1", "2", "3 (quiet)")  # the row label of each of VLM_FILES
VLM_GROUPS = ((0, 1), (2,))  # the loaded runs, then the quiet one, each by workload


def _row(cells: list[str]) -> str:
    """A Markdown table row; an empty cell stays empty (`| |`)."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def _header(cells: list[str]) -> list[str]:
    return ["| " + " | ".join(cells) + " |", "|---" * len(cells) + "|"]


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
