"""What a rejoining worker takes from its donor (comm/ft/admission.py): every real donor state
fits the bound the joiner sets from its own model, a size announced above it is refused before
anything is allocated or received, and a malformed state is refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from frugaltrain.comm import LocalComm, state_format
from frugaltrain.comm.ft.admission import (
    SIZE_TAG,
    STATE_SLACK_BYTES,
    Admission,
    StateRefused,
    state_bound,
)
from frugaltrain.comm.runtime import Runtime
from frugaltrain.train.loop import Place, run_round, setup


class _Log:  # run_round's log, unused here
    def step(self, *args) -> None:
        pass

    def write_steps(self) -> None:
        pass


@pytest.mark.parametrize(
    "sets",
    [
        ["outer.strategy=diloco", "outer.codec='topk:0.1'"],  # error feedback: one more copy
        ["outer.strategy=fgd", "outer.codec=int8"],
        [
            "outer.strategy=streaming",
            "outer.streaming.fragments=2",
            "outer.streaming.overlap=0",
            "model.n_layer=2",
        ],  # fmt: skip
        ["outer.strategy=noloco"],
    ],
)
def test_every_real_donor_state_fits_a_fresh_joiners_bound(make_config, sets):
    cfg = make_config("run.steps=4", "outer.H=2", *sets)
    joiner = setup(cfg, Runtime(LocalComm()), Place(0, 0, 0, 0), torch.device("cpu"), None)
    donor = setup(cfg, Runtime(LocalComm()), Place(0, 0, 0, 0), torch.device("cpu"), None)
    for _ in range(2):
        run_round(donor, _Log())
    state = donor.state()
    state["ft_seq"] = (5, 3, 2)
    # The model copies alone hold it (about 5.2 of the 8 here): the slack is spare.
    assert len(state_format.encode(state)) <= state_bound(joiner.state()) - STATE_SLACK_BYTES


class _Pg:
    """A donor's side of the transfer: announces `size`, then sends `payload`."""

    def __init__(self, size: int, payload: bytes = b"") -> None:
        self.size, self.payload, self.tags = size, payload, []

    def recv(self, tensors, pos, tag):
        self.tags.append(tag)
        t = tensors[0]
        if tag == SIZE_TAG:
            t[0] = self.size
        else:
            t.copy_(torch.frombuffer(bytearray(self.payload), dtype=torch.uint8))
        return SimpleNamespace(wait=lambda: None)


def _receive(pg: _Pg, bound: int) -> dict:
    admission = Admission.__new__(Admission)
    admission.world = SimpleNamespace(pg=pg)
    return admission._receive_state(SimpleNamespace(members=[0, 1]), 0, bound)


@pytest.mark.parametrize("size", [0, -1, 1001, 1 << 40])
def test_a_size_out_of_bounds_is_refused_before_anything_is_received(size, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated a payload")

    monkeypatch.setattr(torch, "empty", no_allocation)
    pg = _Pg(size)
    with pytest.raises(StateRefused, match=f"announced a state of {size} bytes.* 1 to 1000"):
        _receive(pg, bound=1000)
    assert pg.tags == [SIZE_TAG]  # the payload was never asked for


def test_a_malformed_state_is_refused_in_one_line():
    junk = b"FTSW" + bytes(20)
    with pytest.raises(StateRefused, match="^donor 0 sent a malformed state: ") as e:
        _receive(_Pg(len(junk), junk), bound=1000)
    assert "\n" not in str(e.value)


def test_a_state_without_its_counters_is_refused():
    payload = state_format.encode({"model": {}})
    with pytest.raises(StateRefused, match="sent no worker state with its counters"):
        _receive(_Pg(len(payload), payload), bound=1 << 20)
