"""FlowTrain: a vision encoder producer and an LM consumer decoupled through a memory pool.

Reproduces arXiv 2606.23087 (FlowTrain) at small scale: transformers parts (a ViT or SigLIP tower,
a Llama behind a projector) or tiny built-in ones, the pool (shared memory, pinned for a GPU, or
torch.distributed), the execution modes with a data-parallel baseline, the packing scheduler and
the throughput-matching allocator. See docs/flow.md.
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
