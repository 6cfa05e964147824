"""The `[sim]` table: virtual clock, network and fault model of a simulated run.

A simulate config (`SimConfig`) is an ordinary training config (run, data, model, optim, outer)
plus this table, loaded like any other: `--set sim.ratio=0.887` and `--set outer.H=20` both work.
Times are simulated seconds, bandwidths bits per second, powers watts.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields

from frugaltrain import inject
from frugaltrain.config import Config, Section, build_config, load, require

DEFAULT_LINK_J_PER_BYTE = 5e-9
"""Placeholder network energy, J per byte sent: an order-of-magnitude figure (a 100 Gb/s NIC
port draws roughly 10-20 W at 12.5 GB/s, about 1-2 nJ/B at each end, plus a switch port). The
research note gives no per-byte figure and our fits never measured e_X (docs/energy.md), so the
energy label marks it as a placeholder while it is in use."""


@dataclass(kw_only=True)
class SimSection(Section):
    section = "sim"
    compute: str = "fixed"
    """Compute time per inner step: fixed (step_s), lognormal (step_s * exp(N(0, step_sigma))),
    measured (the real seconds the step took in this process), or trace (replays
    compute_trace_s)."""
    step_s: float = 1.0
    """Simulated seconds of one inner step (median for lognormal)."""
    step_sigma: float = 0.0
    """Lognormal sigma of the step time (compute = lognormal)."""
    compute_trace_s: list[float] = field(default_factory=list)
    """compute = trace: simulated compute seconds of whole outer rounds (H inner steps), e.g. a
    real run's measured per-round compute. Every step of round t (steps t*H .. t*H + H-1, t
    from 0) takes compute_trace_s[t mod len] / H, on every worker; stragglers still multiply."""
    ratio: float = 0.0
    """r = T_AR / (H * step_s): sets every worker's bandwidth so a ring all-reduce of all fp32
    parameters takes r times a round of compute (research note b.6: r = 0.887 and 1.774 are the
    paper's 200 and 100 Mbps). 0: use bandwidth_bps."""
    bandwidth_bps: list[float] = field(default_factory=lambda: [1e8])
    """Link bandwidth in bits/s: one value for all workers, or one per worker."""
    latency_s: float = 0.0
    """Per-message latency in simulated seconds."""
    p2p_bandwidth_ratio: float = 1.0
    """Effective bandwidth of a point-to-point transfer (gossip and pair exchanges, a rejoin's
    state copy) as a fraction of the link's bandwidth; all-reduce and all-gather keep the full
    bandwidth. 1.0: nominal. Measure it as the pair exchange's over the all-reduce's effective
    bandwidth (`frugaltrain netlab probe`: 0.93-1.07 for the runtime's exchange on tbf-shaped links,
    0.55 when the sends were posted first) and give bandwidth_bps the all-reduce's; above 1 if
    point-to-point gets more than that."""
    straggler_prob: float = 0.0
    """Probability that a worker's inner step is slowed by straggler_slowdown."""
    straggler_slowdown: float = 4.0
    """Factor k of a straggling step."""
    straggler_worker: int = -1
    """If >= 0, only this worker straggles (with straggler_prob); -1: any worker."""
    drop_prob: float = 0.0
    """q: probability that one message on one edge is lost in an operation. Gossip mixes what
    arrived (the self weight absorbs the missing mass); an all-reduce fails if any of its M ring
    links drops and follows allreduce_policy."""
    allreduce_policy: str = "retry"
    """retry (wait timeout_s, send again) or rollback (discard the round: every worker returns
    to its state at the round start, the round's inner steps are lost)."""
    timeout_s: float = 0.0
    """Simulated seconds before a failed all-reduce is detected; 0: twice its transfer time."""
    max_retries: int = 10
    """retry: attempts after which the all-reduce goes through regardless (keeps runs finite)."""
    crash_worker: int = -1
    """Worker that crashes (-1: none)."""
    crash_round: int = 0
    """Outer round after which it crashes."""
    crash_rounds: int = 0
    """R: rounds it stays down; then it rejoins by copying state from its ring neighbour."""
    compute_threads: int = 2
    """Virtual workers computing at once (one OS thread each; about the number of cores)."""
    fault_seed: int = 0
    """Seeds straggler, drop and lognormal draws (independent of run.seed)."""
    compute_w: float = 700.0
    """Power of one simulated device while it computes, in W (energy estimate only). Default:
    the H100 SXM board limit, which its measured GEMM reached (docs/energy.md section 3:
    0.86 pJ/FLOP x 677 TFLOP/s above 120 W idle); training steps there averaged 120-650 W, so
    this is an upper figure."""
    idle_w: float = 120.0
    """Power of one simulated device while it is blocked in communication, in W. Default: the
    H100's measured idle power (118 and 122 W, docs/energy.md section 3)."""
    link_j_per_byte: float = DEFAULT_LINK_J_PER_BYTE
    """Network energy per byte sent, in J/B (both NICs and the switch). Default: a placeholder
    (see DEFAULT_LINK_J_PER_BYTE), not a measurement; set it for your network."""

    def check(self) -> None:
        self.one_of("compute", ("fixed", "lognormal", "measured", "trace"))
        if self.compute == "trace":
            self.require(
                len(self.compute_trace_s) > 0,
                "compute_trace_s",
                "compute = trace needs at least one round's compute seconds",
            )
        else:
            self.require(
                not self.compute_trace_s,
                "compute_trace_s",
                f"only read with compute = 'trace' (compute = {self.compute!r}); set sim.compute",
            )
        self.require(
            all(c > 0 for c in self.compute_trace_s),
            "compute_trace_s",
            "every round's compute seconds must be > 0",
        )
        self.positive("step_s")
        self.at_least("step_sigma", 0)
        self.at_least("ratio", 0, "0: use bandwidth_bps")
        self.require(all(b > 0 for b in self.bandwidth_bps), "bandwidth_bps", "must be > 0")
        self.at_least("latency_s", 0)
        self.require(
            self.p2p_bandwidth_ratio > 0,
            "p2p_bandwidth_ratio",
            "must be > 0 (a fraction of the link's bandwidth; 1: nominal)",
        )
        self.require(0 <= self.straggler_prob <= 1, "straggler_prob", "must be in [0, 1]")
        self.at_least("straggler_slowdown", 1)
        self.require(0 <= self.drop_prob < 1, "drop_prob", "must be in [0, 1)")
        self.one_of("allreduce_policy", ("retry", "rollback"))
        self.at_least("timeout_s", 0, "0: twice the transfer")
        for key in ("compute_w", "idle_w", "link_j_per_byte"):
            self.at_least(key, 0)
        self.at_least("compute_threads", 1)

    def check_against(self, cfg: Config) -> None:
        """The rules that depend on the training config (worker indices, CPU only, no dropout)."""
        M = cfg.run.workers
        self.require(
            len(self.bandwidth_bps) in (1, M),
            "bandwidth_bps",
            f"give one value or run.workers = {M} values",
        )
        self.require(
            -1 <= self.crash_worker < M,
            "crash_worker",
            f"must be -1 (none) or a worker in [0, {M})",
        )
        self.require(
            -1 <= self.straggler_worker < M,
            "straggler_worker",
            f"must be -1 (any) or a worker in [0, {M})",
        )
        if self.crash_worker >= 0:
            self.require(M >= 2, "crash_worker", "a crash needs run.workers >= 2")
            self.at_least("crash_rounds", 1, "with a crash")
        self.require(
            self.drop_prob == 0 or cfg.outer.coded_average == "all_gather",
            "drop_prob",
            "the simulator stands a worker's own value in for a lost message, which a "
            "reduce-scatter's chunk does not have; set sim.drop_prob = 0 or "
            "outer.coded_average = 'all_gather'",
        )
        require(
            cfg.outer.strategy != "auto",
            "outer.strategy",
            cfg.outer.strategy,
            "the simulator runs one method; `frugaltrain plan` predicts every method for your "
            "links (and `compare` trains them side by side); set outer.strategy to a method",
        )
        require(
            cfg.run.device == "cpu",
            "run.device",
            cfg.run.device,
            "the simulator runs its virtual workers on the CPU; set run.device = 'cpu'",
        )
        require(
            cfg.model.dropout == 0,
            "model.dropout",
            cfg.model.dropout,
            "the simulator runs workers as threads that share torch's global RNG, so dropout "
            "would not be reproducible; set model.dropout = 0",
        )
        require(
            cfg.run.shards == 1,
            "run.shards",
            cfg.run.shards,
            "the simulator runs each worker as one unsharded replica (sharding changes the "
            "per-process bytes, not the algorithm); set run.shards = 1",
        )
        if cfg.run.link_mbit:  # the simulated clock has its own network: nothing to pace
            rates = [r * 1e6 for r in cfg.run.link_mbit]
            warnings.warn(
                f"run.link_mbit = {cfg.run.link_mbit!r}: no effect in the simulator, whose links "
                f"are sim.bandwidth_bps (or sim.ratio); for these set sim.bandwidth_bps = {rates}",
                stacklevel=2,
            )
        acts = [f.kind for f in inject.parse(cfg.fault_tolerance.inject)]
        require(
            set(acts) <= set(inject.WIRE_FAULTS),
            "fault_tolerance.inject",
            cfg.fault_tolerance.inject,
            "the simulator injects what travels between workers (corrupt, drop); for a crash "
            "set sim.crash_worker and sim.crash_round, for a straggler sim.straggler_worker and "
            "sim.straggler_slowdown",
        )


@dataclass(kw_only=True)
class SimConfig(Config):
    """A training config plus the [sim] table: what `simulate` and `compare` read."""

    sim: SimSection = field(default_factory=SimSection)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sim.check_against(self)

    def training(self) -> Config:
        """The training sections alone (as a plain Config)."""
        return Config(**{f.name: getattr(self, f.name) for f in fields(Config)})


def energy_label(s: SimSection) -> str:
    """Provenance of the simulated cluster's energy: an estimate on the simulated clock, with the
    figures it used (the placeholder per-byte figure is named as such)."""
    link = f"{s.link_j_per_byte:g} J/B"
    if s.link_j_per_byte == DEFAULT_LINK_J_PER_BYTE:
        link += " placeholder"
    return (
        f"estimated (simulated clock: compute s x {s.compute_w:g} W + blocking s x "
        f"{s.idle_w:g} W + bytes sent x {link})"
    )


def load_sim_config(
    path: str | None, overrides: list[str] | None = None
) -> tuple[Config, SimSection]:
    """(training config, sim section) from a TOML file with an optional [sim] table and
    `--set` overrides (sim.* keys go to the sim section)."""
    full = load(SimConfig, path, overrides)
    return full.training(), full.sim


def build_sim(raw: dict | None, overrides: list[str], cfg: Config) -> SimSection:
    """A sim section from its own keys (`raw`, `overrides` without the `sim.` prefix), checked
    against the training config `cfg`."""
    sim = build_config(SimSection, raw or {}, overrides)
    sim.check_against(cfg)
    return sim
