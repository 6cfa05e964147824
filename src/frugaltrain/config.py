"""Validated run configuration: keyword-only dataclasses, loaded from TOML plus `--set` overrides.

A config file has one table per section (`[run]`, `[data]`, `[model]`, `[optim]`, `[outer]`).
`--set section.key=value` overrides any field; values are parsed as TOML literals
(`--set outer.H=50`, `--set optim.betas=[0.9,0.95]`, `--set outer.strategy=diloco`).
Unknown keys, wrong types and impossible combinations raise `ConfigError` (a ValueError)
naming the key, the value and the fix, before any work starts.

The loader (`build_config`) is generic over nested dataclasses so other subsystems
(FlowTrain, energy) reuse it for their own config classes.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib


class ConfigError(ValueError):
    """A user-facing configuration error: names the key, the value and the fix."""


@dataclass(kw_only=True)
class RunSection:
    name: str = "run"
    """Run name; the run directory is `out_dir/name` (a numeric suffix is added if it exists)."""
    out_dir: str = "runs"
    """Parent directory of run directories."""
    workers: int = 1
    """Number of worker processes (each a full model replica)."""
    seed: int = 0
    """Seed for model init, data order and everything random."""
    steps: int = 200
    """Inner steps per worker (optimizer steps)."""
    eval_every: int = 50
    """Evaluate validation loss every this many inner steps (0: only at the end)."""
    eval_batches: int = 8
    """Number of fixed validation batches per evaluation."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many outer rounds (0: only at the end)."""
    stop_at_round: int = 0
    """Stop (with a checkpoint) after this outer round; 0 runs to the end (resume tests, demos)."""
    threads: int = 0
    """torch threads per worker (0: cores / workers, at least 1)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on GPU, gloo on CPU), gloo or nccl."""
    device: str = "cpu"
    """cpu or cuda (worker i uses cuda:i modulo the visible devices)."""
    timeout_s: float = 300.0
    """Timeout of every collective, in seconds."""
    deterministic_comm: bool = False
    """Reduce all-reduces as gather + fp64 sum in rank order (bit-identical to the simulator and
    order-independent) instead of the native ring all-reduce; costs (M-1) S instead of
    2 (M-1)/M S bytes per worker."""
    progress: bool = True
    """Show a progress bar on worker 0."""
    fault_tolerance: bool = False
    """Membership epochs, deadlines and rejoin (frugaltrain.ft): workers that die or stop
    answering for run.timeout_s are dropped, restarted ones rejoin from a live peer; local
    launches only. See docs/fault_tolerance.md."""
    mix1_deadline_s: float = 10.0
    """Fault-tolerant runtime: the longest a worker waits at a round end for Mix1 messages still
    missing (a straggler's or a dead peer's), capped by run.timeout_s. Later ones are dropped and
    the row renormalized, so Mix1 never waits on a straggler beyond this."""
    inject: str = ""
    """Faults to inject (needs fault_tolerance), ';'-separated: 'kill:worker=2,round=5',
    'hang:worker=1,round=3', 'partition:worker=1,round=3,seconds=5', 'slow:worker=1,factor=3',
    'drop:p=0.1' (see frugaltrain.ft.inject)."""


@dataclass(kw_only=True)
class DataSection:
    path: str = ""
    """Text file or directory of text files; empty uses the Python standard library's sources."""
    max_bytes: int = 4_000_000
    """Read at most this many bytes of the corpus (0: no limit)."""
    val_fraction: float = 0.05
    """Fraction of documents (files) held out for validation, chosen by a hash of their path."""
    sharding: str = "iid"
    """iid (each shard interleaves 4 KiB chunks of the stream) or noniid (contiguous slices)."""
    num_shards: int = 0
    """Number of data shards (0: one per worker). Worker i reads shards i, i+workers, ..."""
    seq_len: int = 128
    """Tokens per training sequence."""
    batch_size: int = 16
    """Sequences per inner step per worker."""


@dataclass(kw_only=True)
class ModelSection:
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads (must divide n_embd)."""
    n_embd: int = 128
    """Model width."""
    vocab_size: int = 256
    """Vocabulary size; 256 for byte-level tokens."""
    dropout: float = 0.0
    """Dropout probability."""
    bias: bool = False
    """Bias in Linear and LayerNorm layers."""
    tie_embeddings: bool = False
    """Share the token embedding with the LM head (off: embedding and head are separate tensors)."""


@dataclass(kw_only=True)
class OptimSection:
    name: str = "adamw"
    """Inner optimizer: adamw (torch.optim.AdamW), or FORGE's optimizer-in-backward (no weight
    gradient is ever materialized; docs/forge.md): forge-adamw, forge-sgd (momentum betas[0]) or
    forge-lion."""
    lr: float = 3e-3
    """Peak inner learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (applied to matrices and embeddings, not to norms and biases)."""
    warmup_steps: int = 20
    """Linear warmup, in inner steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio at the last step."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this value (0: off)."""


