"""Tables for docs/flow.md from benchmarks/flow.py's committed result files
(benchmarks/results/flow*.json); benchmarks/tables.py writes them between their markers.

    python benchmarks/tables.py            # the tables in flow.md, with every other doc's

Two generations of runs:

- the transformers parts (flow-vlm-run1.json, flow-vlm-run2.json and flow-vlm-quiet.json, run 3),
  whose fair baseline is `monolithic_dp`;
- the tiny parts on digits (TINY_FILES, runs 1-5 and the quiet run), whose baseline is the
  2-thread single process `monolithic` and whose files keep only each variant's statistics
  (median, IQR, range), not its repetitions, plus the per-repetition flow / baseline ratios.

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

TINY_FILES = (
    "flow-run1.json",
    "flow.json",
    "flow-run3-encoder_heavy.json",
    "flow-run4-encoder_heavy.json",
    "flow-run5.json",
    "flow-quiet-2cores.json",
)
TINY_RUNS = ("1", "2", "3", "4", "5", "quiet")  # the row label of each of TINY_FILES
# Where each tiny run ran ({load}: its recorded load, {cores}: the machine's). The files' own
# `machine.note` says "shared machine; interleaved" for every run, the quiet one included, which
# is wrong for it: it ran on 2 pinned cores of an otherwise idle 16-core host.
TINY_HOSTS = {
    "1": "project 2-core machine, shared; {load}; first run",
    "2": "project 2-core, shared; {load}",
    "3": "project 2-core, shared, {load}",
    "4": "project 2-core, shared, {load}",
    "5": "project 2-core, shared, {load}",
    "quiet": "**another host**: {cores} cores, otherwise idle, pinned to 2 cores with "
    "`taskset -c 0,1`; faster CPU; host-wide {load} on {cores} cores",
}


def _row(cells: list[str]) -> str:
    """A Markdown table row; an empty cell stays empty (`| |`)."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def _header(cells: list[str]) -> list[str]:
    return ["| " + " | ".join(cells) + " |", "|---" * len(cells) + "|"]


def _frac(x: float) -> str:
    """A fraction of the window: two decimals, three below 0.01."""
    return f"{x:.3f}" if x < 0.01 else f"{x:.2f}"


def _num(x: float) -> str:
    """Two decimals below 10, one below 100, none from 100."""
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def _pct(x: float) -> str:
    """A relative error in percent, signed: one decimal below 1%, none from 1%."""
    return f"{100 * x:+.1f}%" if abs(x) < 0.01 else f"{100 * x:+.0f}%"


def _range(lo: float, hi: float, fmt=_num) -> str:
    return f"{fmt(lo)}-{fmt(hi)}"


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


# ------------------------------------------------------------------- tiny parts


def _tiny(files: list[dict], wl: str) -> list[tuple[str, str, dict, dict]]:
    """(run label, file name, the file, its workload `wl`) of the TINY_FILES that ran `wl`."""
    return [
        (run, name, f, f["workloads"][wl])
        for run, name, f in zip(TINY_RUNS, TINY_FILES, files, strict=True)
        if wl in f["workloads"]
    ]


def _median(w: dict, variant: str) -> float:
    return w["measured.samples_per_s"][variant]["median"]


def _load(w: dict) -> str | None:
    """The run's 1-minute load average, sampled after every run: median [min-max]."""
    s = w.get("measured.loadavg_1min")
    return s and f"load {s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"


def _reps(s: dict) -> list[float] | None:
    """A variant's repetitions, sorted, where its statistics give them all: with 3 the range and
    median, with 5 also the IQR's ends (numpy's quartiles of 5 values are the 2nd and 4th)."""
    if s["n"] == 3:
        return [s["min"], s["median"], s["max"]]
    if s["n"] == 5:
        return [s["min"], s["iqr"][0], s["median"], s["iqr"][1], s["max"]]
    return None


def _collapsed(w: dict, unit: bool) -> str:
    """Whether the 2-thread baseline collapsed: its median below half the 1-thread median (the
    ratio to the 1-thread median, naming it where `unit`). Where the median did not, the
    repetitions that did, with the largest per-rep flow / baseline ratios as theirs."""
    mono = w["measured.samples_per_s"]["monolithic"]
    one = _median(w, "monolithic_1t")
    x = f"{mono['median'] / one:.2f}x"
    if mono["median"] < one / 2:
        return f"yes ({x}{' 1 thread' if unit else ''})"
    down = [r for r in _reps(mono) or [] if r < one / 2]
    if not down:
        return f"no ({x})"
    k, n = len(down), mono["n"]
    top = sorted(w["measured.flow_over_monolithic_per_rep"], reverse=True)[:k]
    if k == 1:
        return (
            f"median: no ({x}); but 1 of {n} reps did (min {mono['min']:.1f} samples/s, "
            f"that rep's ratio {top[0]:.1f})"
        )
    ratios = " and ".join(f"{r:.1f}" for r in top)
    return f"median: no ({x}); {k} of {n} reps did (rep ratios {ratios})"


