"""FlowTrain benchmark: monolithic, sync and flow (plus ablations) interleaved A B C A B C ...

    .venv/bin/python benchmarks/flow.py                 # 5 repetitions, both workloads
    .venv/bin/python benchmarks/flow.py --reps 3 --workloads encoder_heavy

Prints a table (medians and IQR of measured samples/s, ratio to monolithic, idle breakdown) and
writes the full JSON (per-run metrics, bootstrap interval of flow/monolithic, simulator
validation and the simulated projection) to benchmarks/results/. The machine may be shared:
interleaving and within-repetition ratios are the defence, and the JSON records the load.
"""

from __future__ import annotations

import sys

from frugaltrain.flow.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a == "--config" for a in args):
        args = ["--config", "examples/flow.toml", *args]
    sys.exit(main(["bench", *args]))
