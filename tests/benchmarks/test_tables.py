"""The docs' generated results tables equal what their committed result files give
(benchmarks/tables.py), and a number edited by hand in one of them is caught."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tables():
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tables"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_matches_its_result_files():
    assert _tables().stale() == []


def test_a_number_edited_by_hand_is_caught(tmp_path: Path):
    tables = _tables()
    bodies = {name: tables.render(table) for name, table in tables.TABLES.items()}
    for table in tables.TABLES.values():  # a copy of every doc with a table
        (tmp_path / table.doc).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / table.doc).write_text((ROOT / table.doc).read_text())
    for name, table in tables.TABLES.items():
        doc = tmp_path / table.doc
        text = doc.read_text()
        found = tables._span(name).search(text)
        body = found.group(2)
        row = next(r for r in body.splitlines()[2:] if re.search(r"\d", r))  # first with a number
        digit = re.search(r"\d(?=\D*$)", row)  # its last digit
        bumped = str((int(digit.group()) + 1) % 10)
        edited = row[: digit.start()] + bumped + row[digit.end() :]
        at = found.start(2) + body.index(row)  # in this table: another may hold the same row
        doc.write_text(text[:at] + edited + text[at + len(row) :])
        assert tables.stale(tmp_path, bodies) == [f"{table.doc}: table {name}"]
        doc.write_text(text)
