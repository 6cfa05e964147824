"""benchmarks/flow.py: its option surface, its argument checks and the printed table.

The script is not part of the package, so it is loaded from its path. Nothing here runs a
benchmark: the runs it drives are covered by test_modes.py and test_flow_cli.py.
"""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "flow.py"


@pytest.fixture(scope="module")
def flow_bench():
    spec = importlib.util.spec_from_file_location("flow_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
        "--no-ablations",
        "--out",
        "--alloc-check",
    }
    assert set(flow_bench.WORKLOADS) == {"encoder_heavy", "backbone_heavy"}


def test_bad_arguments_are_usage_errors(flow_bench, capsys) -> None:
    # --config "": no file, the defaults (the script's default path is relative to the repo root)
    assert flow_bench.main(["--config", "", "--reps", "0"]) == 2
    assert "--reps = 0" in capsys.readouterr().err
    assert flow_bench.main(["--config", "", "--set", "run.bogus=1"]) == 2
    assert "unknown key run.bogus" in capsys.readouterr().err


def test_table_has_one_row_per_variant(flow_bench) -> None:
    def stats(median: float) -> dict:
        return {"median": median, "iqr": [median - 1, median + 1]}

    idle = {"starvation_frac": 0.1, "barrier_frac": 0.2, "backpressure_frac": 0.3}
    result = {
        "reps": 3,
        "workloads": {
            "encoder_heavy": {
                "measured.samples_per_s": {"monolithic": stats(100.0), "flow": stats(150.0)},
                "measured.idle_breakdown": {
                    "monolithic": {"mono": {}},
                    "flow": {"consumer0": idle, "producer0": idle},
                },
            }
        },
    }
    lines = flow_bench.table(result).splitlines()
    assert len(lines) == 4  # header, two variants, footnote
    assert lines[2].split()[:5] == ["encoder_heavy", "flow", "150.0", "149.0-151.0", "1.50"]
    assert "c 0.10/0.20  p 0.30/0.20" in lines[2]
    assert "median of 3 interleaved repetitions" in lines[3]
