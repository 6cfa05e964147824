"""Text corpora as byte tokens, a deterministic train/validation split and per-worker shards.

The default corpus is the source of the running interpreter's standard library: every Python
install has it, it is multi-megabyte real text, and nothing is downloaded. Users can point
`data.path` at their own text file or directory instead.

A token shard directory (made by `frugaltrain data prepare`, read by data/shards.py) is read
instead when `data.path` names one: its train and validation tokens stay on disk (np.memmap)
and the same sharding and sampling apply, lazily (`shard_tokens`, `BatchSampler`).

Which text files are read, in which order, and which are held out is data/textfiles.py's rule,
shared with the tokenizer and shard inputs.

Determinism: the files, their order, the split and every batch are pure functions of the
config and the seed. A batch is drawn from `(seed, worker, step)` alone, so the data cursor of a
checkpoint is just the step number (`BatchSampler.state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from frugaltrain.config import ConfigError
from frugaltrain.data.shards import TokenArray, is_shard_dir, open_shards
from frugaltrain.data.textfiles import (
    binary_offset,
    held_out,
    list_files,
    select_text_files,
    stdlib_root,
)

CHUNK = 4096  # i.i.d. sharding interleaves chunks of this many tokens across shards


@dataclass
class Corpus:
    train: torch.Tensor | TokenArray  # uint8 byte tokens (N_train,), or a shard directory's
    val: torch.Tensor | TokenArray  # uint8 byte tokens (N_val,), or a shard directory's
    source: str  # human-readable description
    num_files: int  # files read; documents for token shards
    vocab_size: int = 256  # every token id is below it: 256 for bytes (and markov:), else the
    # tokenizer's size; the model's vocabulary must be at least this
    tokenizer_dir: Path | None = None  # token shards: the tokenizer copy in the shard directory;
    # None for bytes, whose tokenizer is data.tokenizer.byte_tokenizer()


def load_corpus(
    path: str = "", max_bytes: int = 0, val_fraction: float = 0.05, *, verify: bool = True
) -> Corpus:
    """Read the corpus, split it by document into train and validation byte tokens.

    Args:
        path: text file or directory; empty for the standard library's `.py` sources; a token
            shard directory (holding manifest.json) for its tokens, kept on disk.
        max_bytes: stop after this many bytes (0: no limit). Files are taken in an order given by
            a hash of their relative path, so a limited corpus still mixes many packages.
            Not read for token shards (`frugaltrain data prepare --max-bytes` limits those).
        val_fraction: fraction of documents held out (by path hash); a single file is split
            at its tail instead. Not read for token shards: their split is in the manifest.
        verify: token shards only: check every shard's sha256 (reads all of them once); the
            sizes are always checked.
    """
    if is_shard_dir(path):
        return _shard_corpus(path, verify)
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
        files, source = list_files(root, None), f"text under {path}"
    else:
        root = stdlib_root()
        files, source = list_files(root, (".py",)), "Python standard library sources"
    if root.is_file():
        _refuse_binary(root, path)
    base = root if root.is_dir() else root.parent
    # The max_bytes prefix in hash order, in stream order: by path, so contiguous (non-i.i.d.)
    # shards hold different packages. Binary files in a directory are skipped.
    chosen = select_text_files(files, base, max_bytes)
    docs = [(str(p.relative_to(base)), p.read_bytes()[: cut or None]) for p, cut in chosen]
    if not docs:
        raise ConfigError(
            f"data.path = {path!r}: contains no readable text; point it at text files"
        )
    train = [d for r, d in docs if not held_out(r, val_fraction)]
    val = [d for r, d in docs if held_out(r, val_fraction)]
    if not train or not val:  # too few documents for a document split: split the stream's tail
        stream = b"".join(d for _, d in docs)
        cut = int(len(stream) * (1 - val_fraction))
        train, val = [stream[:cut]], [stream[cut:]]
    to_tokens = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)  # noqa: E731
    return Corpus(to_tokens(train), to_tokens(val), source, len(docs))


def _refuse_binary(file: Path, path: str) -> None:
    """A binary file given as data.path is refused (in a directory binary files are skipped)."""
    try:
        offset = binary_offset(file)
    except OSError:  # unreadable: refused as holding no readable text
        return
    if offset is not None:
        raise ConfigError(
            f"data.path = {path!r}: binary data (a NUL byte) at byte offset {offset}; give "
            "text files"
        )


def _shard_corpus(path: str, verify: bool) -> Corpus:
    shards = open_shards(path, verify=verify)
    splits = shards.manifest["splits"]
    documents = splits["train"]["documents"] + splits["val"]["documents"]
    source = (
        f"token shards under {path} ({len(shards.train)} train / {len(shards.val)} val tokens, "
        f"vocab {shards.vocab_size}, tokenizer {shards.tokenizer_hash[:12]})"
    )
    return Corpus(
        shards.train, shards.val, source, documents, shards.vocab_size, shards.tokenizer_dir
    )


def shard_tokens(
    tokens: torch.Tensor | TokenArray, worker: int, workers: int, num_shards: int, sharding: str
) -> torch.Tensor | TokenArray:
    """The tokens worker `worker` trains on: shards worker, worker + workers, ... of num_shards.

    iid: shard s holds chunks s, s + num_shards, ... of CHUNK tokens (every shard spans the corpus).
    noniid: shard s is the s-th contiguous slice (different packages, different statistics).
    A TokenArray (token shards on disk) gets the same tokens in the same order as a lazy view:
    ranges of the files, nothing read (noniid bounds are exact integers there, see _shard_spans).
    """
    num_shards = num_shards or workers
    mine = range(worker, num_shards, workers)
    if isinstance(tokens, TokenArray):
        return tokens.view(_shard_spans(len(tokens), mine, num_shards, sharding))
    if sharding == "iid":
        chunks = tokens.split(CHUNK)
        parts = [c for s in mine for c in chunks[s::num_shards]]
    else:
        bounds = torch.linspace(0, len(tokens), num_shards + 1).long().tolist()
        parts = [tokens[bounds[s] : bounds[s + 1]] for s in mine]
    return torch.cat(parts) if parts else tokens[:0]


def _shard_spans(n: int, mine: range, num_shards: int, sharding: str) -> np.ndarray:
    """shard_tokens's choice as [start, stop) ranges of an n-token stream, (K, 2), in order."""
    if sharding == "iid":  # the chunks torch's split(CHUNK) gives, s, s + num_shards, ...
        starts = [np.arange(s, -(-n // CHUNK), num_shards) * CHUNK for s in mine]
        starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        return np.stack([starts, np.minimum(starts + CHUNK, n)], axis=1)
    # Exact integer bounds; the tensor path's float32 linspace agrees up to an occasional token,
    # and past 2^24 tokens can round n itself (beyond the end of a large shard directory).
    bounds = [s * n // num_shards for s in range(num_shards + 1)]
    return np.array([[bounds[s], bounds[s + 1]] for s in mine], dtype=np.int64).reshape(-1, 2)


class BatchSampler:
    """Random windows of `seq_len + 1` tokens from one shard, a pure function of (seed, step).

    Takes byte tokens (a torch tensor) or token shards (a TokenArray, read window by window);
    batches are int64. `state_dict()` is the reading position for checkpoints: the step after
    the last batch drawn, with what makes a step mean the same batch (seed, shapes, shard size).
    """

    def __init__(
        self, tokens: torch.Tensor | TokenArray, seq_len: int, batch_size: int, seed: int
    ) -> None:
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
        self.step = 0  # the step after the last batch drawn: where a resumed run reads next

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(
            0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=g
        )
        if isinstance(self.tokens, TokenArray):
            rows = [self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()]
            window = torch.from_numpy(np.stack(rows).astype(np.int64))
        else:
            window = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
            window = window.long()
        self.step = step + 1
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict:
        """{"step": next step, "seed", "seq_len", "batch_size", "num_tokens"}: plain ints."""
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at state["step"]; the rest must match this sampler, or step k would draw a
        different batch than the checkpointed run did (ConfigError naming what differs)."""
        mine = self.state_dict()
        for key, cause in _RESUME_CAUSES.items():
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"data sampler: the checkpoint has {key} = {state.get(key)!r}, this run "
                    f"{mine[key]!r} ({cause} changed); resume with the checkpoint's config "
                    "(run.seed, run.workers, data.*) or start a new run"
                )
        self.step = int(state["step"])


_RESUME_CAUSES = {
    "seed": "run.seed or the worker's rank",
    "seq_len": "data.seq_len",
    "batch_size": "data.batch_size",
    "num_tokens": "the worker's shard: data.path, data.max_bytes, data.sharding, "
    "data.num_shards or run.workers",
}


def worker_seed(seed: int, worker: int) -> int:
    return seed * 7919 + worker + 1
