"""The table of every config key, made from the docstrings under the config's fields.

One source for the keys: each field of a section carries its docstring (the string right after
it), and docs/library.md's "Every config key" table is generated from those, so the docs cannot
drift from the code (tests/config/test_config_keys_doc.py compares them). After changing a key:

    python -m frugaltrain.config.keys_doc docs/library.md          # rewrite the table
    python -m frugaltrain.config.keys_doc docs/library.md --check  # exit 1 if it is stale

The docstrings are not kept at runtime, so they are read from the class source with `ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
import typing
from pathlib import Path

from frugaltrain.config.base import ArgumentParser, _toml_value
from frugaltrain.config.training import Config

BEGIN = (
    "<!-- keys: generated from the config's docstrings; "
    "python -m frugaltrain.config.keys_doc docs/library.md -->"
)
END = "<!-- /keys -->"


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring, on one line} of dataclass `cls` and its bases: the string
    expression that follows the field's annotated assignment in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for stmt, after in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def key_rows(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default as TOML, docstring) of every key under `cls`, in field order;
    a nested section's keys take its name as a prefix. ValueError: a field has no docstring."""
    hints, docs, rows = typing.get_type_hints(cls), field_docs(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += key_rows(hints[f.name], f"{prefix}{f.name}.")
            continue
        if f.name not in docs:
            raise ValueError(
                f"{prefix}{f.name} ({cls.__name__}.{f.name}) has no docstring; add one under "
                "the field: the key table in the docs is made from it"
            )
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        tp = f.type if isinstance(f.type, str) else inspect.formatannotation(f.type)
        rows.append((f"{prefix}{f.name}", tp, _toml_value(default), docs[f.name]))
    return rows


def key_table(cls: type = Config) -> str:
    """A Markdown table with one row per key of config class `cls`: key, type, default, meaning."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, doc in key_rows(cls):
        cells = (f"`{key}`", f"`{tp}`", f"`{default}`", doc)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def with_table(text: str, table: str) -> str:
    """`text` with the block between BEGIN and END replaced by `table`."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"expected one {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN)
    tail = rest.split(END)[1]
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m frugaltrain.config.keys_doc",
        description="Write the table of every config key into FILE, between its markers.",
    )
    parser.add_argument(
        "file", type=Path, help="a Markdown file with the markers, e.g. docs/library.md"
    )
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if it differs")
    args = parser.parse_args(argv)
    text = args.file.read_text()
    try:
        new = with_table(text, key_table())
    except ValueError as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print(
                f"{args.file}: the config key table is out of date; run "
                f"python -m frugaltrain.config.keys_doc {args.file}",
                file=sys.stderr,
            )
            return 1
        return 0
    args.file.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
