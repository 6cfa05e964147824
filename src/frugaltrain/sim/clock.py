"""The simulator's clock alone: the simulated wall clock of a run, without training it.

The engine (engine.py) trains M virtual workers and takes minutes; its clock depends on only two
things, which this module replays in milliseconds:

    compute     each worker's inner-step times, drawn as the engine draws them (`step_times`)
    collectives which operation each strategy posts (all-reduce, gather or point-to-point), its
                bytes and peers, and where it is posted and waited, on the engine's own
                SimWorld and network model (world.py, network.py)

The schedules below are outer/'s strategies and comm/base.py's dispatch written out with sizes
in place of tensors: every worker posts the same operations in the same order, so they are posted
for all workers, then waited for all (the engine's threads meet the same way).
tests/train/test_plan.py checks them against `simulate` for every method the planner offers, to
the last bit, so the two cannot drift apart.

Left out: crashes and rejoins (sim.crash_worker), compute = measured (it needs the real steps),
and the guard's norm exchange (it moves no simulated time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from frugaltrain.codecs.compress import chunk_numel, is_sparse, wire_bytes
from frugaltrain.comm.accounting import ring_allreduce_bytes
from frugaltrain.comm.topology import groups_matrix, mixing_matrix, peers
from frugaltrain.config import Config, ConfigError
from frugaltrain.models import build_model
from frugaltrain.models.parts import select
from frugaltrain.optim import is_forge
from frugaltrain.outer.round import dense_or_fp32
from frugaltrain.outer.streaming import StreamingDiLoCo
from frugaltrain.sim.config import SimSection
from frugaltrain.sim.network import build_network
from frugaltrain.sim.world import SimWorld


def step_times(sim: SimSection, M: int, steps: int, H: int) -> np.ndarray:
    """[M, steps] simulated step times: fixed, lognormal or a per-round trace (step k of round
    t = k // H takes compute_trace_s[t mod len] / H), times straggler slowdowns."""
    rng = np.random.default_rng([sim.fault_seed, 0xC10C])
    base = np.full((M, steps), sim.step_s)
    if sim.compute == "lognormal" and sim.step_sigma > 0:
        base *= np.exp(rng.normal(0.0, sim.step_sigma, (M, steps)))
    if sim.compute == "trace":
        trace = np.asarray(sim.compute_trace_s, dtype=np.float64)
        base[:] = trace[(np.arange(steps) // H) % len(trace)] / H
    if sim.straggler_prob > 0:
        slow = rng.random((M, steps)) < sim.straggler_prob
        if sim.straggler_worker >= 0:
            slow[np.arange(M) != sim.straggler_worker] = False
        base = np.where(slow, base * sim.straggler_slowdown, base)
    return base


@dataclass
class Clock:
    """A run's round ends on the simulated clock (seconds; the engine's `time/sim_s`)."""

    steps: list[int]
    """The inner step of each round end."""
    sim_s: list[float]
    """The slowest worker's simulated seconds at each round end."""
    compute_s: float
    """Compute seconds, summed over the workers."""
    blocking_s: float
    """Seconds blocked in communication, summed over the workers."""
    bytes_sent: float
    """Bytes each worker sent over the run (mean over workers, the model's count)."""

    @property
    def util(self) -> float:
        """Compute utilization: compute / (compute + blocking), over all workers."""
        return self.compute_s / (self.compute_s + self.blocking_s)

    def at_step(self, step: float) -> float:
        """Simulated seconds at inner step `step` (0 to the run's steps), linear between round
        ends."""
        return float(np.interp(step, [0, *self.steps], [0.0, *self.sim_s]))


class _Lockstep:
    """One collective on every worker at once: what `Comm.all_reduce_mean_` (w None) and
    `Comm.mix_` (w given) post for `numel` fp32 values, posted for all workers on the world."""

    def __init__(self, world: SimWorld, coded_average: str = "all_gather") -> None:
        self.world, self.M, self.seq = world, world.M, 0
        self.coded_average = coded_average
        self.bytes_sent = [0] * world.M
        self._one = torch.zeros(1)  # the all-reduce's payload: only its byte count is read

    def post(self, numel: int, codec: str, w: np.ndarray | None = None) -> list | None:
        M = self.M
        if M == 1 or numel == 0 or (w is not None and np.array_equal(w, np.eye(M))):
            return None  # the comm returns a finished handle: nothing moves
        if w is None or np.allclose(w, 1.0 / M):  # an exact average
            if codec == "fp32":
                return self._post_all("allreduce", 4 * numel)
            if self.coded_average == "reduce_scatter" and not is_sparse(codec):
                return self._post_two_phases(numel, codec)
            w = np.full((M, M), 1.0 / M)
        return self._post_mix(numel, codec, w)

    def _post_two_phases(self, numel: int, codec: str) -> list:
        """Comm._average_in_two_phases: M-1 shifted exchanges of a chunk now; the chunks' means
        sent to every peer at the time the first phase ended (the runtimes move it in the
        background), waited on with the rest (a callable in the returned list)."""
        M = self.M
        size = chunk_numel(numel, M)
        wire = wire_bytes(size, codec)
        self.bytes_sent = [b + 2 * (M - 1) * wire for b in self.bytes_sent]
        phase1 = [[] for _ in range(M)]
        for k in range(1, M):
            self.seq += 1
            key = ("op", self.seq)
            for r in range(M):
                meta = {"wire": wire, "send_to": [(r + k) % M], "recv_from": [(r - k) % M]}
                phase1[r].append(self.world.post(r, key, "exchange", None, **meta))

        def phase2() -> None:
            self.seq += 1
            key, ops = ("op", self.seq), []
            for r in range(M):
                with self.world.aside(r) as ended:
                    for op in phase1[r]:
                        self.world.wait(r, op)
                peers = [j for j in range(M) if j != r]
                meta = {"wire": wire, "send_to": peers, "recv_from": peers, "at": ended[0]}
                ops.append(self.world.post(r, key, "exchange", None, **meta))
            for r, op in enumerate(ops):
                self.world.wait(r, op)

        return [phase2]

    def _post_all(self, kind: str, nbytes: int) -> list:
        self.seq += 1
        sent = ring_allreduce_bytes(nbytes, self.M)
        self.bytes_sent = [b + sent for b in self.bytes_sent]
        key = ("op", self.seq)
        return [
            self.world.post(r, key, kind, self._one, nbytes=nbytes, scale=1.0 / self.M)
            for r in range(self.M)
        ]

    def _post_mix(self, numel: int, codec: str, w: np.ndarray) -> list:
        self.seq += 1
        key, wire, ops = ("op", self.seq), wire_bytes(numel, codec), []
        for r in range(self.M):
            send_to, recv_from = peers(w, r)
            self.bytes_sent[r] += wire * len(send_to)
            if len(send_to) == self.M - 1 == len(recv_from):
                ops.append(self.world.post(r, key, "gather", None, nbytes=wire))
            else:
                meta = {"wire": wire, "send_to": send_to, "recv_from": recv_from}
                ops.append(self.world.post(r, key, "exchange", None, **meta))
        return ops

    def wait(self, ops: list | None) -> None:
        if ops and callable(ops[0]):  # a two-phase average: its waits post the second phase
            ops[0]()
            return
        for r, op in enumerate(ops or ()):
            self.world.wait(r, op)


class _DDP:
    """outer/ddp.py: a blocking all-reduce of every gradient after each backward."""

    def __init__(self, cfg: Config, sizes: dict[str, int], net: _Lockstep) -> None:
        self.H, self.numel, self.net = cfg.outer.H, sum(sizes.values()), net

    def before_step(self, step: int) -> None:
        pass

    def sync_grads(self) -> None:
        self.net.wait(self.net.post(self.numel, "fp32"))

    def after_step(self, step: int) -> bool:
        return step % self.H == 0


class _Round:
    """outer/round.py: start_round at a round's first step, exchange after its last; with an
    overlap tau, the exchange is posted tau steps before the round's end and waited there."""

    overlap = 0

    def __init__(self, cfg: Config, sizes: dict[str, int], net: _Lockstep) -> None:
        o = cfg.outer
        self.H, self.codec, self.seed = o.H, o.codec, cfg.run.seed
        self.sizes, self.numel, self.net = sizes, sum(sizes.values()), net
        self.momentum = o.momentum
        self.round = 0
        self.early: list | None = None  # an exchange sent early, in flight

    def has_momenta(self) -> bool:
        """OuterRound.momenta() is not None: after the first outer step, with momentum."""
        return self.momentum != 0 and self.round > 0

    def rolled_back(self) -> None:
        """The engine restored the round's start (sim.allreduce_policy = rollback): the round
        counter, which draws topologies and groups, is the one before it again."""
        self.round -= 1

    def before_step(self, step: int) -> None:
        if step % self.H == 0:
            self.start_round()

    def start_round(self) -> None:
        pass

    def sync_grads(self) -> None:
        pass

    def after_step(self, step: int) -> bool:
        if self.overlap and step % self.H == self.H - self.overlap:
            self.early = self.send_early()
        if step % self.H:
            return False
        self.exchange()
        self.early = None
        self.round += 1
        return True

    def exchange(self) -> None:
        raise NotImplementedError

    def send_early(self) -> list | None:
        raise NotImplementedError


class _DiLoCo(_Round):
    """outer/diloco.py: a blocking average of the pseudo-gradients, or one sent early."""

    def __init__(self, cfg: Config, sizes: dict[str, int], net: _Lockstep) -> None:
        super().__init__(cfg, sizes, net)
        self.overlap = cfg.outer.diloco.overlap

    def send_early(self) -> list | None:
        return self.net.post(self.numel, self.codec)

    def exchange(self) -> None:
        self.net.wait(
            self.early if self.early is not None else self.net.post(self.numel, self.codec)
        )


class _NoLoCo(_Round):
    """outer/noloco.py: pseudo-gradients (and, with a pull, parameters) mixed in random groups."""

    def __init__(self, cfg: Config, sizes: dict[str, int], net: _Lockstep) -> None:
        super().__init__(cfg, sizes, net)
        o = cfg.outer
        self.group_size, self.pull = o.noloco.group_size, o.noloco.consensus_pull
        self.param_codec = o.param_codec or dense_or_fp32(o.codec)

    def exchange(self) -> None:
        w = groups_matrix(self.net.M, self.group_size, self.round, self.seed)
        if not self.pull:
            self.net.wait(self.net.post(self.numel, self.codec, w))
        elif self.param_codec == self.codec:  # one exchange for both
            self.net.wait(self.net.post(2 * self.numel, self.codec, w))
        else:
            self.net.wait(self.net.post(self.numel, self.codec, w))
            self.net.wait(self.net.post(self.numel, self.param_codec, w))


class _FGD(_Round):
    """outer/fgd.py: Mix1 of the parameters posted at a round's start, waited after the round's
    blocking Mix2 of the chosen pseudo-gradients; with mix2_delay tau, it is posted tau steps
    before the round's end and waited there."""

    def __init__(self, cfg: Config, sizes: dict[str, int], net: _Lockstep) -> None:
        super().__init__(cfg, sizes, net)
        f = cfg.outer.fgd
        self.f, self.param_codec = f, cfg.outer.param_codec or dense_or_fp32(cfg.outer.codec)
        chosen = select(list(sizes), f.mix2_params) if f.mix2 != "none" else []
        self.mix2_numel = sum(n for n, keep in zip(sizes.values(), chosen, strict=False) if keep)
        self.mix2_on = bool(chosen)
        self.overlap = f.mix2_delay if self.mix2_on else 0
        self.mix1: list | None = None

    def start_round(self) -> None:
        if self.mix1 is not None:
            return
        mixed = self.f.momentum_policy == "mixed" and self.has_momenta()
        w1 = mixing_matrix(self.f.mix1, self.net.M, self.round, self.seed)
        if self.f.mix1_weight < 1:
            a = self.f.mix1_weight
            w1 = (1 - a) * np.eye(self.net.M) + a * w1
        numel = self.numel * (2 if mixed else 1)
        self.mix1 = self.net.post(numel, self.param_codec, w1) or []

    def send_early(self) -> list | None:
        return self.net.post(self.mix2_numel_sent(), self.codec, self.w2())

    def w2(self) -> np.ndarray:
        return mixing_matrix(self.f.mix2, self.net.M, self.round, self.seed + 1)

    def mix2_numel_sent(self) -> int:
        return self.mix2_numel * (2 if self.f.mix2_momentum and self.has_momenta() else 1)

    def exchange(self) -> None:
        if self.mix1 is None:
            self.start_round()
        if self.early is not None:
            self.net.wait(self.early)
        elif self.mix2_on:
            self.net.wait(self.net.post(self.mix2_numel_sent(), self.codec, self.w2()))
        self.net.wait(self.mix1)
        self.mix1 = None


class _Streaming(_Round):
    """outer/streaming.py: fragment k sent (non-blocking) tau steps before it lands at
    (k + 1) H / P, and waited there."""

    def __init__(self, cfg: Config, sizes: dict[str, int], net: _Lockstep) -> None:
        super().__init__(cfg, sizes, net)
        s = cfg.outer.streaming
        self.P, self.tau = s.fragments, s.overlap
        owner = StreamingDiLoCo.fragment_of(list(sizes), self.P)
        counts = list(sizes.values())
        self.fragment_numel = [
            sum(n for n, f in zip(counts, owner, strict=True) if f == k) for k in range(self.P)
        ]
        self.pending: dict[int, list | None] = {}

    def after_step(self, step: int) -> bool:
        pos = step % self.H or self.H
        for k in range(self.P):
            lands = (k + 1) * self.H // self.P
            if pos == lands - self.tau:
                self.pending[k] = self.net.post(self.fragment_numel[k], self.codec)
            if pos == lands:
                self.net.wait(self.pending.pop(k))
        if step % self.H:
            return False
        self.round += 1
        return True


SCHEDULES = {
    "ddp": _DDP,
    "diloco": _DiLoCo,
    "fgd": _FGD,
    "noloco": _NoLoCo,
    "streaming": _Streaming,
}


def trainable_sizes(cfg: Config) -> tuple[dict[str, int], int]:
    """({name: elements} of the model's trainable tensors, as the strategies see them, and its
    parameter count as the engine's network reads it), from the model built on the meta device
    (nothing is allocated)."""
    with torch.device("meta"):
        model = build_model(cfg)
    sizes = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    return sizes, model.num_params()


def clock(cfg: Config, sim: SimSection) -> Clock:
    """The simulated clock of `cfg`'s run on `sim`'s compute and network model, equal to
    `simulate(cfg, sim)`'s without training (the module docstring says what is left out)."""
    if sim.compute == "measured" or sim.crash_worker >= 0:
        what = "compute = 'measured'" if sim.compute == "measured" else "a crash"
        raise ConfigError(
            f"sim: the clock alone cannot replay {what} (it runs no step and moves no state); "
            "use sim.compute = 'fixed' with sim.step_s and sim.crash_worker = -1, or `simulate`"
        )
    M, steps, H = cfg.run.workers, cfg.run.steps, cfg.outer.H
    sizes, num_params = trainable_sizes(cfg)
    world = SimWorld(M, build_network(sim, cfg, num_params), sim)
    net = _Lockstep(world, cfg.outer.coded_average)
    schedule = SCHEDULES[cfg.outer.strategy](cfg, sizes, net)
    dt = step_times(sim, M, steps, H)
    forge = is_forge(cfg.optim)  # FORGE leaves no gradient: the loop never calls sync_grads
    ends, at = [], []
    for step in range(steps):  # the engine's worker loop (engine._run_worker, step.inner_step)
        schedule.before_step(step)
        if not forge:
            schedule.sync_grads()
        for i in range(M):
            world.advance(i, float(dt[i, step]))
        if schedule.after_step(step + 1) or step + 1 == steps:
            ends.append(step + 1)
            at.append(max(world.clock))
            if world.round_failed and isinstance(schedule, _Round):  # engine._restore_snapshot
                schedule.rolled_back()
            world.round_failed = False
    return Clock(ends, at, sum(world.compute_s), sum(world.blocking_s), sum(net.bytes_sent) / M)
