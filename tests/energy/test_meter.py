"""Meters: fake powercap tree for RAPL, a fake pynvml module, and this host's auto meter."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from frugaltrain.energy.meter import (
    CpuTimeEstimateMeter,
    NvmlMeter,
    RaplMeter,
    UnavailableMeter,
    open_meter,
)


def _zone(root: Path, name: str, label: str, energy_uj: int, max_uj: int = 1_000_000) -> Path:
    z = root / name
    z.mkdir(parents=True)
    (z / "name").write_text(label + "\n")
    (z / "energy_uj").write_text(f"{energy_uj}\n")
    (z / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return z


@pytest.fixture
def rapl_tree(tmp_path: Path) -> Path:
    # Two packages, each with a core sub-zone (contained in the package: must not be added)
    # and a dram sub-zone (separate domain: added only on request).
    _zone(tmp_path, "intel-rapl:0", "package-0", 100_000)
    _zone(tmp_path, "intel-rapl:0:0", "core", 50_000)
    _zone(tmp_path, "intel-rapl:0:1", "dram", 10_000)
    _zone(tmp_path, "intel-rapl:1", "package-1", 200_000)
    _zone(tmp_path, "intel-rapl:1:0", "core", 70_000)
    return tmp_path


def _set(root: Path, zone: str, uj: int) -> None:
    (root / zone / "energy_uj").write_text(f"{uj}\n")


def test_rapl_sums_packages_only(rapl_tree: Path) -> None:
    m = RaplMeter(rapl_tree, poll_s=None)
    assert m.available
    m.start()
    _set(rapl_tree, "intel-rapl:0", 400_000)  # +0.3 J
    _set(rapl_tree, "intel-rapl:0:0", 950_000)  # core moves a lot: ignored
    _set(rapl_tree, "intel-rapl:1", 700_000)  # +0.5 J
    r = m.stop()
    assert r.label == "measured (RAPL)" and r.source == "measured"
    assert r.joules == pytest.approx(0.8)
    assert r.domains == pytest.approx({"package-0": 0.3, "package-1": 0.5})


def test_rapl_dram_on_request(rapl_tree: Path) -> None:
    m = RaplMeter(rapl_tree, include_dram=True, poll_s=None)
    m.start()
    _set(rapl_tree, "intel-rapl:0:1", 30_000)  # +0.02 J DRAM
    r = m.stop()
    assert r.label == "measured (RAPL +DRAM)"
    assert r.domains["dram-0"] == pytest.approx(0.02)
    assert r.joules == pytest.approx(0.02)


def test_rapl_wraparound(rapl_tree: Path) -> None:
    m = RaplMeter(rapl_tree, poll_s=None)
    m.start()  # package-0 at 100_000 of a 1_000_000 range
    _set(rapl_tree, "intel-rapl:0", 900_000)
    m.sample()  # the poller's read: +0.8 J
    _set(rapl_tree, "intel-rapl:0", 50_000)  # wrapped: +0.1 to the top, +0.05 after
    r = m.stop()
    assert r.domains["package-0"] == pytest.approx(0.95)
    assert "wraps=1" in r.notes


def test_rapl_poller_thread_runs(rapl_tree: Path) -> None:
    m = RaplMeter(rapl_tree, poll_s=0.01)
    m.start()
    _set(rapl_tree, "intel-rapl:1", 300_000)
    r = m.stop()
    assert r.domains["package-1"] == pytest.approx(0.1)


def test_rapl_permission_denied_is_unavailable(
    rapl_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # energy_uj is root-only on Linux >= 5.10. Mode bits do not stop root (tests may run as
    # root in containers), so the denial is injected at the read.
    real_read = Path.read_text

    def denied(self: Path, *a, **k) -> str:
        if self.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)
    m = RaplMeter(rapl_tree, poll_s=None)
    assert not m.available
    m.start()
    r = m.stop()
    assert r.joules is None
    assert r.label.startswith("unavailable: RAPL counters not readable")
    assert "root" in r.label


def test_rapl_missing_tree_is_unavailable(tmp_path: Path) -> None:
    r = RaplMeter(tmp_path / "nothing", poll_s=None)
    assert not r.available and "no RAPL package zones" in r.reason


# ---------------------------------------------------------------------------------------------
# Fake NVML


class _NVMLError(Exception):
    pass


def _fake_nvml(boards: dict[str, dict]) -> types.ModuleType:
    """boards: uuid -> {'index': i, 'energy_mj': [reads...], 'power_mw': w, 'mig': 0/1}.
    A board without 'energy_mj' raises NotSupported for the counter (pre-Volta)."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = _NVMLError
    nv.calls = {"init": 0}
    by_index = {b["index"]: u for u, b in boards.items()}

    def init() -> None:
        nv.calls["init"] += 1

    def total_energy(h: str) -> int:
        reads = boards[h].get("energy_mj")
        if reads is None:
            raise _NVMLError("Not Supported")
        return reads.pop(0) if len(reads) > 1 else reads[0]

    nv.nvmlInit = init
    nv.nvmlDeviceGetHandleByIndex = lambda i: by_index[i]
    nv.nvmlDeviceGetHandleByUUID = lambda u: (
        u if u in boards else (_ for _ in ()).throw(_NVMLError("not found"))
    )
    nv.nvmlDeviceGetUUID = lambda h: h.encode()
    nv.nvmlDeviceGetMigMode = lambda h: (boards[h].get("mig", 0), 0)
    nv.nvmlDeviceGetTotalEnergyConsumption = total_energy
    nv.nvmlDeviceGetPowerUsage = lambda h: boards[h]["power_mw"]
    return nv


