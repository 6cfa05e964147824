"""Communication: the interface strategies see (`Comm`), the loop's side of a runtime
(`Runtime`), and their torch.distributed and fault-tolerant implementations.

The names below load on first use, so a module of this package that needs no torch (auth.py,
gateway.py, store.py, rendezvous_json.py: what the coordinator runs on) imports none.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from frugaltrain.comm.base import Comm, CommStats, Handle, LocalComm
    from frugaltrain.comm.runtime import Runtime

_WHERE = {
    "Comm": "base",
    "CommStats": "base",
    "Handle": "base",
    "LocalComm": "base",
    "Runtime": "runtime",
}
__all__ = ["Comm", "CommStats", "Handle", "LocalComm", "Runtime"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
