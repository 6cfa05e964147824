"""Loss at equal tokens on several real-text corpora: each method's final validation loss against
DiLoCo's on the same corpus, seed, model and token budget, every method as its example ships.

    python benchmarks/fgd_corpora.py --snapshot runs/corpora          # the corpora, once
    python benchmarks/fgd_corpora.py --corpora runs/corpora --jobs 16 \
        --out benchmarks/results/fgd_corpora.json
    python benchmarks/fgd_corpora.py --table JSON                      # the tables again

A corpus snapshot is a directory of the text files the byte-level corpus reader chooses from a
source (data/textfiles.py: the first --max-bytes in hash order), copied with their relative
paths and cut where the reader cuts them, so reading the snapshot gives the same bytes, in the
same train/validation split, on any machine. Sources: the Python standard library's sources
(the corpus every example's outer step was tuned on), the Debian packages' documentation in
Markdown, text and reStructuredText (English prose, most of it git's and Node.js's manuals) and
the C headers of /usr/include (source code of another language).

Every run is the simulator (the same computation as real processes; tests/sim/ checks it bit
for bit), 4 workers, one thread each, --jobs runs at a time; its figures are losses, not times.
A method is an example config (examples/<file>.toml, its own outer step) with the shared
overrides (steps, H, data, seed, model width) and its own extras (METHODS). Reported per corpus
and model: each method's final validation loss (mean over workers, each worker's own model) as
a ratio to DiLoCo's of the same seed, the mean and the worst seed, and the same for the
workers' averaged model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import provenance

from frugaltrain.config import ConfigError, load_config
from frugaltrain.data.textfiles import list_files, select_text_files, stdlib_root

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "diloco"
SOURCES = {  # snapshot name -> (source directory, suffixes read there)
    "stdlib": (None, (".py",)),
    "doc": (Path("/usr/share/doc"), (".md", ".txt", ".rst")),
    "include": (Path("/usr/include"), None),
}
TUNED_ON = "stdlib"
MIX1_DELTA_4BIT = ["outer.fgd.mix1_delta=true", "outer.param_codec='e3m0'"]
METHODS = {  # name -> (example config, extra overrides)
    "diloco": ("diloco", []),
    "streaming": ("streaming", []),
    "noloco": ("noloco", []),
    "GlobalM1": ("fgd_globalm1", []),
    "GlobalM1LocalM2": ("fgd_globalm1_localm2", []),
    "GlobalM1LocalM2-int8": ("fgd_globalm1_localm2_int8", []),  # Mix2 in int8, Mix1 fp32
    "GlobalM1LocalM2-int8-bf16": (  # and Mix1 in bf16
        "fgd_globalm1_localm2_int8",
        ["outer.param_codec='bf16'"],
    ),
    # Mix1 coded as each worker's update against the last Mix1 mean, in 4 bits with error
    # feedback (outer.fgd.mix1_delta): an eighth of fp32's bytes. Mix2 in int8, or in 4 bits too.
    "GlobalM1LocalM2-int8-d4": ("fgd_globalm1_localm2_int8", MIX1_DELTA_4BIT),
    "GlobalM1LocalM2-4bit": ("fgd_globalm1_localm2_int8", [*MIX1_DELTA_4BIT, "outer.codec='e3m0'"]),
    "subset": ("fgd_subset", []),
    "gossip": ("fgd_gossip", []),  # Mix1 on the exponential graph, Mix2 on pairs: no collective
}
MODELS = {"base": [], "4x": ["model.n_embd=256"]}  # 0.48M and 1.8M parameters


def snapshot(out: Path, max_bytes: int) -> None:
    """Copy each source's chosen files (cut as the reader cuts them) under out/<name>/."""
    for name, (src, suffixes) in SOURCES.items():
        root = src or stdlib_root()
        dest = out / name
        if dest.exists():
            shutil.rmtree(dest)
        chosen = select_text_files(list_files(root, suffixes), root, max_bytes)
        for path, cut in chosen:
            target = dest / path.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes()[: cut or None])
        total = sum((dest / p.relative_to(root)).stat().st_size for p, _ in chosen)
        print(f"{name}: {len(chosen)} files, {total} bytes from {root}")


def run_one(job: tuple[str, list[str]]) -> dict:
    """Simulate one run (a worker process: one thread); its final evaluation."""
    import torch

    from frugaltrain.config import load_config
    from frugaltrain.sim import SimSection, simulate

    torch.set_num_threads(1)
    cfg_path, sets = job
    cfg = load_config(cfg_path, sets)
    records = simulate(cfg, SimSection(ratio=0.887)).records
    last = [r for r in records if r.get("kind") == "round" and "loss/val" in r][-1]
    return {"loss_val": last["loss/val"], "loss_val_avg_model": last.get("loss/val_avg_model")}


def jobs_of(args, out_dir: str) -> list[dict]:
    shared = [
        f"run.steps={args.steps}",
        f"outer.H={args.H}",
        f"run.eval_every={args.steps}",  # one evaluation, at the end
        "run.checkpoint_every=0",
        "run.progress=false",
        f"run.out_dir={out_dir!r}",
        *args.set,
    ]
    jobs = []
    for seed in (int(s) for s in args.seeds.split(",")):  # a cut run keeps whole seeds
        for model in args.models.split(","):
            for corpus in args.names.split(","):
                for method in args.methods.split(","):
                    example, extra = METHODS[method]
                    name = f"{method}-{model}-{corpus}-s{seed}"
                    sets = [*shared, f"data.path={str(Path(args.corpora) / corpus)!r}"]
                    sets += [f"run.seed={seed}", f"run.name={name!r}", *MODELS[model], *extra]
                    jobs.append(
                        {
                            "method": method,
                            "model": model,
                            "corpus": corpus,
                            "seed": seed,
                            "config": f"examples/{example}.toml",
                            "sets": sets,
                        }
                    )
    return jobs


