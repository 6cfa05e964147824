"""data/prepare.py and data/shards.py: shards hold exactly the tokenized documents + EOS, split
by document hash; JSONL and Parquet inputs; the manifest pins sizes, hashes and the tokenizer;
writes are atomic."""

from __future__ import annotations

import json
import shutil
import socket
import zlib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from frugaltrain.config import ConfigError  # noqa: E402
from frugaltrain.data import prepare as prepare_mod  # noqa: E402
from frugaltrain.data.corpus import load_corpus  # noqa: E402
from frugaltrain.data.prepare import _pieces, prepare, shard_dtype  # noqa: E402
from frugaltrain.data.shards import is_shard_dir, open_shards  # noqa: E402
from frugaltrain.data.textfiles import stdlib_root  # noqa: E402
from frugaltrain.data.tokenizer import load_tokenizer, tokenizer_hash, train_tokenizer  # noqa: E402

WORDS = "gossip round outer inner step loss slow cheap link worker naïve 你好".split()


def _all(a) -> np.ndarray:
    return a[0 : len(a)]


def _expected(docs: list[tuple[str, str]], tok, val_fraction: float) -> dict[str, list[int]]:
    """The reference: each document tokenized alone (its text never yields EOS), + EOS, in
    order, on the side its key's hash picks."""
    threshold = int(val_fraction * 10_000)
    out: dict[str, list[int]] = {"train": [], "val": []}
    for key, text in docs:
        if not text:
            continue
        ids = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
        split = "val" if zlib.crc32(key.encode()) % 10_000 < threshold else "train"
        out[split] += ids + [tok.eos_token_id]
    return out


def _assert_stream(out: Path, expected: dict[str, list[int]]) -> None:
    s = open_shards(out)
    for split in ("train", "val"):
        assert np.array_equal(_all(getattr(s, split)), np.array(expected[split])), split


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"body": f"doc {i}: " + " ".join(rng.choice(WORDS, 30)), "n": i} for i in range(n)]


def test_text_shards_reproduce_the_token_stream(shard_dir, text_dir, bpe_dir):
    tok = load_tokenizer(bpe_dir)
    docs = [(p.name, p.read_text()) for p in sorted(text_dir.iterdir())]
    _assert_stream(shard_dir, _expected(docs, tok, 0.2))
    s = open_shards(shard_dir)
    m = s.manifest
    train = [x for x in m["shards"] if x["split"] == "train"]
    assert len(train) > 3 and all(x["tokens"] == 4000 for x in train[:-1])
    assert [x["file"] for x in train[:2]] == ["train_00000.bin", "train_00001.bin"]
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 40
    assert m["splits"]["val"]["tokens"] == len(s.val) > 0 and m["split_rule"] == "document"
    assert s.dtype == np.dtype("<u2") and s.vocab_size == 384 and s.eos_id == 0
    assert m["tokenizer_hash"] == tokenizer_hash(tok) == s.tokenizer_hash
    assert tokenizer_hash(load_tokenizer(s.tokenizer_dir)) == s.tokenizer_hash
    assert m["tokenizer_dir"] == str(bpe_dir.resolve()) and is_shard_dir(shard_dir)
    files = {p.name for p in shard_dir.iterdir()}
    assert files == {"manifest.json", "tokenizer"} | {x["file"] for x in m["shards"]}


def test_text_split_holds_out_the_files_corpus_py_holds_out(shard_dir, text_dir, bpe_dir):
    tok = load_tokenizer(bpe_dir)
    val = [t for t in _all(open_shards(shard_dir).val).tolist() if t != tok.eos_token_id]
    assert (
        tok.decode(val) == bytes(load_corpus(str(text_dir), val_fraction=0.2).val.tolist()).decode()
    )


