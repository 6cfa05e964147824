"""Summary table and loss plots of a run, from its metrics.jsonl alone (`report` re-renders),
and the comparison of several runs' validation loss against the bytes they sent
(`report_runs`, `frugaltrain report RUN_DIR ... --plot-bytes OUT.png`).

A run on emulated links (run.link_mbit) says so wherever a time figure appears: its clock reads
"measured, emulated 20 Mbit/s links" (`clock_label`)."""

from __future__ import annotations

import json
from pathlib import Path

from frugaltrain.config import ConfigError
from frugaltrain.metrics.log import read_metrics

# Per-peer figures the summary totals per worker (metrics/peers.py), and how its table names
# the peer with the most of each.
PEER_ROWS = {
    "peer/compute_s": ("slowest peer: most compute s", "{clock}"),
    "peer/blocking_s": ("peer with most blocking comm s", "{clock}"),
    "peer/bytes_sent": ("peer with most bytes sent", "model-counted, {clock} run"),
}


def summarize(records: list[dict]) -> dict:
    """Totals over the run, taken from the per-round records."""
    rounds = [r for r in records if r.get("kind") == "round"]
    if not rounds:
        return {}
    last = rounds[-1]
    vals = [r["loss/val"] for r in rounds if "loss/val" in r]
    compute = sum(r["time/compute_s"] for r in rounds)
    blocking = sum(r["time/blocking_s"] for r in rounds)
    out = {
        "strategy": last.get("strategy"),
        "workers": last.get("workers"),
        "clock": last.get("clock", "measured"),
        **({"links": last["links"]} if "links" in last else {}),
        "rounds": last["round"],
        "steps": last["step"],
        "tokens": last["tokens"],
        "loss/train_last": last["loss/train"],
        "loss/val_first": vals[0] if vals else None,
        "loss/val_last": vals[-1] if vals else None,
        "time/compute_s": compute,
        "time/blocking_s": blocking,
        "time/recovery_s": sum(r.get("time/recovery_s", 0.0) for r in rounds),
        "util/compute": compute / (compute + blocking) if compute + blocking > 0 else None,
        "comm/bytes_sent": sum(r["comm/bytes_sent"] for r in rounds),
        "comm/bytes_received": sum(r["comm/bytes_received"] for r in rounds),
        "time/wall_s": last.get("time/wall_s"),
    }
    evals = [r for r in rounds if "consensus/total" in r]
    if evals:
        out["consensus/total_last"] = evals[-1]["consensus/total"]
        if "disagreement/logit_js" in evals[-1]:  # simulated runs measure consensus only
            out["disagreement/logit_js_last"] = evals[-1]["disagreement/logit_js"]
    # Energy and FLOPs are per round; the run's figure is their sum. One round without a reading
    # makes the total unavailable (its label says why) rather than a silent undercount.
    labels = [r["energy/label"] for r in rounds if "energy/label" in r]
    if labels:
        missing = [label for label in labels if label.startswith("unavailable")]
        out["energy/label"] = missing[0] if missing else "; ".join(dict.fromkeys(labels))
        if not missing and all("energy/joules" in r for r in rounds):
            out["energy/joules"] = sum(r["energy/joules"] for r in rounds)
    if all("flops/train" in r for r in rounds):
        out["flops/train"] = sum(r["flops/train"] for r in rounds)
        out["flops/label"] = last.get("flops/label", "estimated (analytic)")
    out.update(peer_totals(rounds))
    return out


def peer_totals(rounds: list[dict]) -> dict[str, list]:
    """Each worker's total of the PEER_ROWS figures over the rounds that have them (None for a
    worker that never reported one)."""
    out = {}
    for key in PEER_ROWS:
        lists = [r[key] for r in rounds if isinstance(r.get(key), list)]
        if not lists:
            continue
        totals: list = [None] * max(len(v) for v in lists)
        for values in lists:
            for rank, v in enumerate(values):
                if v is not None:
                    totals[rank] = (totals[rank] or 0) + v
        out[key] = totals
    return out


def _peer_rows(summary: dict, clock: str) -> list[tuple[str, str]]:
    """The peer with the most of each PEER_ROWS figure, with several workers reporting."""
    rows = []
    for key, (name, note) in PEER_ROWS.items():
        totals = [(v, rank) for rank, v in enumerate(summary.get(key) or []) if v is not None]
        if len(totals) < 2:
            continue
        value, rank = max(totals, key=lambda t: t[0])  # ties: the lowest rank
        rows.append((f"{name} ({note.format(clock=clock)})", f"worker {rank}: {_fmt(value)}"))
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def clock_label(figures: dict) -> str:
    """The clock a summary's or round record's times are on: measured, simulated, or measured
    on emulated links (comm/pacing.py)."""
    clock = figures.get("clock", "measured")
    return f"{clock}, {figures['links']} links" if "links" in figures else clock