@dataclass(kw_only=True)
class OuterSection:
    strategy: str = "diloco"
    """Outer strategy: ddp, diloco, fgd (Factored Gossip DiLoCo), noloco or streaming."""
    H: int = 50
    """Inner steps per outer round (for ddp: steps per logged round)."""
    lr: float = 0.7
    """Outer learning rate (gamma)."""
    momentum: float = 0.9
    """Outer momentum (mu); 0 gives plain outer SGD."""
    nesterov: bool = True
    """Nesterov outer momentum (ignored when momentum is 0)."""
    codec: str = "fp32"
    """Encoding of everything the outer step sends: fp32, bf16, int8 or e3m0 (4-bit)."""
    preset: str = ""
    """fgd only: a named variant that sets mix1/mix2/mix2_params: GlobalM1 (complete / none) or
    GlobalM1LocalM2 (complete / pairs on all tensors). Empty: use the keys as given."""
    mix1: str = "complete"
    """fgd: topology of the non-blocking parameter mix (complete, ring, pairs, exponential,
    none)."""
    mix2: str = "none"
    """fgd: topology of the blocking pseudo-gradient mix."""
    mix2_params: str = "all"
    """fgd: tensors Mix2 covers: all, none, or '+'-joined parts among embed, head, blocks:K (the
    first K blocks) and fnmatch patterns of parameter names, e.g. embed+head+blocks:2."""
    momentum_policy: str = "local"
    """fgd: local (each worker keeps its outer momentum) or mixed (Mix1 also mixes it: the
    paper's GlobalM1S, reported to spike)."""
    group_size: int = 2
    """noloco: workers per random group each round."""
    consensus_pull: float = 0.7
    """noloco: gamma, the pull towards the group's mean parameters (public code: = outer lr)."""
    fragments: int = 4
    """streaming: number of parameter fragments P (strided over blocks)."""
    overlap: int = 1
    """streaming: inner steps tau between sending a fragment and applying its outer step."""
    merge_alpha: float = 0.0
    """streaming: theta <- alpha theta + (1 - alpha) x_new for a synced fragment (0: replace)."""


@dataclass(kw_only=True)
class Config:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    outer: OuterSection = field(default_factory=OuterSection)

    def __post_init__(self) -> None:
        validate(self)


STRATEGIES = ("ddp", "diloco", "fgd", "noloco", "streaming")
INNER_OPTIMIZERS = ("adamw", "forge-adamw", "forge-sgd", "forge-lion")
TOPOLOGIES = ("complete", "ring", "pairs", "exponential", "none")
CODECS = ("fp32", "bf16", "int8", "e3m0")
FGD_PRESETS = {
    "GlobalM1": {"mix1": "complete", "mix2": "none", "mix2_params": "all"},
    "GlobalM1LocalM2": {"mix1": "complete", "mix2": "pairs", "mix2_params": "all"},
}


def fgd_mixing(o: OuterSection) -> dict[str, str]:
    """mix1, mix2 and mix2_params of an fgd config, with its preset applied."""
    chosen = {"mix1": o.mix1, "mix2": o.mix2, "mix2_params": o.mix2_params}
    return {**chosen, **FGD_PRESETS.get(o.preset, {})}


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r}: {rule}")


