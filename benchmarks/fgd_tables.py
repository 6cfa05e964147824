"""Tables and plots for docs/results/fgd.md (E1-E4, E7) from the runs of
docs/results/fgd_experiments.sh, packed into one committed result file.

    bash docs/results/fgd_experiments.sh                          # runs/fgd (about 75 min)
    python benchmarks/fgd_tables.py runs/fgd --pack benchmarks/results/fgd_sim.json
    python benchmarks/fgd_tables.py benchmarks/results/fgd_sim.json [--plots docs/results]

(docs/results/fgd.md keeps these tables as frozen text, each naming fgd_sim.json.)

Utilization, wall-clock and energy figures are simulated (energy: an estimate on the simulated
clock). Losses are real losses of the real computation on the synthetic Markov source, reported
as **paired excess**: validation loss minus the source's own loss on the same validation tokens
(its expectation is the entropy floor; pairing removes the sampling noise of the small
evaluation set). Gaps between methods are paired by seed. Cells are mean ± std over seeds.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from frugaltrain.config import Config, build_config, nest_outer_keys, read_toml
from frugaltrain.data.markov import markov_source_nll
from frugaltrain.sim.compare import _ms, _safe
from frugaltrain.sim.engine import validation_batches

# What the tables and plots read of a run's summary.json; the packed file keeps only these.
SUMMARY_KEYS = (
    "loss/val",
    "util/compute",
    "time/sim_s",
    "comm/bytes_sent_per_worker",
    "consensus/total",
    "faults",
)


@dataclass
class Run:
    seed: int
    summary: dict
    records: list[dict]  # the evaluations: time/sim_s and loss/val
    source_nll: float  # the Markov source's own loss on this run's validation batches

    @property
    def excess(self) -> float:
        return self.summary["loss/val"] - self.source_nll

    def time_to(self, excess: float) -> float | None:
        """First simulated second at which the paired excess is <= `excess` (None: never)."""
        for r in self.records:
            if r["loss/val"] - self.source_nll <= excess:
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


def _pack_run(rd: Path) -> dict:
    summary = json.loads((rd / "summary.json").read_text())
    evals = []
    for line in (rd / "metrics.jsonl").open():
        rec = json.loads(line)
        if "loss/val" in rec:
            evals.append([rec["time/sim_s"], rec["loss/val"]])
    return {
        "seed": int(rd.name[4:]),
        "summary": {k: summary[k] for k in SUMMARY_KEYS},
        "source_nll": _source_nll(rd, summary),
        "evals": evals,
    }


def pack(root: Path) -> dict:
    """Every `compare` directory under `root` (e1/r*, e2, e3, e7/*): its methods, seeds and
    overrides, and per method the packed run of each seed that finished."""
    experiments, mtimes = {}, []
    for meta_path in sorted(root.rglob("compare.json")):
        d = meta_path.parent
        meta = json.loads(meta_path.read_text())
        runs = {}
        for m in meta["methods"]:
            done = [
                rd for rd in sorted((d / _safe(m)).glob("seed*")) if (rd / "summary.json").is_file()
            ]
            runs[m] = [_pack_run(rd) for rd in done]
            mtimes += [(rd / "summary.json").stat().st_mtime for rd in done]
        name = str(d.relative_to(root))
        experiments[name] = {k: meta[k] for k in ("methods", "seeds", "config", "sets")}
        experiments[name]["runs"] = runs
    when = [datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")
            for t in (min(mtimes), max(mtimes))]  # fmt: skip
    return {"runs_finished_between": when, "experiments": experiments}


def runs_of(exp: dict) -> dict[str, list[Run]]:
    """{method: [Run per seed]} of one packed experiment, in its method order."""
    return {
        m: [
            Run(
                r["seed"],
                r["summary"],
                [{"time/sim_s": t, "loss/val": v} for t, v in r["evals"]],
                r["source_nll"],
            )
            for r in rs
        ]
        for m, rs in exp["runs"].items()
        if rs
    }


def _gap_pct(runs: list[Run], ref: list[Run], of=lambda r: r.excess) -> list[float]:
    """Per seed: 100 (of(run) / of(reference run) - 1), matched by seed."""
    by_seed = {r.seed: of(r) for r in ref}
    return [100 * (of(r) / by_seed[r.seed] - 1) for r in runs if r.seed in by_seed]


def _val(r: Run) -> float:
    return r.summary["loss/val"]


def _e1(packed: dict) -> list[tuple[float, dict[str, list[Run]], list[str]]]:
    """(r, runs, methods) of each E1 experiment, by r."""
    out = []
    for name, exp in packed["experiments"].items():
        if name.startswith("e1/r"):
            out.append((float(name[4:]), runs_of(exp), exp["methods"]))
    return sorted(out, key=lambda x: x[0])


def e1(packed: dict) -> str:
    rows = _e1(packed)
    methods = rows[0][2]
    head = "| r | " + " | ".join(methods) + " | closed form DiLoCo / GlobalM1 |"
    out = [head, "|---" * (len(methods) + 2) + "|"]
    for r, runs, _ in rows:
        cells = [_ms([x.summary["util/compute"] for x in runs.get(m, [])], ".3f") for m in methods]
        closed = f"{1 / (1 + r):.3f} / {1 / max(1, r):.3f}"
        out.append(f"| {r:g} | " + " | ".join(cells) + f" | {closed} |")
    return "\n".join(out)


def quality(runs: dict[str, list[Run]], ref: dict[str, list[Run]] | None = None) -> str:
    """Per-method table of one experiment; `ref` (the fault-free runs) adds the loss cost of
    the faults, paired by seed and method."""
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


def time_to_targets(runs: dict[str, list[Run]], targets: list[float]) -> str:
    """Simulated seconds until the paired excess first reaches each target (evaluated every
    run.eval_every steps), mean over the seeds that reach it."""
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


def faults(packed: dict) -> str:
    """Each E7 experiment's table, costs against the fault-free runs of E2."""
    ref, out = runs_of(packed["experiments"]["e2"]), []
    for name, exp in sorted(packed["experiments"].items()):
        if not name.startswith("e7/"):
            continue
        runs = runs_of(exp)
        out += [f"**{name[3:]}**", "", quality(runs, ref), ""]
        counts = {}
        for m, rs in runs.items():
            keys = rs[0].summary["faults"]
            counts[m] = {k: sum(r.summary["faults"][k] for r in rs) for k in keys if keys[k]}
        out += [f"fault counters, summed over seeds: `{json.dumps(counts)}`", ""]
    return "\n".join(out).rstrip("\n")


def plots(packed: dict, out: Path) -> None:
    """fgd_e1.png (utilization vs r), fgd_pareto.png (E2/E4), fgd_loss_vs_time.png (E3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from frugaltrain.sim.compare import pareto_front

    tag = "simulated clock; loss measured on the synthetic Markov source"
    rows = _e1(packed)
    rs_ = [r for r, _, _ in rows]
    e1runs = [runs for _, runs, _ in rows]
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

    exps = packed["experiments"]
    e2 = runs_of(exps["e2"])
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
    for ax, name, r in ((axes[0], "e2", 0.887), (axes[1], "e3", 1.774)):
        for m, rs in runs_of(exps[name]).items():
            if m in ("ddp", "M2:all"):  # ddp runs 10x longer; M2:all is diloco
                continue
            run = rs[0]  # seed 0
            pts_ = [(x["time/sim_s"], x["loss/val"] - run.source_nll) for x in run.records]
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
    src = Path(sys.argv[1])
    if "--pack" in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import provenance

        record = provenance.start(
            "simulated",
            note="clock, utilization and bytes simulated or counted; losses measured (the real "
            "computation's); the runs were made by docs/results/fgd_experiments.sh",
        )
        record["runs_command"] = "bash docs/results/fgd_experiments.sh"
        record.update(pack(src))
        record["variants"] = {
            f"{name}/{m}": [*exp["sets"], f"method={m}"]
            for name, exp in record["experiments"].items()
            for m in exp["methods"]
        }
        provenance.save(provenance.finish(record), sys.argv[sys.argv.index("--pack") + 1])
        return
    packed = json.loads(src.read_text())
    exps = packed["experiments"]
    print("## E1\n\n" + e1(packed) + "\n")
    print("## E2/E4 (r = 0.887)\n\n" + quality(runs_of(exps["e2"])) + "\n")
    print("## E3 at r = 0.887 (simulated s)\n\n" + time_to_targets(runs_of(exps["e2"]), TARGETS))
    print("\n## E3 at r = 1.774 (simulated s)\n\n" + time_to_targets(runs_of(exps["e3"]), TARGETS))
    print("\n" + quality(runs_of(exps["e3"])) + "\n")
    print("## E7\n\n" + faults(packed))
    if "--plots" in sys.argv:
        plots(packed, Path(sys.argv[sys.argv.index("--plots") + 1]))


if __name__ == "__main__":
    main()
