"""`frugaltrain compare CONFIG --methods A,B,... [--seeds 0,1,2] [--set ...] --out DIR`: simulate
several outer methods under the same token budget per worker (run.steps x batch) and the same
network, then write DIR/report.md and DIR/*.png. Every time and utilization figure is simulated;
`--report-only` re-renders from the runs already in DIR.

Method names (METHODS below) map to config overrides; `M2:<subset>` is Factored Gossip DiLoCo
with global Mix1 and a global Mix2 over models.parts.select(<subset>) (e.g. M2:embed+head),
`M2pairs:<subset>` the same with pairwise Mix2.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from frugaltrain.config import ArgumentParser, ConfigError, add_set_flag

METHODS: dict[str, list[str]] = {
    "ddp": ["outer.strategy=ddp"],
    "diloco": ["outer.strategy=diloco"],
    "GlobalM1": ["outer.strategy=fgd", "outer.fgd.preset=GlobalM1"],
    "GlobalM1LocalM2": ["outer.strategy=fgd", "outer.fgd.preset=GlobalM1LocalM2"],
    "fgd-ring": ["outer.strategy=fgd", "outer.fgd.mix1=ring", "outer.fgd.mix2=none"],
    # NoLoCo's public gossip configs: groups of 2, outer lr = pull = 0.7, momentum 0.5
    # (research note a.3); DiLoCo's 0.9 is not its setting.
    "noloco": ["outer.strategy=noloco", "outer.momentum=0.5"],
    "streaming": [
        "outer.strategy=streaming",
        "outer.streaming.fragments=2",
        "outer.streaming.overlap=1",
    ],
}


def method_overrides(name: str) -> list[str]:
    if name in METHODS:
        return METHODS[name]
    for prefix, topo in (("M2pairs:", "pairs"), ("M2:", "complete")):
        if name.startswith(prefix):
            return [
                "outer.strategy=fgd",
                "outer.fgd.mix1=complete",
                f"outer.fgd.mix2={topo}",
                f"outer.fgd.mix2_params={name[len(prefix) :]!r}",
            ]
    raise ConfigError(
        f"--methods: unknown method {name!r}; choose from {', '.join(METHODS)}, "
        "M2:<subset> or M2pairs:<subset>"
    )


def _safe(name: str) -> str:
    return name.replace(":", "_").replace("+", "-")


def run_compare(
    config: str | None, methods: list[str], seeds: list[int], sets: list[str], out: Path
) -> None:
    from frugaltrain.sim.config import load_sim_config
    from frugaltrain.sim.engine import simulate

    plans = []
    # Seeds are replicates: each draws its own faults too, unless sim.fault_seed is given.
    own_faults = not any(s.startswith("sim.fault_seed=") for s in sets)
    for m in methods:  # validate every config before running any
        for seed in seeds:
            per_seed = [f"run.seed={seed}"] + ([f"sim.fault_seed={seed}"] if own_faults else [])
            cfg, sim = load_sim_config(config, [*sets, *method_overrides(m), *per_seed])
            plans.append((m, seed, cfg, sim))
    out.mkdir(parents=True, exist_ok=True)  # only once every config is valid
    for m, seed, cfg, sim in plans:
        run_dir = out / _safe(m) / f"seed{seed}"
        if (run_dir / "summary.json").is_file():
            continue  # already done (compare resumes)
        print(f"[compare] {m} seed {seed}", flush=True)
        simulate(cfg, sim, run_dir)
    (out / "compare.json").write_text(
        json.dumps({"methods": methods, "seeds": seeds, "config": config, "sets": sets}, indent=1)
    )


# method -> one (summary, metric records) pair per seed that finished
_Runs = dict[str, list[tuple[dict, list[dict]]]]


def _load(out: Path, methods: list[str]) -> _Runs:
    runs: _Runs = {}
    for m in methods:
        for d in sorted((out / _safe(m)).glob("seed*")):
            if not (d / "summary.json").is_file():
                continue
            recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
            runs.setdefault(m, []).append((json.loads((d / "summary.json").read_text()), recs))
    return runs


def _ms(values: list[float], fmt: str = ".4f") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    spread = fmt.lstrip("+")  # a signed mean ("+.1f") with an unsigned spread
    return f"{statistics.mean(values):{fmt}} ± {statistics.stdev(values):{spread}}"


def _kj(s: dict) -> float | None:
    """The simulated cluster's estimated energy in kJ (None for a run from before the estimate)."""
    return s["energy/joules"] / 1e3 if "energy/joules" in s else None


