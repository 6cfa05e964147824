"""benchmarks/fgd_corpora.py checks every method's overrides before it starts a run: a bad one
is a one-line error naming the key, and no result file is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_bad_variant_fails_before_any_run(tmp_path: Path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/fgd_corpora.py",
            "--names=stdlib",
            "--models=base",
            "--seeds=0",
            "--methods=diloco",
            "--variant=streaming-H5=streaming,outer.H=5",  # 2 fragments cannot divide H = 5
            f"--out={out}",
        ],
        cwd=ROOT,
        env={"PYTHONPATH": "src:benchmarks", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "streaming-H5: outer.streaming.fragments = 2: must divide outer.H = 5 so fragments fire "
        "at offsets k H / P"
    )
    assert not out.exists()
