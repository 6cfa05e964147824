"""The text files of a corpus: which files a path holds, their hash order and the max_bytes cut.

The byte corpus (data/corpus.py) and the tokenizer and shard inputs (data/sources.py) list and
choose text files here, so both take the same files in the same order: files are taken in an
order given by a hash of their relative path (a deterministic shuffle, so a limited corpus still
mixes many packages) until max_bytes, then streamed in the order of their relative paths. The
same hash sends a document to validation (`held_out`).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    """root itself if it is a file, else the files under it (no hidden or package directories)
    ending with one of suffixes (None: all), in a sorted walk."""
    if root.is_file():
        return [root]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if suffixes is None or f.endswith(suffixes):
                files.append(Path(dirpath) / f)
    return files


def binary_offset(path: Path) -> int | None:
    """The byte offset of the first NUL byte of `path` (binary data), read in 1 MiB blocks;
    None for a text file."""
    offset = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            if (i := block.find(b"\x00")) >= 0:
                return offset + i
            offset += len(block)
    return None


def doc_hash(key: str) -> int:
    """The hash that orders text files and splits documents: crc32 of the key's UTF-8."""
    return zlib.crc32(key.encode())


def held_out(key: str, val_fraction: float) -> bool:
    """Whether the document of `key` (a relative path, or a row's text) is a validation one."""
    return doc_hash(key) % 10_000 < int(val_fraction * 10_000)


def select_text_files(files: list[Path], base: Path, max_bytes: int) -> list[tuple[Path, int]]:
    """The readable, non-empty, NUL-free files of `files`, taken in hash order of their paths
    relative to base until max_bytes (0: no limit), then sorted by relative path.

    Returns (file, bytes to keep): 0 keeps the whole file; the file that crosses max_bytes keeps
    only what fits. Unreadable and binary files are skipped; empty when nothing is left.
    """
    ranked = sorted(files, key=lambda p: (doc_hash(str(p.relative_to(base))), str(p)))
    keep: list[tuple[Path, int]] = []
    total = 0
    for p in ranked:
        if max_bytes and total >= max_bytes:
            break
        try:
            size = p.stat().st_size
            if size == 0 or binary_offset(p) is not None:
                continue
        except OSError:
            continue
        take = min(size, max_bytes - total) if max_bytes else size
        keep.append((p, take if take < size else 0))
        total += take
    keep.sort(key=lambda item: str(item[0].relative_to(base)))
    return keep
