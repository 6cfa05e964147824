"""Token shards written from text: `frugaltrain data prepare`, the format of data/shards.py.

    prepare("corpus/", "runs/tok", "runs/shards")   # or: frugaltrain data prepare ...
    open_shards("runs/shards")                       # data/shards.py reads it back

Every document's tokens are followed by EOS. Documents go to train or validation by a hash (text
files: of their relative path, with data/corpus.py's rule, so both paths hold out the same files;
JSONL and Parquet rows: of their text, so duplicates land on one side). When that leaves a side
empty (a single file), the stream's last val_fraction of tokens is held out instead, as corpus.py
does.

The directory appears whole or not at all: everything is written to a staging directory beside
it and renamed into place; the datasets cache lives inside the staging directory and is deleted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np

from frugaltrain.config import ConfigError
from frugaltrain.data.shards import FORMAT, MANIFEST, VERSION
from frugaltrain.data.sources import (
    check_out_dir,
    doc_keys,
    load_documents,
    offline_datasets,
    require_hf,
    resolve_input,
    staged_dir,
    truncate_utf8,
)
from frugaltrain.data.textfiles import held_out
from frugaltrain.data.tokenizer import load_tokenizer, tokenizer_hash

# Long documents are encoded in pieces of about this many characters, cut where the ByteLevel
# regex starts a new pre-token anyway (so the ids are the same): one Encoding per token costs
# ~100 bytes, and a 1 GB file in one piece would need tens of GB.
PIECE_CHARS = 1 << 20


def prepare(
    input: str,
    tokenizer_dir: str,
    out_dir: str,
    *,
    val_fraction: float = 0.05,
    text_field: str = "text",
    shard_tokens: int = 50_000_000,
    num_proc: int = 1,
    max_bytes: int = 0,
    force: bool = False,
) -> dict:
    """Tokenize `input` with the tokenizer in tokenizer_dir into a shard directory out_dir.

    Returns the manifest it wrote. Nothing is written until every check passed, and out_dir
    appears whole or not at all (see the module docstring).

    Args:
        input: text file or directory, JSONL (.jsonl/.json) or Parquet file or directory, or ""
            for the standard library sources (data/sources.py).
        tokenizer_dir: a tokenizer in the transformers format (data/tokenizer.py).
        out_dir: a new or empty directory (or a shard directory, with force).
        val_fraction: fraction of documents held out, chosen by hash.
        text_field: the text column of JSONL and Parquet rows.
        shard_tokens: tokens per shard file (the last of a split is shorter).
        num_proc: processes that tokenize (datasets' map); 1 tokenizes in this process, whose
            tokenizer already uses every core.
        max_bytes: read at most this many bytes of text (0: all).
        force: replace an existing shard directory.
    """
    _check_args(val_fraction, shard_tokens, num_proc, max_bytes)
    out = Path(out_dir).expanduser().resolve()
    check_out_dir(out, marker=MANIFEST, force=force, flag="--out")
    tok = load_tokenizer(tokenizer_dir)
    source = resolve_input(input, text_field=text_field, max_bytes=max_bytes)
    settings = {"val_fraction": val_fraction, "text_field": text_field, "max_bytes": max_bytes}
    settings |= {"shard_tokens": shard_tokens, "tokenizer_hash": tokenizer_hash(tok)}
    with offline_datasets(), staged_dir(out) as staging:
        with tempfile.TemporaryDirectory(prefix=".datasets-cache-", dir=staging) as cache:
            docs = _tokenized(source, tok, settings, Path(cache), num_proc)
            shards, rule = _write_splits(docs, staging, settings, shard_dtype(len(tok)))
            del docs  # its arrow files live in the cache, deleted now
        tok.save_pretrained(staging / "tokenizer")
        assert tokenizer_hash(load_tokenizer(staging / "tokenizer")) == settings["tokenizer_hash"]
        manifest = _manifest(source, tok, Path(tokenizer_dir), settings, shards, rule)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _check_args(val_fraction: float, shard_tokens: int, num_proc: int, max_bytes: int) -> None:
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction = {val_fraction}: must be strictly between 0 and 1")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens = {shard_tokens}: must be positive (50000000 is usual)")
    if num_proc < 1:
        raise ConfigError(f"num_proc = {num_proc}: must be at least 1")
    if max_bytes < 0:
        raise ConfigError(f"max_bytes = {max_bytes}: must be >= 0 (0: no limit)")


def shard_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536), else uint32; little-endian."""
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def _tokenized(source, tok, settings: dict, cache: Path, num_proc: int):
    """The documents as a Dataset of `ids` (EOS appended), `val` and `tokens`, in input order."""
    datasets = require_hf("datasets")
    docs = load_documents(
        source, text_field=settings["text_field"], max_bytes=settings["max_bytes"], cache_dir=cache
    )
    dtype = shard_dtype(len(tok))
    features = datasets.Features(
        {
            "ids": datasets.List(datasets.Value(dtype.name)),
            "val": datasets.Value("bool"),
            "tokens": datasets.Value("int64"),
        }
    )
    fingerprint = hashlib.sha256(json.dumps([source.label, settings]).encode()).hexdigest()
    return docs.map(
        _tokenize_batch,
        batched=True,
        batch_size=64,
        with_indices=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=docs.column_names,
        features=features,
        new_fingerprint=fingerprint[:16],
        fn_kwargs={
            "tokenizer_json": tok.backend_tokenizer.to_str(),
            "eos_id": tok.eos_token_id,
            "dtype": dtype.str,
            "val_fraction": settings["val_fraction"],
            "keys": doc_keys(source),
        },
    )


@functools.lru_cache(maxsize=2)
def _backend(tokenizer_json: str):
    """The tokenizers.Tokenizer of a serialization, once per process, reading "<|endoftext|>"
    in a document as text: only prepare's own EOS ends a document."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer_json)
    backend.encode_special_tokens = True
    return backend


def _tokenize_batch(
    batch: dict,
    indices: list[int],
    *,
    tokenizer_json: str,
    eos_id: int | None,
    dtype: str,
    val_fraction: float,
    keys: list[str] | None,
) -> dict:
    cut = zip(batch["text"], batch["limit"], strict=True)
    texts = [truncate_utf8(t or "", n) if n else t or "" for t, n in cut]
    pieces = [_pieces(t) for t in texts]
    flat = [p for ps in pieces for p in ps]
    encoded = iter(_backend(tokenizer_json).encode_batch_fast(flat, add_special_tokens=False))
    eos = [] if eos_id is None else [eos_id]
    ids, val = [], []
    for text, ps, i in zip(texts, pieces, indices, strict=True):
        doc = np.concatenate([np.asarray(next(encoded).ids, dtype) for _ in ps])
        ids.append(np.concatenate([doc, np.asarray(eos, dtype)]) if len(doc) else doc)
        key = keys[i] if keys is not None else text
        val.append(held_out(key, val_fraction))
    return {"ids": ids, "val": val, "tokens": [len(x) for x in ids]}


def _pieces(text: str, size: int | None = None) -> list[str]:
    """text cut after about `size` characters, only at a "\\n" between two printable ASCII
    characters: the GPT-2 regex never joins a newline with the character before it (not
    whitespace) nor after it (not whitespace), so the pieces pre-tokenize like the whole."""
    size = size or PIECE_CHARS
    pieces, start = [], 0
    while len(text) - start > size:
        cut = _safe_cut(text, start + size)
        if cut is None:  # no safe place (a huge single line): encode the rest at once
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _safe_cut(text: str, pos: int) -> int | None:
    while (nl := text.find("\n", pos)) != -1:
        i = nl + 1
        if nl >= 1 and i < len(text) and "!" <= text[nl - 1] <= "~" and "!" <= text[i] <= "~":
            return i
        pos = i
    return None


class _ShardWriter:
    """One split's shard files: shard_tokens tokens each (the last shorter), hashed as written."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._fh = None

    def write(self, tokens: np.ndarray, doc_ends: np.ndarray) -> None:
        """Append tokens; doc_ends are the (exclusive) positions in tokens where documents end."""
        pos = 0
        while pos < len(tokens):
            if self._fh is None:
                name = f"{self.split}_{len(self.shards):05d}.bin"
                self._fh, self._sha = open(self.out_dir / name, "wb"), hashlib.sha256()
                self.shards.append({"file": name, "split": self.split, "documents": 0, "tokens": 0})
            shard = self.shards[-1]
            n = min(len(tokens) - pos, self.shard_tokens - shard["tokens"])
            data = tokens[pos : pos + n].astype(self.dtype, copy=False).tobytes()
            self._fh.write(data)
            self._sha.update(data)
            shard["tokens"] += n
            ends = np.searchsorted(doc_ends, [pos, pos + n], side="right")
            shard["documents"] += int(ends[1] - ends[0])
            pos += n
            if shard["tokens"] == self.shard_tokens:
                self.close()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self.shards[-1]["sha256"] = self._sha.hexdigest()
            self._fh = None


def _write_splits(docs, out_dir: Path, settings: dict, dtype: np.dtype) -> tuple[list[dict], str]:
    """Stream the tokenized documents into train and val shards; returns the shard records and
    the split rule used (document, or tail when the hash left a side empty)."""
    import pyarrow.compute as pc

    nonempty = pc.greater(docs.data.column("tokens"), 0)
    num_val = pc.sum(pc.and_(docs.data.column("val"), nonempty)).as_py() or 0
    num_docs = pc.sum(nonempty).as_py() or 0
    if num_docs == 0:
        raise ConfigError("the input holds no text once read; point --input at text")
    rule = "document" if 0 < num_val < num_docs else "tail"
    total = pc.sum(docs.data.column("tokens")).as_py()
    cut = int(total * (1 - settings["val_fraction"]))  # tail rule: train is the stream's head
    writers = {
        s: _ShardWriter(out_dir, s, dtype, settings["shard_tokens"]) for s in ("train", "val")
    }
    offset = 0
    for table in docs.with_format("arrow").iter(batch_size=1024):
        ids = table.column("ids").combine_chunks()
        values = ids.flatten().to_numpy(zero_copy_only=False)
        lengths = ids.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
        full = lengths > 0  # an empty document has no tokens and no EOS: not counted
        if rule == "document":
            is_val = table.column("val").to_numpy(zero_copy_only=False)
            tok_val = np.repeat(is_val, lengths)
            for split, docs_in, toks_in in (("train", ~is_val, ~tok_val), ("val", is_val, tok_val)):
                writers[split].write(values[toks_in], np.cumsum(lengths[docs_in & full]))
        else:
            k = min(max(cut - offset, 0), len(values))
            ends = np.cumsum(lengths[full])
            writers["train"].write(values[:k], ends[ends <= k])
            writers["val"].write(values[k:], ends[ends > k] - k)
        offset += len(values)
    for w in writers.values():
        w.close()
    return writers["train"].shards + writers["val"].shards, rule


def _manifest(source, tok, tokenizer_dir: Path, settings: dict, shards: list, rule: str) -> dict:
    splits = {
        s: {
            "documents": sum(x["documents"] for x in shards if x["split"] == s),
            "tokens": sum(x["tokens"] for x in shards if x["split"] == s),
        }
        for s in ("train", "val")
    }
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": shard_dtype(len(tok)).name,
        "byteorder": "little",
        "vocab_size": len(tok),
        "eos_id": tok.eos_token_id,
        "tokenizer_hash": settings["tokenizer_hash"],
        "tokenizer_dir": str(tokenizer_dir.expanduser().resolve()),
        "tokenizer": "tokenizer",
        "input": source.label,
        "input_kind": source.kind,
        "text_field": settings["text_field"] if source.kind != "text" else None,
        "max_bytes": settings["max_bytes"],
        "val_fraction": settings["val_fraction"],
        "split_rule": rule,
        "shard_tokens": settings["shard_tokens"],
        "splits": splits,
        "shards": shards,
    }
