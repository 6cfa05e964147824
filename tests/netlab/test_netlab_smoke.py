"""netlab smoke test: two namespaces, a shaped link, the measured rate, and a full teardown.
Root only (namespaces and tc); anywhere else it is skipped with the reason."""

from __future__ import annotations

import os
import subprocess

import pytest

from frugaltrain.netlab import cpu
from frugaltrain.netlab.lab import NetLab, list_namespaces, why_not_available
from frugaltrain.netlab.run import measure_rate_mbit

REASON = why_not_available()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_netlab_shaped_link_and_teardown():
    limit = 40.0  # Mbit/s: 6 MB take about 1.2 s
    lab = NetLab(2, limit, tag=f"t{os.getpid()}")
    with lab:
        assert set(lab.namespaces) <= set(list_namespaces())
        got = measure_rate_mbit(lab, 0, 1, nbytes=6_000_000)
    # TCP goodput sits a few % under the tbf rate (headers); 20% is the acceptance bound.
    assert abs(got - limit) / limit < 0.20, got
    assert not [ns for ns in list_namespaces() if ns.startswith(f"ftl-t{os.getpid()}-")]


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_netlab_tears_down_on_error():
    with pytest.raises(RuntimeError, match="boom"), NetLab(2, 10.0, tag=f"e{os.getpid()}") as lab:
        assert lab.ns(1) in list_namespaces()
        raise RuntimeError("boom")
    assert not [ns for ns in list_namespaces() if ns.startswith(f"ftl-e{os.getpid()}-")]


CPU_REASON = REASON or cpu.why_not_available()


@pytest.mark.skipif(CPU_REASON is not None, reason=CPU_REASON or "")
def test_netlab_workers_run_in_their_cpu_quota_and_per_worker_links():
    tag = f"q{os.getpid()}"
    lab = NetLab(2, 40.0, tag=tag, rates=[40.0, 10.0], cpu_shares=[0.5, 0.25])
    with lab:
        for i, share in enumerate([0.5, 0.25]):
            out = subprocess.run(
                [*lab.exec_args(i), "cat", "/proc/self/cgroup"], capture_output=True, text=True
            ).stdout
            assert f"ftl-{tag}-w{i}" in out, out
            root, version = cpu.controller_dir()
            d = root / f"ftl-{tag}-w{i}"
            got = (d / ("cpu.cfs_quota_us" if version == 1 else "cpu.max")).read_text().split()[0]
            assert int(got) == int(share * cpu.PERIOD_US)
        shown = subprocess.run(
            ["tc", "-n", lab.ns(1), "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        assert "10Mbit" in shown, shown
    root, _ = cpu.controller_dir()
    assert not list(root.glob(f"ftl-{tag}-*"))
    with pytest.raises(ValueError, match="cpu_shares: 1 values for 2 workers"):
        NetLab(2, 10.0, tag=tag, cpu_shares=[0.5]).up()


@pytest.mark.skipif(CPU_REASON is not None, reason=CPU_REASON or "")
def test_cpu_quota_is_granted_per_its_period():
    tag = f"p{os.getpid()}"
    quota = cpu.CpuQuota(tag, [0.4], period_us=10_000).up()
    try:
        root, version = cpu.controller_dir()
        d = root / f"ftl-{tag}-w0"
        if version == 1:
            got = [(d / f).read_text().strip() for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us")]
        else:
            got = (d / "cpu.max").read_text().split()
        assert got == ["4000", "10000"]
    finally:
        quota.down()
    with pytest.raises(ValueError, match="cpu period 100 us: use 1000 to 1000000"):
        cpu.CpuQuota(tag, [0.4], period_us=100).up()
