"""The other shards of a process's own replica, as the outer Comm of one shard group sees them.

With run.shards = S > 1 (docs/sharding.md) every process is shard s of replica r, and its Comm
spans shard s of every replica: an ordinary world of run.workers members over 1/S of the
elements. A decision about a replica's contribution must come out the same in all S shard
groups, or a replica would take a different mix for different parts of its parameters. What is
decided per replica goes through this link, a process group over the replica's S processes:

    norm      the guard judges a replica's whole contribution: the sum of squares over shards
    count     the fault-tolerant runtime keeps a Mix1 message only if it arrived at every shard
    all_true  a flag true on every shard (a rejoined replica matches its donor on every shard)

Every call is a collective of the replica's S processes, made in the same order on each.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class ReplicaShards:
    """Collectives over the S processes of one replica (small host tensors; on an NCCL group
    they take a round trip through this process's GPU).

    Args:
        group: the replica's process group (its S shard processes).
        shards: S.
    """

    def __init__(self, group: dist.ProcessGroup, shards: int) -> None:
        self.group = group
        self.shards = shards
        self.index = dist.get_rank(group)  # this process's shard index s
        nccl = dist.get_backend(group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` (a host tensor) over the replica's shards, in place; returns it."""
        on_device = t if self._device is None else t.to(self._device)
        dist.all_reduce(on_device, group=self.group)
        if on_device is not t:
            t.copy_(on_device)
        return t

    def norm(self, tensors: list[torch.Tensor]) -> float:
        """The L2 norm of the replica's whole contribution whose local shards are `tensors`, in
        fp64; inf if any shard holds a value that is not finite."""
        return self.norms([torch.cat([t.detach().reshape(-1) for t in tensors])])[0]

    def norms(self, flats: list[torch.Tensor]) -> list[float]:
        """`norm` of several contributions at once (one collective), e.g. the Mix1 messages
        that arrived, in the same order on every shard."""
        squares = torch.tensor([f.detach().double().pow(2).sum().item() for f in flats])
        total = self.sum_(squares).tolist()
        return [math.sqrt(x) if math.isfinite(x) else float("inf") for x in total]

    def count(self, flags: list[bool]) -> list[bool]:
        """Per position, whether the flag is true on every shard of the replica."""
        t = self.sum_(torch.tensor([float(f) for f in flags], dtype=torch.float64))
        return [int(x) == self.shards for x in t.tolist()]

    def all_true(self, flag: bool) -> bool:
        return self.count([flag])[0]