def _comm_share(s: dict) -> float | None:
    """Communication's share of the simulated cluster's estimated energy, in %."""
    if s.get("energy/joules") is None or s.get("energy/comm_j") is None:
        return None  # a run from before the energy estimate: no figure, not a zero
    return 100 * s["energy/comm_j"] / s["energy/joules"] if s["energy/joules"] > 0 else None


def time_to_target(recs: list[dict], key: str, target: float) -> float | None:
    """First simulated time at which the evaluated `key` is <= target (None: never)."""
    for r in recs:
        if key in r and r[key] <= target:
            return r["time/sim_s"]
    return None


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (utilization, loss) points no other point beats on both (higher utilization and
    lower loss), by increasing utilization."""
    front = [
        (u, loss)
        for u, loss in points
        if not any(u2 >= u and l2 <= loss and (u2, l2) != (u, loss) for u2, l2 in points)
    ]
    return sorted(set(front))


def report(out: Path, methods: list[str] | None = None, target: float | None = None) -> str:
    """Write DIR/report.md and the PNGs from the runs in DIR; returns the markdown."""
    meta = (
        json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
    )
    runs = _load(out, methods or meta.get("methods", []))
    key, label = _loss_key(runs)
    if target is None and "diloco" in runs:
        # Default target: the loss DiLoCo reaches (mean over seeds), plus 2%.
        target = statistics.mean(s[key] for s, _ in runs["diloco"]) * 1.02
    tag = (
        "simulated clock and network; synthetic data"
        if key.startswith("loss/excess")
        else "simulated clock and network"
    )
    md = _preamble(meta, _first_summary(runs), tag)
    md += _table(runs, key, target)
    md += _energy_note(runs)
    figs = _plot_curves(out, runs, key, label, tag)
    figs += _plot_bars(out, runs, tag)
    figs.append(_plot_pareto(out, runs, key, label, tag))
    md += [f"![{f}]({f}.png)" for f in figs]
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    return text


def _first_summary(runs: _Runs) -> dict:
    return next(iter(runs.values()))[0][0] if runs else {}


def _loss_key(runs: _Runs) -> tuple[str, str]:
    """The loss to compare on and its axis label: the excess over the source's own loss when
    every run has it, else the excess over the entropy floor, else the plain val loss."""
    if runs and all(s.get("loss/excess_paired") is not None for rs in runs.values() for s, _ in rs):
        return "loss/excess_paired", "val loss - the source's own loss on it (nats)"
    if _first_summary(runs).get("loss/floor") is not None:
        return "loss/excess", "val loss - entropy floor (nats)"
    return "loss/val", "val loss (nats)"


def _preamble(meta: dict, first: dict, tag: str) -> list[str]:
    """Title, the config the runs came from, and the source's loss floor when there is one."""
    md = [f"# Compare report ({tag})", ""]
    if meta:
        md += [
            f"Config: `{meta.get('config')}`, overrides: `{' '.join(meta.get('sets', []))}`,",
            f"seeds: {meta.get('seeds')}.",
            "",
        ]
    if first.get("loss/floor") is not None:
        md += [
            f"Loss floor (entropy of the Markov source over the window): "
            f"{first['loss/floor']:.4f} nats/token.",
            "",
        ]
    return md


