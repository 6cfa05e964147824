"""The results tables of the docs, regenerated from committed result files.

Each table sits in its Markdown between two markers,

    <!-- table NAME: python benchmarks/tables.py -->
    ...
    <!-- /table NAME -->

and is written here from the result files its entry in TABLES names; nothing between the
markers is typed by hand. `python benchmarks/tables.py` rewrites every table; `--check` rewrites
nothing and exits 1 naming each table whose doc differs (tests/test_tables.py runs it, so a
number edited by hand, or a result file changed without its doc, fails the tests).

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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

import flow_tables  # noqa: E402
from codec_speed import table as codec_speed_table  # noqa: E402
from compression import CODECS, cells  # noqa: E402  (a sibling script, not a package)
from data_prep import table as data_prep_table  # noqa: E402
from faults import table as faults_table  # noqa: E402
from fgd_corpora import table as corpora_table  # noqa: E402
from fgd_tables import TARGETS as FGD_TARGETS  # noqa: E402
from fgd_tables import e1 as fgd_e1  # noqa: E402
from fgd_tables import faults as fgd_faults  # noqa: E402
from fgd_tables import quality as fgd_quality  # noqa: E402
from fgd_tables import runs_of as fgd_runs  # noqa: E402
from fgd_tables import time_to_targets as fgd_time_to  # noqa: E402
from flow_profile_check import table as flow_profile_table  # noqa: E402
from link_probe import table as link_probe_table  # noqa: E402
from machines import table as machines_table  # noqa: E402
from netlab_validation import rows as netlab_rows  # noqa: E402
from time_to_loss import (  # noqa: E402
    PENALTY_FILES,
    PENALTY_FILES_BEFORE,
    links_table,
    time_split_table,  # noqa: E402
)
from time_to_loss import analyze as time_to_loss_analyze  # noqa: E402
from time_to_loss import diloco_r as time_to_loss_diloco_r  # noqa: E402
from time_to_loss import fmt_ratios as time_to_loss_fmt_ratios  # noqa: E402
from time_to_loss import penalties as time_to_loss_penalties  # noqa: E402
from time_to_loss import plan_table as time_to_loss_plan  # noqa: E402
from time_to_loss import table as time_to_loss_table  # noqa: E402
from worker_start import table as worker_start_table  # noqa: E402

TINY = flow_tables.TINY_FILES  # the tiny parts' flow runs, in docs/flow.md's order


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


def _row(cells: list[str]) -> str:
    """A Markdown table row; an empty cell stays empty (`| |`)."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def compression(files: list[dict]) -> str:
    """Bytes per round against loss, every codec, DiLoCo and GlobalM1LocalM2 (three seeds)."""
    rows = [r for f in files for r in f["runs"]]
    names = {"diloco": "DiLoCo"}
    lines = [
        "| method | codec | MB/round per worker | x fewer than fp32 DiLoCo | val loss "
        "| x DiLoCo fp32 | util at 100 Mbit/s (simulated) |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in cells(rows, ["diloco", "GlobalM1LocalM2"], CODECS.split(",")):
        lines.append(
            f"| {names.get(x['method'], x['method'])} | {x['codec']} | {_mb(x['mb'])} "
            f"| {x['fewer']:.1f} | {_ms(x['loss'])} | {_ms(x['ratio'])} | {x['util']:.3f} |"
        )
    return "\n".join(lines)


def _by_cell(files: list[dict]) -> dict[tuple[str, str], dict[int, dict]]:
    """(method, codec) -> seed -> run, over every run of `files`, in their order."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for f in files:
        for r in f["runs"]:
            out.setdefault((r["method"], r["codec"]), {})[r["seed"]] = r
    return out


def compression_real(files: list[dict]) -> str:
    """Real processes against the simulator, cell by cell and seed by seed: the first two files
    are the real runs, the last two the simulated ones of the same cells."""
    real, sim = _by_cell(files[:2]), _by_cell(files[2:])
    lines = [
        "| method | codec | MB/round per worker | val loss, real processes (seeds 0 / 1 / 2) "
        "| val loss, simulator |",
        "|---|---|---|---|---|",
    ]
    for (method, codec), seeds in real.items():
        order = sorted(seeds)
        losses = " / ".join(f"{seeds[k]['loss_val']:.4f}" for k in order)
        simulated = " / ".join(f"{sim[method, codec][k]['loss_val']:.4f}" for k in order)
        mb = _mb(statistics.mean(r["bytes_per_round"] for r in seeds.values()) / 1e6)
        name = {"diloco": "DiLoCo"}.get(method, method)
        lines.append(f"| {name} | {codec} | {mb} | {losses} | {simulated} |")
    return "\n".join(lines)


def compression_long(files: list[dict]) -> str:
    """DiLoCo's codecs at 2000 steps (first two files) beside the 500-step ratio (the last two,
    paired by seed 0)."""
    long, short = _by_cell(files[:2]), _by_cell(files[2:])
    ref_long, ref_short = long["diloco", "fp32"][0], short["diloco", "fp32"][0]
    lines = [
        "| codec | val loss at 2000 steps | x DiLoCo fp32 | at 500 steps (table above) |",
        "|---|---|---|---|",
    ]
    for codec in ("fp32", "topk:0.1+2bit", "topk:0.01+2bit"):
        got, was = long["diloco", codec][0], short["diloco", codec][0]
        ratio, before = (
            got["loss_val"] / ref_long["loss_val"],
            was["loss_val"] / ref_short["loss_val"],
        )
        lines.append(f"| {codec} | {got['loss_val']:.4f} | {ratio:.4f} | {before:.4f} |")
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
            _row(
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


def vs_torchft(files: list[dict]) -> str:
    """Our DiLoCo against torchft's, alternating repetitions: loss and tokens/s per rep."""
    f = files[0]
    names = {
        "frugaltrain": "frugaltrain `diloco`",
        "torchft": "torchft `local_sgd.DiLoCo` + Manager + Lighthouse",
    }
    lines = [
        f"| | final val loss | tokens/s per rep ({f['config']['reps']} reps) | mean tokens/s |",
        "|---|---|---|---|",
    ]
    for impl, name in names.items():
        runs = sorted((r for r in f["runs"] if r["impl"] == impl), key=lambda r: r["rep"])
        reps = " / ".join(f"{r['tokens_per_s']:,.0f}" for r in runs)
        mean = f["summary"][impl]
        row = [name, f"{mean['val_loss_mean']:.4f}", reps, f"{mean['tokens_per_s_mean']:,.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


ENERGY_LOGLINEAR = (
    ("flops_only", "ln FLOPs (data set column)"),
    ("flops_lnM", "+ ln M"),
    ("flops_lnM_hw_model", "+ hardware and model dummies"),
    ("duration_only", "measured duration alone (post-run)"),
    ("analytic_F_only", "ln F (our analytic training FLOPs)"),
    ("paper_law_C_M_hw", "paper law ln C, ln M + hw, model (η = 1 here)"),
)
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


def energy_loglinear(files: list[dict]) -> str:
    """The public set's log-linear models against the research note's reference figures."""
    rows = files[0]["rows"]
    lines = [
        "| log-linear model (reproduction) | R²(ln E) | MAPE | reference | ΔR² "
        "| 20-split medians |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, label in ENERGY_LOGLINEAR:
        r, ref = rows[key], rows[key].get("reference")
        lo, hi = r["r2_log_20split_seed_range"]
        cells = [label, f"{r['r2_log']:.3f}", _pct(r["mape"])]
        if ref:
            delta = f"{r['r2_log'] - ref['r2_log']:.3f}".replace("-", "−")
            cells += [f"{ref['r2_log']:g} / {100 * ref['mape']:g}%", delta]
        else:
            cells += ["", ""]
        lines.append(_row([*cells, f"{lo:.3f}–{hi:.3f}"]))
    return "\n".join(lines)


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
        lines.append(_row([label, f"{r['r2_log']:.3f}", mape, rmse]))
    return "\n".join(lines)


def energy_cpu_sweep(files: list[dict]) -> str:
    """The CPU sweep's step-time model: held-out architectures, extrapolation, no fit."""
    f = files[0]
    held = f["time_model_heldout_architectures"]
    lo, hi = held["mape_iqr"]
    n = f["n_configs"] // 4  # architectures: each is swept at 4 (s, b) points
    lines = ["| step-time model | MAPE | R²(ln) |", "| --- | --- | --- |"]
    lines.append(
        _row(
            [
                f"held-out architectures, 70/30 ({n} architectures), median of "
                f"{held['n_splits']} splits",
                f"**{_pct(held['mape'])}** (IQR {100 * lo:.1f}–{_pct(hi)})",
                f"{held['r2_log']:.3f}",
            ]
        )
    )
    lines.append(
        _row(
            [
                "train d < 256, test d = 256 (extrapolation)",
                _pct(f["time_model_extrapolation_mape"]),
                "",
            ]
        )
    )
    lines.append(
        _row(
            [
                "uncalibrated roofline on the microbenchmark ceilings (no fit)",
                _pct(f["uncalibrated_roofline_mape"]),
                "",
            ]
        )
    )
    return "\n".join(lines)


# The H100 sweep's models and their targets: (key, label, MAPE at most, R²(ln) at least).
ENERGY_H100 = (
    ("time model (pre-run)", "time model (pre-run)", 0.12, None),
    ("energy, predicted T (pre-run)", "energy, predicted T (pre-run)", 0.15, 0.95),
    ("energy, measured T (post-run)", "energy, measured T (post-run)", 0.05, None),
    ("extrapolation_pre", "pre-run extrapolation (train on the smallest 75% of C)", 0.30, None),
)


def _kind(f: dict, kind: str) -> list[dict]:
    return [r for r in f["records"] if r["kind"] == kind]


def energy_h100_windows(files: list[dict]) -> str:
    """The NVML counter's energy over power x time, by window length: how short a window reads
    (the range over the windows that read, to two decimals where it reaches under 1)."""
    lines = ["| window | unavailable | E/(P·t) |", "| --- | --- | --- |"]
    for r in _kind(files[0], "granularity"):
        w, got = r["window_s"], r["energy_over_p_t"]
        window = f"{1000 * w:g} ms" if w < 0.1 else f"{w:g} s"
        d = 2 if min(got) < 1 else 1
        reads = f"{min(got):.{d}f}–{max(got):.{d}f}"
        if len(got) == 1:
            reads = f"{got[0]:.1f} (the one window that read)"
        lines.append(
            f"| {window} | {r['unavailable']} of {r['unavailable'] + len(got)} | {reads} |"
        )
    return "\n".join(lines)


def energy_h100_kernels(files: list[dict]) -> str:
    """The energy roofline's two microbenchmarks: dynamic energy (above idle) per FLOP and per
    byte."""
    gemm, copy = _kind(files[0], "roofline_gemm")[0], _kind(files[0], "roofline_copy")[0]
    return "\n".join(
        [
            "| kernel | throughput | energy |",
            "| --- | --- | --- |",
            f"| GEMM | {gemm['flops_per_s'] / 1e12:.0f} TFLOP/s "
            f"| {1e12 * gemm['dynamic_joules'] / gemm['flops']:.2f} pJ/FLOP dynamic (above idle) |",
            f"| 1 GiB copy | {copy['bytes_per_s'] / 1e12:.2f} TB/s "
            f"| {1e9 * copy['dynamic_joules'] / copy['bytes']:.3f} nJ/B dynamic |",
        ]
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
        lines.append(_row([label, *cells]))
    return "\n".join(lines)


HF_NAMES = {
    "diloco": "DiLoCo",
    "M2pairs:embed+head+blocks:1": "GlobalM1 + pairs Mix2 on embed+head+blocks:1",
}


def _hf_rows(f: dict) -> tuple[dict[str, dict[int, dict]], dict[int, dict]]:
    """{method: {seed: run}} of an hf_loss_gap.py file, in its order, and DiLoCo's runs."""
    by: dict[str, dict[int, dict]] = {}
    for r in f["runs"]:
        by.setdefault(r["method"], {})[r["seed"]] = r
    return by, by["diloco"]


def _x_diloco(runs: dict[int, dict], ref: dict[int, dict], key: str) -> list[float]:
    return [runs[k][key] / ref[k][key] for k in sorted(runs)]


def hf_loss_gap(files: list[dict]) -> str:
    """The default job's Llama, one outer step for all: losses, paired ratio, utilization."""
    by, ref = _hf_rows(files[0])
    lines = [
        "| method | val loss (workers' mean) | averaged model | x DiLoCo "
        "| utilization at r = 0.887 |",
        "|---|---|---|---|---|",
    ]
    for m, runs in by.items():
        rs = [runs[k] for k in sorted(runs)]
        x = "-" if m == "diloco" else _ms(_x_diloco(runs, ref, "loss_val"))
        cells = [_ms([r["loss_val"] for r in rs]), _ms([r["loss_val_avg_model"] for r in rs])]
        lines.append(_row([HF_NAMES.get(m, m), *cells, x, f"{rs[0]['util_r0887']:.3f}"]))
    return "\n".join(lines)


def hf_loss_gap_tuned(files: list[dict]) -> str:
    """The same at each method's tuned outer step: ratios for the workers and the averaged
    model, the method inside 1% in bold."""
    by, ref = _hf_rows(files[0])
    lines = [
        "| method (lr 0.35, momentum 0.8) | val loss (workers' mean) | averaged model "
        "| x DiLoCo (workers) | x DiLoCo (averaged) |",
        "|---|---|---|---|---|",
    ]
    for m, runs in by.items():
        rs = [runs[k] for k in sorted(runs)]
        cells = [_ms([r["loss_val"] for r in rs]), _ms([r["loss_val_avg_model"] for r in rs])]
        for key in ("loss_val", "loss_val_avg_model"):
            x = _x_diloco(runs, ref, key)
            cell = "-" if m == "diloco" else _ms(x)
            cells.append(f"**{cell}**" if m != "diloco" and statistics.mean(x) < 1.01 else cell)
        lines.append(_row([HF_NAMES.get(m, m), *cells]))
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
                lines.append(_row([m, corpus, *cells]))
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
                lines.append(_row([f"{method} / {ref}", c, *cells]))
        return "\n".join(lines)

    return render


# The outer steps tried for DiLoCo with topk:0.01+2bit (variant names of the pilot files, whose
# JSON records the name only; fgd_real_text.py's --variant gave each its overrides).
SPARSE_OUTER = (
    ("sl-m09-lr07-b1", "Nesterov, lr 0.7, momentum 0.9, feedback decay 1 (DiLoCo's default)"),
    ("sl-b095-lr1", "momentum 0, lr 1.0, feedback decay 0.95"),
    ("sl-b1-lr1", "momentum 0, lr 1.0, feedback decay 1"),
    ("sl-lr05", "momentum 0, lr 0.5, feedback decay 1"),
    ("sl-lr2", "momentum 0, **lr 2.0**, feedback decay 1"),
    ("sl-lr3", "momentum 0, lr 3.0, feedback decay 1"),
)
SPARSE_CHOSEN = "sl-lr2"


def compression_outer_pilot(files: list[dict]) -> str:
    """Seed 0's validation loss of each outer step at H = 10 and 50 (the pilot files, then the
    sparse lr file), and fp32 DiLoCo's with its tuned outer step (the momentum grid's files)."""
    loss: dict[tuple[str, int], float] = {}
    for f in files[:3]:
        for r in f["runs"]:
            loss[r["method"], r["H"]] = r["loss_val"]
    tuned = {10: ("diloco-mu0.8", files[3]), 50: ("diloco-m8-lr1", files[4])}
    for H, (name, f) in tuned.items():
        loss["tuned", H] = next(
            r["loss_val"] for r in f["runs"] if (r["method"], r["H"]) == (name, H)
        )
    rows = [*SPARSE_OUTER, ("tuned", "fp32 DiLoCo, tuned (lr 0.35 / 1.0, momentum 0.8)")]
    lines = ["| outer step | H = 10 (50 rounds) | H = 50 (10 rounds) |", "|---|---|---|"]
    for name, label in rows:
        cells = [f"{loss[name, H]:.4f}" if (name, H) in loss else "" for H in (10, 50)]
        if name == SPARSE_CHOSEN:
            cells = [f"**{c}**" if c else c for c in cells]
        lines.append(_row([label, *cells]))
    return "\n".join(lines)


def sim_scale(files: list[dict]) -> str:
    """Simulated worker-steps per real second: threads, the loop and vmap, and their ratios."""
    lines = [
        "| M | threads (worker-steps/s) | loop | vmap | threads / loop | vmap / loop |",
        "|---|---|---|---|---|---|",
    ]
    for r in files[0]["rows"]:
        rates = [f"{r[k]['worker_steps_per_s']:.1f}" for k in ("threads", "loop", "vmap")]
        ratios = [f"{r[k]:.2f}" for k in ("ratio_threads_over_loop", "ratio_vmap_over_loop")]
        lines.append(_row([str(r["M"]), *rates, *ratios]))
    return "\n".join(lines)


SUBSET = "M2pairs:embed+head+blocks:1"
FGD_METHODS = ("diloco", "GlobalM1", "GlobalM1LocalM2", SUBSET)
_ALIAS = {"subset": SUBSET, "M2pairs_embed-head-blocks_1": SUBSET}


def _grid_key(name: str) -> tuple[str, float, float]:
    """A run name of fgd_real_text.py -> (method, outer lr, outer momentum): `X` is lr 0.7 at
    momentum 0.9 (the script's default), `X-lr0.35` lr 0.35, `X-m8-lr05` lr 0.5 at 0.8."""
    method, m8, lr = re.fullmatch(r"(.+?)(-m8)?(?:-lr([\d.]+))?", name).groups()
    if lr is None:
        x = 0.7
    else:
        x = float(lr) if "." in lr else int(lr) / 10 ** (len(lr) - 1)
    return _ALIAS.get(method, method), x, 0.8 if m8 else 0.9


def _grid(files: list[dict], H: int) -> dict[tuple[str, float, float], float]:
    """(method, outer lr, momentum) -> seed 0's validation loss (each worker's model) at H."""
    runs = [r for f in files for r in f["runs"] if r["H"] == H and r["seed"] == 0]
    return {_grid_key(r["method"]): r["loss_val"] for r in runs}


def fgd_ablation(files: list[dict]) -> str:
    """What the gap is made of: every variant of fgd_ablation_h10.json, seed 0."""
    labels = {
        "M1-mixed": "GlobalM1, momentum mixed with Mix1 (`outer.fgd.momentum_policy=mixed`)",
        "M1-reset": "GlobalM1, momentum reset each round (`momentum_policy=reset`)",
        "M1-mu0": "GlobalM1, outer momentum 0",
        "M1-lr0.35": "GlobalM1, outer lr 0.35",
        "M1-alpha0.5": "GlobalM1, Mix1 weight 0.5 (`outer.fgd.mix1_weight`)",
        "M1LM2-mom": "GlobalM1LocalM2, Mix2 on post-momentum updates (`outer.fgd.mix2_momentum`)",
        "diloco-lr0.35": "diloco, outer lr 0.35",
    }
    runs = files[0]["runs"]
    ref = next(r["loss_val"] for r in runs if r["method"] == "diloco")

    def spread(r: dict, key: str) -> str:
        first, last = (r["evals"][i].get(key) or 0.0 for i in (0, -1))
        return "0" if first == last == 0 else f"{first:.1f} -> {last:.2f}"

    lines = [
        "| variant | val loss | vs DiLoCo | avg-model loss | consensus (50 -> 500) "
        "| momentum spread (50 -> 500) |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        gap = "-" if r["method"] == "diloco" else f"{(r['loss_val'] / ref - 1) * 100:+.1f}%"
        cells = [labels.get(r["method"], r["method"]), f"{r['loss_val']:.4f}", gap]
        cells += [f"{r['loss_val_avg_model']:.4f}", spread(r, "consensus/total")]
        lines.append(_row([*cells, spread(r, "consensus/momentum")]))
    return "\n".join(lines)


def fgd_lr_grid(H: int, lrs: tuple[str, ...]) -> Callable[[list[dict]], str]:
    """Seed 0's loss at every outer lr (momentum 0.9), the best in bold, beside DiLoCo's best."""

    def render(files: list[dict]) -> str:
        grid = _grid(files, H)
        best = {
            m: min((grid[m, float(s), 0.9], s) for s in lrs if (m, float(s), 0.9) in grid)
            for m in FGD_METHODS
        }
        head = ["method", *(f"lr {s}" for s in lrs), "best vs best DiLoCo"]
        lines = [_row(head), "|" + "---|" * len(head)]
        for m in FGD_METHODS:
            (loss, lr), ref = best[m], best["diloco"][0]
            cells = [f"{grid[m, float(s), 0.9]:.4f}" for s in lrs]
            cells = [f"**{c}**" if s == lr else c for c, s in zip(cells, lrs, strict=True)]
            lines.append(_row([m, *cells, f"{(loss / ref - 1) * 100:+.1f}% (lr {lr})"]))
        return "\n".join(lines)

    return render


def fgd_momentum_grid(files: list[dict]) -> str:
    """H = 50, seed 0: the loss at momentum 0.8 for each outer lr (the first two files), the best
    in bold, beside each method's best at momentum 0.9 (the last file, the lr grid)."""
    lrs = ("0.35", "0.5", "0.7", "1.0", "1.2")
    grid, before = _grid(files[:-1], 50), _grid(files[-1:], 50)
    lines = [_row(["method", *(f"lr {s}" for s in lrs), "best at mu 0.9"]), "|---" * 7 + "|"]
    for m in FGD_METHODS:
        got = {s: grid[m, float(s), 0.8] for s in lrs if (m, float(s), 0.8) in grid}
        top = min(got, key=got.get)
        cells = [
            f"**{got[s]:.4f}**" if s == top else f"{got[s]:.4f}" if s in got else "" for s in lrs
        ]
        loss, lr = min((v, k[1]) for k, v in before.items() if k[0] == m and k[2] == 0.9)
        lines.append(_row([m, *cells, f"{loss:.4f} (lr {lr:g})"]))
    return "\n".join(lines)


@dataclass(frozen=True)
class Seeds:
    """Three seeds per method at one H: seed 0 from the `first` files, the other seeds from
    `rest`; `rows` are (label, run name in `first`, run name in `rest`), DiLoCo first (the
    ratios' reference, paired by seed)."""

    H: int
    first: tuple[str, ...]
    rest: str
    rows: tuple[tuple[str, str, str], ...]

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.first, self.rest)

    def runs(self, data: dict[str, dict], row: int) -> dict[int, tuple[str, dict]]:
        """Seed -> (result file, run) of row `row`; `data` maps file names to their JSON."""
        _, a, b = self.rows[row]
        pick = [(n, a) for n in self.first] + [(self.rest, b)]
        return {
            r["seed"]: (n, r)
            for n, m in pick
            for r in data[n]["runs"]
            if r["method"] == m and r["H"] == self.H
        }

    def ratios(self, data: dict[str, dict], row: int, key: str) -> dict[int, float]:
        """Seed -> row `row`'s `key` over DiLoCo's of the same seed."""
        ref, got = self.runs(data, 0), self.runs(data, row)
        return {s: got[s][1][key] / ref[s][1][key] for s in sorted(got)}


def _named(names: tuple[str, ...], render: Callable[[dict[str, dict]], str]) -> Callable:
    """A render of the files' JSON by name, as Table wants it (the JSON in `names`' order)."""
    return lambda files: render(dict(zip(names, files, strict=True)))


def _unique(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def fgd_seeds(head: str, spec: Seeds, bold: bool = False) -> Table:
    """Mean ± std over seeds of each row's losses and ratios to DiLoCo; with `bold`, a ratio
    whose mean is at most 1.01 is in bold."""

    def render(data: dict[str, dict]) -> str:
        lines = [
            f"| {head} | val loss (workers) | avg-model loss | workers vs DiLoCo "
            "| avg model vs DiLoCo | utilization at r = 0.887 (estimated) |",
            "|---|---|---|---|---|---|",
        ]
        for i, (label, _, _) in enumerate(spec.rows):
            runs = [run for _, (_, run) in sorted(spec.runs(data, i).items())]
            cells = [_ms([r[k] for r in runs]) for k in ("loss_val", "loss_val_avg_model")]
            for k in ("loss_val", "loss_val_avg_model"):
                ratio = list(spec.ratios(data, i, k).values())
                keep = bold and i > 0 and round(statistics.mean(ratio), 4) <= 1.01
                cells.append(f"**{_ms(ratio)}**" if keep else _ms(ratio))
            lines.append(_row([label, *cells, f"{runs[0]['util_r0887']:.3f}"]))
        return "\n".join(lines)

    return Table("docs/results/fgd.md", spec.files, _named(spec.files, render))


def _verdict_cell(ratios: dict[int, float]) -> str:
    """Mean ± std (bold where the mean is at most 1.01), then the worst seed."""
    cell = _ms(list(ratios.values()))
    worst = max(ratios, key=ratios.get)
    cell = f"**{cell}**" if round(statistics.mean(ratios.values()), 4) <= 1.01 else cell
    return f"{cell}, {ratios[worst]:.4f} (seed {worst})"


VerdictRow = tuple[Seeds, int, str, Seeds | None]  # spec, its row, "lr, momentum", real runs


def fgd_verdict(rows: tuple[VerdictRow, ...]) -> Table:
    """One method against DiLoCo per setting: the ratios' mean and worst seed, the files they
    come from; a setting rerun as real processes says whether those give the same cells."""
    names = _unique(
        tuple(n for spec, _, _, real in rows for n in spec.files + (real or spec).files)
    )

    def render(data: dict[str, dict]) -> str:
        lines = [
            "| H (rounds) | GlobalM1LocalM2's outer lr, momentum | workers: mean, worst seed "
            "| averaged: mean, worst seed | files |",
            "|---|---|---|---|---|",
        ]
        for spec, i, setting, real in rows:
            cells = [
                _verdict_cell(spec.ratios(data, i, k)) for k in ("loss_val", "loss_val_avg_model")
            ]
            used = {n for j in (0, i) for n, _ in spec.runs(data, j).values()}
            files = ", ".join(f"`{n}`" for n in spec.files if n in used)
            if real:
                again = [
                    _verdict_cell(real.ratios(data, 1, k))
                    for k in ("loss_val", "loss_val_avg_model")
                ]
                same = "the same" if again == cells else f"{again[0]}; {again[1]}"
                files += f" (real processes: `{real.rest}`, {same})"
            steps = data[spec.rest]["steps"]
            lines.append(_row([f"{spec.H} ({steps // spec.H})", setting, *cells, files]))
        return "\n".join(lines)

    return Table("docs/results/fgd.md", names, _named(names, render))


SUB_S0 = "M2pairs_embed-head-blocks_1"
TUNED_H10 = Seeds(
    10,
    ("fgd_lr_grid_h10.json",),
    "fgd_tuned_h10_seeds12.json",
    (
        ("diloco (0.35)", "diloco-lr0.35", "diloco-t"),
        ("GlobalM1 (0.35)", "GlobalM1-lr0.35", "GlobalM1-t"),
        ("GlobalM1LocalM2 (0.5)", "GlobalM1LocalM2-lr0.5", "GlobalM1LocalM2-t"),
        (f"{SUBSET} (0.35)", f"{SUB_S0}-lr0.35", "subset-t"),
    ),
)
TUNED_H50 = Seeds(
    50,
    ("fgd_lr_grid_h50_h100.json",),
    "fgd_tuned_h50_seeds12.json",
    (
        ("diloco (0.7)", "diloco", "diloco"),
        ("GlobalM1 (0.5)", "GlobalM1-lr0.5", "GlobalM1-t"),
        ("GlobalM1LocalM2 (0.7)", "GlobalM1LocalM2", "GlobalM1LocalM2"),
        (f"{SUBSET} (0.7)", SUBSET, SUBSET),
    ),
)
REAL_H50 = Seeds(  # the same cells as real processes, every seed in one file
    50,
    (),
    "fgd_real_h50.json",
    (("diloco", "", "diloco"), ("GlobalM1LocalM2", "", "GlobalM1LocalM2")),
)
TUNED_H100 = Seeds(
    100,
    ("fgd_lr_grid_h50_h100.json",),
    "fgd_tuned_h100_seeds12.json",
    (
        ("diloco (1.0)", "diloco-lr1.0", "diloco-t"),
        ("GlobalM1 (0.5)", "GlobalM1-lr0.5", "GlobalM1-t"),
        ("GlobalM1LocalM2 (1.0)", "GlobalM1LocalM2-lr1.0", "GlobalM1LocalM2-t"),
        (f"{SUBSET} (1.0)", f"{SUB_S0}-lr1.0", "subset-t"),
    ),
)
MOMENTUM_H10 = Seeds(
    10,
    ("fgd_momentum_h10.json",),
    "fgd_momentum_h10_seeds12.json",
    tuple(
        (label, name, name)
        for label, name in (
            ("diloco (0.35, mu 0.8)", "diloco-mu0.8"),
            ("GlobalM1LocalM2 (0.5, mu 0.8)", "GlobalM1LocalM2-mu0.8"),
            (f"{SUBSET} (0.35, mu 0.8)", "subset-mu0.8"),
        )
    ),
)
MOMENTUM_H50 = Seeds(
    50,
    ("fgd_momentum_h50_h100.json", "fgd_momentum_h50_fill.json"),
    "fgd_momentum_h50_seeds12.json",
    tuple(
        (label, name, name)
        for label, name in (
            ("diloco (1.0)", "diloco-m8-lr1"),
            ("GlobalM1 (0.5)", "GlobalM1-m8-lr05"),
            ("GlobalM1LocalM2 (0.7)", "GlobalM1LocalM2-m8-lr07"),
            (f"{SUBSET} (0.7)", "subset-m8-lr07"),
        )
    ),
)


def _rows(files: list[dict]) -> list[dict]:
    """The rows of every file, grouped by size in order of first appearance, then by tokens."""
    rows = [r for f in files for r in f["rows"]]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    return sorted(rows, key=lambda r: (sizes.index(r["size"]), r.get("tokens", 0)))


def forge_states_loss(files: list[dict]) -> str:
    """FORGE's state formats against torch AdamW: each arm's loss windows (forge_states_loss)."""
    arms = {
        "torch-fp32": ("torch AdamW (reference)", "fp32", "fp32"),
        "torch-bf16": ("torch AdamW", "bf16", "bf16, round to nearest"),
        "forge-fp32": ("FORGE", "fp32", "fp32"),
        "forge-int8": ("FORGE", "fp32", "8-bit"),
        "forge-bf16w": ("FORGE", "bf16, SR", "fp32"),
        "forge-bf16w-bf16s": ("FORGE", "bf16, SR", "bf16, SR"),
    }
    rows = files[0]["rows"]
    ref = rows[0]["windows"]
    lines = [
        "| arm | parameters | states | first window | last window | final step "
        "| max window difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diff = f"{r['max_window_rel_diff'] * 100:.3g}%" if r["max_window_rel_diff"] else "0"
        if r is not rows[0] and r["windows"] == ref and not r["max_window_rel_diff"]:
            diff += " (bit-identical)"
        cells = [f"{r[k]:.4f}" for k in ("first_window", "last_window", "final_step")]
        lines.append(_row([*arms[r["arm"]], *cells, diff]))
    return "\n".join(lines)


def forge_memory(files: list[dict]) -> str:
    """Resident, whole-step peak and transient MiB per GPT size, tokens and variant."""
    lines = [
        "| size (params) | tokens | variant | resident | whole-step peak | ratio | transient "
        "| ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in _rows(files):
        cells = [f"{r['size']} ({r['params_M']:.1f}M)", str(r["tokens"]), r["variant"]]
        cells += [f"{r['resident_MiB']:.0f}", f"{r['peak_MiB']:.0f}", f"{r['peak_ratio']:.2f}"]
        lines.append(_row([*cells, f"{r['transient_MiB']:.0f}", f"{r['transient_ratio']:.2f}"]))
    return "\n".join(lines)


def forge_memory_llama(files: list[dict]) -> str:
    """The same for the transformers Llama, by dtype, with the largest single allocation."""
    lines = [
        "| dtype | variant | resident | whole-step peak | ratio | transient | ratio | largest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in files[0]["rows"]:
        cells = [r["dtype"], r["variant"], f"{r['resident_MiB']:.0f}", f"{r['peak_MiB']:.0f}"]
        cells += [f"{r['peak_ratio']:.2f}", f"{r['transient_MiB']:.0f}"]
        lines.append(_row([*cells, f"{r['transient_ratio']:.2f}", f"{r['largest_alloc_MiB']:.1f}"]))
    return "\n".join(lines)


def forge_speed(files: list[dict]) -> str:
    """Median and minimum step time per size, tokens and variant (files in their order)."""
    lines = ["| size | tokens | variant | median s | min s | ratio |", "|---|---|---|---|---|---|"]
    for r in (r for f in files for r in f["rows"]):
        cells = [r["size"], str(r["tokens"]), r["variant"], f"{r['median_step_s']:.3f}"]
        lines.append(_row([*cells, f"{r['min_step_s']:.3f}", f"{r['ratio']:.2f}"]))
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
        lines.append(_row([*cells, f"{r['ratio']:.2f}", paired]))
    return "\n".join(lines)


def forge_targets(files: list[dict]) -> str:
    """FORGE's CPU targets at 512 tokens from the memory (first file) and speed (second) rows;
    the fp32-state memory targets in bold where met."""
    memory = {(r["size"], r["variant"]): r for r in files[0]["rows"] if r["tokens"] == 512}
    speed = {(r["size"], r["variant"]): r for r in files[1]["rows"] if r["tokens"] == 512}
    sizes = list(dict.fromkeys(size for size, _ in memory))
    targets = (  # label, rows, variant, key, at most, bold
        ("transient <= 0.5x", memory, "forge", "transient_ratio", 0.5, True),
        ("whole-step peak <= 0.8x", memory, "forge", "peak_ratio", 0.8, True),
        ("with 8-bit states: peak <= 0.8x", memory, "forge-int8", "peak_ratio", 0.8, False),
        ("step time <= 1.1x", speed, "forge", "ratio", 1.1, False),
    )
    lines = [_row(["target", *sizes]), "|---" * (len(sizes) + 1) + "|"]
    for label, rows, variant, key, most, bold in targets:
        cells = []
        for size in sizes:
            r = rows.get((size, variant))
            cell = (
                "not run"
                if r is None
                else f"{'met' if r[key] <= most else 'missed'} ({r[key]:.2f})"
            )
            cells.append(f"**{cell}**" if bold and cell.startswith("met") else cell)
        lines.append(_row([label, *cells]))
    return "\n".join(lines)


GPU_VARIANTS = (
    "adamw",
    "adamw-foreach",
    "forge",
    "forge-r512",
    "forge-triton",
    "forge-triton-int8",
)


def forge_gpu_steps(files: list[dict]) -> str:
    """Whole training step on the GPU: each variant's peak and step-time ratios to fused AdamW,
    per size, tokens and dtype (512 tokens first); the target cell (1B, 512 tokens,
    forge-triton) in bold."""
    rows = files[0]["rows"]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    cases = sorted(
        {(r["size"], r["tokens"], r["dtype"]) for r in rows},
        key=lambda c: (c[1], sizes.index(c[0]), c[2] != "fp32"),
    )
    got = {(r["size"], r["tokens"], r["dtype"], r["variant"]): r for r in rows}
    head = ["size", "tokens", "dtype", "fused AdamW: peak MiB / ms", *GPU_VARIANTS]
    lines = [_row(head), "|---" * len(head) + "|"]
    for case in cases:
        ref = got[(*case, "adamw-fused")]
        cells = [case[0], str(case[1]), case[2], f"{ref['peak_MiB']:.0f} / {ref['median_ms']:.1f}"]
        for v in GPU_VARIANTS:
            r = got[(*case, v)]
            t = "n/t" if r.get("time_ratio") is None else f"{r['time_ratio']:.2f}"
            cell = f"{r['peak_ratio']:.2f} / {t}"
            target = case[:2] == ("1B", 512) and v == "forge-triton"
            cells.append(f"**{cell}**" if target else cell)
        lines.append(_row(cells))
    return "\n".join(lines)


def forge_gpu_kernel(files: list[dict]) -> str:
    """The fused kernel alone against cuBLAS dW plus fused AdamW, at the kernel's default tile
    (the one whose time gives `default_speedup`) and the best tile tried."""
    lines = [
        "| dtype | tokens | layer V x H | cuBLAS dW ms | dW + fused AdamW ms | FORGE kernel ms "
        "| speed-up | best tile tried | its speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in files[0]["kernel"]:
        ref = r["cublas_plus_fused_adamw_ms"]
        tiles = [k for k in r if k.startswith("triton_") and k.endswith("_ms")]
        default = min(tiles, key=lambda k: abs(ref / r[k] - r["default_speedup"]))
        cells = [r["dtype"], str(r["tokens"]), f"{r['V']} x {r['H']}", f"{r['gemm_ms']:.3f}"]
        cells += [f"{ref:.3f}", f"{r[default]:.3f}", f"{r['default_speedup']:.2f}"]
        lines.append(_row([*cells, r["best_block"], f"{r['best_speedup']:.2f}"]))
    return "\n".join(lines)


def _times(x: float) -> str:
    return f"{x:.2f}x: {1 / x:.2f}x faster" if x < 1 else f"{x:.2f}x slower"


def forge_gpu_targets(files: list[dict]) -> str:
    """The GPU targets: FORGE's Triton kernel (fp32, then 8-bit states) against fused AdamW at
    512 tokens on the 1B stack, fp32 and bf16 parameters; a missed target in bold."""
    rows = [r for r in files[0]["rows"] if (r["size"], r["tokens"]) == ("1B", 512)]
    got = {(r["dtype"], r["variant"]): r for r in rows}

    def verdict(ok: bool, detail: str) -> str:
        return f"{'met' if ok else '**missed**'} ({detail})"

    lines = ["| target | fp32 | bf16 |", "|---|---|---|"]
    cells = ["step >= 1.2x faster (time <= 0.83x)"]
    for dtype in ("fp32", "bf16"):
        t = got[dtype, "forge-triton"]["time_ratio"]
        cells.append(verdict(t <= 0.83, _times(t)))
    lines.append(_row(cells))
    cells = ["whole-step peak <= 0.8x"]
    for dtype in ("fp32", "bf16"):
        peak = got[dtype, "forge-triton"]["peak_ratio"]
        cells.append(verdict(peak <= 0.8, f"{peak:.3g}x"))
    lines.append(_row(cells))
    cells = ["... with 8-bit states: peak <= 0.8x"]
    for dtype in ("fp32", "bf16"):
        r = got[dtype, "forge-triton-int8"]
        t = "time not run" if r.get("time_ratio") is None else f"{r['time_ratio']:.2f}x slower"
        peak = r["peak_ratio"]
        cells.append(f"{verdict(peak <= 0.8, f'{peak:.3g}x')}, {t}")
    lines.append(_row(cells))
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
            lines.append(_row([f"{malloc} (`benchmarks/results/{name}`)", *[""] * 5]))
            peak = {s: [max(r["peak_rss_MiB"]) for r in rs] for s, rs in runs.items()}
            step = {s: [r["step_s"] for r in rs] for s, rs in runs.items()}
            peak1, step1 = (statistics.median(x[min(runs)]) for x in (peak, step))
            for s, rs in runs.items():
                ratio = f"{statistics.median(peak[s]) / peak1:.3f}"
                cells = [str(s), _spread(peak[s], ".0f"), f"**{ratio}**" if s > 1 else ratio]
                cells += [f"{rs[0]['estimate_with_process_MiB']:.0f}", _spread(step[s], ".1f")]
                lines.append(_row([*cells, f"{statistics.median(step[s]) / step1:.2f}"]))
        return "\n".join(lines)

    return render


def sharding_bytes(files: list[dict]) -> str:
    """Outer bytes one process sent per round, per S (the median over repetitions)."""
    runs = _by_shards(files[0], "bytes")
    sent = {
        s: statistics.median(statistics.mean(r["outer_bytes"]) for r in rs)
        for s, rs in runs.items()
    }
    lines = ["| S | outer bytes per process per round (counted) | x S=1 |", "|---|---|---|"]
    for s, x in sent.items():
        lines.append(_row([str(s), f"{x:,.0f}", f"{x / sent[min(sent)]:.3f}"]))
    return "\n".join(lines)


def netlab_probe(files: list[dict]) -> str:
    """The link probe each rate's runs recorded (netlab.json): the all-reduce and the pair
    exchange of S bytes, measured, beside their nominal times 1.5 S / B and S / B."""
    probes = {r["rate_mbit"]: r["link_probe_measured"] for r in netlab_rows(files[0])}
    lines = [
        "| tbf rate | all-reduce of S (nominal 1.5 S / B) | effective "
        "| pair exchange of S (nominal S / B) | effective |",
        "|---|---|---|---|---|",
    ]
    for rate, p in probes.items():
        nominal = p["bytes"] * 8 / (rate * 1e6)
        cells = [f"{rate:g} Mbit/s", f"{p['allreduce_s_measured']:.3f} s ({1.5 * nominal:.3f} s)"]
        cells += [f"{p['allreduce_effective_bps'] / 1e6:.1f} Mbit/s"]
        cells += [f"{p['pair_exchange_s_measured']:.3f} s ({nominal:.3f} s)"]
        lines.append(_row([*cells, f"{p['pair_effective_bps'] / 1e6:.1f} Mbit/s"]))
    return "\n".join(lines)


def netlab_utilization(files: list[dict]) -> str:
    """Measured utilization on the rate-limited links beside each prediction (netlab.json), with
    the measured figure relative to each prediction."""

    def against(pred: float, measured: float, digits: int = 0) -> str:
        return f"{pred:.3f} ({(measured / pred - 1) * 100:+.{digits}f}%)"

    lines = [
        "| rate | method | step c (s), measured | r (probed) | **U measured** "
        "| closed form, probed link | simulator, probed link | simulator, measured inputs "
        "| closed form, nominal link | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in netlab_rows(files[0]):
        u = r["measured"]["U"]
        cells = [f"{r['rate_mbit']:g} Mbit/s", r["method"], f"{r['measured']['step_s']:.3f}"]
        cells += [f"{r['r_probe_estimated']:.2f}", f"**{u:.3f}**"]
        cells += [
            against(r["U_closed_form_probe_estimated"], u),
            against(r["U_simulated_probe"], u),
        ]
        cells += [against(r["U_simulated_measured_inputs"], u, 1)]
        cells += [against(r["U_closed_form_nominal_estimated"], u)]
        lines.append(_row([*cells, f"{r['load_avg_1min_before']:.1f}"]))
    return "\n".join(lines)


def fgd_corpora(files: list[dict]) -> str:
    """Per results file (a model size): the ratio tables of each worker's model and of the
    averaged one."""
    parts = []
    for rec in files:
        models = ", ".join(
            f"{m} ({' '.join(sets) or 'as shipped'})" for m, sets in rec["models"].items()
        )
        seeds = sorted({r["seed"] for r in rec["runs"] if r["method"] != "diloco"})  # paired
        for key, what in (
            ("loss_val", "each worker's own model"),
            ("loss_val_avg_model", "averaged model"),
        ):
            parts.append(
                f"{models}, {what}; seeds {seeds}; mean, then worst seed ({rec['kind']}):\n"
            )
            parts.append(corpora_table(rec, key) + "\n")
    return "\n".join(parts).rstrip()


def fgd_corpora_merged(files: list[dict]) -> str:
    """The results files of one probe, run in parts (e.g. seeds 0, 1, then 2, 3), as one pair of
    tables (fgd_corpora's), H in the caption; a method run on fewer seeds than the others is
    named with its seeds, so no cell reads as more seeds than it has."""
    runs = [r for f in files for r in f["runs"]]
    methods = list(dict.fromkeys(m for f in files for m in f["methods"]))
    seeds = {m: sorted({r["seed"] for r in runs if r["method"] == m}) for m in methods}
    most = max(len(s) for m, s in seeds.items() if m != "diloco")
    name = {
        m: m if m == "diloco" or len(seeds[m]) == most else f"{m} (seeds {seeds[m]})"
        for m in methods
    }
    Hs = sorted({f["H"] for f in files})
    if len(Hs) != 1:
        raise ValueError(f"one probe, one H: got {Hs}")
    merged = files[0] | {
        "models": {f"{m} at H = {Hs[0]}": s for m, s in files[0]["models"].items()},
        "methods": [name[m] for m in methods],
        "runs": [r | {"method": name[r["method"]]} for r in runs],
    }
    return fgd_corpora([merged])


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


OUTER_STEP = ("outer.lr", "outer.momentum")  # the overrides that make a method's outer step


def _outer_step(sets: list[str]) -> list[str]:
    """The outer-step overrides of a run, as KEY=VALUE without "outer.", each key once (its
    last value: a method's own override after the file's --set), in the order they first came."""
    last = {k: s for s in sets if (k := s.split("=")[0]) in OUTER_STEP}
    return [s.removeprefix("outer.") for s in last.values()]


def fgd_outer_choice(
    corpus: str, groups: tuple[tuple[str, ...], ...]
) -> Callable[[list[dict]], str]:
    """Each method's final validation loss (each worker's own model) on `corpus`, by seed and its
    mean, group by group (one method's outer steps); the lowest mean of each group in bold: the
    pick. Its outer step is the run's outer.lr and outer.momentum overrides, else its example's
    as the file recorded it ("shipped then": examples are retuned)."""

    def render(files: list[dict]) -> str:
        runs = _corpora_runs(files)
        outer = {m: t for f in files for m, t in f["outer_tables"].items()}
        seeds = sorted({s for _, c, s in runs if c == corpus})
        lines = [
            "| method | outer step | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
            "|---" * (len(seeds) + 3) + "|",
        ]
        for group in groups:
            means = {}
            for m in group:
                xs = [runs[(m, corpus, s)]["loss_val"] for s in seeds]
                means[m] = (statistics.mean(xs), xs)
            best = min(means, key=lambda m: means[m][0])
            for m, (mean, xs) in means.items():
                step = _outer_step(runs[(m, corpus, seeds[0])]["sets"])
                shipped = f"lr={outer[m]['lr']}, momentum={outer[m]['momentum']} (shipped then)"
                cells = [f"{x:.4f}" for x in xs] + [f"{mean:.4f}"]
                if m == best:
                    cells = [f"**{c}**" for c in cells]
                lines.append(_row([m, ", ".join(step) or shipped, *cells]))
        return "\n".join(lines)

    return render


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
                    lines.append(_row([f"{method} / {ref}", c + tuned, *cells]))
            parts.append("\n".join(lines) + "\n")
        return "\n".join(parts).rstrip()

    return render


RETUNE_GRID = (  # each method's outer steps on stdlib: as shipped, then momentum 0
    ("diloco", "diloco-m0-lr1.0", "diloco-m0-lr1.26", "diloco-m0-lr1.6"),
    ("GlobalM1LocalM2-int8", "int8-m0-lr1.0", "int8-m0-lr1.26", "int8-m0-lr1.6"),
)
RETUNE_PAIRS = (  # int8 FGD over DiLoCo, both retuned, then both as shipped
    ("int8-m0-lr1.26", "diloco-m0-lr1.26"),
    ("GlobalM1LocalM2-int8", "diloco"),
)
RETUNE_GRID_H10 = (  # the same at H = 10; lr 1.6 dropped for int8 FGD (worst at H = 50)
    ("diloco", "diloco-m0-lr1.0", "diloco-m0-lr1.26", "diloco-m0-lr1.6"),
    ("GlobalM1LocalM2-int8", "int8-m0-lr1.0", "int8-m0-lr1.26"),
)
RETUNE_PAIRS_H10 = (  # the picks at H = 10, then both as shipped
    ("int8-m0-lr1.0", "diloco-m0-lr1.0"),
    ("GlobalM1LocalM2-int8", "diloco"),
)
RETUNE_ALL_GRID = tuple(  # every other example's outer step on stdlib, the same rule
    (m, *(f"{m}-m0-lr{lr}" for lr in ("1.0", "1.26", "1.6")))
    for m in ("streaming", "noloco", "GlobalM1", "GlobalM1LocalM2", "subset", "gossip")
)
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


STREAMING_GRID_H10 = (  # Streaming's own step at H = 10 beside DiLoCo's (its H = 10 pick: lr 1.0)
    ("diloco", "diloco-m0-lr1.0"),
    ("streaming-m0-lr1.0", "streaming-m0-lr1.26", "streaming-m0-lr1.6"),
)
EVERY_H10_FILES = (  # every method's own step at H = 10 (momentum 0), and the probes beside it
    "fgd_retune_all_grid_h10.json",
    "fgd_h10_probes.json",
    "fgd_corpora_h10_mix1_delta.json",  # int8 FGD at lr 1.0, on the same machine
)
EVERY_H10_GRID = (
    ("diloco", "diloco-lr0.8"),
    *(
        tuple(f"{m}-lr{lr}" for lr in ("0.8", "1.0", "1.26"))
        for m in ("streaming", "noloco", "subset", "GlobalM1LocalM2-4bit")
    ),
    ("GlobalM1-lr0.6", "GlobalM1-lr0.8", "GlobalM1-lr1.0", "GlobalM1-lr1.26"),
    ("GlobalM1LocalM2-int8-lr0.8", "GlobalM1LocalM2-int8"),
)
EVERY_H10_PROBES = (  # other settings at lr 1.0: Streaming's overlap, FGD's Mix2 one round late
    ("streaming-lr1.0", "streaming-overlap2", "streaming-overlap3"),
    ("GlobalM1LocalM2-4bit-lr1.0", "GlobalM1LocalM2-4bit-late"),
)
H5_FILES = ("fgd_h5_probe.json", "fgd_h5_probe_others.json")  # rounds twice as often
RS_H5_GRID = (  # 4-bit rs DiLoCo's outer step by the rule at its H = 5, DiLoCo at H = 10 beside
    ("diloco",),
    tuple(f"diloco-e3m0-H5-rs{lr}" for lr in ("-lr0.8", "", "-lr1.26")),
)
H4_OVERLAP_PAIRS = (  # Streaming at H = 4 as one fragment, overlapping 1 or 2 of its 4 steps
    ("streaming-H4", "diloco"),
    ("streaming-H4-f1", "diloco"),
    ("streaming-H4-f1-overlap2", "diloco"),
)
H5_PAIRS = (  # each over DiLoCo at H = 10 (the links' baseline), then over DiLoCo at its own H
    ("diloco-H5", "diloco"),
    ("GlobalM1LocalM2-4bit-H5", "diloco"),
    ("GlobalM1LocalM2-4bit-H5-lr0.8", "diloco"),
    ("GlobalM1-H5", "diloco"),
    ("diloco-e3m0-H5", "diloco"),
    ("streaming-H4", "diloco"),
    ("GlobalM1LocalM2-4bit-H5", "diloco-H5"),
    ("diloco-e3m0-H5", "diloco-H5"),
)
DELAY_FILES = ("fgd_retune_all_grid_h10.json", "fgd_h5_probe.json", "fgd_delay_probe.json")
DELAY_PAIRS = (  # 4-bit FGD with Mix2 blocking, then sent 1, 2 or 3 steps before its round's end
    ("GlobalM1LocalM2-4bit-lr1.0", "diloco"),
    ("GlobalM1LocalM2-4bit-d1", "diloco"),
    ("GlobalM1LocalM2-4bit-d3", "diloco"),
    ("GlobalM1LocalM2-4bit-H5", "diloco"),
    ("GlobalM1LocalM2-4bit-H5-d1", "diloco"),
    ("GlobalM1LocalM2-4bit-H5-d2", "diloco"),
)
GLOBALM2_FILES = ("fgd_globalm2.json", *H5_FILES, "fgd_h5_report.json")
GLOBALM2_PAIRS = (  # DiLoCo's round sent a step early, keeping or discarding the step
    ("GlobalM2-4bit-H5-d1", "diloco"),
    ("streaming-H5-f1", "diloco"),
    ("diloco-e3m0-H5", "diloco"),
    ("GlobalM1LocalM2-4bit-H5", "diloco"),
    ("GlobalM2-4bit-H5-d1", "diloco-e3m0-H5"),
    ("streaming-H5-f1", "diloco-e3m0-H5"),
)
OVERLAP_FILES = (
    "fgd_h5_rs_grid.json",
    "fgd_globalm2_d2_probe.json",
    "fgd_globalm2_late_probe.json",
    "fgd_globalm2_eager_probe.json",
)
OVERLAP_PAIRS = (  # DiLoCo's round in 4 bits at H = 5: blocking, sent 2 steps early, a round late
    ("diloco-e3m0-H5-rs", "diloco"),
    ("GlobalM2-4bit-H5-d2", "diloco"),
    ("GlobalM2-4bit-H5-late", "diloco"),
    ("GlobalM2-4bit-H4-late", "diloco"),
    ("GlobalM2-4bit-H5-late-w0.5", "diloco"),
    ("GlobalM2-4bit-H5-eager", "diloco"),
)
LOWBIT_FILES = (  # 4 bits from its own files (stdlib; doc and include), 2 and 1 from these
    "fgd_h5_rs_grid.json",
    "fgd_reduce_scatter_diloco.json",
    "fgd_lowbit_probe.json",
    "fgd_lowbit_report.json",
)
LOWBIT_PAIRS = (  # DiLoCo's rs round at H = 5 in 4, 2 and 1 bits, the last two with error feedback
    ("diloco-e3m0-H5-rs", "diloco"),
    ("diloco-2bit-H5-rs", "diloco"),
    ("diloco-1bit-H5-rs", "diloco"),
)
RS_FILES = ("fgd_reduce_scatter_stdlib.json", "fgd_reduce_scatter.json")
RS_PAIRS = (  # 4-bit averages as a reduce-scatter then an all-gather, against the gather
    ("GlobalM2-4bit-H5-d1-rs", "diloco"),
    ("diloco-e3m0-H5-rs", "diloco"),
    ("GlobalM2-4bit-H5-d1", "diloco"),
    ("GlobalM2-4bit-H5-d1-rs", "GlobalM2-4bit-H5-d1"),
)
RS_DILOCO_FILES = ("fgd_reduce_scatter_diloco.json",)  # DiLoCo e3m0 H = 5 on the untuned corpora
RS_DILOCO_4X_FILES = ("fgd_reduce_scatter_diloco_4x.json",)  # the same on the 4x model


def _job_grid(method: str) -> tuple[tuple[str, ...], ...]:
    """A method's outer steps tried on the default job's stdlib: the job's earlier one, then
    momentum 0 at three lr."""
    return ((f"{method}-lr0.35-m0.8", *(f"{method}-m0-lr{lr}" for lr in ("1.0", "1.26", "1.6"))),)


DEFAULT_JOB_GRID = _job_grid("diloco") + _job_grid("streaming")
DEFAULT_JOB_PAIRS = (("streaming-m0-lr1.0", "diloco-m0-lr1.0"),)  # the picks
DEFAULT_JOB_FILES = tuple(
    f"default_job_{part}_{m}.json" for part in ("grid", "report") for m in ("diloco", "streaming")
)


DILOCO_RS_JOB = "diloco-e3m0-H5-rs"  # the default job before: DiLoCo at H = 5, 4 bits, rs
DILOCO_RS_JOB_PAIRS = ((f"{DILOCO_RS_JOB}-m0-lr1.0", "diloco-m0-lr1.0"),)  # the pick
DILOCO_RS_JOB_FILES = (
    "default_job_grid_rs_a.json",  # DiLoCo at the job's H = 16, and the job's earlier step
    "default_job_grid_rs_b.json",
    "default_job_report_diloco.json",
    "default_job_report_rs_doc.json",
    "default_job_report_include_diloco.json",
    "default_job_report_rs_include.json",
)
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
E3M0_GRID = (("diloco", "diloco-e3m0-m0-lr1.0", "diloco-e3m0-m0-lr1.26", "diloco-e3m0-m0-lr1.6"),)
E3M0_PAIRS = (("diloco-e3m0-m0-lr1.26", "diloco"),)  # the pick over DiLoCo at its own


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
    r = time_to_loss_diloco_r(record, case)
    lines = [
        f"| method | time to DiLoCo's final loss, x DiLoCo (mean, range over {len(record['seeds'])}"
        " seeds) | loss at DiLoCo's last step, x DiLoCo (mean, worst seed) |",
        "|---|---|---|",
    ]
    found = {a["method"]: a for a in time_to_loss_analyze(record)}
    for label, method in HEADLINE_ROWS:
        a = found[method]
        final = a["final_x"]
        loss = f"{statistics.mean(final):.4f} ({max(final):.4f})" if final else "-"
        lines.append(f"| {label} | {time_to_loss_fmt_ratios(a['ratios'])} | {loss} |")
    return "\n".join(lines) + f"\n\nDiLoCo's exchange took {r:.2f}x its compute per round here."


def _time_to_loss(file: str, render: Callable[[dict], str]) -> Table:
    """A table of docs/results/time_to_loss.md drawn from one time_to_loss.py results file."""
    return Table("docs/results/time_to_loss.md", (file,), lambda f: render(f[0]))


def _plan(file: str, penalty_files: tuple[str, ...] = PENALTY_FILES) -> Table:
    """The planner against one time_to_loss.py results file, with the step penalties drawn from
    `penalty_files` (the packaged ones by default)."""
    paths = [f"benchmarks/results/{name}" for name in penalty_files]

    def render(f: list[dict]) -> str:
        return time_to_loss_plan(f[0], time_to_loss_penalties(list(zip(paths, f[1:], strict=True))))

    return Table("docs/results/time_to_loss.md", (file, *penalty_files), render)


TABLES = {
    "time-to-loss-links": _time_to_loss("time_to_loss.json", links_table),
    "time-to-loss": _time_to_loss("time_to_loss.json", time_to_loss_table),
    "time-to-loss-plan": _plan("time_to_loss.json", PENALTY_FILES_BEFORE),
    "machines": Table("docs/multihost.md", ("machines.json",), lambda f: machines_table(f[0])),
    "faults-matrix": Table("docs/reliability.md", ("faults.json",), lambda f: faults_table(f[0])),
    "link-probe": Table(
        "docs/results/netlab.md", ("link_probe.json",), lambda files: link_probe_table(files[0])
    ),
    "compression-h10": Table(
        "docs/results/compression.md",
        ("compression_h10_s0.json", "compression_h10_s12.json"),
        compression,
    ),
    "compression-long": Table(
        "docs/results/compression.md",
        ("compression_h10_2000steps.json", "compression_h10_2000steps_topk01.json")
        + ("compression_h10_s0.json", "compression_h10_s12.json"),
        compression_long,
    ),
    "compression-real": Table(
        "docs/results/compression.md",
        ("compression_h10_real_s0.json", "compression_h10_real_s12.json")
        + ("compression_h10_s0.json", "compression_h10_s12.json"),
        compression_real,
    ),
    "ft-straggler": Table("docs/fault_tolerance.md", ("ft_straggler.json",), ft_straggler),
    "vs-torchft": Table("docs/fault_tolerance.md", ("vs_torchft.json",), vs_torchft),
    "energy-public-loglinear": Table(
        "docs/energy.md", ("energy_public_validation.json",), energy_loglinear
    ),
    "energy-public-roofline": Table(
        "docs/energy.md", ("energy_public_validation.json",), energy_roofline
    ),
    "energy-cpu-sweep": Table("docs/energy.md", ("energy_cpu_sweep.json",), energy_cpu_sweep),
    "energy-h100": Table("docs/energy.md", ("energy_gpu_h100_summary.json",), energy_h100),
    "energy-h100-windows": Table("docs/energy.md", ("energy_gpu_h100.jsonl",), energy_h100_windows),
    "energy-h100-kernels": Table("docs/energy.md", ("energy_gpu_h100.jsonl",), energy_h100_kernels),
    "data-prep": Table("docs/data.md", ("data_prep.json",), lambda f: data_prep_table(f[0])),
    "flow-runs": Table("docs/flow.md", flow_tables.VLM_FILES, flow_tables.vlm_runs),
    "flow-idle": Table("docs/flow.md", flow_tables.VLM_FILES[:2], flow_tables.vlm_idle),
    "flow-projection": Table("docs/flow.md", flow_tables.VLM_FILES, flow_tables.vlm_projection),
    "flow-sensitivity": Table(
        "docs/flow.md", ("flow-vlm-run2.json",), flow_tables.flow_sensitivity
    ),
    "flow-validation": Table(
        "docs/flow.md", flow_tables.VLM_FILES[:2], flow_tables.flow_validation
    ),
    "flow-tiny-runs": Table("docs/flow.md", TINY, flow_tables.tiny_runs_encoder),
    "flow-tiny-runs-backbone": Table("docs/flow.md", TINY, flow_tables.tiny_runs_backbone),
    "flow-tiny-idle": Table("docs/flow.md", TINY, flow_tables.tiny_idle),
    "flow-tiny-variants": Table("docs/flow.md", TINY, flow_tables.tiny_variants),
    "flow-tiny-alloc": Table(
        "docs/flow.md",
        ("flow-alloc-R3-encoder_heavy.json", "flow-alloc-R4-backbone_heavy.json"),
        flow_tables.tiny_alloc,
    ),
    "flow-tiny-cost-models": Table("docs/flow.md", ("flow.json",), flow_tables.tiny_cost_models),
    "flow-tiny-validation": Table("docs/flow.md", TINY, flow_tables.tiny_validation),
    "flow-tiny-slowdown": Table("docs/flow.md", TINY, flow_tables.tiny_slowdown),
    "flow-tiny-projection-encoder": Table(
        "docs/flow.md", ("flow.json",), flow_tables.tiny_projection("encoder_heavy")
    ),
    "flow-tiny-projection-backbone": Table(
        "docs/flow.md", ("flow.json",), flow_tables.tiny_projection("backbone_heavy")
    ),
    "hf-loss-gap": Table("docs/models.md", ("hf_loss_gap.json",), hf_loss_gap),
    "hf-loss-gap-tuned": Table("docs/models.md", ("hf_loss_gap_tuned.json",), hf_loss_gap_tuned),
    "compression-outer-pilot": Table(
        "docs/results/compression.md",
        ("compression_outer_pilot_h10.json", "compression_outer_pilot_h50.json")
        + ("compression_sparse_lr_h10.json", "fgd_momentum_h10.json", "fgd_momentum_h50_h100.json"),
        compression_outer_pilot,
    ),
    "time-to-loss-int8-links": _time_to_loss("time_to_loss_int8_fgd.json", links_table),
    "time-to-loss-int8": _time_to_loss("time_to_loss_int8_fgd.json", time_to_loss_table),
    "time-to-loss-int8-plan": _plan("time_to_loss_int8_fgd.json", PENALTY_FILES_BEFORE),
    "time-to-loss-retuned-links": _time_to_loss("time_to_loss_retuned_h10.json", links_table),
    "time-to-loss-retuned": _time_to_loss("time_to_loss_retuned_h10.json", time_to_loss_table),
    "time-to-loss-retuned-streaming": _time_to_loss(
        "time_to_loss_retuned_h10_streaming.json", time_to_loss_table
    ),
    "time-to-loss-mix1-bf16": _time_to_loss("time_to_loss_mix1bf16.json", time_to_loss_table),
    "time-to-loss-past-links": _time_to_loss("time_to_loss_past_h10.json", links_table),
    "time-to-loss-past": _time_to_loss("time_to_loss_past_h10.json", time_to_loss_table),
    "time-to-loss-past-r1-slow-links": _time_to_loss(
        "time_to_loss_past_h10_r1_slow.json", links_table
    ),
    "time-to-loss-past-r1-slow": _time_to_loss(
        "time_to_loss_past_h10_r1_slow.json", time_to_loss_table
    ),
    "time-to-loss-rest": _time_to_loss("time_to_loss_past_h10_rest.json", time_to_loss_table),
    "time-to-loss-past-plan": _plan("time_to_loss_past_h10.json"),
    "time-to-loss-rest-plan": _plan("time_to_loss_past_h10_rest.json"),
    "time-to-loss-past-r1-slow-plan": _plan("time_to_loss_past_h10_r1_slow.json"),
    "time-to-loss-mix1-delta-links": _time_to_loss("time_to_loss_mix1_delta.json", links_table),
    "time-to-loss-mix1-delta": _time_to_loss("time_to_loss_mix1_delta.json", time_to_loss_table),
    "time-to-loss-mix1-delta-plan": _plan("time_to_loss_mix1_delta.json"),
    "time-to-loss-mix1-delta-r1-slow-links": _time_to_loss(
        "time_to_loss_mix1_delta_r1_slow.json", links_table
    ),
    "time-to-loss-mix1-delta-r1-slow": _time_to_loss(
        "time_to_loss_mix1_delta_r1_slow.json", time_to_loss_table
    ),
    "time-to-loss-mix1-delta-r1-slow-plan": _plan("time_to_loss_mix1_delta_r1_slow.json"),
    "time-to-loss-llama-links": _time_to_loss("time_to_loss_llama_mix1_delta.json", links_table),
    "time-to-loss-llama": _time_to_loss("time_to_loss_llama_mix1_delta.json", time_to_loss_table),
    "time-to-loss-llama-plan": _plan("time_to_loss_llama_mix1_delta.json"),
    "time-to-loss-own-links": _time_to_loss("time_to_loss_own_steps_h10.json", links_table),
    "time-to-loss-own": _time_to_loss("time_to_loss_own_steps_h10.json", time_to_loss_table),
    "time-to-loss-h5-links": _time_to_loss("time_to_loss_h5.json", links_table),
    "time-to-loss-h5": _time_to_loss("time_to_loss_h5.json", time_to_loss_table),
    "time-to-loss-h5-plan": _plan("time_to_loss_h5.json"),
    "time-to-loss-h5-d1-links": _time_to_loss("time_to_loss_h5_d1.json", links_table),
    "time-to-loss-h5-d1": _time_to_loss("time_to_loss_h5_d1.json", time_to_loss_table),
    "time-to-loss-h5-d1-plan": _plan("time_to_loss_h5_d1.json"),
    "time-to-loss-codec-links": _time_to_loss("time_to_loss_h5_codec.json", links_table),
    "time-to-loss-codec": _time_to_loss("time_to_loss_h5_codec.json", time_to_loss_table),
    "readme-headline": Table("README.md", (HEADLINE,), readme_headline),
    "time-to-loss-globalm2-links": _time_to_loss("time_to_loss_globalm2.json", links_table),
    "time-to-loss-globalm2": _time_to_loss("time_to_loss_globalm2.json", time_to_loss_table),
    "time-to-loss-globalm2-split": _time_to_loss("time_to_loss_globalm2.json", time_split_table),
    "time-to-loss-globalm2-plan": _plan("time_to_loss_globalm2.json"),
    "time-to-loss-rs-links": _time_to_loss("time_to_loss_reduce_scatter.json", links_table),
    "time-to-loss-rs": _time_to_loss("time_to_loss_reduce_scatter.json", time_to_loss_table),
    "time-to-loss-rs-split": _time_to_loss("time_to_loss_reduce_scatter.json", time_split_table),
    "time-to-loss-rs-plan": _plan("time_to_loss_reduce_scatter.json"),
    "time-to-loss-rs-slow-links": _time_to_loss(
        "time_to_loss_reduce_scatter_slow.json", links_table
    ),
    "time-to-loss-rs-slow": _time_to_loss(
        "time_to_loss_reduce_scatter_slow.json", time_to_loss_table
    ),
    "time-to-loss-rs-slow-split": _time_to_loss(
        "time_to_loss_reduce_scatter_slow.json", time_split_table
    ),
    "time-to-loss-rs-slow-plan": _plan("time_to_loss_reduce_scatter_slow.json"),
    "time-to-loss-doc-links": _time_to_loss("time_to_loss_doc_snapshot.json", links_table),
    "time-to-loss-doc": _time_to_loss("time_to_loss_doc_snapshot.json", time_to_loss_table),
    "time-to-loss-doc-split": _time_to_loss("time_to_loss_doc_snapshot.json", time_split_table),
    "time-to-loss-doc-plan": _plan("time_to_loss_doc_snapshot.json"),
    "time-to-loss-doc-seeds-links": _time_to_loss(
        "time_to_loss_doc_snapshot_seeds345.json", links_table
    ),
    "time-to-loss-doc-seeds": _time_to_loss(
        "time_to_loss_doc_snapshot_seeds345.json", time_to_loss_table
    ),
    "time-to-loss-doc-seeds-split": _time_to_loss(
        "time_to_loss_doc_snapshot_seeds345.json", time_split_table
    ),
    "time-to-loss-doc-r2-seeds": _time_to_loss(
        "time_to_loss_doc_snapshot_r2_seeds345.json", time_to_loss_table
    ),
    "time-to-loss-doc-r2-seeds-split": _time_to_loss(
        "time_to_loss_doc_snapshot_r2_seeds345.json", time_split_table
    ),
    "time-to-loss-2bit-links": _time_to_loss("time_to_loss_doc_2bit.json", links_table),
    "time-to-loss-2bit": _time_to_loss("time_to_loss_doc_2bit.json", time_to_loss_table),
    "time-to-loss-2bit-split": _time_to_loss("time_to_loss_doc_2bit.json", time_split_table),
    "time-to-loss-2bit-r1-links": _time_to_loss("time_to_loss_doc_2bit_r1.json", links_table),
    "time-to-loss-2bit-r1": _time_to_loss("time_to_loss_doc_2bit_r1.json", time_to_loss_table),
    "time-to-loss-2bit-r1-split": _time_to_loss("time_to_loss_doc_2bit_r1.json", time_split_table),
    "time-to-loss-eager-links": _time_to_loss("time_to_loss_doc_eager.json", links_table),
    "time-to-loss-eager": _time_to_loss("time_to_loss_doc_eager.json", time_to_loss_table),
    "time-to-loss-eager-split": _time_to_loss("time_to_loss_doc_eager.json", time_split_table),
    "time-to-loss-eager-plan": _plan("time_to_loss_doc_eager.json"),
    "time-to-loss-at-r-links": _time_to_loss("time_to_loss_at_r.json", links_table),
    "time-to-loss-at-r": _time_to_loss("time_to_loss_at_r.json", time_to_loss_table),
    "time-to-loss-at-r-split": _time_to_loss("time_to_loss_at_r.json", time_split_table),
    "time-to-loss-at-r-plan": _plan("time_to_loss_at_r.json"),
    "time-to-loss-at-r1-more-links": _time_to_loss("time_to_loss_at_r1_seeds345.json", links_table),
    "time-to-loss-at-r1-more": _time_to_loss(
        "time_to_loss_at_r1_seeds345.json", time_to_loss_table
    ),
    "time-to-loss-at-r1-more-split": _time_to_loss(
        "time_to_loss_at_r1_seeds345.json", time_split_table
    ),
    "time-to-loss-at-r2-more-links": _time_to_loss("time_to_loss_at_r2_seeds345.json", links_table),
    "time-to-loss-at-r2-more": _time_to_loss(
        "time_to_loss_at_r2_seeds345.json", time_to_loss_table
    ),
    "time-to-loss-at-r2-more-split": _time_to_loss(
        "time_to_loss_at_r2_seeds345.json", time_split_table
    ),
    "time-to-loss-means-ab": Table(
        "docs/results/time_to_loss.md",
        ("time_to_loss_means_at_round_end.json", "time_to_loss_means_when_in.json"),
        lambda f: "\n\n".join(
            f"{when}:\n\n{time_to_loss_table(r)}\n\n{time_split_table(r)}"
            for when, r in zip(
                ("The means sent at the round's end (the commit before)", "Sent when they are in"),
                f,
                strict=True,
            )
        ),
    ),
    "time-to-loss-period-split": Table(
        "docs/results/time_to_loss.md",
        ("time_to_loss_period_100ms.json", "time_to_loss_period_10ms.json"),
        lambda f: "\n\n".join(
            f"The quota granted per {r['cpu_period_ms']:g} ms:\n\n{time_split_table(r)}" for r in f
        ),
    ),
    "mix1-delta-corpora": Table(
        "docs/results/time_to_loss.md", ("fgd_corpora_h10_mix1_delta.json",), fgd_corpora_merged
    ),
    "mix1-bf16-corpora": Table(
        "docs/results/time_to_loss.md", ("fgd_corpora_base_mix1bf16.json",), fgd_corpora
    ),
    "fgd-corpora": Table(
        "docs/results/fgd.md",
        ("fgd_corpora_base.json", "fgd_corpora_4x.json", "fgd_corpora_4x_default_job.json"),
        fgd_corpora,
    ),
    "fgd-late": Table("docs/results/fgd.md", ("fgd_late_probe.json",), fgd_corpora),
    "fgd-prose-outer": Table(
        "docs/results/fgd.md",
        ("fgd_prose_probe_outer.json", "fgd_prose_probe_outer_s23.json"),
        fgd_corpora_merged,
    ),
    "fgd-prose-h25": Table(
        "docs/results/fgd.md",
        ("fgd_prose_probe_h25.json", "fgd_prose_probe_h25_lr.json"),
        fgd_corpora_merged,
    ),
    "fgd-prose-fgd": Table(
        "docs/results/fgd.md", ("fgd_prose_probe_fgd.json",), fgd_corpora_merged
    ),
    "fgd-prose-reset": Table(
        "docs/results/fgd.md", ("fgd_prose_probe_reset.json",), fgd_corpora_merged
    ),
    "fgd-retune-choice": Table(
        "docs/results/fgd.md",
        ("fgd_corpora_base.json", "fgd_retune_grid.json"),
        fgd_outer_choice("stdlib", RETUNE_GRID),
    ),
    "fgd-retune": Table(
        "docs/results/fgd.md",
        ("fgd_retune_grid.json", "fgd_retune_report.json"),
        fgd_corpora_merged,
    ),
    "fgd-retune-pairs": Table(
        "docs/results/fgd.md",
        ("fgd_corpora_base.json", "fgd_retune_grid.json", "fgd_retune_report.json"),
        fgd_pair_ratios(RETUNE_PAIRS),
    ),
    "fgd-retune-h10-choice": Table(
        "docs/results/fgd.md",
        ("fgd_retune_grid_h10.json",),
        fgd_outer_choice("stdlib", RETUNE_GRID_H10),
    ),
    "fgd-retune-h10-pairs": Table(
        "docs/results/fgd.md",
        ("fgd_retune_grid_h10.json", "fgd_retune_report_h10.json"),
        fgd_pair_ratios(RETUNE_PAIRS_H10),
    ),
    "streaming-h10-choice": Table(
        "docs/results/time_to_loss.md",
        ("fgd_streaming_grid_h10.json",),
        fgd_outer_choice("stdlib", STREAMING_GRID_H10),
    ),
    "fgd-every-h10-choice": Table(
        "docs/results/fgd.md", EVERY_H10_FILES, fgd_outer_choice("stdlib", EVERY_H10_GRID)
    ),
    "fgd-every-h10-report": Table(
        "docs/results/fgd.md", ("fgd_every_h10_report.json",), fgd_corpora
    ),
    "fgd-every-h10-probes": Table(
        "docs/results/fgd.md", EVERY_H10_FILES, fgd_outer_choice("stdlib", EVERY_H10_PROBES)
    ),
    "fgd-h5-probe": Table("docs/results/fgd.md", H5_FILES, fgd_pair_ratios(H5_PAIRS)),
    "fgd-h5-report": Table("docs/results/fgd.md", ("fgd_h5_report.json",), fgd_corpora),
    "fgd-h5-4x": Table(
        "docs/results/fgd.md", ("fgd_h5_4x.json", "fgd_h5_4x_seed2.json"), fgd_corpora_merged
    ),
    "fgd-h4-overlap-probe": Table(
        "docs/results/fgd.md",
        ("fgd_h5_probe_others.json", "fgd_h4_overlap_probe.json"),
        fgd_pair_ratios(H4_OVERLAP_PAIRS),
    ),
    "codec-speed": Table(
        "docs/results/compression.md", ("codec_speed.json",), lambda f: codec_speed_table(f[0])
    ),
    "worker-start": Table(
        "docs/fault_tolerance.md", ("worker_start.json",), lambda f: worker_start_table(f[0])
    ),
    "fgd-globalm2-4x": Table(
        "docs/results/fgd.md",
        ("fgd_globalm2_4x.json", "fgd_globalm2_4x_e3m0_seed0.json"),
        fgd_corpora_merged,
    ),
    "fgd-globalm2-h50": Table("docs/results/fgd.md", ("fgd_globalm2_h50.json",), fgd_corpora),
    "fgd-globalm2": Table("docs/results/fgd.md", GLOBALM2_FILES, fgd_pair_ratios(GLOBALM2_PAIRS)),
    "fgd-reduce-scatter": Table("docs/results/fgd.md", RS_FILES, fgd_pair_ratios(RS_PAIRS)),
    "fgd-reduce-scatter-diloco": Table(
        "docs/results/fgd.md", RS_DILOCO_FILES, fgd_pair_ratios(RS_PAIRS[1:2])
    ),
    "fgd-reduce-scatter-diloco-4x": Table(
        "docs/results/fgd.md", RS_DILOCO_4X_FILES, fgd_pair_ratios(RS_PAIRS[1:2], "4x")
    ),
    "fgd-globalm2-rs-4x": Table(
        "docs/results/fgd.md",
        (
            "fgd_globalm2_rs_4x.json",
            "fgd_globalm2_rs_4x_doc.json",
            "fgd_globalm2_fp32_4x_seed0.json",
        ),
        fgd_pair_ratios((*RS_PAIRS[:1], ("GlobalM2-fp32-H5-d1", "diloco")), "4x"),
    ),
    "fgd-h5-rs-choice": Table(
        "docs/results/fgd.md", ("fgd_h5_rs_grid.json",), fgd_outer_choice("stdlib", RS_H5_GRID)
    ),
    "fgd-delay-probe": Table("docs/results/fgd.md", DELAY_FILES, fgd_pair_ratios(DELAY_PAIRS)),
    "fgd-globalm2-overlap": Table(
        "docs/results/fgd.md", OVERLAP_FILES, fgd_pair_ratios(OVERLAP_PAIRS)
    ),
    "fgd-lowbit": Table("docs/results/fgd.md", LOWBIT_FILES, fgd_pair_ratios(LOWBIT_PAIRS)),
    "default-job-choice": Table(
        "docs/models.md", DEFAULT_JOB_FILES[:2], hf_outer_choice(DEFAULT_JOB_GRID)
    ),
    "default-job-pairs": Table(
        "docs/models.md", DEFAULT_JOB_FILES, hf_pair_ratios(DEFAULT_JOB_PAIRS)
    ),
    "diloco-rs-job-choice": Table(
        "docs/models.md", DILOCO_RS_JOB_FILES[:2], hf_outer_choice(_job_grid(DILOCO_RS_JOB))
    ),
    "diloco-rs-job-pairs": Table(
        "docs/models.md", DILOCO_RS_JOB_FILES, hf_pair_ratios(DILOCO_RS_JOB_PAIRS)
    ),
    "diloco-rs-overlap-job-choice": Table(
        "docs/models.md",
        DILOCO_RS_OVERLAP_JOB_FILES[:2],
        hf_outer_choice(_job_grid(DILOCO_RS_OVERLAP_JOB)),
    ),
    "diloco-rs-overlap-job-pairs": Table(
        "docs/models.md", DILOCO_RS_OVERLAP_JOB_FILES, hf_pair_ratios(DILOCO_RS_OVERLAP_JOB_PAIRS)
    ),
    "e3m0-choice": Table(
        "docs/results/compression.md",
        ("fgd_e3m0_grid.json",),
        fgd_outer_choice("stdlib", E3M0_GRID),
    ),
    "e3m0-pairs": Table(
        "docs/results/compression.md",
        ("fgd_e3m0_grid.json", "fgd_e3m0_report.json"),
        fgd_pair_ratios(E3M0_PAIRS),
    ),
    "fgd-retune-all-choice": Table(
        "docs/results/fgd.md",
        ("fgd_retune_all_grid.json", "fgd_retune_all_shipped.json"),
        fgd_outer_choice("stdlib", RETUNE_ALL_GRID),
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
    "flow-profile-check": Table(
        "docs/flow.md",
        ("flow_profile_check.json",),
        lambda f: flow_profile_table(f[0]["measured.summary"]),
    ),
    "fgd-e1": Table("docs/results/fgd.md", ("fgd_sim.json",), lambda f: fgd_e1(f[0])),
    "fgd-e2": Table(
        "docs/results/fgd.md",
        ("fgd_sim.json",),
        lambda f: fgd_quality(fgd_runs(f[0]["experiments"]["e2"])),
    ),
    "fgd-e3-r0.887": Table(
        "docs/results/fgd.md",
        ("fgd_sim.json",),
        lambda f: fgd_time_to(fgd_runs(f[0]["experiments"]["e2"]), FGD_TARGETS),
    ),
    "fgd-e3-r1.774": Table(
        "docs/results/fgd.md",
        ("fgd_sim.json",),
        lambda f: (
            fgd_time_to(fgd_runs(f[0]["experiments"]["e3"]), FGD_TARGETS)
            + "\n\n"
            + fgd_quality(fgd_runs(f[0]["experiments"]["e3"]))
        ),
    ),
    "fgd-e7": Table("docs/results/fgd.md", ("fgd_sim.json",), lambda f: fgd_faults(f[0])),
    "sim-scale": Table("docs/results/fgd.md", ("sim_scale.json",), sim_scale),
    "fgd-ablation": Table("docs/results/fgd.md", ("fgd_ablation_h10.json",), fgd_ablation),
    "fgd-lr-grid-h10": Table(
        "docs/results/fgd.md",
        ("fgd_lr_grid_h10.json", "fgd_ablation_h10.json"),
        fgd_lr_grid(10, ("0.2", "0.35", "0.5", "0.7")),
    ),
    "fgd-lr-grid-h50": Table(
        "docs/results/fgd.md",
        ("fgd_lr_grid_h50_h100.json",),
        fgd_lr_grid(50, ("0.35", "0.5", "0.7", "1")),
    ),
    "fgd-lr-grid-h100": Table(
        "docs/results/fgd.md",
        ("fgd_lr_grid_h50_h100.json",),
        fgd_lr_grid(100, ("0.35", "0.5", "0.7", "1")),
    ),
    "fgd-tuned-h10": fgd_seeds("method (outer lr)", TUNED_H10),
    "fgd-tuned-h50": fgd_seeds("method (outer lr)", TUNED_H50),
    "fgd-tuned-h100": fgd_seeds("method (outer lr)", TUNED_H100),
    "fgd-momentum-h10": fgd_seeds("method (outer lr)", MOMENTUM_H10),
    "fgd-momentum-grid-h50": Table(
        "docs/results/fgd.md",
        ("fgd_momentum_h50_h100.json", "fgd_momentum_h50_fill.json", "fgd_lr_grid_h50_h100.json"),
        fgd_momentum_grid,
    ),
    "fgd-momentum-h50": fgd_seeds("method (outer lr, mu 0.8)", MOMENTUM_H50, bold=True),
    "fgd-verdict": fgd_verdict(
        (
            (TUNED_H10, 2, "lr 0.5, momentum 0.9", None),
            (MOMENTUM_H10, 1, "lr 0.5, momentum 0.8", None),
            (TUNED_H50, 2, "lr 0.7, momentum 0.9", REAL_H50),
            (MOMENTUM_H50, 2, "lr 0.7, momentum 0.8", None),
            (TUNED_H100, 2, "lr 1.0, momentum 0.9", None),
        )
    ),
    "forge-states-loss": Table("docs/forge.md", ("forge_states_loss.json",), forge_states_loss),
    "forge-states-loss-2threads": Table(
        "docs/forge.md", ("forge_states_loss_2threads.json",), forge_states_loss
    ),
    "forge-memory": Table(
        "docs/forge.md", ("forge_memory.json", "forge_memory_85M_4096.json"), forge_memory
    ),
    "forge-memory-llama": Table(
        "docs/forge.md", ("forge_memory_llama125M.json",), forge_memory_llama
    ),
    "forge-speed": Table(
        "docs/forge.md", ("forge_speed.json", "forge_speed_4096.json"), forge_speed
    ),
    "forge-speed-states": Table("docs/forge.md", ("forge_speed_states.json",), forge_speed_states),
    "forge-targets": Table(
        "docs/forge.md", ("forge_memory.json", "forge_speed.json"), forge_targets
    ),
    "forge-gpu-steps": Table("docs/forge.md", ("forge_gpu_h100.json",), forge_gpu_steps),
    "forge-gpu-kernel": Table("docs/forge.md", ("forge_gpu_h100.json",), forge_gpu_kernel),
    "forge-gpu-targets": Table("docs/forge.md", ("forge_gpu_h100.json",), forge_gpu_targets),
    "sharding-memory": Table(
        "docs/sharding.md",
        ("sharding.json", "sharding_mmap128k.json"),
        sharding_memory(("sharding.json", "sharding_mmap128k.json")),
    ),
    "sharding-bytes": Table("docs/sharding.md", ("sharding.json",), sharding_bytes),
    "netlab-probe": Table("docs/results/netlab.md", ("docs/results/netlab.json",), netlab_probe),
    "netlab-utilization": Table(
        "docs/results/netlab.md", ("docs/results/netlab.json",), netlab_utilization
    ),
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
