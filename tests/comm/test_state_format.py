"""state_format (comm/state_format.py): a worker's state round-trips bit for bit, and malformed or
hostile bytes are refused with a ValueError without running anything."""

from __future__ import annotations

import json
import math
import pickle
import random
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from frugaltrain.comm import LocalComm, state_format
from frugaltrain.comm.ft.admission import state_digests
from frugaltrain.comm.runtime import Runtime
from frugaltrain.train.loop import Place, run_round, setup


def same(a: object, b: object) -> bool:
    """Bitwise equality of two trees, types included (nan-safe: tensors and floats by bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            type(k) is type(j) and same(a[k], b[j]) for k, j in zip(a, b, strict=True)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _tensors() -> dict:
    """One of every dtype state_format carries (random bits), and awkward shapes and values."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, d in state_format.DTYPES.items():
        bits = torch.randint(0, 2 if d == torch.bool else 256, (12 * d.itemsize,), generator=g)
        out[name] = bits.to(torch.uint8).view(d).view(3, 4)
    out["bf16_special"] = torch.tensor(
        [1.5, float("nan"), -0.0, float("inf")], dtype=torch.bfloat16
    )
    out["bool_2d"] = torch.tensor([[True, False], [False, True]])
    out["scalar"] = torch.tensor(3.25)
    out["empty"] = torch.zeros(0, 5, dtype=torch.int64)
    out["transposed"] = torch.arange(12.0).view(3, 4).t()  # not contiguous
    out["nan_payload"] = torch.tensor([0x7FC00123, -1], dtype=torch.int32).view(torch.float32)
    return out


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_round_trip_of_every_supported_type_is_bitwise():
    odict = OrderedDict(w=torch.ones(2), b=torch.zeros(1))
    odict._metadata = OrderedDict({"": {"version": 1}})
    tree = {
        "none": None,
        "flags": [True, False],
        "ints": (0, -1, 2**200, -(2**70), 7),
        "floats": [0.5, -0.0, math.inf, -math.inf, math.nan, 1e-310],
        "text": "süß ✓",
        "blob": b"\x00\xffraw",
        7: {"int": "key"},
        "state": {0: {"step": torch.tensor(3.0)}, 1: {}},
        "model": odict,
        "tensors": _tensors(),
        "rng": (3, tuple(range(625)), None),
        "nested": [[[()]], {"": []}],
    }
    back = state_format.decode(state_format.encode(tree))
    assert same(tree, back)
    assert back["model"]._metadata == {"": {"version": 1}}
    for t in back["tensors"].values():
        assert t.is_contiguous() and t.device.type == "cpu"
        t.reshape(-1).view(torch.uint8).fill_(1)  # writable, and its own memory
    assert same(tree, state_format.decode(state_format.encode(tree)))


def test_unknown_types_name_their_path():
    with pytest.raises(TypeError, match=r"state\['outer'\]\[1\] is a set"):
        state_format.encode({"outer": [1, {2}]})
    with pytest.raises(TypeError, match="key"):
        state_format.encode({(1, 2): 3})
    with pytest.raises(TypeError, match="bits8"):
        state_format.encode({"q": torch.zeros(2, dtype=torch.bits8)})
    with pytest.raises(TypeError, match="not a dense tensor"):
        state_format.encode({"s": torch.eye(2).to_sparse()})


class _Log:  # run_round's log, unused here
    def step(self, *args) -> None:
        pass

    def write_steps(self) -> None:
        pass


