"""Byte-level BPE tokenizers trained on local text, saved in the transformers format.

    tok_dir = train_tokenizer("", 4096, "runs/tok", max_bytes=2_000_000)   # stdlib sources
    tok = load_tokenizer(tok_dir)            # a PreTrainedTokenizerFast, nothing downloaded
    tok.decode(tok.encode(text)) == text     # byte-level: every string round trips

The BPE is GPT-2's recipe: the ByteLevel pre-tokenizer (its regex, no prefix space) maps bytes to
256 printable characters, so there is no unknown token; the vocabulary is those 256 bytes, one
special token `<|endoftext|>` (EOS, also BOS; id 0) and the learned merges. `byte_tokenizer()` is
the same format with no merges and no special token: id b is byte b, as in data/corpus.py.

transformers and tokenizers are the `hf` extra; they are imported inside the functions so that
`import frugaltrain.data` stays light.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from frugaltrain.config import ConfigError
from frugaltrain.data.sources import (
    check_out_dir,
    iter_texts,
    offline_datasets,
    require_hf,
    resolve_input,
    staged_dir,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
MIN_VOCAB = 257  # 256 bytes + EOS


def train_tokenizer(
    input: str,
    vocab_size: int,
    out_dir: str | Path,
    *,
    max_bytes: int = 0,
    text_field: str = "text",
    force: bool = False,
) -> Path:
    """Train a byte-level BPE of `vocab_size` tokens on `input` and save it to out_dir.

    The vocabulary can end smaller than vocab_size when the text has fewer distinct pairs. The
    directory appears whole or not at all (written beside it, then renamed).

    Args:
        input: text file, directory, JSONL or Parquet file, or "" for the stdlib sources
            (data/sources.py).
        vocab_size: tokens, EOS and the 256 bytes included (at least 257).
        out_dir: new or empty directory (or one holding a tokenizer, with force).
        max_bytes: train on at most this many bytes of text (0: all).
        text_field: the text column of JSONL and Parquet rows.
        force: replace a tokenizer already in out_dir.
    """
    tk = require_hf("tokenizers")
    if vocab_size < MIN_VOCAB:
        raise ConfigError(
            f"vocab_size = {vocab_size}: must be at least {MIN_VOCAB} (256 bytes + {EOS}); "
            "4096-50000 is usual"
        )
    out_dir = Path(out_dir).expanduser().resolve()
    check_out_dir(out_dir, marker="tokenizer.json", force=force, flag="--out")
    source = resolve_input(input, text_field=text_field, max_bytes=max_bytes)
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    with offline_datasets(), staged_dir(out_dir) as staging:
        with tempfile.TemporaryDirectory(prefix=".datasets-cache-", dir=staging) as cache:
            texts = iter_texts(
                source, text_field=text_field, max_bytes=max_bytes, cache_dir=Path(cache)
            )
            tok.train_from_iterator(texts, trainer)
        _wrap(tok, EOS).save_pretrained(staging)
    return out_dir


def _wrap(tok, eos: str | None) -> PreTrainedTokenizerFast:
    transformers = require_hf("transformers")
    special = {"eos_token": eos, "bos_token": eos} if eos else {}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, **special
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """A tokenizer saved in the transformers format, from a local directory only."""
    path = Path(path).expanduser()
    fix = "train one with `frugaltrain data tokenizer --input PATH --vocab-size N --out DIR`"
    if not path.is_dir():
        raise ConfigError(f"tokenizer {str(path)!r}: no such directory; {fix}")
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(
            f"tokenizer {str(path)!r}: holds no tokenizer.json (transformers format); {fix}"
        )
    transformers = require_hf("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def tokenizer_hash(tokenizer: PreTrainedTokenizerFast) -> str:
    """sha256 of what decides the ids: the tokenizer.json content (model, merges, pre-tokenizer,
    added tokens, post-processor; not the runtime padding and truncation settings) and the
    special tokens map. Equal before and after save_pretrained/load_tokenizer."""
    content = json.loads(tokenizer.backend_tokenizer.to_str())
    content.pop("padding", None)
    content.pop("truncation", None)
    canonical = {"tokenizer": content, "special_tokens": tokenizer.special_tokens_map}
    blob = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte tokens in the transformers format: 256 ids, id b = byte b, no merges, no special
    token; encodes and decodes exactly like data/corpus.py's byte corpora."""
    tk = require_hf("tokenizers")
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges every byte is its own token either way.
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return _wrap(tok, None)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer applies:
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
