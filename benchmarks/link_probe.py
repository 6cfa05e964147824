"""What netlab's shaped links deliver to the runtime's transfers: gloo's ring all-reduce and the
runtime's pair exchange (Mix2's blocking transfer, receives posted first) against the same pair
exchange with the sends posted first, at each rate, in fresh labs repeated --reps times.

    python benchmarks/link_probe.py --rates 28,14 --reps 3 --out benchmarks/results/link_probe.json

Needs root (netlab). Prints a table (median over repetitions, min-max, share of the tbf rate
and the runtime's order against sends-first as a ratio) and writes the JSON: every repetition's
probe (each a median of --repeats timed transfers, slowest worker), measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import provenance

from frugaltrain.comm.probe import TRANSFERS
from frugaltrain.netlab.lab import NetLab, why_not_available
from frugaltrain.netlab.run import probe

S = 1_870_336  # the default GPT's fp32 bytes (the model netlab.md trains)


def table(result: dict) -> str:
    lines = [
        "| tbf rate | transfer of S | seconds (median, min-max) | effective Mbit/s "
        "| share of rate |",
        "|---|---|---|---|---|",
    ]
    for rate, probes in result["probes"].items():
        for name, (s_key, bps_key) in TRANSFERS.items():
            secs = [p[s_key] for p in probes]
            bps = statistics.median(p[bps_key] for p in probes)
            lines.append(
                f"| {float(rate):g} Mbit/s | {name} | {statistics.median(secs):.3f} "
                f"({min(secs):.3f}-{max(secs):.3f}) | {bps / 1e6:.2f} | "
                f"{bps / (float(rate) * 1e6):.0%} |"
            )
    return "\n".join(lines)


def ratios(result: dict) -> str:
    out = []
    for rate, probes in result["probes"].items():
        r = [
            p["pair_exchange_send_first_s_measured"] / p["pair_exchange_s_measured"] for p in probes
        ]
        out.append(f"{float(rate):g} Mbit/s: sends-first / runtime time {min(r):.2f}-{max(r):.2f}x")
    return "; ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="28,14", help="tbf rates, Mbit/s")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="fresh labs per rate")
    ap.add_argument("--repeats", type=int, default=5, help="timed transfers per probe")
    ap.add_argument("--out", default="benchmarks/results/link_probe.json")
    args = ap.parse_args()
    reason = why_not_available()
    if reason:
        print(f"link_probe: skipped: {reason}", file=sys.stderr)
        return 2
    record = provenance.start("measured", note="netlab namespaces, tc tbf both ways")
    record |= {"bytes": S, "workers": args.workers, "repeats": args.repeats, "probes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for rate in args.rates.split(","):
                with NetLab(args.workers, float(rate)) as lab:
                    got = probe(lab, S, args.repeats, Path(tmp) / f"p{rate}-{rep}.json")
                record["probes"].setdefault(rate, []).append(got)
    provenance.finish(record)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))
    print(ratios(record))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
