"""Energy meters with provenance: measured (NVML, RAPL), estimated (a stated model) or unavailable.

Every reading says where its number came from, and a missing counter never becomes 0 J:

    measured (NVML)                      cumulative GPU energy counter (Volta and newer), deltas
    measured (NVML power integrated)     pre-Volta: power polled every 100 ms, trapezoid rule
    measured (RAPL)                      /sys/class/powercap package (and optionally DRAM) counters
    estimated (CPU time x 10 W/core)     this process's CPU seconds times a per-core figure you set
    unavailable: <reason>                joules is None; the reason says what to install or allow

Calling contract (per process): `m = open_meter(device); m.start(); ...work...; r = m.stop()`.
Each worker process opens its own meter; the CPU-time estimate counts that process's CPU time
(all its threads), and `include_children=True` adds the CPU time of waited-for child processes.
GPU meters synchronise CUDA before both reads so queued kernels land in the right window.
A meter may be started again after `stop()`; each window is independent.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

MEASURED = "measured"
ESTIMATED = "estimated"
UNAVAILABLE = "unavailable"

DEFAULT_CPU_WATTS_PER_CORE = 10.0
"""Fallback per-core power (W) when the user sets none. A round figure between CodeCarbon's
4 W/thread default and a busy server core (~10-15 W); the label always states the figure used."""

RAPL_ROOT = "/sys/class/powercap"


@dataclass
class EnergyReading:
    """Energy of one window. `joules` is None whenever nothing trustworthy could be read."""

    joules: float | None
    """Energy in the window, in J (None when unavailable)."""
    label: str
    """Provenance: 'measured (NVML)', 'estimated (CPU time x 10 W/core)', 'unavailable: ...'."""
    seconds: float
    """Wall-clock length of the window, in s."""
    domains: dict[str, float] = field(default_factory=dict)
    """Per-domain joules, e.g. {'gpu:GPU-1234': 812.0} or {'package-0': 40.1, 'dram-0': 3.2}."""
    notes: str = ""
    """Warnings about this window (short window, counter wraps, ...)."""

    @property
    def source(self) -> str:
        """One of 'measured', 'estimated', 'unavailable' (the label's first word)."""
        return self.label.split(" ", 1)[0].rstrip(":")

    @property
    def watts(self) -> float | None:
        """Average power over the window in W, or None."""
        if self.joules is None or self.seconds <= 0:
            return None
        return self.joules / self.seconds


class _Window:
    """Wall-clock bookkeeping shared by all meters."""

    def __init__(self) -> None:
        self._t0: float | None = None

    def _start_clock(self) -> None:
        self._t0 = time.perf_counter()

    def _elapsed(self) -> float:
        if self._t0 is None:
            raise RuntimeError("stop() called before start()")
        return time.perf_counter() - self._t0


class UnavailableMeter(_Window):
    """A meter that always reports `unavailable: <reason>` with joules None."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def start(self) -> None:
        self._start_clock()

    def stop(self) -> EnergyReading:
        return EnergyReading(None, f"{UNAVAILABLE}: {self.reason}", self._elapsed())


class CpuTimeEstimateMeter(_Window):
    """Estimated host energy: E = (CPU seconds of this process) x watts_per_core.

    This is a model, not a measurement: it ignores idle/static power, DRAM, frequency and the
    difference between a busy core and a hyperthread. Use it only to compare runs on the same
    machine, never as a fitting target (the energy fitters drop estimated records by default).

    Args:
        watts_per_core: power of one fully busy core, in W.
        include_children: also count CPU time of child processes waited for during the window
            (used by `frugaltrain energy measure -- CMD`).
    """

    def __init__(self, watts_per_core: float, include_children: bool = False) -> None:
        super().__init__()
        if not watts_per_core > 0:
            raise ValueError(f"cpu_watts_per_core = {watts_per_core!r}: must be > 0 W")
        self.watts_per_core = float(watts_per_core)
        self.include_children = include_children
        self._cpu0 = 0.0

    def _cpu_seconds(self) -> float:
        cpu = time.process_time()
        if self.include_children:
            ru = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu += ru.ru_utime + ru.ru_stime
        return cpu

    def start(self) -> None:
        self._cpu0 = self._cpu_seconds()
        self._start_clock()

    def stop(self) -> EnergyReading:
        seconds = self._elapsed()
        cpu_s = self._cpu_seconds() - self._cpu0
        label = f"{ESTIMATED} (CPU time x {self.watts_per_core:g} W/core)"
        return EnergyReading(
            cpu_s * self.watts_per_core,
            label,
            seconds,
            domains={"host-estimate": cpu_s * self.watts_per_core},
            notes=f"cpu_seconds={cpu_s:.6f}",
        )


# ----------------------------------------------------------------------------------------------
# RAPL through powercap sysfs


@dataclass
class _RaplZone:
    name: str  # package-0, dram-0, ...
    energy_path: Path
    max_range_uj: int
    last_uj: int = 0
    total_uj: int = 0
    wraps: int = 0


def _rapl_zones(root: Path, include_dram: bool) -> list[_RaplZone]:
    """Top-level package zones (intel-rapl:N) and, optionally, their dram sub-zones.

    Core/uncore sub-zones are skipped: they are contained in the package figure.
    """
    zones = []
    for zone_dir in sorted(root.glob("intel-rapl:*")):
        parts = zone_dir.name.split(":")
        name = (zone_dir / "name").read_text().strip()
        top = len(parts) == 2
        if (top and name.startswith("package")) or (not top and include_dram and name == "dram"):
            if not top:
                name = f"dram-{parts[1]}"
            max_uj = int((zone_dir / "max_energy_range_uj").read_text())
            zones.append(_RaplZone(name, zone_dir / "energy_uj", max_uj))
    return zones


class RaplMeter(_Window):
    """CPU package (and optionally DRAM) energy from RAPL counters under powercap sysfs.

    Counters are cumulative microjoules that wrap at `max_energy_range_uj` (about 262 kJ on
    many Intel parts, i.e. minutes at full load). A daemon thread samples every `poll_s`
    seconds so at most one wrap happens between samples; a smaller reading than the last one
    is counted as a wrap. Reading `energy_uj` needs root on Linux >= 5.10; without permission
    the meter reports `unavailable` with the fix in the message.

    Args:
        root: powercap directory (tests pass a fake tree).
        include_dram: add the dram sub-zones (package figures do not contain DRAM).
        poll_s: sampling period of the wraparound thread in s; None samples only at
            start/stop (tests, or windows known to be short).
    """

    def __init__(
        self, root: str | Path = RAPL_ROOT, include_dram: bool = False, poll_s: float | None = 1.0
    ) -> None:
        super().__init__()
        self.root = Path(root)
        self.include_dram = include_dram
        self.poll_s = poll_s
        self.reason = ""
        self._zones: list[_RaplZone] = []
        self._lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._zones = _rapl_zones(self.root, include_dram)
            if not self._zones:
                self.reason = f"no RAPL package zones under {self.root} (VM or non-x86 host)"
            else:
                for z in self._zones:
                    z.energy_path.read_text()
        except PermissionError as e:
            self.reason = (
                f"RAPL counters not readable ({e.filename}): energy_uj is root-only since "
                "Linux 5.10; run as root, or grant read access with a udev rule / "
                "`chmod o+r .../energy_uj`, or use a privileged relay"
            )
        except OSError as e:
            self.reason = f"RAPL read failed under {self.root}: {e}"

    @property
    def available(self) -> bool:
        return not self.reason

    def _read(self, z: _RaplZone) -> int:
        return int(z.energy_path.read_text())

    def sample(self) -> None:
        """Read every zone once and accumulate the delta, counting a wrap when it went down."""
        with self._lock:
            for z in self._zones:
                now = self._read(z)
                if now >= z.last_uj:
                    z.total_uj += now - z.last_uj
                else:  # wrapped past max_energy_range_uj back to 0
                    z.total_uj += z.max_range_uj - z.last_uj + now
                    z.wraps += 1
                z.last_uj = now

    def _poll(self) -> None:
        assert self.poll_s is not None
        while not self._stop_evt.wait(self.poll_s):
            try:
                self.sample()
            except OSError:  # reported by stop(), which reads again
                return

    def start(self) -> None:
        self._start_clock()
        if not self.available:
            return
        try:
            with self._lock:
                for z in self._zones:
                    z.last_uj, z.total_uj, z.wraps = self._read(z), 0, 0
        except PermissionError as e:
            self.reason = f"RAPL counters not readable ({e.filename}); run as root"
            return
        if self.poll_s is not None:
            self._stop_evt.clear()
            self._thread = threading.Thread(target=self._poll, daemon=True, name="rapl-poll")
            self._thread.start()

    def stop(self) -> EnergyReading:
        seconds = self._elapsed()
        if self._thread is not None:
            self._stop_evt.set()
            self._thread.join()
            self._thread = None
        if not self.available:
            return EnergyReading(None, f"{UNAVAILABLE}: {self.reason}", seconds)
        try:
            self.sample()
        except OSError as e:
            return EnergyReading(None, f"{UNAVAILABLE}: RAPL read failed at stop: {e}", seconds)
        domains = {z.name: z.total_uj * 1e-6 for z in self._zones}
        wraps = sum(z.wraps for z in self._zones)
        label = f"{MEASURED} (RAPL{' +DRAM' if self.include_dram else ''})"
        notes = f"counter wraps={wraps}" if wraps else ""
        return EnergyReading(sum(domains.values()), label, seconds, domains=domains, notes=notes)


# ----------------------------------------------------------------------------------------------
# NVML


def _import_pynvml() -> ModuleType | None:
    try:
        import pynvml  # provided by nvidia-ml-py
    except ImportError:
        return None
    return pynvml


def _visible_entries(n: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries for ordinals 0..n-1 (indices or GPU-/MIG- UUIDs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or env.strip() == "":
        return [str(i) for i in range(n)]
    return [e.strip() for e in env.split(",") if e.strip()]


class NvmlMeter(_Window):
    """GPU energy from NVML, one or more devices, summed.

    Volta and newer: deltas of `nvmlDeviceGetTotalEnergyConsumption` (mJ since driver load).
    Older boards (the call raises NotSupported): a thread polls `nvmlDeviceGetPowerUsage`
    every `poll_s` and integrates with the trapezoid rule. MIG slices are refused (NVML has no
    per-slice energy). A counter that did not move over the window is reported unavailable,
    not 0 J: the counter updates every ~10-100 ms, so very short windows read nothing.

    Args:
        ordinals: CUDA ordinals as the process sees them (cuda:0 -> 0); mapped to NVML handles
            through CUDA_VISIBLE_DEVICES (index or UUID entries), not by position.
        nvml: the pynvml module (tests inject a fake); None imports nvidia-ml-py.
        poll_s: power sampling period for pre-Volta boards, in s.
        min_window_s: shorter windows read `unavailable`: on an H100 (2026-11, see
            docs/energy.md) 20 ms windows read 3.4x the true energy and 50 ms ones 1.6-2.1x,
            because the counter advances in steps; from 0.2 s most were within 13%, at 1 s 9%.
    """

    def __init__(
        self,
        ordinals: list[int],
        nvml: ModuleType | None = None,
        poll_s: float = 0.1,
        min_window_s: float = 0.1,
    ) -> None:
        super().__init__()
        self.min_window_s = min_window_s
        self.nvml = nvml if nvml is not None else _import_pynvml()
        self.ordinals = list(ordinals)
        self.poll_s = poll_s
        self.reason = ""
        self.handles: dict[str, object] = {}  # uuid -> handle
        self.counter: dict[str, bool] = {}  # uuid -> has the energy counter
        self._e0: dict[str, float] = {}
        self._samples: dict[str, list[tuple[float, float]]] = {}
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        if self.nvml is None:
            self.reason = (
                "nvidia-ml-py is not installed; `pip install 'frugaltrain[nvml]'` "
                "(or nvidia-ml-py) to read GPU energy counters"
            )
            return
        try:
            self.nvml.nvmlInit()
            self._map_devices()
        except self.nvml.NVMLError as e:
            self.reason = f"NVML error: {e}"

    def _map_devices(self) -> None:
        nv = self.nvml
        entries = _visible_entries(max(self.ordinals, default=-1) + 1)
        for ordinal in self.ordinals:
            if ordinal >= len(entries):
                self.reason = f"cuda:{ordinal} is not visible (CUDA_VISIBLE_DEVICES={entries})"
                return
            entry = entries[ordinal]
            if entry.startswith("MIG-"):
                self.reason = f"cuda:{ordinal} is a MIG slice ({entry}); NVML has no slice energy"
                return
            if entry.startswith("GPU-"):
                handle = nv.nvmlDeviceGetHandleByUUID(entry)
            else:
                handle = nv.nvmlDeviceGetHandleByIndex(int(entry))
            try:
                mig_current, _ = nv.nvmlDeviceGetMigMode(handle)
            except nv.NVMLError:  # not a MIG-capable board
                mig_current = 0
            if mig_current:
                self.reason = f"cuda:{ordinal} has MIG enabled; NVML has no per-slice energy"
                return
            uuid = nv.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            self.handles[uuid] = handle
            try:
                nv.nvmlDeviceGetTotalEnergyConsumption(handle)
                self.counter[uuid] = True
            except nv.NVMLError:  # pre-Volta: NotSupported
                self.counter[uuid] = False

    @property
    def available(self) -> bool:
        return not self.reason

    @staticmethod
    def _sync() -> None:
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        except ImportError:
            pass

    def _poll(self) -> None:
        while not self._stop_evt.wait(self.poll_s):
            self._sample_power()

    def _sample_power(self) -> None:
        t = time.perf_counter()
        for uuid, h in self.handles.items():
            if not self.counter[uuid]:
                self._samples[uuid].append((t, self.nvml.nvmlDeviceGetPowerUsage(h) * 1e-3))

    def start(self) -> None:
        if not self.available:
            self._start_clock()
            return
        self._sync()
        self._samples = {u: [] for u, c in self.counter.items() if not c}
        self._e0 = {
            u: float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h))
            for u, h in self.handles.items()
            if self.counter[u]
        }
        self._start_clock()
        if self._samples:
            self._sample_power()
            self._stop_evt.clear()
            self._thread = threading.Thread(target=self._poll, daemon=True, name="nvml-poll")
            self._thread.start()

    def stop(self) -> EnergyReading:
        if not self.available:
            return EnergyReading(None, f"{UNAVAILABLE}: {self.reason}", self._elapsed())
        self._sync()
        if self._thread is not None:
            self._stop_evt.set()
            self._thread.join()
            self._thread = None
            self._sample_power()
        seconds = self._elapsed()
        if seconds < self.min_window_s:
            return EnergyReading(
                None,
                f"{UNAVAILABLE}: {seconds:.3f} s window is below the NVML counter's reliable "
                f"minimum of {self.min_window_s} s; measure a longer window",
                seconds,
            )
        domains: dict[str, float] = {}
        for uuid, h in self.handles.items():
            if self.counter[uuid]:
                delta_mj = float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)) - self._e0[uuid]
                if delta_mj <= 0:
                    return EnergyReading(
                        None,
                        f"{UNAVAILABLE}: NVML energy counter of {uuid} did not advance in a "
                        f"{seconds:.3f} s window (it updates every ~10-100 ms); measure longer",
                        seconds,
                    )
                domains[f"gpu:{uuid}"] = delta_mj * 1e-3
        for uuid, samples in self._samples.items():
            if len(samples) < 2:
                return EnergyReading(
                    None, f"{UNAVAILABLE}: too few NVML power samples for {uuid}", seconds
                )
            ts, ps = zip(*samples, strict=True)
            domains[f"gpu:{uuid}"] = sum(
                0.5 * (ps[i] + ps[i - 1]) * (ts[i] - ts[i - 1]) for i in range(1, len(ts))
            )
        integrated = any(not c for c in self.counter.values())
        label = f"{MEASURED} (NVML{' power integrated' if integrated else ''})"
        notes = "window < 1 s: counter granularity ~10-100 ms" if seconds < 1.0 else ""
        return EnergyReading(sum(domains.values()), label, seconds, domains=domains, notes=notes)


# ----------------------------------------------------------------------------------------------


def open_meter(
    device: str = "cpu",
    cpu_watts_per_core: float | None = None,
    *,
    rapl_root: str | Path = RAPL_ROOT,
    include_children: bool = False,
) -> NvmlMeter | RaplMeter | CpuTimeEstimateMeter | UnavailableMeter:
    """The best meter for `device`, with a provenance label on every reading.

    cpu: RAPL package counters when readable, else the CPU-time estimate at
    `cpu_watts_per_core` W/core (default 10 W/core; the label states the figure).
    cuda / cuda:N: the NVML counter of that device; without nvidia-ml-py or NVML the meter
    reports `unavailable` with the reason (a CPU-time figure would misstate GPU energy).
    GPU meters cover the GPU only, not the host.
    """
    if device.startswith("cuda"):
        ordinal = int(device.split(":", 1)[1]) if ":" in device else _current_cuda_ordinal()
        meter = NvmlMeter([ordinal])
        return meter if meter.available else UnavailableMeter(meter.reason)
    if device != "cpu":
        raise ValueError(f"device = {device!r}: energy meters support 'cpu', 'cuda' or 'cuda:N'")
    rapl = RaplMeter(rapl_root)
    if rapl.available:
        return rapl
    watts = DEFAULT_CPU_WATTS_PER_CORE if cpu_watts_per_core is None else cpu_watts_per_core
    return CpuTimeEstimateMeter(watts, include_children=include_children)


def _current_cuda_ordinal() -> int:
    try:
        import torch

        return torch.cuda.current_device() if torch.cuda.is_available() else 0
    except ImportError:
        return 0