def test_jsonl_rows_are_documents(tmp_path, bpe_dir):
    rows = _rows(60)
    rows[3]["body"] = f"a literal {'<|endoftext|>'} is text, not the end"
    rows[4]["body"] = ""
    rows[5]["body"] = None
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    m = prepare(
        str(tmp_path / "in.jsonl"), str(bpe_dir), str(out), text_field="body", val_fraction=0.25
    )
    tok = load_tokenizer(bpe_dir)
    docs = [(r["body"] or "", r["body"] or "") for r in rows]  # rows split by their text
    _assert_stream(out, _expected(docs, tok, 0.25))
    assert m["input_kind"] == "json" and m["text_field"] == "body"
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 58
    stream = np.concatenate([_all(open_shards(out).train), _all(open_shards(out).val)])
    assert np.count_nonzero(stream == tok.eos_token_id) == 58  # the literal is not an EOS


def test_jsonl_max_bytes_keeps_a_prefix(tmp_path, bpe_dir):
    rows = [{"text": f"row {i:03d} " + "x" * 90} for i in range(100)]  # 100 bytes each
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    prepare(str(tmp_path / "in.jsonl"), str(bpe_dir), str(out), max_bytes=2550)
    tok = load_tokenizer(bpe_dir)
    s = open_shards(out)
    text = tok.decode(
        np.concatenate([_all(s.train), _all(s.val)]).tolist(), skip_special_tokens=True
    )
    assert len(text) == 2550 and "row 025 xxxxx" in text and "row 026" not in text