def validate(cfg: Config) -> None:
    """Check ranges and cross-field rules; every message states the rule that failed."""
    r, d, m, o, opt = cfg.run, cfg.data, cfg.model, cfg.outer, cfg.optim
    _require(r.workers >= 1, "run.workers", r.workers, "must be at least 1")
    _require(r.steps >= 1, "run.steps", r.steps, "must be at least 1")
    _require(r.eval_every >= 0, "run.eval_every", r.eval_every, "must be >= 0 (0: end only)")
    _require(r.eval_batches >= 1, "run.eval_batches", r.eval_batches, "must be at least 1")
    _require(
        r.backend in ("auto", "gloo", "nccl"), "run.backend", r.backend, "choose auto, gloo or nccl"
    )
    _require(r.device in ("cpu", "cuda"), "run.device", r.device, "choose cpu or cuda")
    _require(r.timeout_s > 0, "run.timeout_s", r.timeout_s, "must be positive")
    _require(r.mix1_deadline_s > 0, "run.mix1_deadline_s", r.mix1_deadline_s, "must be positive")
    _require(
        not r.inject or r.fault_tolerance,
        "run.inject",
        r.inject,
        "faults are injected by the fault-tolerant runtime; set run.fault_tolerance = true",
    )
    if r.inject:
        from frugaltrain.ft.inject import parse

        try:
            parse(r.inject)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _require(d.sharding in ("iid", "noniid"), "data.sharding", d.sharding, "choose iid or noniid")
    _require(
        0 < d.val_fraction < 1,
        "data.val_fraction",
        d.val_fraction,
        "must be strictly between 0 and 1",
    )
    _require(d.seq_len >= 2, "data.seq_len", d.seq_len, "must be at least 2")
    _require(d.batch_size >= 1, "data.batch_size", d.batch_size, "must be at least 1")
    _require(d.max_bytes >= 0, "data.max_bytes", d.max_bytes, "must be >= 0 (0: no limit)")
    _require(d.num_shards >= 0, "data.num_shards", d.num_shards, "must be >= 0 (0: one per worker)")
    if d.num_shards:
        _require(
            d.num_shards >= r.workers,
            "data.num_shards",
            d.num_shards,
            f"fewer shards than run.workers = {r.workers}; set data.num_shards >= "
            f"{r.workers} or 0 (one shard per worker)",
        )
    _require(m.n_layer >= 1, "model.n_layer", m.n_layer, "must be at least 1")
    _require(
        m.n_embd % m.n_head == 0, "model.n_head", m.n_head, f"must divide model.n_embd = {m.n_embd}"
    )
    _require(m.vocab_size >= 2, "model.vocab_size", m.vocab_size, "must be at least 2")
    _require(0 <= m.dropout < 1, "model.dropout", m.dropout, "must be in [0, 1)")
    _require(
        opt.name in INNER_OPTIMIZERS,
        "optim.name",
        opt.name,
        f"choose one of {', '.join(INNER_OPTIMIZERS)}",
    )
    _require(
        not (opt.name.startswith("forge-") and o.strategy == "ddp" and r.workers > 1),
        "optim.name",
        opt.name,
        f"FORGE updates weights inside backward, so no gradient exists for outer.strategy = "
        f"'ddp' to all-reduce over run.workers = {r.workers}; use optim.name = 'adamw' with ddp, "
        "or a DiLoCo-family outer strategy (diloco, fgd, noloco, streaming) with FORGE",
    )
    _require(opt.lr > 0, "optim.lr", opt.lr, "must be positive")
    _require(all(0 <= b < 1 for b in opt.betas), "optim.betas", opt.betas, "each must be in [0, 1)")
    _require(opt.warmup_steps >= 0, "optim.warmup_steps", opt.warmup_steps, "must be >= 0")
    _require(
        0 <= opt.min_lr_ratio <= 1, "optim.min_lr_ratio", opt.min_lr_ratio, "must be in [0, 1]"
    )
    _require(opt.grad_clip >= 0, "optim.grad_clip", opt.grad_clip, "must be >= 0 (0: off)")
    _require(
        o.strategy in STRATEGIES,
        "outer.strategy",
        o.strategy,
        f"choose one of {', '.join(STRATEGIES)}",
    )
    _require(o.H >= 1, "outer.H", o.H, "must be at least 1 (inner steps per outer round)")
    _require(
        o.H <= r.steps,
        "outer.H",
        o.H,
        f"exceeds run.steps = {r.steps}, so no outer round would run; lower outer.H",
    )
    if o.strategy != "ddp":
        _require(
            r.steps % o.H == 0,
            "run.steps",
            r.steps,
            f"must be a multiple of outer.H = {o.H} so the run ends on an outer round; "
            f"use run.steps = {max(o.H, r.steps // o.H * o.H)}",
        )
    _require(o.lr > 0, "outer.lr", o.lr, "must be positive")
    _require(0 <= o.momentum < 1, "outer.momentum", o.momentum, "must be in [0, 1)")
    _require(o.codec in CODECS, "outer.codec", o.codec, f"choose one of {', '.join(CODECS)}")
    _require(
        o.preset in ("", *FGD_PRESETS),
        "outer.preset",
        o.preset,
        f"choose one of {', '.join(FGD_PRESETS)} or leave empty",
    )
    _require(
        not o.preset or o.strategy == "fgd",
        "outer.preset",
        o.preset,
        "presets name fgd variants; set outer.strategy = 'fgd' or drop the preset",
    )
    defaults = OuterSection()
    for key, value in FGD_PRESETS.get(o.preset, {}).items():
        _require(
            getattr(o, key) in (value, getattr(defaults, key)),
            f"outer.{key}",
            getattr(o, key),
            f"conflicts with outer.preset = {o.preset!r} (which sets {value!r}); drop one",
        )
    for key in ("mix1", "mix2"):
        value = getattr(o, key)
        _require(
            value in TOPOLOGIES, f"outer.{key}", value, f"choose one of {', '.join(TOPOLOGIES)}"
        )
    _require(
        o.momentum_policy in ("local", "mixed"),
        "outer.momentum_policy",
        o.momentum_policy,
        "choose local or mixed",
    )
    _require(o.group_size >= 2, "outer.group_size", o.group_size, "must be at least 2")
    _require(o.consensus_pull >= 0, "outer.consensus_pull", o.consensus_pull, "must be >= 0")
    _require(0 <= o.merge_alpha <= 1, "outer.merge_alpha", o.merge_alpha, "must be in [0, 1]")
    if o.strategy == "streaming":
        _require(o.fragments >= 1, "outer.fragments", o.fragments, "must be at least 1")
        _require(
            o.fragments <= m.n_layer,
            "outer.fragments",
            o.fragments,
            f"cannot exceed model.n_layer = {m.n_layer} (fragments are groups of blocks)",
        )
        _require(
            0 <= o.overlap < o.H // o.fragments,
            "outer.overlap",
            o.overlap,
            f"must be in [0, outer.H / outer.fragments = {o.H // o.fragments}) so a fragment "
            "is sent inside its own slot of the round",
        )
        _require(
            o.H % o.fragments == 0,
            "outer.fragments",
            o.fragments,
            f"must divide outer.H = {o.H} so fragments fire at offsets k H / P",
        )
    _warn_unused_outer_keys(o)