@pytest.mark.parametrize(
    "sets",
    [
        ["outer.strategy=diloco", "outer.codec='topk:0.1'"],
        ["outer.strategy=fgd", "outer.codec=int8"],
        [
            "outer.strategy=streaming",
            "outer.streaming.fragments=2",
            "outer.streaming.overlap=0",
            "model.n_layer=2",
        ],
        ["outer.strategy=noloco"],
        ["outer.strategy=ddp"],
    ],
)
def test_a_real_worker_state_round_trips(make_config, sets):
    cfg = make_config("run.steps=4", "outer.H=2", *sets)
    w = setup(cfg, Runtime(LocalComm()), Place(0, 0, 0, 0), torch.device("cpu"), None)
    for _ in range(2):
        run_round(w, _Log())
    random.random()
    state = w.state()
    state["ft_seq"] = (5, 3, 2)
    back = state_format.decode(state_format.encode(state))
    assert same(state, back)
    transfers = [(2, 0, 1)]  # (round, donor, joiner)
    assert state_digests(back, (5, 3, 2), transfers) == state_digests(state, (5, 3, 2), transfers)
    assert isinstance(back["inner"]["state"], dict) and all(
        type(k) is int for k in back["inner"]["state"]
    )
    random.setstate(back["rng"]["python"])  # what Worker.load would do
    torch.set_rng_state(back["rng"]["torch"])
    w.load(back)


def _with_header(header: object, data: bytes = b"", version: int = state_format.VERSION) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">4sHQ", state_format.MAGIC, version, len(raw)) + raw + data


class _Evil:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "ran"))


def _malformed(tmp_path: Path) -> dict[str, bytes]:
    good = state_format.encode({"x": torch.arange(4, dtype=torch.int32), "b": b"ab"})
    tensor = ["tensor", "float32", [2, 2], 16]
    return {
        "empty": b"",
        "truncated prefix": good[:9],
        "truncated data": good[:-1],
        "trailing bytes": good + b"\x00",
        "wrong magic": b"PK\x03\x04" + good[4:],
        "wrong version": _with_header({"tree": ["none"], "data": 0}, version=99),
        "header beyond buffer": struct.pack(">4sHQ", state_format.MAGIC, 1, 1 << 40) + b"{}",
        "header not json": struct.pack(">4sHQ", state_format.MAGIC, 1, 3) + b"{x]",
        "header not an object": _with_header([1, 2]),
        "nan constant": _with_header({"tree": ["none"], "data": float("nan")}),
        "deep json": struct.pack(">4sHQ", state_format.MAGIC, 1, 200_000) + b"[" * 200_000,
        "deep tree": _with_header({"tree": json.loads('["list", [' * 100 + "]]" * 100), "data": 0}),
        "unknown node": _with_header({"tree": ["pickle", "x"], "data": 0}),
        "bad int": _with_header({"tree": ["int", "__import__('os')"], "data": 0}),
        "bad float": _with_header({"tree": ["float", 1.5], "data": 0}),
        "bytes beyond data": _with_header({"tree": ["bytes", 10], "data": 4}, b"abcd"),
        "negative length": _with_header({"tree": ["bytes", -1], "data": 0}),
        "unknown dtype": _with_header(
            {"tree": ["tensor", "object", [2], 16], "data": 16}, b"0" * 16
        ),
        "shape and bytes differ": _with_header(
            {"tree": ["tensor", "float32", [2, 3], 16], "data": 16}, b"0" * 16
        ),
        "negative dim": _with_header(
            {"tree": ["tensor", "float32", [-2, -2], 16], "data": 16}, b"0" * 16
        ),
        "tensor beyond data": _with_header({"tree": tensor, "data": 8}, b"0" * 8),
        "bad dict key": _with_header({"tree": ["dict", [[["none"], ["none"]]]], "data": 0}),
        "pickle": pickle.dumps(_Evil(tmp_path / "pwned")),
        "torch.save": _torch_save({"x": torch.ones(2)}),
    }


def _torch_save(obj: object) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_malformed_input_is_refused_without_running_anything(tmp_path):
    for name, data in _malformed(tmp_path).items():
        with pytest.raises(ValueError, match=r"^state_format: ") as err:
            state_format.decode(data)
        assert "\n" not in str(err.value), name
    assert not (tmp_path / "pwned").exists()
    pickle.loads(pickle.dumps(_Evil(tmp_path / "control")))  # the payload would have run
    assert (tmp_path / "control").read_text() == "ran"
