"""Wall time of the data commands a new user runs first (docs/data.md, "Measured"): train a BPE
tokenizer on 2 MB of the standard library's sources, tokenize the same 2 MB into shards with one
and with two processes, and tokenize the whole standard library. Each command is a fresh
`frugaltrain data ...` process, so its start-up (torch, transformers, datasets) is counted.

    python benchmarks/data_prep.py [--reps 3] [--out benchmarks/results/data_prep.json]
    python benchmarks/data_prep.py --table benchmarks/results/data_prep.json

Every repetition runs the four commands in order (the shards need that repetition's tokenizer)
into a fresh temporary directory, with a datasets cache of its own; the table gives the median
and range over repetitions and the shards' token counts from their manifests, and the JSON
whether the one- and two-process shards are equal (their SHA-256s). Measured. The table
(table_format.data_prep_table) is the one tables.py writes into docs/data.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import provenance
from table_format import data_prep_table as table  # shared with tables.py (docs/data.md)

TWO_MB = ["--max-bytes", "2000000"]
# name -> arguments after `frugaltrain data`, with TOK and OUT for the paths (recorded as the
# result's variants, from which the table reads what each step read: its --max-bytes or all)
STEPS = {
    "tokenizer": ["tokenizer", "--vocab-size", "4096", *TWO_MB, "--out", "TOK"],
    "prepare, 1 process": ["prepare", "--tokenizer", "TOK", *TWO_MB, "--out", "OUT"],
    "prepare, 2 processes": ["prepare", "--tokenizer", "TOK", *TWO_MB, "--out", "OUT",
                             "--num-proc", "2"],
    "prepare, whole stdlib": ["prepare", "--tokenizer", "TOK", "--out", "OUT"],
}  # fmt: skip


def run_step(args: list[str], tok: Path, out: Path, cache: Path) -> float:
    """Seconds of one `frugaltrain data` command, start-up included, with a datasets cache of
    the repetition's own (a new user's is empty)."""
    cmd = [sys.executable, "-m", "frugaltrain", "data"]
    cmd += [str(tok) if a == "TOK" else str(out) if a == "OUT" else a for a in args]
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def shards_of(out: Path) -> dict:
    """What a shard directory holds: its splits' token counts, dtype and shard hashes."""
    m = json.loads((out / "manifest.json").read_text())
    return {
        "splits": m["splits"],
        "dtype": m["dtype"],
        "sha256": [s["sha256"] for s in m["shards"]],
    }


def repetition() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok, rep = root / "tok", {}
        for i, (name, args) in enumerate(STEPS.items()):
            out = root / f"shards{i}"
            seconds = run_step(args, tok, out, root / "datasets-cache")
            rep[name] = {"wall_s": seconds}
            if "prepare" in name:
                rep[name]["shards"] = shards_of(out)
        return rep


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/data_prep.json")
    ap.add_argument("--table", metavar="JSON", help="print the table of a result file")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    record = provenance.start("measured", variants=STEPS)
    record["python"] = sys.version.split()[0]  # the stdlib's size depends on it
    record["versions"] = {m: __import__(m).__version__ for m in ("tokenizers", "datasets")}
    reps = []
    for i in range(args.reps):
        reps.append(repetition())
        print(f"rep {i}: " + ", ".join(f"{k} {v['wall_s']:.1f} s" for k, v in reps[-1].items()))
    record["measured.repetitions"] = reps
    one, two = (reps[0][k]["shards"]["sha256"] for k in list(STEPS)[1:3])
    record["measured.same_shards_1_and_2_processes"] = one == two
    provenance.save(provenance.finish(record), args.out)
    print(table(record))
    print(f"one- and two-process shards equal: {one == two}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
