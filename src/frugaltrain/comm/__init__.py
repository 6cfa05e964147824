"""Communication interface (base), its torch.distributed runtime, and later topologies."""

from frugaltrain.comm.base import Comm, CommStats, Handle, LocalComm

__all__ = ["Comm", "CommStats", "Handle", "LocalComm"]
