"""The docs' generated results tables equal what their committed result files give
(benchmarks/tables.py), a number edited by hand in one of them is caught, and tables.py imports
no benchmark script: only modules of table code that the scripts import too."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "benchmarks"


def _tables():
    """benchmarks/tables.py as `python benchmarks/tables.py` runs it: with its own directory on
    the module search path, where it finds the table modules beside it."""
    sys.path.insert(0, str(LAB))
    try:
        spec = importlib.util.spec_from_file_location("tables", LAB / "tables.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["tables"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(LAB))
    return module


def test_every_generated_table_matches_its_result_files():
    cmd = [sys.executable, "benchmarks/tables.py", "--check"]  # as a user runs it
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, ""), done.stdout + done.stderr


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


def _siblings(path: Path) -> set[str]:
    """The modules of benchmarks/ that the file at `path` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if (LAB / f"{n}.py").is_file()}


def test_tables_imports_no_benchmark_script():
    """The dependency goes one way: tables.py imports only modules of table code (no script: none
    runs as __main__), which import no benchmark script either; and it leaves sys.path alone."""
    assert "sys.path" not in (LAB / "tables.py").read_text()
    shared = _siblings(LAB / "tables.py")
    assert shared, "tables.py imports its table code from the modules beside it"
    for name in shared:
        text = (LAB / f"{name}.py").read_text()
        assert "__main__" not in text, f"tables.py imports {name}.py, a script"
        assert not _siblings(LAB / f"{name}.py"), f"{name}.py imports a benchmark script"
