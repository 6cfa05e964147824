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

MODES = ("monolithic", "monolithic_dp", "sync", "flow")
BACKENDS = ("shm", "dist")
SOURCES = ("digits", "shapes", "folder")
ENCODERS = ("tiny", "vit", "siglip")
BACKBONES = ("tiny", "llama")


@dataclass(kw_only=True)
class FlowRun(Section):
    section = "run"
    mode: str = "flow"
    """Execution mode: monolithic (lockstep, one process), monolithic_dp (lockstep data
    parallelism over run.producers + run.consumers processes: the flow run's process count),
    sync (batch-synchronized disaggregated, DistTrain-like) or flow (producer runs ahead,
    bounded by the pool)."""
    backend: str = "shm"
    """Pool backend for sync/flow: shm (shared memory, one host) or dist (torch.distributed p2p)."""
    producers: int = 1
    """Encoder (producer) worker processes; each is one encoder data-parallel replica."""
    consumers: int = 1
    """Backbone (consumer) worker processes; each is one backbone data-parallel replica."""
    threads: int = 1
    """torch threads per worker process in monolithic_dp, sync and flow modes (count)."""
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
    device: str = "cpu"
    """cpu or cuda. With cuda every worker runs on the one visible GPU (cuda:0) and the shm
    pool's slabs are pinned host memory, so embeddings and gradients move by DMA."""

    def check(self) -> None:
        self.one_of("mode", MODES)
        self.one_of("backend", BACKENDS)
        self.one_of("device", ("cpu", "cuda"))
        self.require(
            self.device == "cpu" or self.backend == "shm" or self.mode.startswith("monolithic"),
            "device",
            "the dist pool sends over gloo, which has no CUDA point-to-point; use "
            "run.backend = 'shm' with run.device = 'cuda'",
        )
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
    source: str = "digits"
    """digits (scikit-learn's 8x8 digits, tiled; for the tiny encoder), shapes (procedural
    scenes of coloured shapes at variable resolution, captioned from the scene) or folder
    (data.path: images and a metadata.jsonl of captions, read with datasets' imagefolder)."""
    path: str = ""
    """source = folder: a directory of images with a metadata.jsonl holding one
    {"file_name": ..., data.caption_field: ...} line per image."""
    caption_field: str = "text"
    """source = folder: the metadata.jsonl column that holds the caption."""
    tokenizer: str = ""
    """shapes and folder: a tokenizer directory in the transformers format (e.g. made by
    `frugaltrain data tokenizer`); empty for byte-level tokens (256 ids, nothing to train)."""
    global_batch: int = 16
    """Samples per global batch (per optimizer step)."""
    max_tiles: int = 4
    """digits: most digit images tiled into one sample (visual tokens = tiles * (8/patch)^2)."""
    tile_weights: tuple[float, ...] = (0.45, 0.25, 0.18, 0.12)
    """digits: relative frequency of 1, 2, ... max_tiles tiles (a skewed mix, like dynamic
    resolution)."""
    patch: int = 2
    """Patch side in pixels: digits 1, 2, 4 or 8 (the tiles are 8x8); for the transformers
    vision towers their patch_size (e.g. 16), which every entry of data.image_sides must be a
    multiple of."""
    image_sides: tuple[int, ...] = (32, 48, 64, 96)
    """shapes and folder: the square sides (pixels) an image may have. A shapes scene is drawn
    at one of them; a folder image is resized to the one nearest its longer edge. Visual tokens
    per image are (side / patch)^2 (+1 for ViT's CLS token), so they vary per image."""
    side_weights: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1)
    """shapes: relative frequency of each entry of data.image_sides (one weight per side)."""
    max_shapes: int = 4
    """shapes: most shapes in one scene (1..9; each on its own cell of a 3x3 grid)."""

    def check(self) -> None:
        self.at_least("global_batch", 1)
        self.one_of("source", SOURCES)
        self.at_least("patch", 1)
        if self.source == "digits":
            self.one_of("patch", (1, 2, 4, 8))
        else:
            self._check_images()
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

    def _check_images(self) -> None:
        self.require(
            len(self.image_sides) > 0 and all(s % self.patch == 0 for s in self.image_sides),
            "image_sides",
            f"needs at least one side, each a multiple of data.patch = {self.patch}",
        )
        self.require(
            len(self.side_weights) == len(self.image_sides),
            "side_weights",
            f"needs one weight per entry of data.image_sides ({len(self.image_sides)} values)",
        )
        self.require(
            all(w >= 0 for w in self.side_weights) and sum(self.side_weights) > 0,
            "side_weights",
            "must be non-negative with a positive sum",
        )
        self.require(1 <= self.max_shapes <= 9, "max_shapes", "must be in 1..9 (a 3x3 grid)")
        self.require(
            self.source != "folder" or bool(self.path),
            "path",
            "data.source = 'folder' needs a directory of images with a metadata.jsonl",
        )


