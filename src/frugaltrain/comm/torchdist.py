"""`Comm` over torch.distributed: gloo on CPU, NCCL on GPU.

Tensors are flattened into one buffer per call so a round costs one collective, not one per
parameter. Asynchronous calls return a handle whose `wait()` unflattens into the caller's tensors.
Every collective uses the process group's timeout (run.timeout_s), so a dead peer raises instead
of hanging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from frugaltrain.comm.base import Comm, Handle


class TorchDistComm(Comm):
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _all_reduce_sum(self, tensors: list[torch.Tensor], scale: float) -> Handle:
        flat = _flatten_dense_tensors(tensors)
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def finish() -> None:
            work.wait()
            flat.mul_(scale)
            for t, r in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                t.copy_(r)

        return Handle(self.stats, finish, work.is_completed)

    def _metric_sum(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)

    def _metric_max(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)
