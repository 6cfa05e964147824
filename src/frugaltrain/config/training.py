"""The training config: five sections (`[run] [data] [model] [optim] [outer]`), one class each;
[outer] nests one sub-section per strategy with keys of its own ([outer.diloco], [outer.fgd],
[outer.noloco], [outer.streaming]).

Each section checks its own fields; `Config` checks the rules that span sections (outer.H
against run.steps, FORGE with ddp, Streaming's fragments against the model's blocks). The
names the config accepts live here too (strategies and the keys each reads, topologies, fgd
presets, the planner's methods); the code that implements each name lives above (outer/, comm/,
sim/) and takes its list of names from here. Codec names are the codecs' own grammar
(codecs/grammar.py, which imports no torch), and fault specs the injector's (inject.py).
"""

from __future__ import annotations

import dataclasses
import re
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from frugaltrain import inject
from frugaltrain.codecs.grammar import codec_error
from frugaltrain.config.base import ConfigError, Section, require

# The shared [outer] keys each strategy reads (besides outer.strategy); each also reads all of
# its own sub-section ([outer.fgd], [outer.noloco], [outer.streaming]), so the full list,
# OUTER_KEYS, is derived from the dataclasses below. The names are those `outer.strategy`
# accepts; outer.STRATEGIES maps them to classes whose constructors take these keys, all but
# auto, which the launcher replaces by the method the planner picks (sim/plan.py) before any
# worker starts (it reads only H and [outer.auto]).
_ROUND_KEYS = ("H", "lr", "momentum", "nesterov", "codec", "feedback_decay", "coded_average")
SHARED_KEYS = {
    "ddp": ("H",),
    "diloco": _ROUND_KEYS,
    "fgd": (*_ROUND_KEYS, "param_codec"),
    "noloco": ("H", "lr", "momentum", "codec", "feedback_decay", "coded_average", "param_codec"),
    "streaming": _ROUND_KEYS,
    "auto": ("H",),
}
AUTO_METHODS = {
    "diloco": "DiLoCo",
    "diloco-4bit": "DiLoCo, 4-bit pseudo-gradients, rounds twice as often",
    "diloco-overlap": "DiLoCo, 4-bit, overlapped: the default job's method",
    "streaming": "Streaming DiLoCo",
    "noloco": "NoLoCo",
    "fgd": "Factored Gossip DiLoCo (GlobalM1LocalM2), 4-bit",
    "ddp": "DDP",
}
"""The methods `outer.strategy = "auto"` and `frugaltrain plan` choose from: the name a user
types (--methods, outer.auto.methods) and what it is, in words. The penalties file (PENALTIES)
holds each one's [outer] table as measured side by side (benchmarks/time_to_loss.py) and its
measured step penalty. diloco-4bit and diloco-overlap (examples/default.toml's [outer]) ran at
half DiLoCo's H and plan at half of outer.H; fgd is examples/fgd_globalm1_localm2_4bit.toml's
method."""
PENALTIES = "benchmarks/results/penalties.json"
"""The step penalties the planner reads unless told otherwise (outer.auto.penalties, plan
--penalties), relative to the working directory: the lab's measured file in this repository."""
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")
_MARKOV_ITEM = re.compile(r"[a-z_]+=[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
INNER_OPTIMIZERS = ("adamw", "forge-adamw", "forge-sgd", "forge-lion")
MODEL_FAMILIES = ("gpt", "llama", "qwen2", "gpt2", "hf")  # built in models/__init__.py
TOPOLOGIES = ("complete", "ring", "pairs", "exponential", "none")  # built in comm/topology.py
FGD_PRESETS = {
    "GlobalM1": {"mix1": "complete", "mix2": "none", "mix2_params": "all"},
    "GlobalM1LocalM2": {"mix1": "complete", "mix2": "pairs", "mix2_params": "all"},
    # No Mix1, a complete Mix2: DiLoCo's round (the paper's ablation of Mix1).
    "GlobalM2": {"mix1": "none", "mix2": "complete", "mix2_params": "all"},
}


@dataclass(kw_only=True)
class RunSection(Section):
    section = "run"
    name: str = "run"
    """Run name; the run directory is `out_dir/name` (a numeric suffix is added if it exists)."""
    out_dir: str = "runs"
    """Parent directory of run directories."""
    workers: int = 1
    """Number of workers (model replicas), the members of the outer strategy; across machines
    that come and go, the run's slots (docs/multihost.md)."""
    min_workers: int = 1
    """With fault tolerance: the fewest live workers that train on. With fewer, the members
    wait at a round end (up to run.timeout_s) until a worker joins."""
    shards: int = 1
    """Processes per replica: its parameters, gradients and inner optimizer states are sharded
    over them with FSDP2, each takes data.batch_size / shards of its replica's batch, and the
    outer strategy runs across replicas on matching shards (docs/sharding.md). 1: one process
    holds a whole replica."""
    activation_checkpointing: bool = False
    """Keep only each transformer block's input for backward and recompute the rest (less
    activation memory for about one more forward pass of compute)."""
    seed: int = 0
    """Seed for model init, data order and everything random."""
    steps: int = 200
    """Inner steps per worker (optimizer steps)."""
    eval_every: int = 50
    """Evaluate validation loss every this many inner steps (0: only at the end)."""
    eval_batches: int = 8
    """Number of fixed validation batches per evaluation."""
    eval_diagnostics: bool = True
    """With several workers, an evaluation also measures how far apart they are and the loss of
    their averaged model: an all-reduce of every parameter, which waits for any transfer still in
    flight. false: each worker's own validation loss only, averaged with the round's scalars
    without blocking (timing runs on slow links)."""
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
    dtype: str = "fp32"
    """Compute precision of the inner steps: fp32, or bf16 (autocast of forward passes, on CPU
    and GPU); weights, inner optimizer states and all outer state stay fp32."""
    timeout_s: float = 300.0
    """Timeout of every collective, in seconds (with fault tolerance: the longest any wait may
    last, before three rounds have been timed and as a cap on the adaptive deadline)."""
    deterministic_comm: bool = False
    """Reduce all-reduces as gather + fp64 sum in rank order (bit-identical to the simulator and
    order-independent) instead of the native ring all-reduce; costs (M-1) S instead of
    2 (M-1)/M S bytes per worker."""
    link_mbit: list[float] = field(default_factory=list)
    """Emulated links, Mbit/s: each worker's algorithm traffic is paced in process to this rate
    (comm/pacing.py: one FIFO full-duplex queue per worker, no root needed), so a fast machine
    shows what slow links cost. One value for every worker, or run.workers values (one per
    worker, e.g. one slow link); [] (default): the links as they are. Every time figure of such
    a run is labelled "emulated"; shaped links (netlab) give the figures to publish."""
    progress: bool = True
    """Show a progress bar on worker 0."""
    tensorboard: bool = False
    """Also write every numeric metric of metrics.jsonl as TensorBoard events to
    `<run dir>/tensorboard/`, against the inner step (metrics/sinks.py); needs the tensorboard
    extra."""
    wandb: str = ""
    """Also log the same metrics to an offline Weights & Biases run in `<run dir>/wandb/`:
    "" (off) or "offline" (upload later with `wandb sync`); needs the wandb extra."""
    guard: str = "reject"
    """What happens to a contribution (pseudo-gradient or parameters) far outside the others
    before it is averaged or mixed: reject (left out; its sender takes its peers' values), clip
    (scaled down to run.guard_factor x the median norm) or off. Non-finite ones are always
    rejected (comm/guard.py)."""
    guard_factor: float = 10.0
    """A contribution whose norm exceeds this multiple of the median of the members' norms is
    an outlier."""
    # Keys that moved to their own section: refused here with their new name.
    moved: ClassVar[dict[str, str]] = {
        "fault_tolerance": "fault_tolerance.enabled",
        **{k: f"fault_tolerance.{k}" for k in ("mix1_deadline_s", "max_restarts", "inject")},
        **{k: f"fault_tolerance.{k}" for k in ("deadline_factor", "deadline_floor_s")},
    }

    def check(self) -> None:
        self.require(
            _PLAIN_NAME.fullmatch(self.name) is not None and self.name not in (".", ".."),
            "name",
            "must be a plain name (letters, digits, '.', '_', '-'): the run directory is "
            "run.out_dir/run.name; set run.out_dir to put runs elsewhere",
        )
        self.require(
            not Path(self.out_dir).expanduser().is_file(),
            "out_dir",
            "is a file; run directories are made under run.out_dir: give a directory",
        )
        for name in ("workers", "shards", "steps", "eval_batches"):
            self.at_least(name, 1)
        self.require(
            1 <= self.min_workers <= self.workers,
            "min_workers",
            f"must be 1 to run.workers ({self.workers})",
        )
        self.at_least("eval_every", 0, "0: end only")
        self.one_of("backend", ("auto", "gloo", "nccl"))
        self.one_of("device", ("cpu", "cuda"))
        self.one_of("dtype", ("fp32", "bf16"))
        self.positive("timeout_s")
        self.one_of("guard", ("reject", "clip", "off"))
        self.require(
            self.wandb in ("", "offline"),
            "wandb",
            "choose '' (off) or 'offline'; a run never talks to the network, so 'online' is "
            "refused too: log offline and upload with `wandb sync <run dir>/wandb/offline-run-*`",
        )
        self.require(self.guard_factor > 1, "guard_factor", "must be above 1 (the median itself)")
        self.require(all(r > 0 for r in self.link_mbit), "link_mbit", "every rate must be > 0")
        self.require(
            len(self.link_mbit) in (0, 1, self.workers),
            "link_mbit",
            f"give one rate for every worker or run.workers = {self.workers} rates (one each)",
        )
        if self.link_mbit and self.workers == 1:
            warnings.warn(
                f"run.link_mbit = {self.link_mbit!r}: no effect with run.workers = 1 (one worker "
                "sends nothing); drop it or set run.workers >= 2",
                stacklevel=3,
            )


@dataclass(kw_only=True)
class FaultToleranceSection(Section):
    """The fault-tolerant runtime (comm/ft/, docs/fault_tolerance.md): the launcher's policy
    and the runtime's deadlines, passed whole to both. run.timeout_s, which every runtime
    reads, stays in [run]."""

    section = "fault_tolerance"
    enabled: bool = False
    """Membership epochs, deadlines and rejoin: workers that die or stop answering are dropped,
    restarted ones rejoin from a live peer; local launches only."""
    mix1_deadline_s: float = 10.0
    """The longest a worker waits at a round end for Mix1 messages still missing (a
    straggler's or a dead peer's), capped by run.timeout_s. Later ones are dropped and the row
    renormalized, so Mix1 never waits on a straggler beyond this."""
    max_restarts: int = 3
    """How many times the launcher restarts one worker before it calls the run failed (a worker
    that keeps dying is more likely a bug than a fault to ride out). `train --nodes` passes it
    to torchrun as --max-restarts (restarts of a machine's workers)."""
    deadline_factor: float = 4.0
    """A blocking wait fails after this multiple of the 90th percentile of the last rounds'
    wall times (a peer alive, its heartbeat beating, but stuck), at least
    fault_tolerance.deadline_floor_s and at most run.timeout_s. A peer whose heartbeat stops is
    dropped within seconds whatever this is."""
    deadline_floor_s: float = 60.0
    """The shortest adaptive deadline, in seconds: slack for what a round can legitimately
    contain on one peer only (a checkpoint write, a slow evaluation)."""
    coordinator_wait_s: float = 0.0
    """Across machines (frugaltrain join): how long a machine that lost the coordinator keeps
    its workers going and waits for it to come back (`frugaltrain coordinator --resume`); 0:
    half of run.timeout_s. The workers finish the round in hand and wait in their next store
    call. Past it, every worker finishes its round without the store, checkpoints it, and
    stops; the machine exits with one line. At most half of run.timeout_s: a worker held that
    long plus a round must not outlast its peers' gloo deadline or its own store timeout."""
    resume_wait_s: float = 120.0
    """Across machines: how long `frugaltrain coordinator --resume` waits for the machines that
    held slots before it goes on with those back, if they hold run.min_workers slots. The
    others' slots are freed; a machine back later joins as a new one, from a live peer."""
    inject: str = ""
    """Faults to inject, ';'-separated (with enabled = false on the plain runtime, where a killed
    worker ends the run and a silent one holds the others up): 'kill:worker=2,round=5',
    'hang:worker=1,round=3', 'partition:worker=1,round=3,seconds=5',
    'stall:worker=1,round=3,seconds=60', 'slow:worker=1,factor=3',
    'drop:p=0.1', 'corrupt:worker=1,round=3,value=1e30' (see frugaltrain.inject)."""

    def check(self) -> None:
        self.positive("mix1_deadline_s")
        self.require(self.deadline_factor >= 1, "deadline_factor", "must be at least 1 (x p90)")
        self.positive("deadline_floor_s")
        self.at_least("coordinator_wait_s", 0)
        self.positive("resume_wait_s")
        self.at_least("max_restarts", 0)
        try:
            inject.parse(self.inject)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(kw_only=True)
class DataSection(Section):
    section = "data"
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

    def check(self) -> None:
        if self.path.startswith("markov:"):  # its keys are data/markov.py's, checked on load
            items = [i.strip() for i in self.path.removeprefix("markov:").split(",") if i.strip()]
            self.require(
                all(_MARKOV_ITEM.fullmatch(i) for i in items),
                "path",
                "a synthetic source is markov:KEY=NUMBER,... (e.g. markov:order=2,symbols=32)",
            )
        self.one_of("sharding", ("iid", "noniid"))
        self.require(0 < self.val_fraction < 1, "val_fraction", "must be strictly between 0 and 1")
        self.at_least("seq_len", 2)
        self.at_least("batch_size", 1)
        self.at_least("max_bytes", 0, "0: no limit")
        self.at_least("num_shards", 0, "0: one per worker")


@dataclass(kw_only=True)
class ModelSection(Section):
    section = "model"
    family: str = "gpt"
    """gpt (the built-in GPT, no dependencies), llama, qwen2 or gpt2 (a transformers model built
    from the size keys below), or hf (a transformers model from model.config_json or
    model.pretrained). The transformers families need the `hf` extra."""
    pretrained: str = ""
    """family = hf: a local transformers model directory (config.json and safetensors weights) to
    start from; its config decides the architecture and the size keys are not read. Nothing is
    downloaded."""
    config_json: str = ""
    """family = hf: a transformers config.json to build a randomly initialized model from."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads (must divide n_embd)."""
    n_kv_head: int = 0
    """llama, qwen2: key-value heads of grouped-query attention (must divide n_head); 0: n_head."""
    n_embd: int = 128
    """Model width."""
    intermediate_size: int = 0
    """MLP width of the transformers families; 0: 4 n_embd (gpt2), or 8/3 n_embd rounded up to a
    multiple of 32 (llama, qwen2)."""
    vocab_size: int = 256
    """Vocabulary size; 256 for byte-level tokens, at least the tokenizer's for token shards."""
    dropout: float = 0.0
    """Dropout probability."""
    bias: bool = False
    """Bias in Linear and LayerNorm layers (gpt, llama; gpt2 and qwen2 have their own)."""
    tie_embeddings: bool = False
    """Share the token embedding with the LM head (off: embedding and head are separate tensors)."""

    def check(self) -> None:
        self.one_of("family", MODEL_FAMILIES)
        hf = self.family == "hf"
        self.require(
            hf or not (self.pretrained or self.config_json),
            "family",
            "model.pretrained and model.config_json take their architecture from a transformers "
            "config; set model.family = 'hf'",
        )
        self.require(
            not hf or bool(self.pretrained) != bool(self.config_json),
            "family",
            "family = 'hf' needs exactly one of model.pretrained (a local model directory) and "
            "model.config_json (a config.json to build from)",
        )
        self.at_least("n_layer", 1)
        self.at_least("n_head", 1)
        self.require(
            self.n_embd % self.n_head == 0, "n_head", f"must divide model.n_embd = {self.n_embd}"
        )
        self.at_least("n_kv_head", 0, "0: n_head")
        self.require(
            self.n_kv_head == 0 or self.n_head % self.n_kv_head == 0,
            "n_kv_head",
            f"must divide model.n_head = {self.n_head} (or 0: n_head)",
        )
        self.at_least("intermediate_size", 0, "0: the family's default")
        self.at_least("vocab_size", 2)
        self.require(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")


@dataclass(kw_only=True)
class OptimSection(Section):
    section = "optim"
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
    decay_steps: int = 0
    """Inner steps the warmup and cosine decay span (0: run.steps). Past them the lr stays at its
    floor, so a run longer than decay_steps repeats the shorter run's first decay_steps steps
    exactly and then goes on at the floor (how a comparison lets a method run past another's
    step count without changing the steps they share)."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this value (0: off)."""

    def check(self) -> None:
        self.one_of("name", INNER_OPTIMIZERS)
        self.positive("lr")
        self.require(all(0 <= b < 1 for b in self.betas), "betas", "each must be in [0, 1)")
        self.at_least("warmup_steps", 0)
        self.require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        self.at_least("decay_steps", 0, "0: run.steps")
        self.at_least("grad_clip", 0, "0: off")


@dataclass(kw_only=True)
class FgdSection(Section):
    """[outer.fgd]: the keys of Factored Gossip DiLoCo alone."""

    section = "outer.fgd"
    resolved_here: ClassVar[tuple[str, ...]] = ("preset",)
    """Keys the config applies itself (a preset sets mix1, mix2, mix2_params); the strategy's
    constructor does not take them."""
    preset: str = ""
    """A named variant that sets mix1/mix2/mix2_params: GlobalM1 (complete / none) or
    GlobalM1LocalM2 (complete / pairs on all tensors). Empty: use the keys as given."""
    mix1: str = "complete"
    """Topology of the non-blocking parameter mix (complete, ring, pairs, exponential, none)."""
    mix2: str = "none"
    """Topology of the blocking pseudo-gradient mix."""
    mix2_params: str = "all"
    """Tensors Mix2 covers: all, none, or '+'-joined parts among embed, head, blocks:K (the
    first K blocks) and fnmatch patterns of parameter names, e.g. embed+head+blocks:2."""
    momentum_policy: str = "local"
    """local (each worker keeps its outer momentum), mixed (Mix1 also mixes it: the paper's
    GlobalM1S, reported to spike) or reset (cleared before every outer step: outer SGD with
    learning rate gamma (1 + mu), no momentum carried across rounds)."""
    mix1_weight: float = 1.0
    """alpha, how much of Mix1 a worker takes: y_i = (1 - alpha) x_i + alpha (W1 x)_i (1: the
    full mix, 0: no Mix1)."""
    mix2_momentum: bool = False
    """Mix2 also mixes the chosen tensors' outer momentum, so it mixes their post-momentum
    update rather than only the raw pseudo-gradient (with a complete Mix2 on all tensors both
    are DiLoCo)."""
    mix2_delay: int = 0
    """tau: Mix2 is sent tau inner steps before the round's end, on the pseudo-gradient of the
    steps so far, and runs while the worker takes the last tau steps; at the end each worker
    steps with it and keeps those tau steps' progress on top of its new x_i, so they count in
    the next round's pseudo-gradient (Streaming DiLoCo's overlap, with the local progress kept
    instead of discarded). 0: Mix2 blocks at the round's end."""
    mix1_delta: bool = False
    """Mix1 sends x_i minus the last Mix1 mean (which every worker holds alike), with error
    feedback, instead of x_i: with a lossy outer.param_codec (int8, e3m0) it codes a round's
    update, which quantizes as well as a pseudo-gradient, not the parameters themselves. Needs
    the complete Mix1 taken whole (mix1 = 'complete', mix1_weight = 1) and no mixed momentum."""

    def check(self) -> None:
        self.require(
            self.preset in ("", *FGD_PRESETS),
            "preset",
            f"choose one of {', '.join(FGD_PRESETS)} or leave empty",
        )
        self._apply_preset()
        self.one_of("mix1", TOPOLOGIES)
        self.one_of("mix2", TOPOLOGIES)
        error = mix2_params_error(self.mix2_params)
        self.require(error is None, "mix2_params", error or "")
        self.one_of("momentum_policy", ("local", "mixed", "reset"))
        self.require(0 <= self.mix1_weight <= 1, "mix1_weight", "must be in [0, 1]")
        self.at_least("mix2_delay", 0)
        if self.mix2_delay:
            self.require(self.mix2 != "none", "mix2_delay", "delays a Mix2; set mix2 or drop it")
        if self.mix1_delta:
            self.require(
                self.mix1 == "complete" and self.mix1_weight == 1,
                "mix1_delta",
                "codes against the mean every worker holds, which needs mix1 = 'complete' and "
                "mix1_weight = 1; set both or drop mix1_delta",
            )
            self.require(
                self.momentum_policy != "mixed",
                "mix1_delta",
                "codes parameters, not momenta; set momentum_policy = 'local' or drop mix1_delta",
            )

    def _apply_preset(self) -> None:
        """Refuse a key set against the preset, then hold the preset's values (so the strategy
        and anything reading the section see the resolved keys)."""
        for key, value in FGD_PRESETS.get(self.preset, {}).items():
            default = next(f.default for f in dataclasses.fields(self) if f.name == key)
            self.require(
                getattr(self, key) in (value, default),
                key,
                f"conflicts with {self.key('preset')} = {self.preset!r} (which sets {value!r}); "
                "drop one",
            )
            setattr(self, key, value)


@dataclass(kw_only=True)
class DilocoSection(Section):
    """[outer.diloco]: the keys of DiLoCo alone."""

    section = "outer.diloco"
    overlap: int = 0
    """tau: the round's average is sent tau inner steps before the round's end, on the
    pseudo-gradient of the steps so far, and overlaps the last tau steps; each worker keeps
    those steps on top of the new outer parameters, so they count in the next round (Streaming
    DiLoCo's overlap with the local progress kept). 0: the average blocks at the round's end."""

    def check(self) -> None:
        self.at_least("overlap", 0, "0: the average blocks at the round's end")


@dataclass(kw_only=True)
class NolocoSection(Section):
    """[outer.noloco]: the keys of NoLoCo alone."""

    section = "outer.noloco"
    group_size: int = 2
    """Workers per random group each round."""
    consensus_pull: float = 0.7
    """gamma, the pull towards the group's mean parameters (public code: = outer lr)."""

    def check(self) -> None:
        self.at_least("group_size", 2)
        self.at_least("consensus_pull", 0)


@dataclass(kw_only=True)
class StreamingSection(Section):
    """[outer.streaming]: the keys of Streaming DiLoCo alone."""

    section = "outer.streaming"
    fragments: int = 4
    """Number of parameter fragments P (strided over blocks)."""
    overlap: int = 1
    """Inner steps tau between sending a fragment and applying its outer step."""
    merge_alpha: float = 0.0
    """theta <- alpha theta + (1 - alpha) x_new for a synced fragment (0: replace)."""

    def check(self) -> None:
        self.at_least("fragments", 1)
        self.at_least("overlap", 0)
        self.require(0 <= self.merge_alpha <= 1, "merge_alpha", "must be in [0, 1]")


@dataclass(kw_only=True)
class AutoSection(Section):
    """[outer.auto]: how `outer.strategy = "auto"` picks a method. The launcher plans on these
    links before any worker starts (sim/plan.py: measured step time, simulated clock, measured
    step penalty), runs the pick and writes it into the run directory's config.toml."""

    section = "outer.auto"
    link_mbit: list[float] = field(default_factory=list)
    """Each worker's link in Mbit/s, as stated (given): one value for every worker, or one per
    worker."""
    link_json: str = ""
    """A link probe's JSON (`frugaltrain netlab probe --out FILE`): the all-reduce's and the pair
    exchange's effective rates (measured). Set this or link_mbit."""
    penalties: str = PENALTIES
    """The measured step penalties the planner weighs methods by (a JSON file written by
    `python benchmarks/time_to_loss.py --penalties FILE`; relative to the working directory).
    The plan prints which file it read; the package ships none."""
    methods: list[str] = field(default_factory=list)
    """The methods to choose from, by name (config.AUTO_METHODS: diloco, diloco-4bit,
    diloco-overlap, streaming, noloco, fgd, ddp); empty: all of them."""

    def check(self) -> None:
        self.require(all(r > 0 for r in self.link_mbit), "link_mbit", "every rate must be > 0")
        self.require(
            not (self.link_mbit and self.link_json),
            "link_json",
            f"and {self.key('link_mbit')} both give the links; set one of them",
        )
        self.require(
            not self.link_json or Path(self.link_json).expanduser().is_file(),
            "link_json",
            "no such file; write one with `frugaltrain netlab probe --out FILE`, or set "
            f"{self.key('link_mbit')}",
        )
        unknown = [m for m in self.methods if m not in AUTO_METHODS] or [""]
        self.require(
            unknown == [""],
            "methods",
            f"{unknown[0]!r} is no method; choose among {', '.join(AUTO_METHODS)}",
        )


@dataclass(kw_only=True)
class OuterSection(Section):
    """[outer]: the keys several strategies share, and one sub-section per strategy with keys
    of its own (a sub-section is read only by the strategy it is named after)."""

    section = "outer"
    strategy: str = "diloco"
    """Outer strategy: ddp, diloco, fgd (Factored Gossip DiLoCo), noloco, streaming, or auto (the
    launcher runs the method `frugaltrain plan` picks for [outer.auto]'s links)."""
    H: int = 50
    """Inner steps per outer round (for ddp: steps per logged round)."""
    lr: float = 0.7
    """Outer learning rate (gamma)."""
    momentum: float = 0.9
    """Outer momentum (mu); 0 gives plain outer SGD."""
    nesterov: bool = True
    """Nesterov outer momentum (ignored when momentum is 0)."""
    codec: str = "fp32"
    """Encoding of the pseudo-gradients the outer step sends: fp32, bf16, int8, e3m0 (4-bit);
    2bit (a sign and one of two block magnitudes) and 1bit (the sign times the block's mean
    magnitude); or sparse: topk:F (the largest fraction F of every 4096 values, with their
    positions) and topk:F+2bit (values in 2 bits). 2bit, 1bit and the sparse codecs carry what
    was not sent to the next round (error feedback, outer.feedback_decay)."""
    feedback_decay: float = 1.0
    """2bit, 1bit and sparse codecs: what a worker did not send is added to its next round's
    pseudo-gradient times this (1: all of it, 0: dropped, no error feedback)."""
    coded_average: str = "all_gather"
    """How an average under a dense codec other than fp32 travels: all_gather (each worker sends
    its coded payload to the M-1 others; its own values stay exact) or reduce_scatter (coded
    chunks to their owners, then the owners' coded means to all: 2 (M-1)/M of the payload, half
    at M = 4, for coding the mean once more). fp32 averages are a ring all-reduce either way."""
    param_codec: str = ""
    """fgd's Mix1 and noloco's pull send parameters, which top-k cannot thin: their dense
    encoding (fp32, bf16, int8, e3m0). Empty: outer.codec when it is dense, else fp32."""
    diloco: DilocoSection = field(default_factory=DilocoSection)
    """DiLoCo's own keys ([outer.diloco])."""
    fgd: FgdSection = field(default_factory=FgdSection)
    """Factored Gossip DiLoCo's own keys ([outer.fgd])."""
    noloco: NolocoSection = field(default_factory=NolocoSection)
    """NoLoCo's own keys ([outer.noloco])."""
    streaming: StreamingSection = field(default_factory=StreamingSection)
    """Streaming DiLoCo's own keys ([outer.streaming])."""
    auto: AutoSection = field(default_factory=AutoSection)
    """How outer.strategy = "auto" picks a method ([outer.auto])."""

    def check(self) -> None:
        self.one_of("strategy", SHARED_KEYS)
        self.at_least("H", 1, "inner steps per outer round")
        self.positive("lr")
        self.require(0 <= self.momentum < 1, "momentum", "must be in [0, 1)")
        for key in ("codec", "param_codec"):
            value = getattr(self, key)
            if value or key == "codec":
                error = codec_error(value, params=key == "param_codec")
                self.require(error is None, key, error or "")
        self.require(0 <= self.feedback_decay <= 1, "feedback_decay", "must be in [0, 1]")
        self.one_of("coded_average", ("all_gather", "reduce_scatter"))
        self.fgd.require(
            not self.fgd.preset or self.strategy == "fgd",
            "preset",
            "presets name fgd variants; set outer.strategy = 'fgd' or drop the preset",
        )
        if self.strategy == "streaming":
            self._check_streaming_schedule()
        self.fgd.require(
            self.fgd.mix2_delay < self.H,
            "mix2_delay",
            f"must be below outer.H = {self.H} so Mix2 is sent inside its round",
        )
        self.diloco.require(
            self.diloco.overlap < self.H,
            "overlap",
            f"must be below outer.H = {self.H} so the average is sent inside its round",
        )
        self.auto.require(
            self.strategy != "auto" or bool(self.auto.link_mbit or self.auto.link_json),
            "link_mbit",
            "outer.strategy = 'auto' plans on the workers' links; set outer.auto.link_mbit = "
            "[RATE] (Mbit/s per worker) or outer.auto.link_json = 'PROBE.json' (written by "
            "`frugaltrain netlab probe --out`)",
        )

    def _check_streaming_schedule(self) -> None:
        s = self.streaming
        s.require(
            self.H % s.fragments == 0,
            "fragments",
            f"must divide outer.H = {self.H} so fragments fire at offsets k H / P",
        )
        s.require(
            s.overlap < self.H // s.fragments,
            "overlap",
            f"must be in [0, outer.H / {s.key('fragments')} = {self.H // s.fragments}) so a "
            "fragment is sent inside its own slot of the round",
        )

    def own_section(self) -> Section | None:
        """The chosen strategy's sub-section (None: it has none, e.g. diloco)."""
        return getattr(self, self.strategy) if self.strategy in strategy_sections() else None

    def strategy_keys(self) -> dict[str, Any]:
        """The keywords of the chosen strategy's constructor: the shared keys it reads and its
        own sub-section's keys (less those the config resolved itself, e.g. fgd's preset)."""
        keys = {k: getattr(self, k) for k in SHARED_KEYS[self.strategy]}
        own = self.own_section()
        skip = getattr(own, "resolved_here", ())
        for f in dataclasses.fields(own) if own else ():
            if f.name not in skip:
                keys[f.name] = getattr(own, f.name)
        return keys


def strategy_sections() -> dict[str, type]:
    """{strategy: its sub-section's class}, from OuterSection's nested fields."""
    hints = typing.get_type_hints(OuterSection)
    return {name: tp for name, tp in hints.items() if dataclasses.is_dataclass(tp)}


def outer_keys(strategy: str) -> tuple[str, ...]:
    """The keys under [outer] that `strategy` reads, dotted below outer (e.g. fgd.mix1): the
    shared ones it declares in SHARED_KEYS and every key of its own sub-section."""
    own = strategy_sections().get(strategy)
    subs = tuple(f"{strategy}.{f.name}" for f in dataclasses.fields(own)) if own else ()
    return ("strategy", *SHARED_KEYS[strategy], *subs)


OUTER_KEYS = {name: outer_keys(name) for name in SHARED_KEYS}


def _default(f: dataclasses.Field) -> Any:
    """A field's default, made by its factory if it has one (a list key's [])."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _outer_items(o: OuterSection) -> list[tuple[str, Any, Any]]:
    """(key dotted below outer, value, default) of every [outer] key, sub-sections included."""
    items = []
    for f in dataclasses.fields(o):
        value = getattr(o, f.name)
        if isinstance(value, Section):
            items += [
                (f"{f.name}.{g.name}", getattr(value, g.name), _default(g))
                for g in dataclasses.fields(value)
            ]
        else:
            items.append((f.name, value, f.default))
    return items


def unused_outer_keys(o: OuterSection) -> list[tuple[str, Any]]:
    """(key, value) of the [outer] keys set away from their default that the chosen strategy
    never reads, e.g. outer.codec with ddp or outer.fgd.mix2 with noloco."""
    reads = OUTER_KEYS[o.strategy]
    return [
        (f"outer.{k}", v) for k, v, default in _outer_items(o) if k not in reads and v != default
    ]


def outer_for(o: OuterSection, strategy: str) -> OuterSection:
    """`o` under `strategy`, with the keys that strategy does not read at their defaults."""
    reads, sections = OUTER_KEYS[strategy], strategy_sections()
    shared = {
        f.name: f.default
        for f in dataclasses.fields(o)
        if f.name not in reads and f.name not in sections
    }
    for name, tp in sections.items():
        if name != strategy:  # its own sub-section is all keys it reads
            shared[name] = tp()
    shared.pop("strategy", None)
    return dataclasses.replace(o, strategy=strategy, **shared)


def nest_outer_keys(flat: dict[str, Any]) -> dict[str, Any]:
    """Flat [outer] keywords (wrap's) as an [outer] table: a key of a strategy's sub-section
    goes under it (mix1 -> fgd.mix1), under the chosen strategy's own where several have it
    (overlap: diloco's or streaming's); the rest, unknown ones included, stay at the top."""
    sections = strategy_sections()
    chosen = flat.get("strategy")
    owner = {f.name: name for name, tp in sections.items() for f in dataclasses.fields(tp)}
    if chosen in sections:
        owner |= {f.name: chosen for f in dataclasses.fields(sections[chosen])}
    table: dict[str, Any] = {}
    for key, value in flat.items():
        if key in owner:
            table.setdefault(owner[key], {})[key] = value
        else:
            table[key] = value
    return table


def _warn_unused_outer_keys(o: OuterSection) -> None:
    """Warn about [outer] keys the chosen strategy never reads (a config file may carry keys
    for several strategies; wrap refuses them instead)."""
    unused = [f"{key} = {value!r}" for key, value in unused_outer_keys(o)]
    if unused:
        warnings.warn(
            f"{', '.join(unused)}: no effect with outer.strategy = {o.strategy!r}; drop it",
            stacklevel=3,
        )


def mix2_params_error(spec: str) -> str | None:
    """Why `spec` is not a Mix2 subset (models.parts.select's grammar); None: it is. Whether
    each part selects a tensor is checked against the built model (parts.select)."""
    parts = [p.strip() for p in spec.split("+")]
    if spec in ("all", "none") or all(_mix2_part_ok(p) for p in parts):
        return None
    return (
        "choose all, none, or '+'-joined parts among embed, head, blocks:K (the first K >= 1 "
        "blocks) and fnmatch patterns of parameter names (letters, digits, '.', '_', '-', '*', "
        "'?', '[]'), e.g. embed+head+blocks:2"
    )


_NAME_PATTERN = re.compile(r"[A-Za-z0-9._*?\[\]!-]+")


def _mix2_part_ok(part: str) -> bool:
    if part.startswith("blocks:"):
        k = part.removeprefix("blocks:")
        return k.isdigit() and int(k) >= 1
    return part not in ("all", "none") and _NAME_PATTERN.fullmatch(part) is not None


@dataclass(kw_only=True)
class Config:
    """A training run: `frugaltrain train` (real workers) and `simulate` (virtual ones)."""

    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    outer: OuterSection = field(default_factory=OuterSection)
    fault_tolerance: FaultToleranceSection = field(default_factory=FaultToleranceSection)

    def __post_init__(self) -> None:
        r, d, m, o, opt = self.run, self.data, self.model, self.outer, self.optim
        if d.num_shards:
            require(
                d.num_shards >= r.workers,
                "data.num_shards",
                d.num_shards,
                f"fewer shards than run.workers = {r.workers}; set data.num_shards >= "
                f"{r.workers} or 0 (one shard per worker)",
            )
        require(
            not (opt.name.startswith("forge-") and o.strategy == "ddp" and r.workers > 1),
            "optim.name",
            opt.name,
            f"FORGE updates weights inside backward, so no gradient exists for outer.strategy = "
            f"'ddp' to all-reduce over run.workers = {r.workers}; use optim.name = 'adamw' with "
            "ddp, or a DiLoCo-family outer strategy (diloco, fgd, noloco, streaming) with FORGE",
        )
        require(
            not (opt.name.startswith("forge-") and r.dtype == "bf16"),
            "run.dtype",
            r.dtype,
            "FORGE updates weights inside backward and does not run under autocast; use "
            "run.dtype = 'fp32' with FORGE, or optim.name = 'adamw' with bf16",
        )
        require(
            o.H <= r.steps,
            "outer.H",
            o.H,
            f"exceeds run.steps = {r.steps}, so no outer round would run; lower outer.H",
        )
        if o.strategy != "ddp":
            require(
                r.steps % o.H == 0,
                "run.steps",
                r.steps,
                f"must be a multiple of outer.H = {o.H} so the run ends on an outer round; "
                f"use run.steps = {max(o.H, r.steps // o.H * o.H)}",
            )
        if o.strategy == "streaming":
            _check_streaming(o, m)
        if r.shards > 1:
            _check_shards(r, d, opt, o)
        if o.strategy == "auto":
            _check_auto(o.auto, r)
        _check_faults(self.fault_tolerance, r, o)
        _warn_unused_outer_keys(o)


def _check_shards(r: RunSection, d: DataSection, opt: OptimSection, o: OuterSection) -> None:
    """What a replica sharded over run.shards processes supports (docs/sharding.md)."""
    require(
        d.batch_size % r.shards == 0,
        "data.batch_size",
        d.batch_size,
        f"must be a multiple of run.shards = {r.shards} (each shard process takes an equal "
        f"part of its replica's batch); use data.batch_size = "
        f"{max(r.shards, d.batch_size // r.shards * r.shards)}",
    )
    require(
        not opt.name.startswith("forge-"),
        "optim.name",
        opt.name,
        f"FORGE updates whole weights inside backward, which FSDP2 shards over run.shards = "
        f"{r.shards}; use optim.name = 'adamw' with shards, or run.shards = 1 with FORGE",
    )
    require(
        o.strategy != "ddp",
        "outer.strategy",
        o.strategy,
        f"ddp averages gradients every step, which FSDP2 inside a replica (run.shards = "
        f"{r.shards}) does not hand to it; use a DiLoCo-family strategy (diloco, fgd, noloco, "
        "streaming) with shards, or run.shards = 1 with ddp",
    )


def _check_auto(a: AutoSection, r: RunSection) -> None:
    """What the planner behind outer.strategy = 'auto' needs from the run."""
    require(
        r.workers >= 2,
        "run.workers",
        r.workers,
        "with one worker every outer method is the same training, so outer.strategy = 'auto' "
        "has nothing to pick; set outer.strategy = 'diloco' or run.workers >= 2",
    )
    require(
        r.shards == 1,
        "run.shards",
        r.shards,
        "outer.strategy = 'auto' plans whole replicas, one process each; set run.shards = 1, "
        "or pick a method with `frugaltrain plan` and set outer.strategy to it",
    )
    a.require(
        len(a.link_mbit) in (0, 1, r.workers),
        "link_mbit",
        f"give one rate for every worker or run.workers = {r.workers} rates",
    )
    a.require(
        Path(a.penalties).expanduser().is_file(),
        "penalties",
        "no such file; run from the repository's root, or write one with "
        "`python benchmarks/time_to_loss.py --penalties FILE` and set outer.auto.penalties",
    )


def _check_streaming(o: OuterSection, m: ModelSection) -> None:
    if m.family == "hf":  # the blocks are in a config file: the strategy checks its fragments
        return
    o.streaming.require(
        o.streaming.fragments <= m.n_layer,
        "fragments",
        f"cannot exceed model.n_layer = {m.n_layer} (fragments are groups of blocks)",
    )


def coordinator_wait_s(cfg: Config) -> float:
    """fault_tolerance.coordinator_wait_s, its default (0) resolved: half of run.timeout_s."""
    return cfg.fault_tolerance.coordinator_wait_s or cfg.run.timeout_s / 2


def _check_faults(ft: FaultToleranceSection, r: RunSection, o: OuterSection) -> None:
    """Every injected fault names a worker of this run and fires in one of its rounds; the
    fault-tolerant runtime's only non-blocking mix is Mix1 (comm/ft/mix1.py), sent whole (it may
    drop a late message); a machine waits
    for a lost coordinator at most half of run.timeout_s."""
    require(
        ft.coordinator_wait_s <= r.timeout_s / 2,
        "fault_tolerance.coordinator_wait_s",
        ft.coordinator_wait_s,
        f"must be at most half of run.timeout_s = {r.timeout_s:g} s (a worker held that long "
        "plus a round must not outlast its peers' gloo deadline); lower it, or raise "
        "run.timeout_s",
    )
    require(
        not (ft.enabled and o.coded_average != "all_gather"),
        "outer.coded_average",
        o.coded_average,
        "the fault-tolerant runtime averages as a gather over the members that delivered; set "
        "outer.coded_average = 'all_gather' or fault_tolerance.enabled = false",
    )
    require(
        not (ft.enabled and o.strategy == "fgd" and o.fgd.mix2_delay),
        "outer.fgd.mix2_delay",
        o.fgd.mix2_delay,
        "the fault-tolerant runtime runs Mix2 blocking only; set outer.fgd.mix2_delay = 0 "
        "or fault_tolerance.enabled = false",
    )
    require(
        not (ft.enabled and o.strategy == "diloco" and o.diloco.overlap),
        "outer.diloco.overlap",
        o.diloco.overlap,
        "the fault-tolerant runtime averages at the round's end only; set "
        "outer.diloco.overlap = 0 or fault_tolerance.enabled = false",
    )
    require(
        not (ft.enabled and o.strategy == "fgd" and o.fgd.mix1_delta),
        "outer.fgd.mix1_delta",
        True,
        "the fault-tolerant runtime's Mix1 drops a late message, so workers would not hold the "
        "same mean to code against; set outer.fgd.mix1_delta = false or "
        "fault_tolerance.enabled = false",
    )
    rounds = -(-r.steps // o.H)
    for fault in inject.parse(ft.inject):
        require(
            fault.worker < r.workers,
            "fault_tolerance.inject",
            ft.inject,
            f"{fault.kind} names worker {fault.worker} but run.workers = {r.workers} "
            f"(workers 0 to {r.workers - 1})",
        )
        require(
            fault.round <= rounds,
            "fault_tolerance.inject",
            ft.inject,
            f"{fault.kind} fires in round {fault.round} but the run has {rounds} rounds "
            f"(run.steps / outer.H); it would never fire",
        )
