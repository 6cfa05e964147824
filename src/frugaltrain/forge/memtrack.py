"""A storage-level allocation tracker (TorchDispatchMode) for CPU, where tracemalloc is blind.

Every op's outputs are inspected; a storage not seen before (and not aliasing an input, so
in-place ops and views are not counted) is a new allocation. A `weakref.finalize` on the
UntypedStorage object (not the tensor wrapper, which can die while `.grad` still holds the
storage) removes it from the live set when it is freed.

Blind spot: memory an op allocates and frees internally before returning (e.g. a BLAS packing
buffer) is not seen. Live bytes are counted from the moment the mode is entered; tensors alive
before that are the caller's "resident" bytes (see `resident_bytes`).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationTracker(TorchDispatchMode):
    """Track new tensor storages: live bytes, their peak, and the largest single allocation.

    Usage:
        with AllocationTracker() as t:
            ...
        t.peak_bytes, t.largest_bytes, t.live_bytes
    `mark(label)` starts a phase; `phase_peak[label]` and `phase_largest[label]` are per phase.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0
        self.phase = "start"
        self.phase_peak: dict[str, int] = {}
        self.phase_largest: dict[str, int] = {}
        self._keys = itertools.count()
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def mark(self, phase: str) -> None:
        self.phase = phase
        self.phase_peak[phase] = self.live_bytes
        self.phase_largest.setdefault(phase, 0)

    def _free(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        in_ptrs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            nbytes = st.nbytes()
            if nbytes == 0 or st.data_ptr() in in_ptrs or st in self._seen:
                continue
            key = next(self._keys)
            self._seen[st] = key
            self.live[key] = nbytes
            self.live_bytes += nbytes
            weakref.finalize(st, self._free, key)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.largest_bytes = max(self.largest_bytes, nbytes)
            p = self.phase
            self.phase_peak[p] = max(self.phase_peak.get(p, 0), self.live_bytes)
            self.phase_largest[p] = max(self.phase_largest.get(p, 0), nbytes)
        return out


def resident_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (weights, optimizer states, ...)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
