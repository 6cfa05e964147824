"""Text corpora as byte tokens, a deterministic train/validation split and per-worker shards.

The default corpus is the source of the running interpreter's standard library: every Python
install has it, it is multi-megabyte real text, and nothing is downloaded. Users can point
`data.path` at their own text file or directory instead.

Determinism: the files, their order, the split and every batch are pure functions of the
config and the seed. A batch is drawn from `(seed, worker, step)` alone, so the data cursor of a
checkpoint is just the step number.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from frugaltrain.config import ConfigError

CHUNK = 4096  # i.i.d. sharding interleaves chunks of this many tokens across shards
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 byte tokens, shape (N_train,)
    val: torch.Tensor  # uint8 byte tokens, shape (N_val,)
    source: str  # human-readable description
    num_files: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _list_files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    if root.is_file():
        return [root]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if suffixes is None or f.endswith(suffixes):
                files.append(Path(dirpath) / f)
    return files


def _is_text(data: bytes) -> bool:
    return b"\x00" not in data[:4096]


def _doc_hash(rel: str) -> int:
    return zlib.crc32(rel.encode())


def load_corpus(path: str = "", max_bytes: int = 0, val_fraction: float = 0.05) -> Corpus:
    """Read the corpus, split it by document into train and validation byte tokens.

    Args:
        path: text file or directory; empty for the standard library's `.py` sources.
        max_bytes: stop after this many bytes (0: no limit). Files are taken in an order given by
            a hash of their relative path, so a limited corpus still mixes many packages.
        val_fraction: fraction of documents held out (by path hash); a single file is split
            at its tail instead.
    """
    if path.startswith("markov:"):  # synthetic source with a known loss floor (data/markov.py)
        from frugaltrain.data.markov import markov_tokens

        train, val = markov_tokens(path)
        return Corpus(train, val, f"synthetic {path}", 1)
    if path:
        root = Path(path).expanduser()
        if not root.exists():
            raise ConfigError(
                f"data.path = {path!r}: no such file or directory; give a text file, a directory"
                " of text files, or leave it empty for the standard library corpus"
            )
        files, source = _list_files(root, None), f"text under {path}"
    else:
        root = stdlib_root()
        files, source = _list_files(root, (".py",)), "Python standard library sources"
    base = root if root.is_dir() else root.parent
    # Take files in hash order (a deterministic shuffle), up to max_bytes.
    ranked = sorted(files, key=lambda p: (_doc_hash(str(p.relative_to(base))), str(p)))
    docs: list[tuple[str, bytes]] = []
    total = 0
    for p in ranked:
        if max_bytes and total >= max_bytes:
            break
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if not data or not _is_text(data):
            continue
        if max_bytes:
            data = data[: max_bytes - total]
        docs.append((str(p.relative_to(base)), data))
        total += len(data)
    if total == 0:
        raise ConfigError(
            f"data.path = {path!r}: contains no readable text; point it at text files"
        )
    # Stream order is by path, so contiguous (non-i.i.d.) shards hold different packages.
    docs.sort()
    threshold = int(val_fraction * 10_000)
    train = [d for r, d in docs if _doc_hash(r) % 10_000 >= threshold]
    val = [d for r, d in docs if _doc_hash(r) % 10_000 < threshold]
    if not train or not val:  # too few documents for a document split: split the stream's tail
        stream = b"".join(d for _, d in docs)
        cut = int(len(stream) * (1 - val_fraction))
        train, val = [stream[:cut]], [stream[cut:]]
    to_tokens = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)  # noqa: E731
    return Corpus(to_tokens(train), to_tokens(val), source, len(docs))


def shard_tokens(
    tokens: torch.Tensor, worker: int, workers: int, num_shards: int, sharding: str
) -> torch.Tensor:
    """The tokens worker `worker` trains on: shards worker, worker + workers, ... of num_shards.

    iid: shard s holds chunks s, s + num_shards, ... of CHUNK tokens (every shard spans the corpus).
    noniid: shard s is the s-th contiguous slice (different packages, different statistics).
    """
    num_shards = num_shards or workers
    mine = range(worker, num_shards, workers)
    if sharding == "iid":
        chunks = tokens.split(CHUNK)
        parts = [c for s in mine for c in chunks[s::num_shards]]
    else:
        bounds = torch.linspace(0, len(tokens), num_shards + 1).long().tolist()
        parts = [tokens[bounds[s] : bounds[s + 1]] for s in mine]
    return torch.cat(parts) if parts else tokens[:0]


class BatchSampler:
    """Random windows of `seq_len + 1` tokens from one shard, a pure function of (seed, step)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        if len(tokens) < seq_len + 2:
            raise ConfigError(
                f"data.seq_len = {seq_len}: a worker's shard has only {len(tokens)} tokens; "
                "use a larger corpus (data.max_bytes, data.path), fewer workers or shards, "
                "or a shorter data.seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(
            0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=g
        )
        window = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        window = window.long()
        return window[:, :-1], window[:, 1:]


def worker_seed(seed: int, worker: int) -> int:
    return seed * 7919 + worker + 1