def _tiny_runs(files: list[dict], wl: str, header: list[str], first: bool) -> str:
    """One row per tiny run of `wl`: conditions, repetitions, the medians, flow / 2-thread
    baseline as a ratio of medians and as the median of per-rep ratios, the stored bootstrap
    interval, and whether the baseline collapsed. The `first` of the two tables (encoder-heavy)
    names each run's host, bolds the ratios of the runs whose baseline did not collapse (the
    ones its verdict reads) and names the collapse ratio's unit once; the other gives only its
    own load, where recorded."""
    lines = _header(header)
    for i, (run, name, f, w) in enumerate(_tiny(files, wl)):
        load = _load(w)
        if first:
            cond = TINY_HOSTS[run].format(
                load=load or "load not recorded", cores=f["machine"]["cores"]
            )
            cond += "" if "flow_no_pool" in w["measured.samples_per_s"] else "; no ablations"
        else:
            cond = load or "as above"
        mono, one, flow = (_median(w, v) for v in ("monolithic", "monolithic_1t", "flow"))
        ratio = _num(flow / mono)
        if first and mono >= one / 2:
            ratio = f"**{ratio}**"
        lines.append(
            _row(
                [
                    f"{run}, `{name}`",
                    cond,
                    str(f["reps"]),
                    f"{mono:.1f}",
                    f"{one:.1f}",
                    f"{flow:.1f}",
                    ratio,
                    _num(statistics.median(w["measured.flow_over_monolithic_per_rep"])),
                    _range(*w["measured.flow_over_monolithic_boot95"]),
                    _collapsed(w, first and i == 0),
                ]
            )
        )
    return "\n".join(lines)


def tiny_runs_encoder(files: list[dict]) -> str:
    """Every tiny run, encoder-heavy (TINY_FILES)."""
    header = [
        "Run, file",
        "Machine and conditions",
        "Reps",
        "Monolithic, 2 threads",
        "Monolithic, 1 thread",
        "Flow",
        "Flow / mono 2t, ratio of medians",
        "Median of per-rep ratios",
        "Bootstrap 95% (ratio of medians)",
        "Baseline collapsed?",
    ]
    return _tiny_runs(files, "encoder_heavy", header, first=True)


def tiny_runs_backbone(files: list[dict]) -> str:
    """Every tiny run that ran backbone-heavy (TINY_FILES)."""
    header = [
        "Run, file",
        "Conditions",
        "Reps",
        "Monolithic, 2 threads",
        "Monolithic, 1 thread",
        "Flow",
        "Ratio of medians",
        "Median of per-rep ratios",
        "Bootstrap 95%",
        "Baseline collapsed?",
    ]
    return _tiny_runs(files, "backbone_heavy", header, first=False)


def tiny_idle(files: list[dict]) -> str:
    """Flow's idle breakdown per tiny run (encoder-heavy, medians over repetitions), with flow /
    sync and flow / the one-thread single process (ratios of medians)."""
    lines = _header(
        [
            "Run",
            "Producer busy",
            "Producer backpressure",
            "Consumer busy",
            "Consumer starvation",
            "Flow / sync",
            "Flow / mono 1 thread",
        ]
    )
    for run, _, _, w in _tiny(files, "encoder_heavy"):
        p, c = (w["measured.idle_breakdown"]["flow"][r] for r in ("producer0", "consumer0"))
        fracs = [p["busy_frac"], p["backpressure_frac"], c["busy_frac"], c["starvation_frac"]]
        flow = _median(w, "flow")
        ratios = [flow / _median(w, "sync"), flow / _median(w, "monolithic_1t")]
        lines.append(_row([run, *map(_frac, fracs), *(f"{r:.2f}" for r in ratios)]))
    return "\n".join(lines)


def tiny_variants(files: list[dict]) -> str:
    """Median samples/s of flow, sync and the two ablations per tiny run (encoder-heavy)."""
    variants = ("flow", "sync", "flow_no_pool", "flow_fifo")
    lines = _header(["Run", *variants])
    for run, _, _, w in _tiny(files, "encoder_heavy"):
        thr = w["measured.samples_per_s"]
        cells = [f"{thr[v]['median']:.1f}" if v in thr else "not run" for v in variants]
        lines.append(_row([run, *cells]))
    return "\n".join(lines)


