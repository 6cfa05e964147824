"""Real rate-limited links on one machine: network namespaces, veth pairs, a bridge, tc tbf.

    hub namespace:     br0 <- v0, v1, ... (the hub ends of the veth pairs), no address
    worker namespace:  eth0 (10.77.0.{i+2}/24), the other end of v{i}

Each worker's link is shaped in both directions with a token bucket (tbf on eth0 for what the
worker sends, on v{i} for what it receives); netem is not available on these kernels, so there
is no added delay or loss beyond what the rate implies. `rates` gives workers links of their own
(a slower machine), and `cpu_shares` holds each worker to a fixed CPU quota (netlab/cpu.py).
Everything lives inside namespaces this module creates (named `ftl-<tag>-...`); interface names
and addresses are private to them, the host's own network is never touched. `NetLab` is a
context manager: leaving it, normally, on an exception or on Ctrl-C / SIGTERM, deletes every
namespace it made (and with them the links).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

from frugaltrain.netlab import cpu
from frugaltrain.netlab.cpu import PERIOD_US, CpuQuota

PREFIX = "ftl-"
SUBNET = "10.77.0"


def why_not_available() -> str | None:
    """None if netlab can run here, else the reason (for a clear skip message)."""
    if os.geteuid() != 0:
        return "netlab needs root (network namespaces and tc); run it as root or skip it"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"netlab needs the `{tool}` command (iproute2), which is not installed"
    return None


def _sh(*args: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {r.stderr.strip()}")


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup(tag: str = "") -> list[str]:
    """Delete namespaces this module made (all of them, or those of one tag)."""
    gone = []
    for ns in list_namespaces():
        if ns.startswith(PREFIX + tag):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            gone.append(ns)
    return gone + cpu.cleanup(tag)


def tbf_args(rate_mbit: float) -> list[str]:
    """tc tbf parameters for `rate_mbit`: a bucket of at least 64 KiB (a GSO super-packet from
    a veth must fit in it, or tbf drops it) or 4 ms at the rate, whichever is larger."""
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))
    return ["rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms"]


@dataclass
class NetLab:
    """`workers` namespaces joined through a bridge, each link limited to `rate_mbit` Mbit/s
    in each direction (0: unshaped), or worker i's to `rates[i]`; with `cpu_shares`, worker i's
    processes get `cpu_shares[i]` cores at most, per `cpu_period_us`."""

    workers: int
    rate_mbit: float
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    namespaces: list[str] = field(default_factory=list)
    rates: list[float] | None = None
    cpu_shares: list[float] | None = None
    cpu_period_us: int = PERIOD_US
    quota: CpuQuota | None = None

    def rate_of(self, i: int) -> float:
        return self.rates[i] if self.rates else self.rate_mbit

    @property
    def hub(self) -> str:
        return f"{PREFIX}{self.tag}-hub"

    def ns(self, i: int) -> str:
        return f"{PREFIX}{self.tag}-w{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 2}"

    def up(self) -> NetLab:
        if not 1 <= self.workers <= 200:
            raise ValueError(f"netlab workers = {self.workers}: use 1 to 200")
        for name, per_worker in (("rates", self.rates), ("cpu_shares", self.cpu_shares)):
            if per_worker is not None and len(per_worker) != self.workers:
                raise ValueError(
                    f"netlab {name}: {len(per_worker)} values for {self.workers} workers"
                )
        if self.cpu_shares is not None:
            self.quota = CpuQuota(self.tag, list(self.cpu_shares), self.cpu_period_us).up()
        _sh("ip", "netns", "add", self.hub)
        self.namespaces.append(self.hub)
        _sh("ip", "-n", self.hub, "link", "set", "lo", "up")
        _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i in range(self.workers):
            ns = self.ns(i)
            _sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            # Create the pair straight inside the namespaces: no name ever exists on the host.
            _sh("ip", "link", "add", f"v{i}", "netns", self.hub, "type", "veth", "peer", "name",
                "eth0", "netns", ns)  # fmt: skip
            _sh("ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            if self.rate_of(i) > 0:
                _sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf",
                    *tbf_args(self.rate_of(i)))  # fmt: skip
                _sh("tc", "-n", self.hub, "qdisc", "add", "dev", f"v{i}", "root", "tbf",
                    *tbf_args(self.rate_of(i)))  # fmt: skip
        return self

    def down(self) -> None:
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
        if self.quota is not None:
            self.quota.down()

    def kill(self, i: int) -> None:
        """Every process of namespace i at once, with SIGKILL: a machine lost whole."""
        pids = subprocess.run(["ip", "netns", "pids", self.ns(i)], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def set_link(self, i: int, up: bool) -> None:
        """Namespace i's link down (a partition: its processes live on, cut off) or up."""
        _sh("ip", "-n", self.ns(i), "link", "set", "eth0", "up" if up else "down")

    def exec_args(self, i: int) -> list[str]:
        """Prefix that runs a command inside worker i's namespace (and CPU share)."""
        prefix = ["ip", "netns", "exec", self.ns(i)]
        return self.quota.wrap(i, prefix) if self.quota is not None else prefix

    def __enter__(self) -> NetLab:
        # SIGTERM tears down like Ctrl-C does (the default action would skip `finally`).
        self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()
        signal.signal(signal.SIGTERM, self._old_term)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
