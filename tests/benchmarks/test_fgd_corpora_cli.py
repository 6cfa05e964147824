"""benchmarks/fgd_corpora.py checks its corpora and every method's overrides before it starts a
run: a missing corpus or a bad override is a one-line error naming it, and no result file is
written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/fgd_corpora.py", "--names=stdlib", "--models=base"]
        + ["--seeds=0", "--methods=diloco", f"--corpora={tmp_path}", f"--out={tmp_path / 'r.json'}"]
        + list(args),
        cwd=ROOT,
        env={"PYTHONPATH": "src:benchmarks", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_missing_corpus_fails_before_any_run(tmp_path: Path):
    proc = _run(tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"--corpora: no {tmp_path / 'stdlib'}; write it with --snapshot {tmp_path}"
    )
    assert not (tmp_path / "r.json").exists()


def test_a_bad_variant_fails_before_any_run(tmp_path: Path):
    (tmp_path / "stdlib").mkdir()
    proc = _run(tmp_path, "--variant=streaming-H5=streaming,outer.H=5")  # 2 cannot divide 5
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "streaming-H5: outer.streaming.fragments = 2: must divide outer.H = 5 so fragments fire "
        "at offsets k H / P"
    )
    assert not (tmp_path / "r.json").exists()
