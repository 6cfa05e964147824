"""Every result file in benchmarks/results/ says what it is (benchmarks/provenance.py): a JSON
object with "command", "kind", "machine" and "date", its kind one of provenance.KINDS (or a dict
of them, figure by figure), its command the relative `python benchmarks/...` line that
reproduces it (reconstructed afterwards for the oldest files, as their "command_note" says),
and no absolute path of the machine it ran on anywhere in it (older runs' run directories under
the system temp directory are written as $TMPDIR/..., benchmarks/redact_paths.py)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
REQUIRED = ("command", "kind", "machine", "date")

# An absolute path, alone or inside a longer string, but for /usr/ (the corpora Debian packages
# ship, read as data): one names the machine a run was made on. Not a ratio ("Mbit/s"), a
# relative path ("runs/x") or a URL ("https://...").
MACHINE_PATH = re.compile(r"(?<![\w.~/:-])/(?!usr/)[A-Za-z_]")


def _kinds() -> tuple[str, ...]:
    """provenance.KINDS, read from benchmarks/provenance.py."""
    path = ROOT / "benchmarks" / "provenance.py"
    spec = importlib.util.spec_from_file_location("provenance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KINDS


def _result_files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


def _load(path: Path) -> object:
    return json.loads(path.read_text())


def _strings(value: object) -> Iterator[str]:
    """Every string in a JSON value, dict keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def provenance_errors(record: object, kinds: tuple[str, ...]) -> list[str]:
    """What is missing or wrong in a result file's provenance fields (empty: nothing)."""
    if not isinstance(record, dict):
        return [f"not a JSON object but {type(record).__name__}"]
    errors = [f"no {key!r}" for key in REQUIRED if key not in record]
    kind = record.get("kind")
    if "kind" in record and not _kind_ok(kind, kinds):
        errors.append(f"kind = {kind!r}: use one of {kinds} or a dict of them")
    command = record.get("command")
    if "command" in record and not _command_ok(command):
        errors.append(f"command = {command!r}: give the 'python benchmarks/...' line that ran")
    return errors


def _kind_ok(kind: object, kinds: tuple[str, ...]) -> bool:
    if isinstance(kind, dict):
        return bool(kind) and all(value in kinds for value in kind.values())
    return kind in kinds


def _command_ok(command: object) -> bool:
    return isinstance(command, str) and command.startswith("python benchmarks/")


def machine_paths(record: object) -> list[str]:
    """The strings in a result file that hold an absolute path of the machine it ran on."""
    return [s for s in _strings(record) if MACHINE_PATH.search(s)]


@pytest.mark.parametrize("path", _result_files(), ids=lambda p: p.name)
def test_result_file_says_what_it_is(path: Path):
    assert provenance_errors(_load(path), _kinds()) == []


@pytest.mark.parametrize("path", _result_files(), ids=lambda p: p.name)
def test_result_file_holds_no_machine_path(path: Path):
    assert machine_paths(_load(path)) == []


# Scripts whose methods are example configs: an example's outer step can be chosen again later,
# so each file keeps the [outer] table every method ran with.
OUTER_TABLE_SCRIPTS = ("python benchmarks/fgd_corpora.py", "python benchmarks/time_to_loss.py")


@pytest.mark.parametrize("path", _result_files(), ids=lambda p: p.name)
def test_a_file_of_example_methods_keeps_each_ones_outer_table(path: Path):
    record = _load(path)
    if not str(record.get("command", "")).startswith(OUTER_TABLE_SCRIPTS):
        pytest.skip("its methods are not example configs")
    assert set(record.get("outer_tables", {})) == set(record["methods"])


@pytest.mark.parametrize("path", _result_files(), ids=lambda p: p.name)
def test_a_variant_at_its_own_H_keeps_it_in_its_outer_table(path: Path):
    record = _load(path)
    if not str(record.get("command", "")).startswith(OUTER_TABLE_SCRIPTS):
        pytest.skip("its methods are not example configs")
    for method, sets in record.get("variants", {}).items():
        own = [s.removeprefix("outer.H=") for s in sets if s.startswith("outer.H=")]
        if own:  # the file's H is not this method's
            assert record["outer_tables"][method].get("H") == int(own[-1]), method


def test_a_missing_or_wrong_field_is_caught():
    kinds = _kinds()
    good = {"command": "python benchmarks/x.py", "kind": "measured", "machine": {}, "date": "d"}
    assert provenance_errors(good, kinds) == []
    for key in REQUIRED:
        assert provenance_errors({k: v for k, v in good.items() if k != key}, kinds) == [
            f"no {key!r}"
        ]
    assert provenance_errors(good | {"kind": {"loss": "measured", "util": "guessed"}}, kinds)
    assert provenance_errors(good | {"command": "/usr/bin/python benchmarks/x.py"}, kinds)
    assert provenance_errors(good | {"command": None}, kinds)
    assert provenance_errors(good | {"command": None, "command_note": "not recorded"}, kinds)
    assert provenance_errors([good], kinds) == ["not a JSON object but list"]


def test_a_machine_path_is_caught():
    assert machine_paths({"out": "/tmp/run"}) == ["/tmp/run"]
    assert machine_paths({"sets": ["run.out_dir='/home/a/x'"]}) == ["run.out_dir='/home/a/x'"]
    assert machine_paths({"/srv/a": 1}) == ["/srv/a"]
    assert machine_paths({"sets": ["run.out_dir='$TMPDIR/tmpab12'"], "out": "$TMPDIR/x"}) == []
    clean = {"out": "runs/tmp/x", "data": "/usr/share/doc", "rate": "Mbit/s", "u": "https://a/b"}
    assert machine_paths(clean | {"file": "benchmarks/results/a.json"}) == []
