"""netlab smoke test: two namespaces, a shaped link, the measured rate, and a full teardown.
Root only (namespaces and tc); anywhere else it is skipped with the reason."""

from __future__ import annotations

import os

import pytest

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
