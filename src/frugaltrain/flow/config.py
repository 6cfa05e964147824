"""FlowTrain configuration: keyword-only dataclasses, one per section, loaded from TOML + `--set`.

    [run] [data] [model] [pool] [sched] [alloc]

Load with `load_flow_config(path, overrides)`; unknown keys and impossible values raise
`ConfigError` (a ValueError) naming the key, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from frugaltrain.config import ConfigError, build_config, read_toml

MODES = ("monolithic", "sync", "flow")
BACKENDS = ("shm", "dist")


@dataclass(kw_only=True)
class FlowRun:
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


@dataclass(kw_only=True)
class FlowData:
    global_batch: int = 16
    """Samples per global batch (per optimizer step)."""
    max_tiles: int = 4
    """Most digit images tiled into one sample (visual tokens = tiles * (8/patch)^2)."""
    tile_weights: tuple[float, ...] = (0.45, 0.25, 0.18, 0.12)
    """Relative frequency of 1, 2, ... max_tiles tiles (a skewed mix, like dynamic resolution)."""
    patch: int = 2
    """Patch side in pixels (2 or 4; digits are 8x8)."""


@dataclass(kw_only=True)
class FlowModel:
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


@dataclass(kw_only=True)
class FlowPool:
    slots: int = 16
    """Slots per producer segment (samples). Bounds the producer's run-ahead; sync mode needs a
    whole global batch's share, flow only one wave of micro-batches (checked before a run)."""
    max_tokens: int = 0
    """Visual tokens per slot (0: the largest sample's, max_tiles * (8/patch)^2)."""


@dataclass(kw_only=True)
class FlowSched:
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


@dataclass(kw_only=True)
class FlowAlloc:
    budget: int = 2
    """Device budget R: worker slots of one thread each. Above the core count it oversubscribes."""
    max_threads: int = 2
    """Largest threads-per-replica candidate (the CPU stand-in for tensor parallelism)."""
    profile_steps: int = 3
    """Global batches of unseen samples timed per thread count in the warm-up profile (count)."""


@dataclass(kw_only=True)
class FlowConfig:
    run: FlowRun = field(default_factory=FlowRun)
    data: FlowData = field(default_factory=FlowData)
    model: FlowModel = field(default_factory=FlowModel)
    pool: FlowPool = field(default_factory=FlowPool)
    sched: FlowSched = field(default_factory=FlowSched)
    alloc: FlowAlloc = field(default_factory=FlowAlloc)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def tokens_per_tile(self) -> int:
        return (8 // self.data.patch) ** 2

    @property
    def slot_tokens(self) -> int:
        return self.pool.max_tokens or self.data.max_tiles * self.tokens_per_tile


def _require(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r}: {rule}")


def _validate(c: FlowConfig) -> None:
    r, d, m, p, s, a = c.run, c.data, c.model, c.pool, c.sched, c.alloc
    _require(r.mode in MODES, "run.mode", r.mode, f"choose one of {', '.join(MODES)}")
    _require(r.backend in BACKENDS, "run.backend", r.backend, "choose shm or dist")
    _require(r.producers >= 1, "run.producers", r.producers, "must be at least 1")
    _require(r.consumers >= 1, "run.consumers", r.consumers, "must be at least 1")
    _require(r.threads >= 1, "run.threads", r.threads, "must be at least 1")
    _require(r.mono_threads >= 1, "run.mono_threads", r.mono_threads, "must be at least 1")
    _require(r.steps >= 1, "run.steps", r.steps, "must be at least 1")
    _require(
        0 <= r.warmup_steps < r.steps,
        "run.warmup_steps",
        r.warmup_steps,
        f"must be in [0, run.steps = {r.steps})",
    )
    _require(r.dtype in ("float32", "float64"), "run.dtype", r.dtype, "choose float32 or float64")
    _require(r.lr > 0, "run.lr", r.lr, "must be positive")
    _require(r.optimizer in ("adamw", "sgd"), "run.optimizer", r.optimizer, "choose adamw or sgd")
    _require(r.staleness >= 0, "run.staleness", r.staleness, "must be >= 0")
    _require(r.timeout_s > 0, "run.timeout_s", r.timeout_s, "must be positive")
    _require(d.global_batch >= 1, "data.global_batch", d.global_batch, "must be at least 1")
    _require(d.patch in (1, 2, 4, 8), "data.patch", d.patch, "choose 1, 2, 4 or 8 (divides 8)")
    _require(1 <= d.max_tiles <= 8, "data.max_tiles", d.max_tiles, "must be in 1..8")
    _require(
        len(d.tile_weights) == d.max_tiles,
        "data.tile_weights",
        d.tile_weights,
        f"needs one weight per tile count, i.e. data.max_tiles = {d.max_tiles} values",
    )
    _require(
        all(w >= 0 for w in d.tile_weights) and sum(d.tile_weights) > 0,
        "data.tile_weights",
        d.tile_weights,
        "must be non-negative with a positive sum",
    )
    for key, dim, heads in (("enc", m.enc_dim, m.enc_heads), ("lm", m.lm_dim, m.lm_heads)):
        _require(
            dim % heads == 0, f"model.{key}_heads", heads, f"must divide model.{key}_dim = {dim}"
        )
    _require(p.slots >= 1, "pool.slots", p.slots, "must be at least 1")
    _require(
        p.max_tokens == 0 or p.max_tokens >= d.max_tiles * c.tokens_per_tile,
        "pool.max_tokens",
        p.max_tokens,
        f"must be 0 or >= the largest sample's visual tokens ({d.max_tiles * c.tokens_per_tile})",
    )
    _require(s.policy in ("bfd", "fifo"), "sched.policy", s.policy, "choose bfd or fifo")
    _require(
        s.dispatch in ("snake", "lpt", "round_robin"),
        "sched.dispatch",
        s.dispatch,
        "choose snake, lpt or round_robin",
    )
    _require(
        s.cost in ("paper", "fitted", "auto"), "sched.cost", s.cost, "choose paper, fitted or auto"
    )
    _require(a.budget >= 2, "alloc.budget", a.budget, "must be at least 2 (one slot per module)")
    _require(a.max_threads >= 1, "alloc.max_threads", a.max_threads, "must be at least 1")
    _require(a.profile_steps >= 1, "alloc.profile_steps", a.profile_steps, "must be at least 1")
    if r.staleness and not r.train_encoder:
        raise ConfigError(
            f"run.staleness = {r.staleness}: only applies with run.train_encoder = "
            "true; set run.staleness = 0 or enable the trainable encoder"
        )
    if r.staleness and r.mode != "flow":
        raise ConfigError(
            f"run.staleness = {r.staleness}: only the flow mode runs ahead; set "
            f"run.staleness = 0 for run.mode = {r.mode!r}"
        )


def load_flow_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> FlowConfig:
    """Build a `FlowConfig` from an optional TOML file plus `section.key=value` overrides."""
    return build_config(FlowConfig, read_toml(path) if path else {}, overrides)
