"""Communication, the data plane: the interface strategies see (`Comm`), the loop's side of a
runtime (`Runtime`), and their torch.distributed and fault-tolerant implementations, composing
the codecs (frugaltrain/codecs/), the guard, the accounting and the pacing. The control plane
across machines (the coordinator, its store, gateway and run token) is cluster/, torch-free;
this package's rendezvous code uses its store keys and rendezvous JSON.

The names below load on first use, so importing one of this package's torch-free modules
(pacing.py) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from frugaltrain.comm.accounting import CommStats
    from frugaltrain.comm.base import Comm, Handle, LocalComm
    from frugaltrain.comm.runtime import Runtime

_WHERE = {
    "Comm": "base",
    "CommStats": "accounting",
    "Handle": "base",
    "LocalComm": "base",
    "Runtime": "runtime",
}
__all__ = ["Comm", "CommStats", "Handle", "LocalComm", "Runtime"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
