"""A fixed CPU share per netlab worker: one cgroup per worker with a CPU quota (cgroup v2's
`cpu.max`, or v1's `cpu.cfs_quota_us`), so a worker's compute speed does not depend on whether
the others are blocked in communication. Without it, four workers on two cores speed each other
up whenever one waits on the link, and a blocking method looks faster per step than it is.

The groups are named `ftl-<tag>-w<i>` under the cpu controller's root and removed on `down()`
(after the workers in them have exited)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def controller_dir() -> tuple[Path, int] | None:
    """Where CPU quotas are written, and the cgroup version; None where none is writable."""
    v1 = ROOT / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1, 1
    controllers = ROOT / "cgroup.controllers"
    if (
        controllers.exists()
        and "cpu" in controllers.read_text().split()
        and os.access(ROOT, os.W_OK)
    ):
        return ROOT, 2
    return None


def why_not_available() -> str | None:
    if controller_dir() is None:
        return (
            "no writable cgroup cpu controller (/sys/fs/cgroup/cpu or cgroup v2 with cpu): "
            "run as root on a host that has one, or drop the CPU share"
        )
    return None


@dataclass
class CpuQuota:
    """`shares[i]`: worker i's CPU share in cores (0.5: half a core, however idle the rest),
    granted per `period_us` (a group that spends its share early in a period waits for the
    next one, communication threads included)."""

    tag: str
    shares: list[float]
    period_us: int = PERIOD_US
    dirs: list[Path] = field(default_factory=list)

    def up(self) -> CpuQuota:
        found = controller_dir()
        if found is None:
            raise RuntimeError(why_not_available())
        root, version = found
        if not 1_000 <= self.period_us <= 1_000_000:  # the kernel's bounds on a CFS period
            raise ValueError(f"cpu period {self.period_us} us: use 1000 to 1000000")
        if version == 2:  # children of the root may only use controllers it hands down
            (root / "cgroup.subtree_control").write_text("+cpu")
        for i, share in enumerate(self.shares):
            if not 0.01 <= share <= (os.cpu_count() or 1):
                raise ValueError(f"cpu share {share} for worker {i}: use 0.01 to the core count")
            d = root / f"ftl-{self.tag}-w{i}"
            d.mkdir(exist_ok=True)
            self.dirs.append(d)
            quota = int(share * self.period_us)
            if version == 1:
                (d / "cpu.cfs_period_us").write_text(str(self.period_us))
                (d / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (d / "cpu.max").write_text(f"{quota} {self.period_us}")
        return self

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run inside worker i's group: the shell joins it, then becomes the command, so
        every thread and child the command starts is held to the share."""
        procs = self.dirs[i] / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def down(self) -> None:
        _remove(reversed(self.dirs))
        self.dirs.clear()


def cleanup(tag: str = "") -> list[str]:
    """Remove empty groups netlab left behind (all, or those of one tag)."""
    found = controller_dir()
    return _remove(sorted(found[0].glob(f"ftl-{tag}*")) if found else [])


def _remove(dirs) -> list[str]:
    """The names of the groups removed; one still holding a process (killed, not yet reaped)
    is left."""
    gone = []
    for d in dirs:
        try:
            d.rmdir()
            gone.append(d.name)
        except OSError:
            pass
    return gone
