"""data/tokenizer.py: the byte-level BPE round trips, byte_tokenizer is corpus.py's byte tokens,
the hash pins a tokenizer, a missing tokenizer is a ConfigError that says how to make one."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from frugaltrain.config import ConfigError  # noqa: E402
from frugaltrain.data.corpus import load_corpus, stdlib_root  # noqa: E402
from frugaltrain.data.tokenizer import (  # noqa: E402
    EOS,
    byte_tokenizer,
    load_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)

NON_ASCII = "naïve café — 你好, мир! 🚀 emoji\tand tabs\r\n\x00 and a NUL, ÿ\u0100"


def test_bpe_round_trips(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    assert len(tok) == 384 and tok.eos_token == EOS and tok.eos_token_id == 0
    source = (stdlib_root() / "argparse.py").read_text()[:50_000]
    for text in (source, NON_ASCII, "", " leading space", "trailing  \n\n"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # 127 merges learned on Python already save a third of the tokens on Python code.
    assert len(tok.encode(source)) < 0.67 * len(source.encode())


def test_byte_tokenizer_is_corpus_bytes(text_dir):
    tok = byte_tokenizer()
    assert len(tok) == 256
    for text in ("hello, world\n", NON_ASCII, "".join(map(chr, range(1, 256)))):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == list(text.encode())
        assert tok.decode(ids) == text
    c = load_corpus(str(text_dir), max_bytes=20_000)
    train = bytes(c.train.tolist())
    assert tok.encode(train.decode(), add_special_tokens=False) == c.train.tolist()


def test_hash_is_stable_and_pins_the_content(bpe_dir, tmp_path):
    tok = load_tokenizer(bpe_dir)
    tok.save_pretrained(tmp_path / "copy")
    assert tokenizer_hash(load_tokenizer(tmp_path / "copy")) == tokenizer_hash(tok)
    assert len(tokenizer_hash(tok)) == 64
    assert tokenizer_hash(byte_tokenizer()) not in (tokenizer_hash(tok), "")
    tok.add_tokens(["frugaltrain"])
    assert tokenizer_hash(tok) != tokenizer_hash(load_tokenizer(bpe_dir))


def test_missing_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such directory.*frugaltrain data tokenizer"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty.*no tokenizer.json.*frugaltrain data tokenizer"):
        load_tokenizer(tmp_path / "empty")


def test_train_refuses_bad_arguments_and_writes_nothing(bpe_dir, tmp_path):
    with pytest.raises(ConfigError, match="vocab_size = 256: must be at least 257"):
        train_tokenizer("", 256, tmp_path / "tok")
    with pytest.raises(ConfigError, match="already holds tokenizer.json.*--force"):
        train_tokenizer("", 300, bpe_dir)
    with pytest.raises(ConfigError, match="no such file"):
        train_tokenizer(str(tmp_path / "missing.txt"), 300, tmp_path / "tok")
    assert list(tmp_path.iterdir()) == []


def test_train_on_jsonl_with_a_limit(tmp_path):
    rows = [{"body": f"row {i} " + "abcdefgh " * 40, "id": i} for i in range(200)]
    (tmp_path / "rows.jsonl").write_text("\n".join(map(__import__("json").dumps, rows)))
    out = train_tokenizer(
        str(tmp_path / "rows.jsonl"), 300, tmp_path / "tok", max_bytes=5000, text_field="body"
    )
    tok = load_tokenizer(out)
    assert 257 <= len(tok) <= 300 and tok.decode(tok.encode("row 7 abcdefgh")) == "row 7 abcdefgh"
