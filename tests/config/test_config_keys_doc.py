"""docs/library.md's table of every config key is the one the config's docstrings give:
regenerate it with `python -m frugaltrain.config.keys_doc docs/library.md`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from frugaltrain.config import Config, flat_items, to_dict
from frugaltrain.config.keys_doc import BEGIN, END, key_rows, key_table, main, with_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "library.md"


def _block(text: str) -> str:
    return text.split(BEGIN)[1].split(END)[0].removeprefix("\n")


def test_the_doc_holds_the_generated_table():
    assert _block(DOC.read_text()) == key_table(), (
        "docs/library.md's key table differs from the config's docstrings; run "
        "python -m frugaltrain.config.keys_doc docs/library.md"
    )


def test_every_key_appears_once():
    keys = [row[0] for row in key_rows()]
    assert len(keys) == len(set(keys))
    assert keys == list(flat_items(to_dict(Config())))
    table = key_table()
    for key in keys:
        assert table.count(f"| `{key}` |") == 1, key


def test_a_row_reads_type_default_and_docstring():
    rows = {row[0]: row[1:] for row in key_rows()}
    assert rows["run.link_mbit"][:2] == ("list[float]", "[]")
    assert rows["optim.betas"][:2] == ("tuple[float, float]", "[0.9, 0.95]")
    tp, default, doc = rows["outer.diloco.overlap"]
    assert (tp, default) == ("int", "0")
    assert doc.startswith("tau: the round's average is sent") and "\n" not in doc


@dataclasses.dataclass(kw_only=True)
class _Inner:
    pipe: str = "a|b"
    """A value with a | in it."""


@dataclasses.dataclass(kw_only=True)
class _Toy:
    size: int = 3
    """How many."""
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    bare: float = 1.0


def test_a_field_without_docstring_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^bare \(_Toy\.bare\) has no docstring"):
        key_table(_Toy)


def test_nested_sections_and_pipes():
    @dataclasses.dataclass(kw_only=True)
    class Documented:
        inner: _Inner = dataclasses.field(default_factory=_Inner)
        """Not a key: a section."""

    assert key_table(Documented).splitlines()[2] == (
        '| `inner.pipe` | `str` | `"a\\|b"` | A value with a \\| in it. |'
    )


def test_the_command_rewrites_and_checks(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n\n{BEGIN}\n| stale |\n{END}\nafter\n")
    assert main([str(doc), "--check"]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert main([str(doc)]) == 0
    assert doc.read_text() == f"intro\n\n{BEGIN}\n{key_table()}{END}\nafter\n"
    assert main([str(doc), "--check"]) == 0
    assert with_table(doc.read_text(), key_table()) == doc.read_text()