def time_to_loss(records: list[dict], target: float) -> float | None:
    """Wall seconds (the run's own clock) until its validation loss first reached `target`,
    interpolated linearly between evaluations; None if it never did."""
    return time_to(target, *wall_curve(records))


def time_to(target: float, seconds: list[float], losses: list[float]) -> float | None:
    """The first time a loss curve reaches `target`, linear between its points; None: never."""
    for k, (t, loss) in enumerate(zip(seconds, losses, strict=True)):
        if loss > target:
            continue
        if k == 0 or losses[k - 1] == loss:
            return t
        t0, l0 = seconds[k - 1], losses[k - 1]
        return t0 + (l0 - target) / (l0 - loss) * (t - t0)
    return None


def format_summary(summary: dict) -> str:
    clock = clock_label(summary)
    rows = [
        ("strategy / workers", f"{summary['strategy']} / {summary['workers']}"),
        ("rounds / inner steps", f"{summary['rounds']} / {summary['steps']}"),
        ("tokens (all workers)", _fmt(summary["tokens"])),
        ("train loss (last round)", _fmt(summary["loss/train_last"])),
        (
            "val loss first -> last",
            f"{_fmt(summary['loss/val_first'])} -> {_fmt(summary['loss/val_last'])}",
        ),
        (f"compute s per worker ({clock})", _fmt(summary["time/compute_s"])),
        (f"blocking comm s per worker ({clock})", _fmt(summary["time/blocking_s"])),
        (f"compute utilization ({clock})", _fmt(summary["util/compute"])),
        *(
            [(f"time lost to recovery s per worker ({clock})", _fmt(summary["time/recovery_s"]))]
            if summary.get("time/recovery_s")
            else []
        ),
        ("bytes sent per worker (model-counted)", _fmt(summary["comm/bytes_sent"])),
        ("bytes received per worker (model-counted)", _fmt(summary["comm/bytes_received"])),
        (f"wall s ({clock})", _fmt(summary["time/wall_s"])),
        *_peer_rows(summary, clock),
    ]
    if "consensus/total_last" in summary:
        rows.append(("consensus distance (last eval)", _fmt(summary["consensus/total_last"])))
    if "disagreement/logit_js_last" in summary:
        rows.append(("logit JS vs averaged model", _fmt(summary["disagreement/logit_js_last"])))
    if "energy/label" in summary:
        rows.append((f"energy J ({summary['energy/label']})", _fmt(summary.get("energy/joules"))))
    if "flops/train" in summary:
        label = summary.get("flops/label", "estimated (analytic)")
        rows.append((f"training FLOPs ({label})", _fmt(summary["flops/train"])))
    width = max(len(k) for k, _ in rows)
    lines = [f"{'metric'.ljust(width)}  value", f"{'-' * width}  -----"]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def format_comparison(
    ours: dict,
    theirs: dict,
    names: tuple[str, str] | None = None,
    records: tuple[list[dict], list[dict]] | None = None,
) -> str:
    """Two runs' headline figures side by side (ours first), with their ratio; `names` label the
    columns (default: each run's strategy). With both runs' `records`, also the wall clock each
    took to reach the second's final validation loss (`time_to_loss`), and its ratio: ours in
    units of theirs."""
    rows = [
        ("val loss (last eval)", "loss/val_last"),
        ("compute utilization", "util/compute"),
        ("blocking comm s per worker", "time/blocking_s"),
        ("compute s per worker", "time/compute_s"),
        ("bytes sent per worker", "comm/bytes_sent"),
        ("wall s", "time/wall_s"),
    ]
    names = names or (f"{ours.get('strategy')}", f"{theirs.get('strategy')}")
    clock = clock_label(ours)
    table = []
    for label, key in rows:
        a, b = ours.get(key), theirs.get(key)
        name = label if key.startswith(("loss", "comm")) else f"{label} ({clock})"
        table.append((name, _fmt(a), _fmt(b), _ratio(a, b)))
    if records is not None:
        target = theirs.get("loss/val_last")
        a, b = (None, None) if target is None else (time_to_loss(r, target) for r in records)
        reached = "-" if target is None else "not reached"
        name = f"wall s to the baseline's final val loss ({clock})"
        table.append((name, _fmt(a) if a is not None else reached, _fmt(b), _ratio(a, b, reached)))
    width = max(len(name) for name, *_ in table)
    lines = [f"run: {names[0]}; baseline: {names[1]}"]
    lines += [f"{'metric':<{width}}{'run':>12}{'baseline':>12}{'run/baseline':>14}"]
    lines += [f"{n:<{width}}{a:>12}{b:>12}{r:>14}" for n, a, b, r in table]
    return "\n".join(lines)


def _ratio(a, b, missing: str = "-") -> str:
    """a / b to three decimals; `missing` when either is not a number (or b is 0)."""
    if isinstance(a, float | int) and isinstance(b, float | int) and b:
        return f"{a / b:.3f}"
    return missing