def tiny_alloc(files: list[dict]) -> str:
    """The MILP plan and the even split run for real (--alloc-check): predicted G against the
    measured median, and the prediction scaled by each worker's share of 2 cores (2 / R)."""
    lines = _header(
        [
            "Workload, budget",
            "Plan (enc+bb)",
            "Predicted G (predicted)",
            "Measured, median [min-max]",
            "Predicted / measured",
            "Predicted x 2/R / measured (estimated)",
        ]
    )
    for f in files:
        R = f["budget"]
        for plan, name in (("milp", "MILP"), ("even", "even")):
            p = f[plan]
            s = p["measured.samples_per_s"]
            over = p["predicted.G_samples_per_s"] / s["median"]
            lines.append(
                _row(
                    [
                        f"{WORKLOADS[f['workload']]}, R = {R}",
                        f"{name} {p['encoder']['replicas']}+{p['backbone']['replicas']}",
                        f"{p['predicted.G_samples_per_s']:.0f}",
                        f"{s['median']:.0f} [{s['min']:.0f}-{s['max']:.0f}]",
                        f"{over:.2f}",
                        f"{over * 2 / R:.2f}",
                    ]
                )
            )
    return "\n".join(lines)


def tiny_cost_models(files: list[dict]) -> str:
    """Both cost models' fit on held-out micro-batches (R^2 / MAPE) and the one used."""
    lines = _header(["Workload", "fitted R^2 / MAPE", "paper formula R^2 / MAPE", "used"])
    for wl, name in WORKLOADS.items():
        fit = files[0]["workloads"][wl]["measured.cost_fit"]
        cells = [f"{fit['r2'][m]:.2f} / {100 * fit['mape'][m]:.1f}%" for m in ("fitted", "paper")]
        lines.append(_row([name, *cells, fit["best"]]))
    return "\n".join(lines)


def tiny_validation(files: list[dict]) -> str:
    """The simulator's error against each tiny run's measured medians (flow, sync and the
    one-thread single process); empty where the run did not run the workload."""
    variants = {"flow": "flow", "sync": "sync", "monolithic_1t": "mono 1 thread"}
    short = {"encoder_heavy": "enc-heavy", "backbone_heavy": "bb-heavy"}
    lines = _header(["Run", *(f"{short[wl]} {v}" for wl in WORKLOADS for v in variants.values())])
    for run, f in zip(TINY_RUNS, files, strict=True):
        cells = []
        for wl in WORKLOADS:
            val = f["workloads"].get(wl, {}).get("simulated.validation")
            for v in variants:
                if val is None:
                    cells.append("")
                else:
                    cells.append(_pct(val[v]["error"]) if v in val else "not simulated")
        lines.append(_row([run, *cells]))
    return "\n".join(lines)


def tiny_slowdown(files: list[dict]) -> str:
    """The producer's busy seconds per sample in the flow run over the profile's, estimated as
    rho_enc x producer busy fraction / flow's median throughput, beside the simulator's error
    on flow (encoder-heavy)."""
    rows = _tiny(files, "encoder_heavy")
    lines = _header(["Run", *(run for run, *_ in rows)])
    slow, err = [], []
    for _, _, _, w in rows:
        busy = w["measured.idle_breakdown"]["flow"]["producer0"]["busy_frac"]
        slow.append(w["measured.rho_samples_per_s"]["encoder"]["1"] * busy / _median(w, "flow"))
        err.append(w["simulated.validation"]["flow"]["error"])
    lines.append(_row(["producer slow-down vs profile", *(f"{x:.2f}" for x in slow)]))
    lines.append(_row(["simulator error, flow", *map(_pct, err)]))
    return "\n".join(lines)


def tiny_projection(wl: str):
    """The render function of run 2's simulated projection of `wl` (flow.json): the MILP plan,
    both plans' predicted G, flow under each plan, sync under the MILP plan and data parallelism
    over R one-thread replicas (samples/s)."""

    def render(files: list[dict]) -> str:
        lines = _header(
            [
                "R",
                "MILP plan",
                "predicted G, MILP / even",
                "flow, MILP plan",
                "flow, even split",
                "sync, MILP plan",
                "monolithic DP, R x 1 thread",
            ]
        )
        proj = files[0]["workloads"][wl]["simulated.projection"]
        for R in sorted(proj, key=int):
            p = proj[R]
            keys = ("flow_milp", "flow_even", "sync", "monolithic_1t_dp")
            lines.append(
                _row(
                    [
                        R,
                        "+".join(map(str, p["milp_plan"])),
                        f"{p['predicted.milp_G_samples_per_s']:.0f} / "
                        f"{p['predicted.even_G_samples_per_s']:.0f}",
                        *(f"{p[f'simulated.{k}_samples_per_s']:.0f}" for k in keys),
                    ]
                )
            )
        return "\n".join(lines)

    return render
