"""Markdown tables for docs/results/fgd.md from the runs of docs/results/fgd_experiments.sh.

    python benchmarks/fgd_tables.py runs/fgd [--plots docs/results] > tables.md

Utilization, wall-clock and energy figures are simulated (energy: an estimate on the simulated
clock). Losses are real losses of the real computation on the synthetic Markov source, reported
as **paired excess**: validation loss minus the source's own loss on the same validation tokens
(its expectation is the entropy floor; pairing removes the sampling noise of the small
evaluation set). Gaps between methods are paired by seed. Cells are mean ± std over seeds.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from frugaltrain.config import Config, build_config, nest_outer_keys, read_toml
from frugaltrain.data.markov import markov_source_nll
from frugaltrain.sim.compare import _ms, _safe
from frugaltrain.sim.engine import validation_batches


@dataclass
class Run:
    seed: int
    summary: dict
    records: list[dict]
    source_nll: float  # the Markov source's own loss on this run's validation batches

    @property
    def excess(self) -> float:
        return self.summary["loss/val"] - self.source_nll

    def time_to(self, excess: float) -> float | None:
        """First simulated second at which the paired excess is <= `excess` (None: never)."""
        for r in self.records:
            if "loss/val" in r and r["loss/val"] - self.source_nll <= excess:
                return r["time/sim_s"]
        return None


def _source_nll(run_dir: Path, summary: dict) -> float:
    if summary.get("loss/source_nll") is not None:
        return summary["loss/source_nll"]
    raw = read_toml(run_dir / "config.toml")  # a run from before the simulator recorded it
    raw.pop("sim", None)
    raw["outer"] = nest_outer_keys(raw.get("outer", {}))  # older runs wrote [outer] flat
    cfg = build_config(Config, raw)
    return markov_source_nll(cfg.data.path, validation_batches(cfg))


def load(d: Path) -> dict[str, list[Run]]:
    """{method: [Run per seed]} of one `compare` output directory, in its method order."""
    methods = json.loads((d / "compare.json").read_text())["methods"]
    out: dict[str, list[Run]] = {}
    for m in methods:
        for rd in sorted((d / _safe(m)).glob("seed*")):
            if not (rd / "summary.json").is_file():
                continue
            summary = json.loads((rd / "summary.json").read_text())
            records = [json.loads(line) for line in (rd / "metrics.jsonl").open()]
            run = Run(int(rd.name[4:]), summary, records, _source_nll(rd, summary))
            out.setdefault(m, []).append(run)
    return out


def _gap_pct(runs: list[Run], ref: list[Run], of=lambda r: r.excess) -> list[float]:
    """Per seed: 100 (of(run) / of(reference run) - 1), matched by seed."""
    by_seed = {r.seed: of(r) for r in ref}
    return [100 * (of(r) / by_seed[r.seed] - 1) for r in runs if r.seed in by_seed]


def _val(r: Run) -> float:
    return r.summary["loss/val"]


def e1(root: Path) -> str:
    dirs = [d for d in (root / "e1").glob("r*") if (d / "compare.json").is_file()]
    if not dirs:
        return "(not run)"
    dirs.sort(key=lambda p: float(p.name[1:]))
    methods = json.loads((dirs[0] / "compare.json").read_text())["methods"]
    head = "| r | " + " | ".join(methods) + " | closed form DiLoCo / GlobalM1 |"
    out = [head, "|---" * (len(methods) + 2) + "|"]
    for d in dirs:
        runs, r = load(d), float(d.name[1:])
        cells = [_ms([x.summary["util/compute"] for x in runs.get(m, [])], ".3f") for m in methods]
        closed = f"{1 / (1 + r):.3f} / {1 / max(1, r):.3f}"
        out.append(f"| {r:g} | " + " | ".join(cells) + f" | {closed} |")
    return "\n".join(out)


def quality(d: Path, ref: dict[str, list[Run]] | None = None) -> str:
    """Per-method table of one compare directory; `ref` (the fault-free runs) adds the loss cost
    of the faults, paired by seed and method."""
    runs = load(d)
    cost = "| cost of the faults (%) " if ref else ""
    out = [
        "| method | paired excess (nats) | vs DiLoCo (%) | val loss vs DiLoCo (%) "
        + cost
        + "| utilization | wall (s) | MB sent/worker | consensus |",
        "|---" * (9 if ref else 8) + "|",
    ]
    for m, rs in runs.items():
        gap = _ms(_gap_pct(rs, runs["diloco"]), "+.1f") if "diloco" in runs else "-"
        val_gap = _ms(_gap_pct(rs, runs["diloco"], _val), "+.2f") if "diloco" in runs else "-"
        fault_cost = f"| {_ms(_gap_pct(rs, ref.get(m, [])), '+.1f')} " if ref else ""
        out.append(
            f"| {m} | {_ms([r.excess for r in rs])} | {gap} | {val_gap} {fault_cost}"
            f"| {_ms([r.summary['util/compute'] for r in rs], '.3f')} "
            f"| {_ms([r.summary['time/sim_s'] for r in rs], '.0f')} "
            f"| {_ms([r.summary['comm/bytes_sent_per_worker'] / 1e6 for r in rs], '.2f')} "
            f"| {_ms([r.summary['consensus/total'] for r in rs], '.4f')} |"
        )
    return "\n".join(out)


def time_to_targets(d: Path, targets: list[float]) -> str:
    """Simulated seconds until the paired excess first reaches each target (evaluated every
    run.eval_every steps), mean over the seeds that reach it."""
    runs = load(d)
    out = [
        "| method | " + " | ".join(f"excess <= {t:g}" for t in targets) + " |",
        "|---" * (len(targets) + 1) + "|",
    ]
    for m, rs in runs.items():
        cells = []
        for t in targets:
            times = [r.time_to(t) for r in rs]
            got = [x for x in times if x is not None]
            note = "" if len(got) == len(rs) else f" ({len(got)}/{len(rs)} seeds)"
            cells.append((_ms(got, ".0f") if got else "never") + note)
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def faults(root: Path, ref: dict[str, list[Run]]) -> str:
    out = []
    for d in sorted((root / "e7").glob("*")):
        if not (d / "compare.json").is_file():
            continue
        out += [f"**{d.name}**", "", quality(d, ref), ""]
        counts = {}
        for m, rs in load(d).items():
            keys = rs[0].summary["faults"]
            counts[m] = {k: sum(r.summary["faults"][k] for r in rs) for k in keys if keys[k]}
        out += [f"fault counters, summed over seeds: `{json.dumps(counts)}`", ""]
    return "\n".join(out)


def speed(path: Path) -> str:
    if not path.is_file():
        return "(not run)"
    res = json.loads(path.read_text())
    out = [
        "| M | threads (worker-steps/s) | loop | vmap | threads / loop | vmap / loop |",
        "|---|---|---|---|---|---|",
    ]
    for row in res["rows"]:
        t, lo, v = row["threads"], row["loop"], row.get("vmap")
        vmap = f"{v['worker_steps_per_s']:.1f}" if v else "-"
        ratio = f"{row['ratio_vmap_over_loop']:.2f}" if v else "-"
        out.append(
            f"| {row['M']} | {t['worker_steps_per_s']:.1f} | {lo['worker_steps_per_s']:.1f} "
            f"| {vmap} | {row['ratio_threads_over_loop']:.2f} | {ratio} |"
        )
    return "\n".join(out)


def plots(root: Path, out: Path) -> None:
    """fgd_e1.png (utilization vs r), fgd_pareto.png (E2/E4), fgd_loss_vs_time.png (E3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from frugaltrain.sim.compare import pareto_front

    tag = "simulated clock; loss measured on the synthetic Markov source"
    dirs = sorted((root / "e1").glob("r*"), key=lambda p: float(p.name[1:]))
    rs_ = [float(d.name[1:]) for d in dirs]
    e1runs = [load(d) for d in dirs]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, m in enumerate(e1runs[0]):
        ax.plot(rs_, [runs[m][0].summary["util/compute"] for runs in e1runs], "o-", label=m,
                color=f"C{i % 10}", ms=3)  # fmt: skip
    ax.plot(rs_, [1 / (1 + r) for r in rs_], "k:", lw=1, label="1/(1+r)")
    ax.plot(rs_, [1 / max(1, r) for r in rs_], "k--", lw=1, label="1/max(1,r)")
    ax.set_xscale("log")
    ax.set_xticks(rs_, [f"{r:g}" for r in rs_])
    ax.minorticks_off()
    ax.set_xlabel("r = all-reduce time / H steps of compute")
    ax.set_ylabel("compute utilization (simulated)")
    ax.set_title("E1: utilization vs r (simulated clock and network)", fontsize=8)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "fgd_e1.png", dpi=110)
    plt.close(fig)

    e2 = load(root / "e2")
    pts = {
        m: (statistics.mean(r.summary["util/compute"] for r in rs),
            statistics.mean(r.excess for r in rs))
        for m, rs in e2.items()
    }  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels: dict[tuple[float, float], list[str]] = {}
    for i, (m, (u, ex)) in enumerate(pts.items()):
        ax.scatter([u], [ex], color=f"C{i % 10}", marker="o" if m.startswith("M2") else "s")
        labels.setdefault((round(u, 3), round(ex, 4)), []).append(m)
    for (u, ex), names in labels.items():  # identical points (diloco = M2:all) share a label
        ax.annotate(
            " = ".join(names), (u, ex), fontsize=7, xytext=(4, 2), textcoords="offset points"
        )
    ax.plot(*zip(*pareto_front(list(pts.values())), strict=True), "k--", lw=0.8, alpha=0.6)
    ax.set_xlabel("compute utilization (simulated)")
    ax.set_ylabel("final paired excess loss (nats)")
    ax.set_title(f"E2/E4 at r = 0.887, mean of 3 seeds; dashed: Pareto front\n({tag})", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fgd_pareto.png", dpi=110)
    plt.close(fig)

    color = {m: f"C{i % 10}" for i, m in enumerate(e2)}  # same colour per method in both panels
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, d, r in ((axes[0], root / "e2", 0.887), (axes[1], root / "e3", 1.774)):
        if not (d / "compare.json").is_file():
            continue
        for m, rs in load(d).items():
            if m in ("ddp", "M2:all"):  # ddp runs 10x longer; M2:all is diloco
                continue
            run = rs[0]  # seed 0
            pts_ = [(x["time/sim_s"], x["loss/val"] - run.source_nll) for x in run.records
                    if "loss/val" in x]  # fmt: skip
            ax.plot(*zip(*pts_, strict=True), label=m, color=color[m], lw=1)
        ax.set_xlabel("simulated wall-clock (s)")
        ax.set_yscale("log")
        ax.set_title(f"E3, r = {r}, seed 0", fontsize=9)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("paired excess loss (nats)")
    fig.suptitle(tag, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fgd_loss_vs_time.png", dpi=110)
    plt.close(fig)


TARGETS = [0.40, 0.34, 0.30, 0.25]  # paired excess, nats: reached by most methods at r = 0.887


def main() -> None:
    root = Path(sys.argv[1])
    print("## Speed\n\n" + speed(Path("benchmarks/results/sim_scale.json")) + "\n")
    print("## E1\n\n" + e1(root) + "\n")
    print("## E2/E4 (r = 0.887)\n\n" + quality(root / "e2") + "\n")
    print("## E3 at r = 0.887 (simulated s)\n\n" + time_to_targets(root / "e2", TARGETS) + "\n")
    if (root / "e3" / "compare.json").is_file():
        print("## E3 at r = 1.774 (simulated s)\n\n" + time_to_targets(root / "e3", TARGETS))
        print("\n" + quality(root / "e3") + "\n")
    print("## E7\n\n" + faults(root, load(root / "e2")))
    if "--plots" in sys.argv:
        plots(root, Path(sys.argv[sys.argv.index("--plots") + 1]))


if __name__ == "__main__":
    main()