def ratios(record: dict, key: str) -> dict:
    """(model, corpus, method) -> [loss / DiLoCo's of the same seed]."""
    base = {
        (r["model"], r["corpus"], r["seed"]): r[key]
        for r in record["runs"]
        if r["method"] == BASELINE
    }
    out: dict = {}
    for r in record["runs"]:
        ref = base.get((r["model"], r["corpus"], r["seed"]))
        if r["method"] != BASELINE and ref and r.get(key) is not None:
            out.setdefault((r["model"], r["corpus"], r["method"]), []).append(r[key] / ref)
    return out


def table(record: dict, key: str = "loss_val") -> str:
    """Rows: methods; columns: model x corpus; cells: mean ratio, then the worst seed."""
    got = ratios(record, key)
    cols = sorted({(m, c) for m, c, _ in got}, key=lambda mc: (mc[0] != "base", mc))
    methods = [m for m in record["methods"] if m != BASELINE]
    tuned = lambda c: " (tuned)" if c == record["tuned_on"] else ""  # noqa: E731
    head = "| method | " + " | ".join(f"{m}, {c}{tuned(c)}" for m, c in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for method in methods:
        cells = []
        for m, c in cols:
            xs = got.get((m, c, method), [])
            cells.append(f"{statistics.mean(xs):.4f}, {max(xs):.4f}" if xs else "-")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_tables(record: dict) -> None:
    print(f"final validation loss / DiLoCo's, same seed (mean, worst of seeds {record['seeds']})")
    print("each worker's own model, mean over workers:\n" + table(record))
    print("\nthe workers' averaged model:\n" + table(record, "loss_val_avg_model"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshot", default="", help="write the corpus snapshots here and stop")
    ap.add_argument("--max-bytes", type=int, default=4_000_000)
    ap.add_argument("--corpora", default="runs/corpora")
    ap.add_argument("--names", default=",".join(SOURCES))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("-H", type=int, default=50)
    ap.add_argument("--set", action="append", default=[], help="an override for every run")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=METHOD,KEY=VALUE,...",
        help="a method of METHODS with extra overrides (a probe of a setting)",
    )
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--table", default="", help="print the tables of this results file")
    ap.add_argument("--out", default="benchmarks/results/fgd_corpora.json")
    args = ap.parse_args()
    if args.table:
        print_tables(json.loads(Path(args.table).read_text()))
        return 0
    if args.snapshot:
        snapshot(Path(args.snapshot), args.max_bytes)
        return 0
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        base, *sets = rest.split(",")
        METHODS[name] = (METHODS[base][0], [*METHODS[base][1], *sets])
        args.methods += f",{name}"
    for corpus in args.names.split(","):
        if not (Path(args.corpora) / corpus).is_dir():
            where = Path(args.corpora) / corpus
            print(
                f"--corpora: no {where}; write it with --snapshot {args.corpora}", file=sys.stderr
            )
            return 2
    if BASELINE not in args.methods.split(","):
        args.methods = f"{BASELINE},{args.methods}"
    with tempfile.TemporaryDirectory() as tmp:
        jobs = jobs_of(args, tmp)
        for config in {j["method"]: j for j in jobs}.values():  # bad overrides fail before any run
            try:
                load_config(ROOT / config["config"], config["sets"])
            except ConfigError as e:
                print(f"{config['method']}: {e}", file=sys.stderr)
                return 2
        record = provenance.start(
            "simulated",
            variants={m: METHODS[m][1] for m in args.methods.split(",")},
            note=f"simulator, {args.jobs} runs at a time, one thread each",
        )
        record |= {
            "figures": "final validation loss (the simulator trains the real model; no clock)",
            "methods": args.methods.split(","),
            "examples": {m: f"examples/{METHODS[m][0]}.toml" for m in args.methods.split(",")},
            "outer_tables": {  # as the runs get them: --set, then the method's own
                m: provenance.outer_table(
                    ROOT / f"examples/{METHODS[m][0]}.toml", [*args.set, *METHODS[m][1]]
                )
                for m in args.methods.split(",")
            },
            "models": {m: MODELS[m] for m in args.models.split(",")},
            "corpora": {c: str(SOURCES[c][0] or "python stdlib") for c in args.names.split(",")},
            "tuned_on": TUNED_ON,
            "seeds": [int(s) for s in args.seeds.split(",")],
            "steps": args.steps,
            "H": args.H,
            "max_bytes": args.max_bytes,
        }
        record["runs"] = []
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(run_one, (str(ROOT / j["config"]), j["sets"])): j for j in jobs}
            for future in as_completed(futures):  # saved as they finish: a cut run keeps them
                job = futures[future]
                job["sets"] = [s for s in job["sets"] if not s.startswith("run.out_dir")]
                job |= future.result()
                record["runs"].append(job)
                provenance.save(record, args.out)
                print(
                    f"{job['model']} {job['corpus']} s{job['seed']} {job['method']}: "
                    f"{job['loss_val']:.4f}",
                    flush=True,
                )
    provenance.finish(record)
    provenance.save(record, args.out)
    print_tables(record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
