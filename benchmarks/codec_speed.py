"""CPU time of each codec's encode and decode at one tensor's size, on one thread: what a round's
coding costs inside a worker's CPU share (a worker held to 0.4 core pays 2.5x these times).

Beside the packed e3m0 codec (codecs/compress.py) runs `e3m0-formula`, the same values computed
elementwise as the format is defined (compress.e3m0_by_formula: exp2 and selects per value,
unpacked); the two give the same bits (tests/comm/test_mixing.py). Each variant runs `--reps` times,
alternating, after a warm-up; the table gives the median and the min-max, and e3m0's round
trip as a ratio to the formula's.

    python benchmarks/codec_speed.py [--numel 475776] [--reps 30] [--out FILE]

The default size is the base byte-level GPT's parameter count (benchmarks/time_to_loss.py's
model), so a round of 4-bit FGD codes it twice (Mix1 and Mix2) and decodes it about four times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import provenance
import torch

from frugaltrain.codecs import compress


def measure(numel: int, reps: int) -> dict[str, dict[str, list[float]]]:
    """{variant: {"encode": seconds, "decode": seconds}} per repetition; the variants alternate
    within each repetition so load hits them alike."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    codecs = [c for c in compress.CODECS if c != "fp32"]
    parts = {c: compress.encode(x, c) for c in codecs}
    calls = {
        c: {
            "encode": lambda c=c: compress.encode(x, c),
            "decode": lambda c=c: compress.decode(parts[c], c, numel),
        }
        for c in codecs
    }
    calls["e3m0-formula"] = {"roundtrip": lambda: compress.e3m0_by_formula(x)}
    times: dict = {v: {op: [] for op in ops} for v, ops in calls.items()}
    for rep in range(reps + 1):  # the first is a warm-up
        for v, ops in calls.items():
            for op, fn in ops.items():
                t0 = time.perf_counter()
                fn()
                if rep:
                    times[v][op].append(time.perf_counter() - t0)
    return times


def table(record: dict) -> str:
    """Median (min-max) milliseconds per call, and e3m0's round trip against the formula's."""
    t = record["seconds"]
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.2f} ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})"  # noqa: E731
    lines = [
        f"{record['numel']} values, 1 thread, {record['reps']} repetitions (measured):",
        "",
        "| codec | encode, ms | decode, ms | round trip x e3m0-formula (median) |",
        "|---|---|---|---|",
    ]
    formula = statistics.median(t["e3m0-formula"]["roundtrip"])
    for v, ops in t.items():
        if v == "e3m0-formula":
            lines.append(f"| {v} | - | - | 1.00 ({ms(ops['roundtrip'])} ms) |")
            continue
        trip = statistics.median(a + b for a, b in zip(ops["encode"], ops["decode"], strict=True))
        ratio = f"{trip / formula:.2f}" if v == "e3m0" else "-"
        lines.append(f"| {v} | {ms(ops['encode'])} | {ms(ops['decode'])} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=475776)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/codec_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    record = provenance.start("measured")
    record |= {"numel": args.numel, "reps": args.reps, "threads": 1}
    record["seconds"] = measure(args.numel, args.reps)
    provenance.report(record, args.out, table)


if __name__ == "__main__":
    main()