def test_nvml_counter_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # The first read is the counter probe at construction, then start and stop.
    nv = _fake_nvml({"GPU-a": {"index": 0, "energy_mj": [5_000, 10_000, 135_000]}})
    m = NvmlMeter([0], nvml=nv, min_window_s=0)
    m.start()
    r = m.stop()
    assert r.label == "measured (NVML)"
    assert r.joules == pytest.approx(125.0)
    assert r.domains == pytest.approx({"gpu:GPU-a": 125.0})


def test_nvml_maps_through_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    boards = {
        "GPU-a": {"index": 0, "energy_mj": [0, 0, 1_000_000]},
        "GPU-b": {"index": 1, "energy_mj": [0, 0, 2_000]},
        "GPU-c": {"index": 2, "energy_mj": [0, 0, 7_000]},
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")  # cuda:0 is physical 2
    m = NvmlMeter([0], nvml=_fake_nvml(boards), min_window_s=0)
    m.start()
    assert m.stop().domains == pytest.approx({"gpu:GPU-c": 7.0})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-b")  # UUID entries
    m = NvmlMeter([0], nvml=_fake_nvml(boards), min_window_s=0)
    m.start()
    assert m.stop().domains == pytest.approx({"gpu:GPU-b": 2.0})


def test_nvml_zero_delta_is_unavailable_not_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    m = NvmlMeter([0], nvml=_fake_nvml({"GPU-a": {"index": 0, "energy_mj": [42]}}), min_window_s=0)
    m.start()
    r = m.stop()
    assert r.joules is None and r.label.startswith("unavailable: NVML energy counter")
    # A window shorter than the counter's reliable minimum is unavailable, not a number.
    m = NvmlMeter([0], nvml=_fake_nvml({"GPU-a": {"index": 0, "energy_mj": [0, 0, 5_000]}}))
    m.start()
    r = m.stop()
    assert r.joules is None and "reliable minimum" in r.label


def test_nvml_pre_volta_integrates_power(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    m = NvmlMeter(
        [0],
        nvml=_fake_nvml({"GPU-k80": {"index": 0, "power_mw": 150_000}}),
        poll_s=0.01,
        min_window_s=0,
    )
    m.start()
    # Sleep-free: the start and stop samples bracket the window, so 150 W x window.
    r = m.stop()
    assert r.label == "measured (NVML power integrated)"
    assert r.joules == pytest.approx(150.0 * r.seconds, rel=0.2)


def test_nvml_refuses_mig(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-123")
    m = NvmlMeter([0], nvml=_fake_nvml({"GPU-a": {"index": 0, "energy_mj": [1]}}))
    assert not m.available and "MIG" in m.reason
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    m = NvmlMeter([0], nvml=_fake_nvml({"GPU-a": {"index": 0, "energy_mj": [1], "mig": 1}}))
    assert not m.available and "MIG" in m.reason
    m.start()
    assert m.stop().joules is None


def test_missing_pynvml_gives_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    m = open_meter("cuda:0")
    assert isinstance(m, UnavailableMeter)
    m.start()
    r = m.stop()
    assert r.joules is None and "nvidia-ml-py" in r.label and "frugaltrain[nvml]" in r.label


# ---------------------------------------------------------------------------------------------


def test_host_meter_here_is_estimated_or_unavailable() -> None:
    """This machine class has no readable RAPL: the host meter must never claim 'measured'."""
    m = open_meter("cpu")
    m.start()
    sum(i * i for i in range(100_000))
    r = m.stop()
    readable = Path("/sys/class/powercap/intel-rapl:0/energy_uj")
    if readable.exists() and os.access(readable, os.R_OK):
        pytest.skip("this host has readable RAPL counters")
    assert r.source in ("estimated", "unavailable")
    assert r.label == "estimated (CPU time x 10 W/core)"
    assert r.joules is not None and r.joules > 0


def test_cpu_estimate_uses_stated_watts(rapl_tree: Path) -> None:
    m = open_meter("cpu", cpu_watts_per_core=3.5, rapl_root=rapl_tree / "absent")
    assert isinstance(m, CpuTimeEstimateMeter)
    m.start()
    sum(i * i for i in range(200_000))
    r = m.stop()
    assert r.label == "estimated (CPU time x 3.5 W/core)"
    cpu_s = float(r.notes.split("=")[1])
    assert r.joules == pytest.approx(3.5 * cpu_s, rel=1e-3)
    with pytest.raises(ValueError, match="cpu_watts_per_core"):
        CpuTimeEstimateMeter(0.0)


def test_open_meter_prefers_readable_rapl(rapl_tree: Path) -> None:
    assert isinstance(open_meter("cpu", rapl_root=rapl_tree), RaplMeter)
    with pytest.raises(ValueError, match="device"):
        open_meter("tpu")
