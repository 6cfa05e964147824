"""`frugaltrain data`: bad input is one line on stderr, exit code 2 and nothing written; a good
run says what it wrote; nothing lands in the user's Hugging Face cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from frugaltrain.data.cli import main as data_main  # noqa: E402


def _fails(capsys, argv: list[str], *needles: str) -> str:
    assert data_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("frugaltrain data: error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, bpe_dir, shard_dir, text_dir):
    out = str(tmp_path / "out")
    missing = str(tmp_path / "missing")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"body": "hi", "id": 1}) + "\n")
    before = sorted(tmp_path.iterdir())
    _fails(
        capsys,
        ["tokenizer", "--input", missing, "--vocab-size", "300", "--out", out],
        missing,
        "no such file",
    )
    _fails(capsys, ["tokenizer", "--vocab-size", "100", "--out", out], "--vocab-size 100", "257")
    _fails(capsys, ["tokenizer", "--vocab-size", "300"], "--out")
    _fails(
        capsys,
        ["tokenizer", "--input", str(tmp_path / "blob.bin"), "--vocab-size", "300", "--out", out],
        "blob.bin",
        "binary",
    )
    _fails(
        capsys,
        ["tokenizer", "--vocab-size", "300", "--out", str(bpe_dir)],
        "already holds tokenizer.json",
        "--force",
    )
    prep = ["prepare", "--tokenizer", str(bpe_dir), "--out", out]
    _fails(
        capsys,
        [*prep, "--input", str(tmp_path / "rows.jsonl")],
        "rows.jsonl",
        "no 'text' field",
        "body",
        "--text-field",
    )
    _fails(capsys, [*prep, "--input", missing], missing)
    _fails(capsys, [*prep, "--val-fraction", "1.5"], "--val-fraction 1.5")
    _fails(
        capsys,
        ["prepare", "--tokenizer", missing, "--out", out],
        missing,
        "frugaltrain data tokenizer",
    )
    _fails(
        capsys,
        ["prepare", "--tokenizer", str(bpe_dir), "--out", str(shard_dir), "--input", str(text_dir)],
        "already holds manifest.json",
        "--force",
    )
    _fails(capsys, ["frobnicate"], "invalid choice")
    assert sorted(tmp_path.iterdir()) == before


def test_prepare_prints_what_it_wrote(tmp_path, capsys, bpe_dir, text_dir):
    from frugaltrain.cli import main  # the top-level command routes `data` here

    out = tmp_path / "shards"
    argv = [
        "data",
        "prepare",
        "--input",
        str(text_dir),
        "--tokenizer",
        str(bpe_dir),
        "--out",
        str(out),
        "--shard-tokens",
        "20000",
        "--val-fraction",
        "0.2",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert f"{m['splits']['train']['tokens']} tokens" in printed and " s\n" in printed
    assert f"{m['splits']['val']['documents']} documents" in printed and "shards" in printed


def test_no_hugging_face_cache_is_touched(tmp_path, text_dir):
    """A fresh process whose HF_HOME and XDG cache are empty directories leaves them empty."""
    home = {k: str(tmp_path / k.lower()) for k in ("HF_HOME", "XDG_CACHE_HOME", "HOME")}
    code = (
        "import sys; from frugaltrain.data.cli import main\n"
        f"a = ['tokenizer', '--input', {str(text_dir)!r}, '--vocab-size', '300',"
        f" '--out', {str(tmp_path / 'tok')!r}, '--max-bytes', '50000']\n"
        f"b = ['prepare', '--input', {str(text_dir)!r}, '--tokenizer',"
        f" {str(tmp_path / 'tok')!r}, '--out', {str(tmp_path / 'out')!r}]\n"
        "sys.exit(main(a) or main(b))\n"
    )
    env = {**os.environ, **home}
    env.pop("HF_DATASETS_CACHE", None)
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert [p for p in map(Path, home.values()) if p.exists()] == []