@dataclass(kw_only=True)
class FlowModel(Section):
    section = "model"
    encoder: str = "tiny"
    """The producer: tiny (the built-in TinyViT; data.source = digits), vit (transformers
    ViTModel) or siglip (transformers SiglipVisionModel); the last two take images of any
    side in data.image_sides (interpolated position embeddings)."""
    backbone: str = "tiny"
    """The consumer's language model: tiny (built-in) or llama (transformers
    LlamaForCausalLM), behind a 2-layer projector either way."""
    encoder_pretrained: str = ""
    """vit or siglip: a local directory (config.json + weights) to load instead of a random
    init from the size keys; nothing is downloaded."""
    backbone_pretrained: str = ""
    """llama: a local directory (config.json + weights) to load instead of a random init."""
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
    lm_kv_heads: int = 0
    """llama: key-value heads (grouped-query attention; must divide lm_heads); 0 = lm_heads."""

    def check(self) -> None:
        self.one_of("encoder", ENCODERS)
        self.one_of("backbone", BACKBONES)
        self.at_least("lm_kv_heads", 0)
        self.require(
            self.lm_kv_heads == 0 or self.lm_heads % self.lm_kv_heads == 0,
            "lm_kv_heads",
            f"must divide model.lm_heads = {self.lm_heads}",
        )
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
    """Visual tokens per slot (0: the largest sample's: max_tiles * (8/patch)^2 for digits,
    the largest image side's for shapes and folder)."""

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
        tiny = self.model.encoder == "tiny"
        require(
            tiny == (self.data.source == "digits"),
            "model.encoder",
            self.model.encoder,
            "the tiny encoder reads digits tiles and the transformers towers read images: use "
            "model.encoder = 'tiny' with data.source = 'digits', or 'vit'/'siglip' with "
            "'shapes'/'folder'",
        )
        require(
            self.pool.max_tokens == 0 or self.pool.max_tokens >= self.max_visual_tokens,
            "pool.max_tokens",
            self.pool.max_tokens,
            f"must be 0 or >= the largest sample's visual tokens ({self.max_visual_tokens})",
        )

    @property
    def tokens_per_tile(self) -> int:
        return (8 // self.data.patch) ** 2

    def visual_tokens(self, side: int) -> int:
        """Encoder output tokens of one square image: its patches, plus ViT's CLS token."""
        return (side // self.data.patch) ** 2 + (self.model.encoder == "vit")

    @property
    def max_visual_tokens(self) -> int:
        if self.data.source == "digits":
            return self.data.max_tiles * self.tokens_per_tile
        return self.visual_tokens(max(self.data.image_sides))

    @property
    def slot_tokens(self) -> int:
        return self.pool.max_tokens or self.max_visual_tokens


def load_flow_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> FlowConfig:
    """Build a `FlowConfig` from an optional TOML file plus `section.key=value` overrides."""
    return load(FlowConfig, path, overrides)
