"""Factored Gossip DiLoCo against DiLoCo on real text: validation loss at equal tokens.

Every method x H x seed trains 4 workers on the same steps, batches and inner optimizer, either as
real gloo processes (`--runtime real`, train.launch.run) or in the simulator (`--runtime sim`,
the same computation: tests/sim/test_sim_equality.py finds it bitwise equal to real runs with
deterministic all-reduces). Runs are interleaved (for each H and seed, every method), so load
on this shared machine falls on all alike. Reported per H and method: the final per-token
validation loss (mean over workers, and of their averaged model), mean and spread over seeds,
the ratio to DiLoCo paired by seed, and the compute utilization each method would have at
r = 0.887 (one all-reduce of all parameters takes 0.887 rounds of compute: the paper's 200 Mbps
setting) from the closed forms below (estimated). Each run's evaluation records (consensus
distance, outer momentum spread, every worker's loss) go into the JSON.

    python benchmarks/fgd_real_text.py                        # built-in GPT, byte-level stdlib
    python benchmarks/fgd_real_text.py --model llama --data runs/data/stdlib-bpe2k
    python benchmarks/fgd_real_text.py --H 10 --seeds 0 --runtime sim \
        --variant "M1-mixed=GlobalM1,outer.fgd.momentum_policy=mixed"

Methods are `frugaltrain compare` names (sim/compare.py); `--variant NAME=METHOD,KEY=VALUE,...`
adds a method with extra config overrides (an ablation).

Closed forms (time in rounds of compute; a ring all-reduce of all parameters takes r, a pairwise
exchange of a fraction f of them r f M / (2 (M - 1)); Mix1 shares the link with Mix2):
    DiLoCo            1 / (1 + r)
    GlobalM1          1 / max(1, r)                   (Mix1 overlaps the round)
    Mix2 on pairs, f  1 / (max(1, r) + r f M / (2 (M - 1)))
    Mix2 complete, f  1 / (max(1, r) + r f)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import provenance

from frugaltrain.config import Config, build_config, read_toml
from frugaltrain.metrics.log import read_metrics
from frugaltrain.models import build_model
from frugaltrain.models.parts import select
from frugaltrain.sim.compare import method_overrides

ROOT = Path(__file__).resolve().parent.parent
GPT = {  # the byte-level GPT job (the earlier default): 0.48M parameters, stdlib bytes
    "data": {"max_bytes": 4_000_000, "seq_len": 128, "batch_size": 8},
    "model": {"n_layer": 2, "n_head": 4, "n_embd": 128},
    "optim": {"lr": 3e-3, "warmup_steps": 20},
}


def base_config(model: str, data: str) -> dict:
    """The job every method shares; [outer] holds only what every method reads."""
    if model == "gpt":
        raw = {k: dict(v) for k, v in GPT.items()}
        raw["data"]["path"] = data
    else:
        raw = read_toml(ROOT / "examples" / "default.toml")
        raw["data"]["path"] = data
    raw["run"] = {"workers": 4, "progress": False, "checkpoint_every": 0}
    raw["outer"] = {"lr": 0.7, "momentum": 0.9}
    return raw


def ensure_shards(data: str, vocab: int = 2048) -> None:
    """Train the tokenizer and write the shards once (as `make run` does)."""
    if not data or (Path(data) / "manifest.json").is_file():
        return
    cli = [sys.executable, "-m", "frugaltrain", "data"]
    tok, limit = f"{data}-tokenizer", ["--max-bytes", "4000000", "--force"]
    subprocess.run(
        [*cli, "tokenizer", "--vocab-size", str(vocab), "--out", tok, *limit], check=True
    )
    subprocess.run([*cli, "prepare", "--tokenizer", tok, "--out", data, *limit], check=True)


def overrides_of(name: str, variants: dict[str, list[str]]) -> list[str]:
    return variants[name] if name in variants else method_overrides(name)


def run_one(cfg: Config, runtime: str, out: Path) -> list[dict]:
    """Train `cfg` (real processes or the simulator); its round records."""
    run_dir = out / cfg.run.name
    if runtime == "sim":
        from frugaltrain.sim import SimSection, simulate

        return simulate(cfg, SimSection(ratio=0.887), run_dir).records
    from frugaltrain.train import launch

    launch.check_data(cfg)
    run_dir.mkdir(parents=True)
    launch.run(cfg, run_dir)
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "round"]


def summarize(records: list[dict]) -> dict:
    evals = [r for r in records if "loss/val" in r]
    keep = ("step", "loss/val", "loss/val_avg_model", "loss/val_workers", "consensus/total")
    keep += ("consensus/momentum",)
    util = [r["util/compute"] for r in records if r.get("util/compute") is not None]
    return {
        "loss_val": evals[-1]["loss/val"],
        "loss_val_avg_model": evals[-1].get("loss/val_avg_model"),
        "util_measured": statistics.mean(util) if util else None,
        "evals": [{k: r[k] for k in keep if k in r} for r in evals],
    }


def closed_form_util(cfg: Config, r: float = 0.887) -> float:
    """Estimated compute utilization at bandwidth ratio r (module docstring)."""
    o, M = cfg.outer, cfg.run.workers
    if o.strategy == "diloco":
        return 1 / (1 + r)
    fgd = o.fgd  # a preset is already resolved into mix2 and mix2_params
    if fgd.mix2 == "none":
        return 1 / max(1.0, r)
    model = build_model(cfg)
    sizes = [(n, p.numel()) for n, p in model.named_parameters()]
    chosen = select([n for n, _ in sizes], fgd.mix2_params)
    f = sum(s for (_, s), c in zip(sizes, chosen, strict=True) if c) / sum(s for _, s in sizes)
    per = M / (2 * (M - 1)) if fgd.mix2 == "pairs" else 1.0
    return 1 / (max(1.0, r) + r * f * per)


def _ms(xs: list[float], fmt: str) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):{fmt}} ± {sd:{fmt}}"


def table(rows: list[dict], H: int, methods: list[str], seeds: list[int]) -> str:
    by = {(r["method"], r["seed"]): r for r in rows if r["H"] == H}
    head = (
        f"{'method':<34}{'val loss':>18}{'avg-model loss':>18}{'x DiLoCo':>17}{'util r=.887':>12}"
    )
    lines = [f"H = {H}", head, "-" * len(head)]
    for m in methods:
        got = [by[m, s] for s in seeds if (m, s) in by]
        if not got:
            continue
        ref = [by.get(("diloco", g["seed"])) for g in got]
        ratio = [g["loss_val"] / r["loss_val"] for g, r in zip(got, ref, strict=True) if r]
        cells = [_ms([g["loss_val"] for g in got], ".4f")]
        cells.append(_ms([g["loss_val_avg_model"] for g in got], ".4f"))
        cells.append(_ms(ratio, ".4f") if m != "diloco" and ratio else "-")
        lines.append(
            f"{m:<34}{cells[0]:>18}{cells[1]:>18}{cells[2]:>17}{got[0]['util_r0887']:>12.3f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--data", default="", help="'' (stdlib bytes) or a token shard directory")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--H", default="10,50,100", help="comma-separated inner steps per round")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--methods", default="diloco,GlobalM1,GlobalM1LocalM2,M2pairs:embed+head+blocks:1"
    )
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=METHOD,KEY=VALUE")
    ap.add_argument(
        "--no-reference", action="store_true", help="no DiLoCo run (a grid's cells, no ratios)"
    )
    ap.add_argument("--runtime", choices=("real", "sim"), default="real")
    ap.add_argument("--evals", type=int, default=10, help="evaluations per run")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--out", default="benchmarks/results/fgd_real_text.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    variants = {}
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        base, *sets = rest.split(",")
        variants[name] = [*method_overrides(base), *sets]
    methods = [m for m in args.methods.split(",") if m] + list(variants)
    if not args.no_reference:  # the ratios are to DiLoCo's run of the same seed
        methods = ["diloco"] + [m for m in methods if m != "diloco"]
    seeds, Hs = [int(s) for s in args.seeds.split(",")], [int(h) for h in args.H.split(",")]
    ensure_shards(args.data)
    raw, rows = base_config(args.model, args.data), []
    shared = [f"run.steps={args.steps}", *args.set]  # outer.H, eval_every, seed: runs[].sets
    record = provenance.start(
        "measured" if args.runtime == "real" else "simulated",
        variants={m: [*shared, *overrides_of(m, variants)] for m in methods},
    )
    with tempfile.TemporaryDirectory() as tmp:
        for H in Hs:
            every = max(H, args.steps // args.evals // H * H)
            common = [f"run.steps={args.steps}", f"outer.H={H}", f"run.eval_every={every}"]
            for seed in seeds:
                for m in methods:
                    name = f"{m}-H{H}-s{seed}".replace(":", "_").replace("+", "-")
                    sets = [*common, *args.set, f"run.seed={seed}", f"run.name={name!r}"]
                    out_dir = f"run.out_dir={tmp!r}"  # a temporary directory: not recorded
                    cfg = build_config(Config, raw, [*sets, out_dir, *overrides_of(m, variants)])
                    row = {"method": m, "H": H, "seed": seed, "sets": sets}
                    row |= summarize(run_one(cfg, args.runtime, Path(tmp)))
                    row["util_r0887"] = closed_form_util(cfg)
                    rows.append(row)
                    print(f"[H {H} seed {seed}] {m}: val {row['loss_val']:.4f}", flush=True)
    clock = "measured (real processes)" if args.runtime == "real" else "simulated runtime"
    print(f"\nfinal validation loss ({clock}), 4 workers, {args.steps} steps, {args.model}")
    for H in Hs:
        print("\n" + table(rows, H, methods, seeds))
    provenance.finish(record)
    result = record | {
        "clock": clock,
        "utilization": "estimated (closed forms at r = 0.887)",
        "model": args.model,
        "data": args.data or "stdlib bytes",
        "steps": args.steps,
        "runs": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
