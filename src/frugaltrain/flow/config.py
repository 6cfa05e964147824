"""FlowTrain configuration: keyword-only dataclasses, one per section, loaded from TOML + `--set`.

    [run] [data] [model] [pool] [sched] [alloc]

Load with `load_flow_config(path, overrides)`; unknown keys and impossible values raise
`ConfigError` (a ValueError) naming the key, the value and the fix. Each section checks its own
fields (config.Section); FlowConfig checks the rules across sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from frugaltrain.config import Section, load, require

MODES = ("monolithic", "sync", "flow")
BACKENDS = ("shm", "dist")


@dataclass(kw_only=True)
class FlowRun(Section):
    section = "run"
    mode: str = "flow"
    """Execution mode: monolithic (lockstep, one process), sync (batch-synchronized
    disaggregated, DistTrain-like) or flow (producer runs ahead, bounded by the pool)."""
    backend: str = "shm"
    """Pool backend for sync/flow: shm (shared memory, one host) or dist (torch.distributed p2p)."""
    producers: int = 1
    """Encoder (producer) worker processes; each is one encoder data-parallel replica."""
    consumers: int = 1
    """Backbone (consumer) worker processes; each is one backbone data-parallel replica."""
    threads: int = 1
    """torch threads per worker process in sync/flow mode (count)."""
    mono_threads: int = 2
    """torch threads of the single monolithic process (count); same total cores as 1+1 workers."""
    steps: int = 6
    """Optimizer steps = global batches."""
    warmup_steps: int = 1
    """Leading steps left out of throughput figures (count)."""
    seed: int = 0
    """Seed for data, model init and everything random."""
    dtype: str = "float32"
    """Parameter and activation dtype: float32 or float64 (tests use float64)."""
    lr: float = 1e-3
    """Learning rate of both modules' optimizers."""
    optimizer: str = "adamw"
    """adamw or sgd. AdamW turns round-off-sized gradients (e.g. the key bias, whose true
    gradient is 0) into lr-sized steps, so re-associated sums are compared under sgd."""
    train_encoder: bool = False
    """Trainable encoder: gradients of the embeddings flow back through the pool."""
    staleness: int = 0
    """Trainable encoder only. 0 is exact (the encoder steps on batch k before it encodes
    batch k+1). s >= 1 lets it encode batch k+s with version-k weights and recompute backward with
    the current weights: this CHANGES THE OPTIMIZATION and is never equivalent to lockstep."""
    timeout_s: float = 120.0
    """Timeout of every blocking pool call and collective (seconds)."""
    out_dir: str = "runs/flow"
    """Directory for traces, metrics JSON and the timeline PNG."""

    def check(self) -> None:
        self.one_of("mode", MODES)
        self.one_of("backend", BACKENDS)
        for name in ("producers", "consumers", "threads", "mono_threads", "steps"):
            self.at_least(name, 1)
        self.require(
            0 <= self.warmup_steps < self.steps,
            "warmup_steps",
            f"must be in [0, run.steps = {self.steps})",
        )
        self.one_of("dtype", ("float32", "float64"))
        self.positive("lr")
        self.one_of("optimizer", ("adamw", "sgd"))
        self.at_least("staleness", 0)
        self.positive("timeout_s")
        if self.staleness:
            self.require(
                self.train_encoder,
                "staleness",
                "only applies with run.train_encoder = true; set run.staleness = 0 or enable "
                "the trainable encoder",
            )
            self.require(
                self.mode == "flow",
                "staleness",
                f"only the flow mode runs ahead; set run.staleness = 0 for run.mode = "
                f"{self.mode!r}",
            )


@dataclass(kw_only=True)
class FlowData(Section):
    section = "data"
    global_batch: int = 16
    """Samples per global batch (per optimizer step)."""
    max_tiles: int = 4
    """Most digit images tiled into one sample (visual tokens = tiles * (8/patch)^2)."""
    tile_weights: tuple[float, ...] = (0.45, 0.25, 0.18, 0.12)
    """Relative frequency of 1, 2, ... max_tiles tiles (a skewed mix, like dynamic resolution)."""
    patch: int = 2
    """Patch side in pixels (2 or 4; digits are 8x8)."""

    def check(self) -> None:
        self.at_least("global_batch", 1)
        self.one_of("patch", (1, 2, 4, 8))
        self.require(1 <= self.max_tiles <= 8, "max_tiles", "must be in 1..8")
        self.require(
            len(self.tile_weights) == self.max_tiles,
            "tile_weights",
            f"needs one weight per tile count, i.e. data.max_tiles = {self.max_tiles} values",
        )
        self.require(
            all(w >= 0 for w in self.tile_weights) and sum(self.tile_weights) > 0,
            "tile_weights",
            "must be non-negative with a positive sum",
        )


