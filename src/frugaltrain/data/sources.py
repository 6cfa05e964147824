"""Local inputs of the tokenizer trainer and of `prepare`: text files, JSONL or Parquet, read
through Hugging Face `datasets` with the cache in a directory the caller deletes.

An input is a text file, a directory of text files, a JSONL (`.jsonl`, `.json`) or Parquet file,
a directory of JSONL or Parquet files, or "" for the Python standard library's `.py` sources (the
default corpus of data/corpus.py, listed the same way). A text file is one document; a JSONL or
Parquet row is one document, its text in the `text_field` column. Nothing is downloaded: only
the packaged `text`, `json` and `parquet` builders run, on local files.

max_bytes keeps the first documents up to that many UTF-8 bytes and cuts the last one. Text files
are taken in the same hash order as data/corpus.py (data/textfiles.py: a limited corpus mixes
many packages), rows in file order.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from frugaltrain.config import ConfigError
from frugaltrain.data.textfiles import binary_offset, list_files, select_text_files, stdlib_root

_JSON = (".jsonl", ".json")
_PARQUET = (".parquet",)


def require_hf(
    module: str, *, user: str = "frugaltrain's tokenizer and token shards", extra: str = "hf"
) -> ModuleType:
    """Import a module of an extra (the `hf` one unless told), or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{user} need {module.split('.')[0]!r}: pip install 'frugaltrain[{extra}]'"
        ) from e


@dataclass(frozen=True, kw_only=True)
class Source:
    kind: str
    """The datasets builder: text, json or parquet."""
    files: list[Path]
    """Files to read, in stream order."""
    base: Path
    """Directory the document keys (relative paths) are relative to."""
    label: str
    """What the input is, for messages and the manifest."""
    limits: dict[int, int]
    """Text files: index in `files` -> bytes to keep of it (the one max_bytes cuts)."""


def resolve_input(input: str, *, text_field: str = "text", max_bytes: int = 0) -> Source:
    """Check and list an input (see the module docstring); ConfigError names the path and fix."""
    if not input:
        root = stdlib_root()
        return _text_source(
            list_files(root, (".py",)), root, "Python standard library sources", max_bytes
        )
    root = Path(input).expanduser().resolve()
    if not root.exists():
        raise ConfigError(
            f"--input {input!r}: no such file or directory; give a text file, a directory of "
            "text files, a JSONL or Parquet file (or a directory of them), or '' for the "
            "standard library sources"
        )
    files = list_files(root, None)
    parquet = [f for f in files if f.name.endswith(_PARQUET)]
    jsonl = [f for f in files if f.name.endswith(_JSON if root.is_file() else (".jsonl",))]
    if parquet and jsonl:
        raise ConfigError(
            f"--input {input!r}: holds both Parquet and JSONL files; point it at one kind"
        )
    base = root if root.is_dir() else root.parent
    if parquet or jsonl:
        kind = "parquet" if parquet else "json"
        for f in parquet or jsonl:
            _check_field(f, kind, text_field)
        return Source(kind=kind, files=parquet or jsonl, base=base, label=str(root), limits={})
    if root.is_file() and (offset := binary_offset(root)) is not None:
        raise ConfigError(
            f"--input {input!r}: binary data (a NUL byte) at byte offset {offset}; give UTF-8 "
            "text, JSONL (.jsonl) or Parquet"
        )
    return _text_source(files, base, str(root), max_bytes)


def _text_source(files: list[Path], base: Path, label: str, max_bytes: int) -> Source:
    """Readable, non-empty text files: the max_bytes prefix in hash order, in stream order (both
    as data/corpus.py takes them, data/textfiles.py)."""
    keep = select_text_files(files, base, max_bytes)
    if not keep:
        raise ConfigError(f"--input {label!r}: contains no readable text; point it at text files")
    limits = {i: cut for i, (_, cut) in enumerate(keep) if cut}
    return Source(kind="text", files=[p for p, _ in keep], base=base, label=label, limits=limits)