def test_parquet_directory(tmp_path, bpe_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows(50, seed=1)
    (tmp_path / "pq").mkdir()
    for name, part in (("b.parquet", rows[25:]), ("a.parquet", rows[:25])):  # read by name
        pq.write_table(pa.Table.from_pylist(part), tmp_path / "pq" / name)
    out = tmp_path / "out"
    m = prepare(str(tmp_path / "pq"), str(bpe_dir), str(out), text_field="body")
    docs = [(r["body"], r["body"]) for r in rows]
    _assert_stream(out, _expected(docs, load_tokenizer(bpe_dir), 0.05))
    assert m["input_kind"] == "parquet"
    with pytest.raises(ConfigError, match=r"a.parquet.*no 'text' field.*--text-field"):
        prepare(str(tmp_path / "pq"), str(bpe_dir), str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists()


def test_single_file_is_split_at_its_tail(tmp_path, bpe_dir):
    text = (stdlib_root() / "textwrap.py").read_text()
    (tmp_path / "one.txt").write_text(text)
    m = prepare(str(tmp_path / "one.txt"), str(bpe_dir), str(tmp_path / "out"), val_fraction=0.1)
    s = open_shards(tmp_path / "out")
    tok = load_tokenizer(bpe_dir)
    whole = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    assert m["split_rule"] == "tail" and len(s.val) == len(whole) - int(len(whole) * 0.9)
    assert np.concatenate([_all(s.train), _all(s.val)]).tolist() == whole


def test_long_documents_are_encoded_in_pieces_with_the_same_ids(tmp_path, bpe_dir, monkeypatch):
    tok = load_tokenizer(bpe_dir)
    tricky = "x\ny  \nz\n\n\nw\n a\n\tb\n'sx\n你\n好\nend)\n(start\n" * 40
    for text in ((stdlib_root() / "argparse.py").read_text()[:40_000], tricky):
        pieces = _pieces(text, 100)
        assert len(pieces) > 5 and "".join(pieces) == text
        assert [i for p in pieces for i in tok.encode(p)] == tok.encode(text)
    monkeypatch.setattr(prepare_mod, "PIECE_CHARS", 64)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text((stdlib_root() / "argparse.py").read_text()[:30_000])
    (src / "b.txt").write_text(tricky)
    prepare(str(src), str(bpe_dir), str(tmp_path / "out"), val_fraction=0.5)
    docs = [(p.name, p.read_text()) for p in sorted(src.iterdir())]
    _assert_stream(tmp_path / "out", _expected(docs, tok, 0.5))


def test_parallel_prepare_is_identical(tmp_path, shard_dir, text_dir, bpe_dir):
    out = tmp_path / "par"
    m = prepare(
        str(text_dir), str(bpe_dir), str(out), val_fraction=0.2, shard_tokens=4000, num_proc=2
    )
    assert m == json.loads((shard_dir / "manifest.json").read_text())
    for shard in m["shards"]:
        assert (out / shard["file"]).read_bytes() == (shard_dir / shard["file"]).read_bytes()


def test_a_changed_shard_is_refused(tmp_path, shard_dir):
    copy = tmp_path / "shards"
    shutil.copytree(shard_dir, copy)
    f = copy / "train_00001.bin"
    data = bytearray(f.read_bytes())
    data[10] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"train_00001.bin.*sha256.*frugaltrain data prepare"):
        open_shards(copy)
    assert len(open_shards(copy, verify=False).train) > 0  # sizes still match
    f.write_bytes(bytes(data[:-2]))
    with pytest.raises(ConfigError, match=r"train_00001.bin.*cut short.*frugaltrain data prepare"):
        open_shards(copy, verify=False)
    f.unlink()
    with pytest.raises(ConfigError, match=r"train_00001.bin.*missing"):
        open_shards(copy, verify=False)
    with pytest.raises(ConfigError, match=r"no readable manifest.json.*frugaltrain data prepare"):
        open_shards(tmp_path)


def test_a_failed_prepare_leaves_nothing(tmp_path, shard_dir, text_dir, bpe_dir, monkeypatch):
    old = tmp_path / "old"
    shutil.copytree(shard_dir, old)
    before = (old / "manifest.json").read_text()
    calls = []

    def fail_on_second(self, tokens, doc_ends):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(self, tokens, doc_ends)

    real = prepare_mod._ShardWriter.write
    monkeypatch.setattr(prepare_mod._ShardWriter, "write", fail_on_second)
    for out, force in ((tmp_path / "new", False), (old, True)):
        calls.clear()
        with pytest.raises(OSError, match="disk full"):
            prepare(str(text_dir), str(bpe_dir), str(out), force=force, shard_tokens=4000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no new dir, no staging
    assert (old / "manifest.json").read_text() == before
    open_shards(old)


def test_an_existing_shard_directory_needs_force(tmp_path, shard_dir, text_dir, bpe_dir):
    out = tmp_path / "shards"
    shutil.copytree(shard_dir, out)
    with pytest.raises(ConfigError, match="already holds manifest.json.*--force"):
        prepare(str(text_dir), str(bpe_dir), str(out))
    m = prepare(str(text_dir), str(bpe_dir), str(out), force=True, shard_tokens=10**9)
    files = {p.name for p in out.iterdir()}
    assert files == {"manifest.json", "tokenizer"} | {x["file"] for x in m["shards"]}
    assert "train_00003.bin" not in files  # the old run's shards are gone
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(
        ConfigError, match="not an empty directory.*choose a new or empty directory"
    ):
        prepare(str(text_dir), str(bpe_dir), str(tmp_path / "other"), force=True)


def test_nothing_is_downloaded(tmp_path, text_dir, monkeypatch):
    """Every connection attempt is recorded (libraries swallow a refused one) and refused."""
    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    tok = train_tokenizer(str(text_dir), 300, tmp_path / "tok", max_bytes=50_000)
    prepare(str(text_dir), str(tok), str(tmp_path / "out"), max_bytes=50_000)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(50)))
    prepare(str(rows), str(tok), str(tmp_path / "out2"), max_bytes=100)
    assert attempts == [] and len(open_shards(tmp_path / "out").train) > 0


def test_dtype_follows_the_vocabulary():
    assert shard_dtype(384) == shard_dtype(65_536) == np.dtype("<u2")
    assert shard_dtype(65_537) == np.dtype("<u4")
