"""benchmarks/flow.py: its option surface, its argument checks, what it records of the machine
and the printed table.

The script is not part of the package, so it is loaded from its path. Nothing here runs a
benchmark: the runs it drives are covered by test_modes.py and test_flow_cli.py.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "flow.py"


@pytest.fixture(scope="module")
def flow_bench():
    sys.path.insert(0, str(SCRIPT.parent))  # as when run: it imports its sibling provenance.py
    try:
        spec = importlib.util.spec_from_file_location("flow_benchmark", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_option_surface_is_frozen(flow_bench) -> None:
    options = {o for a in flow_bench.parser()._actions for o in a.option_strings}
    assert options == {
        "-h",
        "--help",
        "--config",
        "--set",
        "--reps",
        "--workloads",
        "--ablations",
        "--note",
        "--out",
        "--alloc-check",
    }
    assert set(flow_bench.WORKLOADS) == {"encoder_heavy", "backbone_heavy"}
    assert flow_bench.BASELINE == "monolithic_dp"  # the verdict is against the fair baseline


def test_machine_block_is_read_from_the_machine(flow_bench) -> None:
    """No fixed sentence about the conditions: what the run can read, and the user's note."""
    info = flow_bench.machine_info()
    assert "note" not in info
    assert info["cores"] == os.cpu_count()
    assert info["affinity"] == sorted(os.sched_getaffinity(0))
    assert info["torch"] == __import__("torch").__version__
    assert info["measured.loadavg_1min_at_start"] >= 0
    assert (
        flow_bench.machine_info("2 pinned cores, idle host")["note"] == "2 pinned cores, idle host"
    )


def test_bad_arguments_are_usage_errors(flow_bench, capsys) -> None:
    # --config "": no file, the defaults (the script's default path is relative to the repo root)
    assert flow_bench.main(["--config", "", "--reps", "0"]) == 2
    assert "--reps = 0" in capsys.readouterr().err
    assert flow_bench.main(["--config", "", "--set", "run.bogus=1"]) == 2
    assert "unknown key run.bogus" in capsys.readouterr().err
    assert flow_bench.main(["--config", "", "--workloads", "tiny"]) == 2
    assert "--workloads = 'tiny'" in capsys.readouterr().err


def test_table_has_one_row_per_variant(flow_bench) -> None:
    def stats(median: float) -> dict:
        return {"median": median, "iqr": [median - 1, median + 1]}

    idle = {"starvation_frac": 0.1, "barrier_frac": 0.2, "backpressure_frac": 0.3}
    result = {
        "reps": 3,
        "workloads": {
            "encoder_heavy": {
                "measured.samples_per_s": {"monolithic_dp": stats(100.0), "flow": stats(150.0)},
                "measured.idle_breakdown": {
                    "monolithic_dp": {"replica0": {}, "replica1": {}},
                    "flow": {"consumer0": idle, "producer0": idle},
                },
                "verdict": {
                    "target": 1.2,
                    "predicted.ratio": 0.8,
                    "measured.ratio_of_medians": 1.5,
                    "measured.boot95": [1.1, 1.9],
                    "predicted_to_meet": False,
                    "met": True,
                },
                "simulated.projection": {
                    8: {"simulated.flow_over_baseline": 1.25, "milp_plan": [5, 3]},
                    64: {"simulated.flow_over_baseline": 1.4, "milp_plan": [40, 24]},
                },
                "simulated.flow_over_baseline_by_samples_per_device": {
                    1: {8: {"simulated.flow_over_baseline": 1.3}},
                    4: {8: {"simulated.flow_over_baseline": 1.25}},
                },
            }
        },
    }
    lines = flow_bench.table(result).splitlines()
    assert len(lines) == 7  # header, two variants, footnote, verdict, projection, sensitivity
    assert lines[2].split()[:5] == ["encoder_heavy", "flow", "150.0", "149.0-151.0", "1.50"]
    assert "c 0.10/0.20  p 0.30/0.20" in lines[2]
    assert "median of 3 interleaved repetitions" in lines[3]
    assert "= 1.50 (measured, 95% 1.10-1.90); the allocator predicted 0.80" in lines[4]
    assert lines[4].endswith("target 1.2x met (and not predicted)")
    assert "R=8: 1.25x (5+3), R=64: 1.40x (40+24)" in lines[5]
    assert lines[6].endswith("1/device: R=8 1.30x; 4/device: R=8 1.25x")
