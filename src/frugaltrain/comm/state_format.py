"""state_format: a worker's state as bytes that cannot run code when read.

A restarted worker takes a live peer's whole state over the network (comm/ft/admission.py). A
pickle (torch.save, torch.load with weights_only=False) runs whatever its bytes say when it is
loaded, so a peer, or anyone who can reach the link, could run code in the joiner. This format
only describes data:

    magic      b"FTSW" and a 2-byte version (big-endian)
    length     8 bytes, big-endian: the JSON header's length
    header     UTF-8 JSON: {"tree": node, "data": bytes of the data section}
    data       every tensor's (and bytes object's) raw bytes, in the tree's order, back to back

A node is a JSON list whose first item names its type:

    ["none"]  ["bool", b]  ["int", hex]  ["float", 16 hex digits of the IEEE double]
    ["str", s]  ["bytes", n]  ["tensor", dtype name, shape, n]
    ["list", [nodes]]  ["tuple", [nodes]]  ["dict", [[key, value], ...]]
    ["odict", [[key, value], ...], metadata node or ["none"]]

Dict keys are str or int nodes, so an optimizer's int-keyed "state" comes back with int keys;
"odict" is a module's state_dict (an OrderedDict, with the `_metadata` load_state_dict reads).
Floats go as their 8 bytes, so nan payloads and -0.0 survive; ints as hex, of any size. Every
tensor comes back on the CPU, contiguous, owning fresh memory, bit for bit what was sent.

That covers what `Worker.state()` holds for every strategy and codec (model and optimizer state
dicts, the schedule's, the outer strategy's with error feedback, torch and python RNG states,
the sampler's ints) and the sequence counters admission adds. Anything else is a TypeError
naming where in the tree it is. `decode` checks everything it reads and raises a one-line
ValueError on anything malformed.
"""

from __future__ import annotations

import json
import re
import struct
from collections import OrderedDict

import numpy as np
import torch

