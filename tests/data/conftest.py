"""Fixtures of the data tests: a small BPE tokenizer and a shard directory, made once."""

from __future__ import annotations

from pathlib import Path

import pytest


def _need_hf() -> None:
    for module in ("tokenizers", "datasets", "transformers"):
        pytest.importorskip(module)


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory) -> Path:
    """A 384-token BPE trained on 200 KB of the standard library's sources (about a second)."""
    _need_hf()
    from frugaltrain.data.tokenizer import train_tokenizer

    return train_tokenizer("", 384, tmp_path_factory.mktemp("tok") / "bpe", max_bytes=200_000)


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory, text_dir: Path, bpe_dir: Path) -> Path:
    """The 40-file test corpus as token shards of 4000 tokens, a fifth of the files held out."""
    _need_hf()
    from frugaltrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("shards") / "shards"
    prepare(str(text_dir), str(bpe_dir), str(out), val_fraction=0.2, shard_tokens=4000)
    return out