def plot_losses(records: list[dict], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.get("kind") == "step"]
    rounds = [r for r in records if r.get("kind") == "round" and "loss/val" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        ax.plot(
            [r["step"] for r in steps],
            [r["loss/train"] for r in steps],
            lw=0.8,
            alpha=0.6,
            label="train loss (worker 0)",
        )
    if rounds:
        ax.plot(
            [r["step"] for r in rounds],
            [r["loss/val"] for r in rounds],
            "o-",
            label="validation loss (mean over workers)",
        )
    ax.set_xlabel("inner step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(run_dir: str | Path, quiet: bool = False) -> dict:
    """Re-render summary.json, the summary table and loss.png from RUN_DIR/metrics.jsonl.
    A simulated run's summary.json is the simulator's own (loss floor, faults, cluster energy)
    and is kept; the table is still printed from the records."""
    run_dir = Path(run_dir)
    records = read_metrics(_metrics_file(run_dir))
    summary = summarize(records)
    if summary.get("clock") != "simulated":
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    title = f"{summary.get('strategy')} x{summary.get('workers')} ({run_dir.name})"
    plot = plot_losses(records, run_dir / "loss.png", title)
    if not quiet:
        print(format_summary(summary) if summary else "no complete round yet")
        print(f"plot: {plot}")
    return summary


def _metrics_file(run_dir: Path) -> Path:
    metrics = Path(run_dir) / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(
            f"{metrics} not found: {run_dir} has no metrics.jsonl; pass a run directory from "
            "`train` or `simulate`"
        )
    return metrics


def bytes_curve(records: list[dict]) -> tuple[list[int], list[float]]:
    """(cumulative bytes sent per worker, validation loss) at each round with a validation
    loss; rounds before any byte was sent are left out (a log axis has no 0)."""
    xs, ys, sent = [], [], 0
    for r in records:
        if r.get("kind") != "round":
            continue
        sent += r.get("comm/bytes_sent", 0)
        if "loss/val" in r and sent > 0:
            xs.append(sent)
            ys.append(r["loss/val"])
    return xs, ys


def wall_curve(records: list[dict]) -> tuple[list[float], list[float]]:
    """(wall seconds since training started, validation loss) at each round with a validation
    loss, on the run's own clock (measured, or the simulator's)."""
    rounds = [r for r in records if r.get("kind") == "round" and "loss/val" in r]
    return [r["time/wall_s"] for r in rounds], [r["loss/val"] for r in rounds]


def plot_loss_vs_bytes(runs: list[tuple[str, list[dict]]], path: Path) -> Path:
    """Validation loss against cumulative bytes sent per worker (log x), one line per
    (label, records) run, into `path`."""
    xlabel = "bytes sent per worker, cumulative (model-counted)"
    return _plot_curves(runs, path, bytes_curve, xlabel, "validation loss vs bytes sent", True)


def plot_loss_vs_wall(runs: list[tuple[str, list[dict]]], path: Path) -> Path:
    """Validation loss against wall clock, one line per (label, records) run, into `path`."""
    xlabel = "wall clock since training started, s"
    return _plot_curves(runs, path, wall_curve, xlabel, "validation loss vs wall clock", False)


def _plot_curves(runs, path: Path, curve, xlabel: str, title: str, log_x: bool) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, records in runs:
        xs, ys = curve(records)
        ax.plot(xs, ys, "o-", ms=3, label=label)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


_PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def report_runs(run_dirs: list[str | Path], plot_bytes: str | Path | None = None) -> list[dict]:
    """`report` every run in turn, then with `plot_bytes` draw their validation loss against
    the bytes each sent into that file. Every input is checked before anything is written."""
    dirs = [Path(d) for d in run_dirs]
    records = {d: read_metrics(_metrics_file(d)) for d in dirs}
    runs = []
    if plot_bytes is not None:
        out = Path(plot_bytes)
        if out.suffix.lower() not in _PLOT_SUFFIXES or not out.parent.is_dir():
            raise ConfigError(
                f"--plot-bytes {out}: give a {', '.join(_PLOT_SUFFIXES)} file in an existing "
                "directory"
            )
        for d in dirs:
            last = next((r for r in reversed(records[d]) if r.get("kind") == "round"), {})
            if bytes_curve(records[d])[0]:
                clock = clock_label(last)
                runs.append((f"{d.name} ({last.get('strategy')}, {clock})", records[d]))
            else:
                print(f"{d}: no validation loss after a byte was sent; not in the plot")
        if not runs:
            raise ConfigError(
                f"--plot-bytes {out}: no run given has a validation loss after sending bytes "
                "(one-worker runs send none); nothing to plot"
            )
    summaries = []
    for d in dirs:
        if len(dirs) > 1:
            print(f"\n== {d}")
        summaries.append(report(d))
    if runs:
        print(f"loss vs bytes: {plot_loss_vs_bytes(runs, Path(plot_bytes))}")
    return summaries