def _table(runs: _Runs, key: str, target: float | None) -> list[str]:
    """One row per method, each cell the mean ± stdev over its seeds."""
    last_col = f"time to {key} <= {target:.4f} (sim. s)" if target else "-"
    md = [
        f"| method | seeds | final {key} | utilization (sim.) | wall (sim. s) | MB sent/worker "
        "| consensus dist. | energy (est., sim. kJ) | comm share of energy (%) "
        f"| {last_col} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    md += ["| " + " | ".join(_row(m, rs, key, target)) + " |" for m, rs in runs.items()]
    md.append("")
    return md


def _row(m: str, rs: list[tuple[dict, list[dict]]], key: str, target: float | None) -> list[str]:
    sums = [s for s, _ in rs]
    ttt = [time_to_target(recs, key, target) for _, recs in rs] if target else []
    return [
        m,
        str(len(rs)),
        _ms([s[key] for s in sums]),
        _ms([s["util/compute"] for s in sums]),
        _ms([s["time/sim_s"] for s in sums]),
        _ms([s["comm/bytes_sent_per_worker"] / 1e6 for s in sums]),
        _ms([s["consensus/total"] for s in sums]),
        _ms([_kj(s) for s in sums], ".4g"),
        _ms([_comm_share(s) for s in sums], ".3g"),
        _ms([t for t in ttt if t is not None]) + ("" if all(ttt) else " (not all)"),
    ]


def _energy_note(runs: _Runs) -> list[str]:
    """Say how the energy column was estimated (nothing when no run has an estimate)."""
    labels = sorted(
        {s["energy/label"] for rs in runs.values() for s, _ in rs if "energy/label" in s}
    )
    if not labels:
        return []
    return [
        "Energy is the simulated cluster's, all workers together, "
        + "; ".join(f"`{label}`" for label in labels)
        + ": an estimate on the simulated clock, not a measurement.",
        "",
    ]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    _pyplot().close(fig)
    return name


def _plot_curves(out: Path, runs: _Runs, key: str, label: str, tag: str) -> list[str]:
    """Loss against tokens and against simulated time, and consensus against tokens: one line
    per run, one colour per method."""
    figs = []
    for name, xkey, ykey, xl, yl in (
        ("loss_vs_tokens", "tokens_per_worker", key, "tokens per worker", label),
        ("loss_vs_time", "time/sim_s", key, "simulated wall-clock (s)", label),
        (
            "consensus",
            "tokens_per_worker",
            "consensus/total",
            "tokens per worker",
            "consensus distance (sum of squares)",
        ),
    ):
        fig, ax = _pyplot().subplots(figsize=(6.4, 4.2))
        _curve(ax, runs, xkey, ykey)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        if ykey == key:
            ax.set_yscale("log")
        ax.set_title(f"{yl} ({tag})", fontsize=9)
        ax.legend(fontsize=7)
        figs.append(_save(fig, out, name))
    return figs


def _curve(ax, runs: _Runs, xkey: str, ykey: str) -> None:
    for i, (m, rs) in enumerate(runs.items()):
        for n, (_, recs) in enumerate(rs):
            pts = [(r[xkey], r[ykey]) for r in recs if ykey in r and r.get(xkey) is not None]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    color=f"C{i % 10}",
                    label=m if n == 0 else None,
                    alpha=0.8,
                )


def _plot_bars(out: Path, runs: _Runs, tag: str) -> list[str]:
    """Mean compute utilization and mean bytes sent per worker, one bar per method."""
    figs = []
    for name, skey, yl in (
        ("utilization", "util/compute", "compute utilization (simulated)"),
        ("bytes", "comm/bytes_sent_per_worker", "bytes sent per worker"),
    ):
        fig, ax = _pyplot().subplots(figsize=(6.4, 3.6))
        names = list(runs)
        ax.bar(
            names,
            [statistics.mean(s[skey] for s, _ in runs[m]) for m in names],
            color=[f"C{i % 10}" for i in range(len(names))],
        )
        ax.set_ylabel(yl)
        ax.set_title(f"{yl} ({tag})", fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        figs.append(_save(fig, out, name))
    return figs


def _plot_pareto(out: Path, runs: _Runs, key: str, label: str, tag: str) -> str:
    """Each method's mean (utilization, final loss), with the Pareto front dashed."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 4.2))
    points = {
        m: (
            statistics.mean(s["util/compute"] for s, _ in rs),
            statistics.mean(s[key] for s, _ in rs),
        )
        for m, rs in runs.items()
    }
    for i, (m, (u, loss)) in enumerate(points.items()):
        ax.scatter([u], [loss], color=f"C{i % 10}", marker="o" if m.startswith("M2") else "s")
        ax.annotate(m, (u, loss), fontsize=7, xytext=(4, 2), textcoords="offset points")
    front = pareto_front(list(points.values()))
    ax.plot(*zip(*front, strict=True), "k--", lw=0.8, alpha=0.6, label="Pareto front")
    ax.legend(fontsize=7)
    ax.set_xlabel("compute utilization (simulated)")
    ax.set_ylabel(f"final {label}")
    ax.set_title(f"Pareto: utilization vs final loss, Mix2 subsets as circles\n({tag})", fontsize=9)
    return _save(fig, out, "pareto")


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="frugaltrain compare", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="TOML config (training sections plus [sim])")
    p.add_argument(
        "--methods",
        default="ddp,diloco,GlobalM1,GlobalM1LocalM2,noloco,streaming",
        help="comma-separated method names",
    )
    p.add_argument("--seeds", default="0", help="comma-separated run.seed values")
    add_set_flag(p, "sim.ratio=0.887")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--target", type=float, help="target loss for time-to-target")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    out = Path(args.out)
    try:
        if args.report_only and not out.is_dir():
            raise ConfigError(f"--out {out}: no such directory; run without --report-only first")
        if not args.report_only:
            run_compare(
                args.config, methods, [int(s) for s in args.seeds.split(",")], args.set, out
            )
        print(report(out, methods, args.target))
    except ConfigError as e:
        print(f"frugaltrain: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
