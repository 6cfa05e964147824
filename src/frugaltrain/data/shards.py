"""Token shards: a tokenized corpus on disk as raw token files plus a manifest, read by np.memmap.

    shards = open_shards("runs/shards")              # checks sizes and sha256 against the manifest
    shards.train[1000:1129]                          # np.ndarray of token ids, read from disk

A shard directory holds `train_00000.bin, ...`, `val_00000.bin, ...` (little-endian uint16 when
the vocabulary fits in 65536 ids, else uint32: nanoGPT's format), `manifest.json` and a copy of
the tokenizer in `tokenizer/`, so it is self-contained. Each document's tokens are followed by
EOS; a split's shards concatenated are its token stream. `frugaltrain data prepare` writes one
(data/prepare.py, which says how documents go to train or validation).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from frugaltrain.config import ConfigError

MANIFEST = "manifest.json"
FORMAT = "frugaltrain-token-shards"  # dashes: test_architecture reads "frugaltrain.x" as imports
VERSION = 1
_FIX = "re-run `frugaltrain data prepare ... --force` to rebuild the shards"


class TokenArray:
    """A read-only 1-D token sequence over memory-mapped shard files, never loaded whole.

    `len(a)`, `a[i:j]` (an np.ndarray copy of just those tokens) and `a.view(spans)` (the
    concatenation of [start, stop) ranges of `a`, also lazy: how per-worker shards are cut).
    """

    def __init__(self, parts: list[np.ndarray], spans: np.ndarray | None = None) -> None:
        self._parts = parts
        self._part_starts = np.cumsum([0] + [len(p) for p in parts]).tolist()
        if spans is None:
            spans = np.array([[0, self._part_starts[-1]]], dtype=np.int64)
        spans = spans[spans[:, 1] > spans[:, 0]]
        self._spans = spans  # (K, 2) [start, stop) in the concatenation of parts
        self._starts = np.concatenate([[0], np.cumsum(spans[:, 1] - spans[:, 0])])
        self.dtype = parts[0].dtype if parts else np.dtype("<u2")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, key: slice | int) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("TokenArray slices take no step")
            pieces = [self._read(a, b) for a, b in self._base_ranges(start, stop)]
            return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)
        i = key + len(self) if key < 0 else key
        if not 0 <= i < len(self):
            raise IndexError(f"index {key} out of range for {len(self)} tokens")
        return self[i : i + 1][0]

    def view(self, spans: np.ndarray) -> TokenArray:
        """The tokens of `spans` ((K, 2) [start, stop) of this array), in that order."""
        spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        if len(self._spans) == 1:  # the common case, a whole split: shift, no loop
            base = spans + self._spans[0, 0]
        else:
            ranges = [r for a, b in spans.tolist() for r in self._base_ranges(a, b)]
            base = np.array(ranges, dtype=np.int64).reshape(-1, 2)
        return TokenArray(self._parts, base)

    def _base_ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """[start, stop) of this array as ranges of the concatenated parts."""
        out = []
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            lo, hi = self._spans[k]
            offset = start - int(self._starts[k])
            n = min(stop - start, int(hi - lo) - offset)
            out.append((int(lo) + offset, int(lo) + offset + n))
            start += n
            k += 1
        return out

    def _read(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        p = bisect.bisect_right(self._part_starts, start) - 1
        while start < stop:
            p0 = self._part_starts[p]
            n = min(stop, self._part_starts[p + 1]) - start
            pieces.append(np.array(self._parts[p][start - p0 : start - p0 + n]))
            start += n
            p += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


@dataclass(frozen=True, kw_only=True)
class TokenShards:
    train: TokenArray
    """Training tokens: the train shards, concatenated."""
    val: TokenArray
    """Validation tokens: the val shards, concatenated."""
    vocab_size: int
    """Every id is below this (the tokenizer's size)."""
    tokenizer_hash: str
    """data.tokenizer.tokenizer_hash of the tokenizer the shards were made with."""
    tokenizer_dir: Path
    """The copy of that tokenizer inside the shard directory."""
    dtype: np.dtype
    """Token dtype on disk: uint16 or uint32, little-endian."""
    eos_id: int | None
    """The id that ends every document (None: the tokenizer has no EOS)."""
    manifest: dict
    """manifest.json as read."""


def is_shard_dir(path: str | Path) -> bool:
    """Whether path is a directory holding a shard manifest."""
    return bool(path) and (Path(path).expanduser() / MANIFEST).is_file()


def open_shards(path: str | Path, *, verify: bool = True) -> TokenShards:
    """Open a shard directory: every shard must exist with the size its manifest implies and,
    with verify, the sha256 it records (reads every byte once; off for a quick reopen)."""
    root = Path(path).expanduser()
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{str(root)!r}: no readable {MANIFEST} ({e}); make a shard directory with "
            "`frugaltrain data prepare`"
        ) from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ConfigError(
            f"{str(root / MANIFEST)!r}: not a version-{VERSION} {FORMAT} manifest; {_FIX}"
        )
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    splits: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for shard in manifest["shards"]:
        file = root / shard["file"]
        _check_shard(file, shard, dtype.itemsize, verify)
        splits[shard["split"]].append(np.memmap(file, dtype=dtype, mode="r"))
    return TokenShards(
        train=TokenArray(splits["train"]),
        val=TokenArray(splits["val"]),
        vocab_size=manifest["vocab_size"],
        tokenizer_hash=manifest["tokenizer_hash"],
        tokenizer_dir=root / manifest["tokenizer"],
        dtype=dtype,
        eos_id=manifest["eos_id"],
        manifest=manifest,
    )


def _check_shard(file: Path, shard: dict, itemsize: int, verify: bool) -> None:
    if not file.is_file():
        raise ConfigError(f"shard {str(file)!r}: missing (listed in its {MANIFEST}); {_FIX}")
    size, expected = file.stat().st_size, shard["tokens"] * itemsize
    if size != expected:
        raise ConfigError(
            f"shard {str(file)!r}: is {size} bytes, its {MANIFEST} says {expected} "
            f"({shard['tokens']} tokens); the file was cut short or replaced; {_FIX}"
        )
    if verify and _sha256(file) != shard["sha256"]:
        raise ConfigError(
            f"shard {str(file)!r}: sha256 differs from its {MANIFEST}: the file changed "
            f"after it was written (disk or copy error); {_FIX}"
        )


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as fh:
        while block := fh.read(1 << 23):
            h.update(block)
    return h.hexdigest()
