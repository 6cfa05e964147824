"""FlowTrain at toy scale: a ViT producer and an LM consumer decoupled through a memory pool.

Reproduces arXiv 2606.23087 (FlowTrain) on CPU: the pool (shared memory or torch.distributed),
the three execution modes, the packing scheduler and the throughput-matching allocator.
See docs/flow.md.
"""

from frugaltrain.flow.config import FlowConfig, load_flow_config
from frugaltrain.flow.packing import BatchPlan, fit_cost, pack_bfd, plan_batch
from frugaltrain.flow.pool import DistPool, PoolClosed, ShmPool
from frugaltrain.flow.runtime import FlowWorkerError, RunResult, make_plans, run

__all__ = [
    "BatchPlan",
    "DistPool",
    "FlowConfig",
    "FlowWorkerError",
    "PoolClosed",
    "RunResult",
    "ShmPool",
    "fit_cost",
    "load_flow_config",
    "make_plans",
    "pack_bfd",
    "plan_batch",
    "run",
]
