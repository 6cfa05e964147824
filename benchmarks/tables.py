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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

from compression import CODECS, cells  # noqa: E402  (a sibling script, not a package)
from link_probe import table as link_probe_table  # noqa: E402


@dataclass(frozen=True)
class Table:
    doc: str  # Markdown file, relative to the repository root
    files: tuple[str, ...]  # result files under benchmarks/results/
    render: Callable[[list[dict]], str]  # the files' JSON -> the table's Markdown


def _mb(x: float) -> str:
    """Megabytes to three decimals, or three significant digits below one."""
    return f"{x:.3f}" if x >= 1 else f"{x:#.3g}"


def _ms(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.4f} ± {sd:.4f}"


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


TABLES = {
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
}


def _span(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- table {re.escape(name)}: python benchmarks/tables.py -->\n)(.*?)"
        rf"(<!-- /table {re.escape(name)} -->)",
        re.S,
    )


def regenerate(text: str, name: str, table: Table, results: Path = RESULTS) -> str:
    """`text` with table `name` written anew between its markers (ValueError without them)."""
    span = _span(name)
    if not span.search(text):
        raise ValueError(f"{table.doc}: no markers for table {name!r}; add them around it")
    files = [json.loads((results / f).read_text()) for f in table.files]
    body = table.render(files) + "\n"
    return span.sub(lambda m: m.group(1) + body + m.group(3), text)


def stale(root: Path = ROOT) -> list[str]:
    """The tables whose doc under `root` differs from what their result files give."""
    out = []
    for name, table in TABLES.items():
        text = (root / table.doc).read_text()
        if regenerate(text, name, table) != text:
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