def _check_field(path: Path, kind: str, text_field: str) -> None:
    """The text column must exist: checked on the Parquet schema or the first JSONL record."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as e:  # pyarrow raises its own types for a bad footer or magic bytes
            raise ConfigError(f"--input {str(path)!r}: not a readable Parquet file ({e})") from None
    else:
        with open(path, encoding="utf-8", errors="replace") as fh:
            first = next((line for line in fh if line.strip()), "")
        try:
            record = json.loads(first) if first else {}
        except json.JSONDecodeError:
            if path.suffix == ".json":  # a JSON document, not JSON Lines: checked after loading
                return
            raise ConfigError(
                f"--input {str(path)!r}: first line is not JSON; give JSON Lines"
            ) from None
        names = list(record) if isinstance(record, dict) else []
    if text_field not in names:
        raise ConfigError(
            f"--input {str(path)!r}: has no {text_field!r} field (it has {', '.join(names)}); "
            "name the text column with --text-field"
        )


def doc_keys(source: Source) -> list[str] | None:
    """Text files: their paths relative to source.base (the split hashes them, as corpus.py
    does); None for rows, which are split by a hash of their text."""
    if source.kind != "text":
        return None
    return [str(p.relative_to(source.base)) for p in source.files]


def _load(source: Source, text_field: str, cache_dir: Path, streaming: bool):
    datasets = require_hf("datasets")
    kwargs = (
        {"sample_by": "document", "encoding_errors": "replace"} if source.kind == "text" else {}
    )
    try:
        ds = datasets.load_dataset(
            source.kind,
            data_files=[str(f) for f in source.files],
            split="train",
            cache_dir=str(cache_dir),
            streaming=streaming,
            **kwargs,
        )
    except Exception as e:  # malformed JSON, a truncated Parquet file: name the input
        raise ConfigError(f"--input {source.label!r}: cannot be read: {e}") from e
    field = "text" if source.kind == "text" else text_field
    names = ds.column_names if ds.column_names is not None else [field]
    if field not in names:
        raise ConfigError(
            f"--input {source.label!r}: has no {field!r} field (it has {', '.join(names)}); "
            "name the text column with --text-field"
        )
    return ds.select_columns([field]).rename_column(field, "text") if field != "text" else ds


def iter_texts(
    source: Source, *, text_field: str, max_bytes: int, cache_dir: Path
) -> Iterator[str]:
    """The input's documents as strings (streamed: nothing is cached), cut at max_bytes."""
    rows = _load(source, text_field, cache_dir, streaming=True)  # errors here, not mid-iteration
    return _texts(rows, source, max_bytes)


def _texts(rows, source: Source, max_bytes: int) -> Iterator[str]:
    total = 0
    for i, row in enumerate(rows):
        text = row["text"] or ""
        if source.kind == "text":  # max_bytes chose the files; limits cuts the last one
            yield truncate_utf8(text, source.limits[i]) if i in source.limits else text
            continue
        n = len(text.encode())
        if max_bytes and total + n >= max_bytes:
            yield truncate_utf8(text, max_bytes - total)
            return
        total += n
        yield text


def load_documents(source: Source, *, text_field: str, max_bytes: int, cache_dir: Path):
    """The input as a `datasets.Dataset` with columns `text` and `limit` (bytes to keep of the
    text, 0 for all), cached under cache_dir."""
    ds = _load(source, text_field, cache_dir, streaming=False)
    if source.kind == "text":
        assert len(ds) == len(source.files), "one row per text file"
        limits = [source.limits.get(i, 0) for i in range(len(ds))]
        return ds.add_column("limit", limits)
    limits = [0] * len(ds)
    if max_bytes:  # keep whole rows up to max_bytes, cut the one that crosses it
        total = 0
        for i, n in enumerate(ds.map(_utf8_lengths, batched=True, remove_columns=["text"])["n"]):
            if total + n >= max_bytes:
                limits[i] = max_bytes - total
                ds, limits = ds.select(range(i + 1)), limits[: i + 1]
                break
            total += n
    return ds.add_column("limit", limits)


def _utf8_lengths(batch: dict) -> dict:
    return {"n": [len((t or "").encode()) for t in batch["text"]]}


def truncate_utf8(text: str, num_bytes: int) -> str:
    """The longest prefix of text within num_bytes UTF-8 bytes (never half a character)."""
    return text.encode()[:num_bytes].decode("utf-8", errors="ignore")


# ---------------------------------------------------------------- atomic output directories


def check_out_dir(out_dir: Path, *, marker: str, force: bool, flag: str) -> None:
    """An output directory must be new, empty, or (with force) one we wrote before (it holds
    `marker`); anything else is refused, so a wrong --out never mixes with other files."""
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return
    if (out_dir / marker).is_file():
        if not force:
            raise ConfigError(
                f"{flag} {str(out_dir)!r}: already holds {marker}; pass --force (force=True) to "
                "replace it, or choose a new directory"
            )
        return
    raise ConfigError(
        f"{flag} {str(out_dir)!r}: exists and is not an empty directory (no {marker}); choose a "
        "new or empty directory"
    )


@contextlib.contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a staging directory beside out_dir; on success it replaces out_dir in one rename,
    on failure it is deleted, so a reader never sees half an output."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()  # not mkdtemp: its 0700 mode would stay on the published directory
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if out_dir.exists():  # checked by check_out_dir: empty, or ours and --force
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.rename(out_dir, old)
    os.rename(staging, out_dir)
    if old is not None:
        shutil.rmtree(old)


@contextlib.contextmanager
def offline_datasets() -> Iterator[None]:
    """datasets offline and quiet inside; its settings are restored after.

    Offline: even with local files, load_dataset sends a download-count request to the Hub
    unless datasets is offline. Quiet: no progress bars (our callers print one summary).
    """
    datasets = require_hf("datasets")
    cfg = datasets.config
    saved = cfg.HF_HUB_OFFLINE, cfg.HF_UPDATE_DOWNLOAD_COUNTS
    bars_on = not datasets.utils.are_progress_bars_disabled()
    cfg.HF_HUB_OFFLINE, cfg.HF_UPDATE_DOWNLOAD_COUNTS = True, False
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        cfg.HF_HUB_OFFLINE, cfg.HF_UPDATE_DOWNLOAD_COUNTS = saved
        if bars_on:
            datasets.utils.enable_progress_bars()
