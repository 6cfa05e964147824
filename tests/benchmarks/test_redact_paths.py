"""benchmarks/redact_paths.py writes a result file's run directories under the system temp
directory as $TMPDIR/... and changes nothing else: not a number, not another string, not the key
order or the layout; a file with nothing to redact is not rewritten, and a file that is not a
JSON object is refused with its name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _redact_paths():
    path = ROOT / "benchmarks" / "redact_paths.py"
    spec = importlib.util.spec_from_file_location("redact_paths", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _machine_paths():
    path = ROOT / "tests" / "benchmarks" / "test_result_files.py"
    spec = importlib.util.spec_from_file_location("result_files", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.machine_paths


RECORD = {
    "command": "python benchmarks/x.py --out /tmp/tmpab12/out.json",
    "runs": [
        {
            "sets": ["run.seed=0", "run.out_dir='/tmp/tmpab12'", "outer.lr=0.35"],
            "config": {"run": {"out_dir": "/tmp/tmpab12/run", "steps": 2000}},
            "loss": [3.1415926535, 2.5e-07, 1, -0.0],
        }
    ],
    "/tmp": "/tmp",
    "others": ["runs/tmp/x", "/tmpfoo", "https://a/tmp/b", "Mbit/s", "/usr/share/doc", "tmp"],
    "ratio": 0.1 + 0.2,
}


@pytest.mark.parametrize("indent", [1, 2, None])
def test_temp_paths_are_written_as_tmpdir_and_nothing_else_changes(tmp_path: Path, indent):
    rp = _redact_paths()
    path = tmp_path / "a.json"
    path.write_text(json.dumps(RECORD, indent=indent) + "\n")
    assert _machine_paths()(RECORD)

    assert rp.redact_file(path) == 5
    text = path.read_text()
    record = json.loads(text)
    assert text == json.dumps(record, indent=indent) + "\n"  # its own layout
    assert list(record) == ["command", "runs", "$TMPDIR", "others", "ratio", "redacted"]
    assert record["redacted"] == rp.NOTE
    assert record["command"] == "python benchmarks/x.py --out $TMPDIR/tmpab12/out.json"
    run = record["runs"][0]
    assert run["sets"] == ["run.seed=0", "run.out_dir='$TMPDIR/tmpab12'", "outer.lr=0.35"]
    assert run["config"] == {"run": {"out_dir": "$TMPDIR/tmpab12/run", "steps": 2000}}
    assert run["loss"] == RECORD["runs"][0]["loss"]
    assert json.dumps(run["loss"]) == json.dumps(RECORD["runs"][0]["loss"])
    assert record["$TMPDIR"] == "$TMPDIR"
    assert record["others"] == RECORD["others"]
    assert record["ratio"] == RECORD["ratio"]
    assert _machine_paths()(record) == ["/tmpfoo"]  # not under /tmp: left for the test to flag

    before = path.read_bytes()  # a second run finds nothing left and writes nothing
    assert rp.redact_file(path) == 0
    assert path.read_bytes() == before


def test_an_existing_note_is_extended():
    rp = _redact_paths()
    assert rp._with_note({"a": 1, "redacted": "x"}) == {"a": 1, "redacted": f"x; {rp.NOTE}"}
    assert rp._with_note({"redacted": rp.NOTE}) == {"redacted": rp.NOTE}


def test_a_file_without_a_temp_path_is_left_byte_identical(tmp_path: Path):
    rp = _redact_paths()
    path = tmp_path / "clean.json"
    data = (
        b'{"out":  "runs/tmp/x",\n "n": 1.50, "s": "\\u00e9"}'  # a layout json.dumps never writes
    )
    path.write_bytes(data)
    assert rp.redact_file(path) == 0
    assert path.read_bytes() == data


def test_a_file_that_is_not_an_object_is_refused_by_name(tmp_path: Path, capsys):
    rp = _redact_paths()
    path = tmp_path / "list.json"
    data = b'["/tmp/tmpab12"]\n'
    path.write_bytes(data)
    with pytest.raises(rp.RedactError, match=r"list\.json: not a JSON object but list"):
        rp.redact_file(path)
    assert path.read_bytes() == data
    assert rp.main([str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "list.json" in err
    assert path.read_bytes() == data