MAGIC = b"FTSW"
VERSION = 1
_PREFIX = struct.Struct(">4sHQ")  # magic, version, header length
MAX_DEPTH = 64  # nesting of containers; a worker state needs about 6
_DTYPE_NAMES = (
    "bool uint8 uint16 uint32 uint64 int8 int16 int32 int64 float16 bfloat16 float32 float64 "
    "complex32 complex64 complex128 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz "
    "float8_e8m0fnu float4_e2m1fn_x2"
).split()
DTYPES = {
    n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
"""The tensor dtypes this format carries, by name (those this torch has)."""
_DTYPE_NAME = {d: n for n, d in DTYPES.items()}
_HEX_INT = re.compile(r"-?[0-9a-f]+")
_HEX_FLOAT = re.compile(r"[0-9a-f]{16}")


# ---- encoding
def encode(obj: object) -> bytes:
    """`obj` (a worker state: see the module docstring for the types) as state_format bytes.
    Raises TypeError naming the path of anything else."""
    blobs: list[bytes] = []
    tree = _node(obj, "state", 0, blobs)
    data = b"".join(blobs)
    header = json.dumps({"tree": tree, "data": len(data)}, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header + data


def _node(x: object, path: str, depth: int, blobs: list[bytes]) -> list:
    if depth > MAX_DEPTH:
        raise TypeError(f"state_format: {path} is nested deeper than {MAX_DEPTH} (a cycle?)")
    kind = type(x)
    if x is None:
        return ["none"]
    if kind is bool:
        return ["bool", x]
    if kind is int:
        return ["int", format(x, "x")]
    if kind is float:
        return ["float", struct.pack(">d", x).hex()]
    if kind is str:
        return ["str", x]
    if kind is bytes:
        blobs.append(x)
        return ["bytes", len(x)]
    if isinstance(x, torch.Tensor):
        return _tensor_node(x, path, blobs)
    if kind is list or kind is tuple:
        items = [_node(v, f"{path}[{i}]", depth + 1, blobs) for i, v in enumerate(x)]
        return [kind.__name__, items]
    if kind is dict or kind is OrderedDict:
        return _dict_node(x, path, depth, blobs)
    raise TypeError(f"state_format: {path} is a {kind.__qualname__}, which it does not carry")


def _tensor_node(t: torch.Tensor, path: str, blobs: list[bytes]) -> list:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
        raise TypeError(
            f"state_format: {path} is a {type(t).__qualname__} ({t.layout}), not a dense tensor"
        )
    if t.dtype not in _DTYPE_NAME:
        raise TypeError(f"state_format: {path} has dtype {t.dtype}, which it does not carry")
    flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes()
    blobs.append(raw)
    return ["tensor", _DTYPE_NAME[t.dtype], list(t.shape), len(raw)]


def _dict_node(d: dict, path: str, depth: int, blobs: list[bytes]) -> list:
    pairs = []
    for k, v in d.items():
        if type(k) not in (str, int):
            raise TypeError(
                f"state_format: {path} has a {type(k).__qualname__} key; keys are str or int"
            )
        pairs.append(
            [_node(k, path, depth + 1, blobs), _node(v, f"{path}[{k!r}]", depth + 1, blobs)]
        )
    if type(d) is dict:
        return ["dict", pairs]
    meta = getattr(d, "_metadata", None)
    return ["odict", pairs, _node(meta, f"{path}._metadata", depth + 1, blobs)]


# ---- decoding
def decode(data: bytes) -> object:
    """The object `encode` made `data` from. Raises ValueError (one line) on anything that is
    not well-formed state_format; reads data only, never runs any."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise ValueError(
            f"state_format: {len(view)} bytes, shorter than the {_PREFIX.size}-byte prefix"
        )
    magic, version, n_header = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise ValueError(f"state_format: bad magic {bytes(magic)!r} (not state_format data)")
    if version != VERSION:
        raise ValueError(f"state_format: version {version}, this reader knows {VERSION}")
    start = _PREFIX.size + n_header
    if start > len(view):
        raise ValueError(
            f"state_format: header of {n_header} bytes runs past the {len(view)}-byte buffer"
        )
    header = _parse_header(view[_PREFIX.size : start])
    size = header.get("data")
    if type(size) is not int or size != len(view) - start:
        raise ValueError(
            f"state_format: data section of {len(view) - start} bytes, header says {size!r}"
        )
    reader = _Reader(view[start:])
    obj = reader.node(header.get("tree"), "state", 0)
    if reader.pos != size:
        raise ValueError(f"state_format: {size - reader.pos} bytes of the data section left unread")
    return obj


def _parse_header(raw: memoryview) -> dict:
    try:
        header = json.loads(bytes(raw).decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, nesting, huge ints
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"state_format: header is not JSON ({reason})") from None
    if not isinstance(header, dict):
        raise ValueError("state_format: header is not a JSON object")
    return header


def _no_constant(name: str) -> None:
    raise json.JSONDecodeError(f"{name} is not allowed", name, 0)


def _bad(path: str, what: str) -> ValueError:
    where = path if len(path) <= 120 else f"{path[:60]}...{path[-57:]}"
    return ValueError(f"state_format: {where}: {what}")


class _Reader:
    """Builds the tree of nodes, taking blobs from the data section in order."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def take(self, n: object, path: str) -> memoryview:
        if type(n) is not int or n < 0 or n > len(self.data) - self.pos:
            raise _bad(path, f"length {n!r} beyond the data section")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def node(self, node: object, path: str, depth: int) -> object:
        if depth > MAX_DEPTH:
            raise _bad(path, f"nested deeper than {MAX_DEPTH}")
        if not isinstance(node, list) or not node or type(node[0]) is not str:
            raise _bad(path, "not a node")
        kind, args = node[0], node[1:]
        leaf = _LEAVES.get(kind)
        if leaf is not None:
            return leaf(self, args, path)
        if kind in ("list", "tuple") and len(args) == 1 and isinstance(args[0], list):
            items = [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(args[0])]
            return items if kind == "list" else tuple(items)
        if kind == "dict" and len(args) == 1:
            return self.pairs(args[0], {}, path, depth)
        if kind == "odict" and len(args) == 2:
            d = self.pairs(args[0], OrderedDict(), path, depth)
            meta = self.node(args[1], f"{path}._metadata", depth + 1)
            if meta is not None:
                d._metadata = meta  # what nn.Module.load_state_dict reads
            return d
        raise _bad(path, f"unknown or malformed node {kind!r}")

    def pairs(self, pairs: object, out: dict, path: str, depth: int) -> dict:
        if not isinstance(pairs, list):
            raise _bad(path, "dict items are not a list")
        for pair in pairs:
            if not isinstance(pair, list) or len(pair) != 2:
                raise _bad(path, "a dict item is not a [key, value] pair")
            key = self.node(pair[0], path, depth + 1)
            if type(key) not in (str, int):
                raise _bad(path, f"a dict key is a {type(key).__name__}")
            out[key] = self.node(pair[1], f"{path}[{key!r}]", depth + 1)
        return out

    def tensor(self, args: list, path: str) -> torch.Tensor:
        if len(args) != 3 or type(args[0]) is not str or not isinstance(args[1], list):
            raise _bad(path, "malformed tensor node")
        dtype = DTYPES.get(args[0])
        if dtype is None:
            raise _bad(path, f"unknown dtype {args[0][:40]!r}")
        shape = args[1]
        if len(shape) > MAX_DEPTH or any(type(s) is not int or s < 0 for s in shape):
            raise _bad(path, f"bad shape {str(shape)[:80]}")
        numel = 1
        for s in shape:
            numel *= s
        if numel * dtype.itemsize != args[2]:
            raise _bad(
                path,
                f"shape {shape} of {args[0]} needs {numel * dtype.itemsize} bytes, not {args[2]!r}",
            )
        raw = self.take(args[2], path)
        t = torch.empty(shape, dtype=dtype)
        if numel:
            t.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
        return t


def _leaf(kind: str, check, build):
    """A leaf node's reader: one argument that passes `check`, turned into a value by `build`."""

    def read(reader: _Reader, args: list, path: str) -> object:
        if kind == "none" and not args:
            return None
        if len(args) != 1 or not check(args[0]):
            raise _bad(path, f"malformed {kind} node")
        return build(reader, args[0], path)

    return read


_LEAVES = {
    "none": _leaf("none", lambda a: False, None),
    "bool": _leaf("bool", lambda a: type(a) is bool, lambda r, a, p: a),
    "int": _leaf(
        "int", lambda a: type(a) is str and _HEX_INT.fullmatch(a), lambda r, a, p: int(a, 16)
    ),
    "float": _leaf(
        "float",
        lambda a: type(a) is str and _HEX_FLOAT.fullmatch(a),
        lambda r, a, p: struct.unpack(">d", bytes.fromhex(a))[0],
    ),
    "str": _leaf("str", lambda a: type(a) is str, lambda r, a, p: a),
    "bytes": _leaf("bytes", lambda a: type(a) is int, lambda r, a, p: bytes(r.take(a, p))),
    "tensor": lambda r, args, p: r.tensor(args, p),
}
