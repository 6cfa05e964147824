"""Communication: the interface strategies see (`Comm`), the loop's side of a runtime
(`Runtime`), and their torch.distributed and fault-tolerant implementations."""

from frugaltrain.comm.base import Comm, CommStats, Handle, LocalComm
from frugaltrain.comm.runtime import Runtime

__all__ = ["Comm", "CommStats", "Handle", "LocalComm", "Runtime"]
