"""What every result file records beside its numbers: the exact command, the date, the machine it
ran on and its load before and after, and what kind of figure it holds (measured, simulated,
counted or estimated). A benchmark script calls `start(...)` before its runs and `finish(...)`
after them:

    record = provenance.start("measured", variants={"diloco": [...], "fgd": [...]})
    ... runs ...
    provenance.finish(record)          # adds the load after and the duration
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

KINDS = ("measured", "simulated", "counted", "estimated")


def machine_info(note: str = "") -> dict:
    """What the run measured on, read from the machine (and the user's note, if any)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "measured.loadavg_1min_at_start": os.getloadavg()[0],
    }
    if note:
        info["note"] = note
    return info


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def start(kind: str, variants: dict[str, list[str]] | None = None, note: str = "") -> dict:
    """The record's head: `kind` is what its figures are (one of KINDS); `variants` maps each
    variant's name to every override it ran with."""
    if kind not in KINDS:
        raise ValueError(f"kind = {kind!r}: use one of {', '.join(KINDS)}")
    return {
        "kind": kind,
        "command": "python " + shlex.join([_relative(sys.argv[0]), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(note),
        "variants": variants or {},
        "loadavg_before": list(os.getloadavg()),
        "started_unix": time.time(),
    }


def finish(record: dict) -> dict:
    record["loadavg_after"] = list(os.getloadavg())
    record["wall_s"] = round(time.time() - record["started_unix"], 1)
    return record


def save(record: dict, out: str | Path) -> None:
    """Write the record as JSON (a script that saves after every run keeps what a cut run
    finished)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=1) + "\n")


def report(record: dict, out: str | Path, table) -> None:
    """Finish the record, write it to `out` and print its table (`table(record)`)."""
    finish(record)
    save(record, out)
    print(table(record))
    print(f"wrote {out}")


def outer_table(config: str | Path, sets: list[str]) -> dict:
    """The [outer] table a run of `config` with overrides `sets` gets: what a variant's outer
    step was, even after its example changes. H only where `sets` give it (a variant at its own
    H); otherwise the file records its runs' H, not the example's."""
    from frugaltrain.config.base import read_toml, with_overrides

    table = with_overrides(read_toml(config), sets)["outer"]
    if not any(s.startswith("outer.H=") for s in sets):
        table.pop("H", None)
    return table


def _relative(path: str) -> str:
    """The script's path relative to the repository (no machine's paths in result files)."""
    p = Path(path).resolve()
    root = Path(__file__).resolve().parent.parent
    return str(p.relative_to(root)) if p.is_relative_to(root) else p.name