@dataclass(kw_only=True)
class FlowModel(Section):
    section = "model"
    enc_dim: int = 64
    """Encoder width d_v."""
    enc_layers: int = 2
    """Encoder transformer blocks."""
    enc_heads: int = 4
    """Encoder attention heads (must divide enc_dim)."""
    lm_dim: int = 64
    """Backbone width d_model."""
    lm_layers: int = 2
    """Backbone transformer blocks."""
    lm_heads: int = 4
    """Backbone attention heads (must divide lm_dim)."""

    def check(self) -> None:
        for module in ("enc", "lm"):
            dim, heads = getattr(self, f"{module}_dim"), getattr(self, f"{module}_heads")
            self.at_least(f"{module}_heads", 1)
            self.require(
                dim % heads == 0, f"{module}_heads", f"must divide model.{module}_dim = {dim}"
            )


@dataclass(kw_only=True)
class FlowPool(Section):
    section = "pool"
    slots: int = 16
    """Slots per producer segment (samples). Bounds the producer's run-ahead; sync mode needs a
    whole global batch's share, flow only one wave of micro-batches (checked before a run)."""
    max_tokens: int = 0
    """Visual tokens per slot (0: the largest sample's, max_tiles * (8/patch)^2)."""

    def check(self) -> None:
        self.at_least("slots", 1)


@dataclass(kw_only=True)
class FlowSched(Section):
    section = "sched"
    capacity: int = 160
    """Micro-batch capacity L (tokens, visual + text) of one packed sequence."""
    policy: str = "bfd"
    """bfd (best-fit decreasing, segment tree) or fifo (next-fit in sample order)."""
    dispatch: str = "snake"
    """Micro-batch to backbone-rank dispatch: snake (zig-zag by cost), lpt or round_robin."""
    cost: str = "paper"
    """Cost model used for dispatch: paper (sum(l)/L + max(l)^2/L^2), fitted (NNLS on measured
    micro-batch times; see `frugaltrain flow plan`) or auto (profile, fit both, use the one
    with the lower held-out error)."""

    def check(self) -> None:
        self.one_of("policy", ("bfd", "fifo"))
        self.one_of("dispatch", ("snake", "lpt", "round_robin"))
        self.one_of("cost", ("paper", "fitted", "auto"))


@dataclass(kw_only=True)
class FlowAlloc(Section):
    section = "alloc"
    budget: int = 2
    """Device budget R: worker slots of one thread each. Above the core count it oversubscribes."""
    max_threads: int = 2
    """Largest threads-per-replica candidate (the CPU stand-in for tensor parallelism)."""
    profile_steps: int = 3
    """Global batches of unseen samples timed per thread count in the warm-up profile (count)."""

    def check(self) -> None:
        self.at_least("budget", 2, "one slot per module")
        self.at_least("max_threads", 1)
        self.at_least("profile_steps", 1)


@dataclass(kw_only=True)
class FlowConfig:
    run: FlowRun = field(default_factory=FlowRun)
    data: FlowData = field(default_factory=FlowData)
    model: FlowModel = field(default_factory=FlowModel)
    pool: FlowPool = field(default_factory=FlowPool)
    sched: FlowSched = field(default_factory=FlowSched)
    alloc: FlowAlloc = field(default_factory=FlowAlloc)

    def __post_init__(self) -> None:
        visual = self.data.max_tiles * self.tokens_per_tile
        require(
            self.pool.max_tokens == 0 or self.pool.max_tokens >= visual,
            "pool.max_tokens",
            self.pool.max_tokens,
            f"must be 0 or >= the largest sample's visual tokens ({visual})",
        )

    @property
    def tokens_per_tile(self) -> int:
        return (8 // self.data.patch) ** 2

    @property
    def slot_tokens(self) -> int:
        return self.pool.max_tokens or self.data.max_tiles * self.tokens_per_tile


def load_flow_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> FlowConfig:
    """Build a `FlowConfig` from an optional TOML file plus `section.key=value` overrides."""
    return load(FlowConfig, path, overrides)
