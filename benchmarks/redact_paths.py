"""Write the run directories a result file names under the system temp directory as $TMPDIR/...

Older runs recorded each run's temporary directory (tempfile.mkdtemp, under /tmp) in their
overrides or config, e.g. "run.out_dir='/tmp/tmpab12'". That path named the machine the run was
made on and means nothing elsewhere, and nothing in the repo may name a machine's paths
(tests/benchmarks/test_result_files.py). This rewrites every such path, alone or inside a longer
string,
dict keys included, relative to a placeholder: "/tmp/tmpab12/run" -> "$TMPDIR/tmpab12/run".
Every number and every other string stays as it was, the key order too, and the file is written
in its own layout (indentation, escaping, final newline). A file that changes gets one top-level
field "redacted" saying so (an existing one is extended); a file with nothing to redact is not
written at all. A file that is not a JSON object, or whose layout cannot be reproduced, is
refused with one line naming it.

    python benchmarks/redact_paths.py benchmarks/results/a.json benchmarks/results/b.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

TEMP_DIR = "/tmp"
PLACEHOLDER = "$TMPDIR"
NOTE = (
    "run directories under the system temp directory written as $TMPDIR/...; nothing else changed"
)


class RedactError(ValueError):
    """A file this script will not rewrite; the message is one line naming it."""


def temp_path_pattern(temp_dir: str = TEMP_DIR) -> re.Pattern[str]:
    """The temp directory as the start of an absolute path: not inside a relative path
    ("runs/tmp/x") or a URL, and not a longer name ("/tmpfoo")."""
    return re.compile(r"(?<![\w.~/:$-])" + re.escape(temp_dir.rstrip("/")) + r"(?![\w.-])")


def redact(value: object, pattern: re.Pattern[str]) -> tuple[object, int]:
    """A JSON value with every temp path written as $TMPDIR/..., and how many strings changed."""
    if isinstance(value, str):
        new = pattern.sub(lambda _: PLACEHOLDER, value)
        return new, int(new != value)
    if isinstance(value, dict):
        out: dict[str, object] = {}
        changed = 0
        for key, item in value.items():
            new_key, n_key = redact(key, pattern)
            new_item, n_item = redact(item, pattern)
            out[str(new_key)] = new_item
            changed += n_key + n_item
        return out, changed
    if isinstance(value, list):
        items = [redact(item, pattern) for item in value]
        return [item for item, _ in items], sum(n for _, n in items)
    return value, 0


def _layout(text: str, record: object) -> tuple[int | None, bool, str] | None:
    """The indentation, ASCII escaping and ending that write `record` back as exactly `text`
    (None: none does)."""
    lines = text.splitlines()
    body = next((line for line in lines[1:] if line.strip()), None)
    indent = None if body is None else len(body) - len(body.lstrip(" "))
    end = "\n" if text.endswith("\n") else ""
    for ensure_ascii in (True, False):
        if json.dumps(record, indent=indent, ensure_ascii=ensure_ascii) + end == text:
            return indent, ensure_ascii, end
    return None


def _with_note(record: dict[str, object]) -> dict[str, object]:
    """`record` with NOTE in its top-level "redacted" field, added last or extended."""
    note = record.get("redacted")
    if note is None:
        return record | {"redacted": NOTE}
    if isinstance(note, str):
        return record if NOTE in note else record | {"redacted": f"{note}; {NOTE}"}
    if isinstance(note, list):
        return record if NOTE in note else record | {"redacted": [*note, NOTE]}
    raise ValueError(f"its 'redacted' field is a {type(note).__name__}, not a string or list")


def redact_file(path: Path, temp_dir: str = TEMP_DIR) -> int:
    """Rewrite one result file's temp paths in place; how many strings changed (0: untouched)."""
    try:
        text = path.read_text()
        record = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RedactError(f"{path}: not read as JSON ({err})") from err
    if not isinstance(record, dict):
        raise RedactError(f"{path}: not a JSON object but {type(record).__name__}")
    new, changed = redact(record, temp_path_pattern(temp_dir))
    if not changed:
        return 0
    layout = _layout(text, record)
    if layout is None:
        raise RedactError(f"{path}: its layout cannot be written back as it is; left unchanged")
    assert isinstance(new, dict)
    try:
        new = _with_note(new)
    except ValueError as err:
        raise RedactError(f"{path}: {err}; left unchanged") from err
    indent, ensure_ascii, end = layout
    path.write_text(json.dumps(new, indent=indent, ensure_ascii=ensure_ascii) + end)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="result JSON files, rewritten in place")
    ap.add_argument("--temp-dir", default=TEMP_DIR, help="the system temp directory (%(default)s)")
    args = ap.parse_args(argv)
    status = 0
    for path in args.files:
        try:
            changed = redact_file(path, args.temp_dir)
        except RedactError as err:
            print(f"error: {err}", file=sys.stderr)
            status = 1
            continue
        print(f"{path}: {changed} strings redacted" if changed else f"{path}: nothing to redact")
    return status


if __name__ == "__main__":
    sys.exit(main())