# The [outer] keys each strategy reads (build_strategy in train/loop.py).
_OUTER_KEYS_READ = {
    "ddp": {"strategy", "H"},
    "diloco": {"strategy", "H", "lr", "momentum", "nesterov"},
    "fgd": {
        *("strategy", "H", "lr", "momentum", "nesterov", "codec", "preset"),
        *("mix1", "mix2", "mix2_params", "momentum_policy"),
    },
    "noloco": {"strategy", "H", "lr", "momentum", "codec", "group_size", "consensus_pull"},
    "streaming": {
        *("strategy", "H", "lr", "momentum", "nesterov", "codec"),
        *("fragments", "overlap", "merge_alpha"),
    },
}


def _warn_unused_outer_keys(o: OuterSection) -> None:
    """Warn (once per process and key set) about [outer] keys set away from their default that
    the chosen strategy never reads, e.g. outer.codec with diloco (its all-reduce is fp32)."""
    unused = [
        f"outer.{f.name} = {getattr(o, f.name)!r}"
        for f in dataclasses.fields(o)
        if f.name not in _OUTER_KEYS_READ[o.strategy] and getattr(o, f.name) != f.default
    ]
    if unused:
        warnings.warn(
            f"{', '.join(unused)}: no effect with outer.strategy = {o.strategy!r}; drop it",
            stacklevel=2,
        )


# ---------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotated type `tp`; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{key} = {value!r}: expected {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key} = {value!r}: expected nothing")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r}: expected a list like [0.9, 0.95]")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(key, v, args[0]) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{key} = {value!r}: expected {len(args)} values")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args, strict=True))
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r}: expected a list")
        return [_coerce(key, v, arg) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected true or false")
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected {_type_name(tp)}, got a boolean")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(
            f"{key} = {value!r}: expected {_type_name(tp)}, got {type(value).__name__}"
        )
    return value


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. outer.H=50")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as diloco is taken as a string
    return key.strip().split("."), value


def _merge(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is a value, not a section")
    tree[path[-1]] = value


def _build(cls: type, raw: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            near = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {prefix}{key}; valid keys here: {near}")
    kwargs = {}
    for name, value in raw.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{name} is a section; write [{prefix}{name}] keys")
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", value, tp)
    return cls(**kwargs)


def build_config(cls: type, raw: dict | None = None, overrides: list[str] | None = None) -> Any:
    """Build dataclass `cls` from a nested dict plus `key=value` overrides; validate all."""
    tree: dict = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for item in overrides or []:
        path, value = _parse_override(item)
        _merge(tree, path, value)
    return _build(cls, tree, "")


def read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing .toml file")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a training `Config` from an optional TOML file and `--set` overrides."""
    return build_config(Config, read_toml(path) if path else {}, overrides)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Any) -> str:
    """Render a two-level config dataclass as TOML; `load_config` reads it back equal."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")
