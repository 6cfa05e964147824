"""Replicas x shards: FSDP2 inside each replica, the outer strategy across replicas on matching
shards (docs/sharding.md).

A run of run.workers replicas with run.shards = S has workers x S processes, laid out
replica-major, so a replica's S processes are consecutive ranks (torchrun --nproc-per-node S
puts one replica on each node):

    rank = replica * S + shard
    replica group r   its S processes: FSDP2's all-gathers and reduce-scatters, every step
    shard group s     shard s of every replica: the outer strategy's Comm, every round

Inside a replica, FSDP2 (`fully_shard` per transformer block, then the root) shards the
parameters, gradients and inner AdamW states over a 1-D "shard" mesh (DTensors). Each shard
process takes data.batch_size / S rows of its replica's batch and the reduce-scatter averages
their gradients, so a replica steps as one process with the whole batch would, up to the order
of the additions. The outer strategy sees only this process's shard of each parameter
(`LocalShards`): each shard group is an ordinary DiLoCo/FGD/... world over 1/S of the elements,
so outer bytes and outer state per process fall by S and no strategy knows about sharding.

Shapes: B batch rows of the replica, T sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from frugaltrain.comm.replica_shards import ReplicaShards
from frugaltrain.models.parts import is_block_module


@dataclass
class Shards:
    """This process's place inside its replica.

    index: s, its shard index. count: S. group: the replica's S processes. mesh: the 1-D
    ("shard",) mesh over them that FSDP2 shards on. link: the same group for the outer Comm
    (comm/replica_shards.py)."""

    index: int
    count: int
    group: dist.ProcessGroup
    mesh: DeviceMesh
    link: ReplicaShards


def shards_of(group: dist.ProcessGroup, device_type: str) -> Shards:
    """The Shards of a process in replica group `group` (its rank there is its shard index)."""
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))
    count = dist.get_world_size(group)
    return Shards(dist.get_rank(group), count, group, mesh, ReplicaShards(group, count))


def build_layout(
    workers: int, shards: int, device_type: str
) -> tuple[Shards | None, dist.ProcessGroup | None]:
    """The replica and shard groups of a run whose processes are the first workers x shards
    ranks of the default group. Every process of the default group calls this, in the same
    order (process groups are created collectively); returns this process's Shards and its
    shard group (the outer Comm's group), or (None, None) for a rank outside the run."""
    replicas = [list(range(r * shards, (r + 1) * shards)) for r in range(workers)]
    by_shard = [list(range(s, workers * shards, shards)) for s in range(shards)]
    replica_groups = [dist.new_group(ranks) for ranks in replicas]
    shard_groups = [dist.new_group(ranks) for ranks in by_shard]
    rank = dist.get_rank()
    if rank >= workers * shards:
        return None, None
    replica, shard = divmod(rank, shards)
    return shards_of(replica_groups[replica], device_type), shard_groups[shard]


def shard_model(model: nn.Module, shards: Shards | None, activation_checkpointing: bool) -> None:
    """FSDP2 on every transformer block, then on the root (with shards); activation
    checkpointing on every block first, if asked (with or without shards)."""
    blocks = [m for name, m in model.named_modules() if is_block_module(name)]
    for block in blocks:
        if activation_checkpointing:
            _recompute_in_backward(block)
        if shards is not None:
            fully_shard(block, mesh=shards.mesh)
    if shards is not None:
        fully_shard(model, mesh=shards.mesh)


def _recompute_in_backward(block: nn.Module) -> None:
    """Keep only the block's inputs for backward and run its forward again there. The block's
    own forward is wrapped (not the module), so parameter names do not change."""
    forward = block.forward

    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


class LocalShards:
    """What the outer strategy sees of a sharded model: this process's shard of every trainable
    parameter, under the parameter's name. The tensors are leaves that share the shards'
    storage, so the outer step's theta <- x writes into the model."""

    def __init__(self, model: nn.Module) -> None:
        self._named = [
            (name, p.to_local().detach().requires_grad_())
            for name, p in model.named_parameters()
            if p.requires_grad
        ]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._named)

    def parameters(self) -> Iterator[torch.Tensor]:
        return (p for _, p in self._named)


def rows(t_BT: torch.Tensor, shards: Shards) -> torch.Tensor:
    """This shard's B / S rows of its replica's batch."""
    return t_BT.chunk(shards.count)[shards.index]


def replica_mean(loss: torch.Tensor, shards: Shards) -> float:
    """The replica's loss: the mean over its shards' losses (each on B / S rows). One small
    all-reduce per step, which also makes every shard see the same value (a non-finite loss
    stops all of them at the same step)."""
    total = loss.detach().float().reshape(1).clone()
    dist.all_reduce(total, group=shards.group)
    return total.item() / shards.count


def replica_sum(values: list[float], shards: Shards | None) -> list[float]:
    """Sum per-shard figures (sums of squares) over the replica's shards."""
    if shards is None:
        return values
    return shards.link.sum_(torch.tensor(values, dtype=torch.float64)).tolist()


@contextlib.contextmanager
def holding(params: list[torch.Tensor], values: list[torch.Tensor]):
    """Inside the block the parameters hold `values` (e.g. the workers' mean, to evaluate the
    averaged model of a sharded replica); their own values are put back after."""
    own = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, own, strict=True):
                p.copy_(v)


class Averaged(nn.Module):
    """`model` run with `values` in its parameters `params` (the workers' mean: the averaged
    model of a sharded replica, whose FSDP2 modules are not copied; every shard process runs
    it at once). Its train/eval mode is the model's."""

    def __init__(self, model: nn.Module, params: list[torch.Tensor], values: list[torch.Tensor]):
        super().__init__()
        self._model = [model]  # not a submodule: nothing of it is registered twice
        self._params, self._values = params, values

    def forward(self, *args):
        with holding(self._params, self._values):
            return self._model[0](*args)

    def train(self, mode: bool = True) -> Averaged:
        self._model[0].train(mode)
        return super().train(mode)


# ---- worker states as local tensors (a rejoining replica takes its donor's, shard by shard)


def to_local(tree):
    """`tree` (dicts, lists, tuples) with every DTensor replaced by this process's shard."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: to_local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_local(v) for v in tree)
    return tree


@torch.no_grad()
def load_local_model(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy local shards (`to_local` of a model state dict of the same layout) into `model`."""
    for name, t in model.state_dict().items():
        (t.to_local() if isinstance(t, DTensor) else t).copy_(state[name])


def rewrap_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After `opt.load_state_dict` of local tensors: states of sharded parameters become
    DTensors of the parameter's layout again (the optimizer steps on DTensors)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            local_shape = p.to_local().shape
            for key, value in opt.state.get(p, {}).items():
                if torch.is_tensor(value) and not isinstance(value, DTensor):
                    if value.shape == local_shape:
                        opt.state[p][key] = like(p, value)


def like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor of `param`'s global layout: a DTensor with its mesh and placements
    when it is sharded (for DCP), else `local` itself."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def shard_full(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This process's shard of `full`, a whole tensor of `param`'s shape (taken locally:
    every process holds the same `full`)."""
    if not isinstance(param, DTensor):
        return full
    mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return mine.to_local()
