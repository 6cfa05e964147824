"""Run M virtual workers in one process: the simulated counterpart of train/launch.py.

Design (docs/sim.md): one OS thread per virtual worker runs the inner step of train/loop.py
(step.inner_step: before_step, forward, backward, sync_grads, clip, AdamW, schedule; then
after_step) on its own model, AdamW and outer strategy object (outer/, unchanged), talking
through a `SimComm`. At most `sim.compute_threads` workers compute at once (a semaphore):
torch releases the GIL inside ops, so 2 threads can use 2 cores (1.07-1.37x a one-at-a-time
loop at this model size, measured), and the rest wait without spinning.
Every worker thread meets the others at each round end (a barrier); the last to arrive runs the
round's bookkeeping single-threaded: metrics, rollback, crash and rejoin.

Batching all workers into one vmapped step was measured and rejected for this model size
(benchmarks/sim_scale.py): torch has no vmap rule for CPU flash attention and falls back to a
per-sample loop, slower than threads.

Per-peer figures and the blocking time per named operation are in every round record under the
keys of real runs (metrics/peers.py), on the simulated clock.

Energy and FLOPs (per round record, summed in the summary; keys as in train/loop.py):
    energy/compute_j, energy/idle_j, energy/comm_j = the simulated cluster's estimated energy:
        simulated compute seconds x sim.compute_w, simulated blocking seconds x sim.idle_w and
        model-counted bytes sent x sim.link_j_per_byte, summed over the live workers;
        energy/joules is their total, energy/label says it is an estimate and gives the figures.
        Not counted: a crashed worker's down time, its rejoin transfer (not in comm/bytes_sent
        either), and a worker's time after its last operation while slower ones finish.
    flops/train = analytic forward + backward FLOPs of the inner steps the workers ran
        (models.train_flops_per_token; rolled-back steps included: they were computed).
    energy/host_joules, energy/host_label (summary only) = this process's own energy from
        energy.open_meter: what simulating cost on this host, not the simulated cluster.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from frugaltrain.comm.faulty import FaultyWire
from frugaltrain.comm.guard import guard_of
from frugaltrain.config import Config, to_dict, to_toml
from frugaltrain.config.base import section_toml
from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens, worker_seed
from frugaltrain.energy.meter import open_meter
from frugaltrain.inject import Injector, parse
from frugaltrain.metrics.consensus import GROUPS, averaged_model, spread, squared_distance
from frugaltrain.metrics.log import MetricsLog
from frugaltrain.metrics.peers import blocking_ops, count_events, sim_fields
from frugaltrain.metrics.sinks import check_sinks, open_sinks
from frugaltrain.models import build_model, evaluate, train_flops_per_token
from frugaltrain.optim import build_inner_optimizer, build_schedule
from frugaltrain.outer import build_strategy
from frugaltrain.sim.clock import step_times
from frugaltrain.sim.config import SimSection, energy_label
from frugaltrain.sim.network import build_network
from frugaltrain.sim.world import SimComm, SimWorld
from frugaltrain.step import inner_step

ENERGY_KEYS = ("energy/compute_j", "energy/idle_j", "energy/comm_j", "energy/joules")


@dataclass
class _Worker:
    model: torch.nn.Module
    inner: torch.optim.Optimizer
    schedule: object
    strategy: object
    sampler: BatchSampler
    comm: SimComm
    alive: bool = True
    loss_sum: float = 0.0
    steps: int = 0


@dataclass
class SimResult:
    models: list[torch.nn.Module]
    world: SimWorld
    records: list[dict]
    summary: dict


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class _Sim:
    def __init__(self, cfg: Config, sim: SimSection, run_dir: Path | None) -> None:
        r, d = cfg.run, cfg.data
        self.cfg, self.sim, self.run_dir = cfg, sim, run_dir
        self.host_meter = open_meter("cpu")  # this process, setup included
        self.host_meter.start()
        M = self.M = r.workers
        corpus = load_corpus(d.path, d.max_bytes, d.val_fraction)
        self.val_batches = validation_batches(cfg, corpus.val)
        self.floor = self.source_nll = None
        if d.path.startswith("markov:"):
            from frugaltrain.data.markov import markov_floor, markov_source_nll

            self.floor = markov_floor(d.path, d.seq_len)
            # The source's own loss on these exact tokens: a paired floor for a small eval set.
            self.source_nll = markov_source_nll(d.path, self.val_batches)
        template = build_model(cfg)
        self.num_params = template.num_params()
        self.world = SimWorld(M, build_network(sim, cfg, self.num_params), sim)
        self.workers: list[_Worker] = []
        for i in range(M):  # built in this thread: build_model seeds torch's global RNG
            model = copy.deepcopy(template)
            model.train()
            inner = build_inner_optimizer(model, cfg.optim)
            comm = SimComm(self.world, i, guard_of(r))
            if cfg.fault_tolerance.inject:  # corrupt and drop only (SimSection.check_against)
                injector = Injector(parse(cfg.fault_tolerance.inject), i, cfg.outer.H, True, r.seed)
                comm.wire = FaultyWire(injector, i, lambda: self.round)
            shard = shard_tokens(corpus.train, i, M, d.num_shards, d.sharding)
            self.workers.append(
                _Worker(
                    model,
                    inner,
                    build_schedule(inner, cfg.optim, r.steps),
                    build_strategy(cfg, model, comm),
                    BatchSampler(shard, d.seq_len, d.batch_size, worker_seed(r.seed, i)),
                    comm,
                )
            )
        self.slots = threading.Semaphore(sim.compute_threads)
        self.barrier = threading.Barrier(M, action=self._round_end)
        self.step_draws = step_times(sim, M, r.steps, cfg.outer.H)  # shared with clock.py
        self.records: list[dict] = []
        self.log = None
        if run_dir:
            self.log = MetricsLog(run_dir / "metrics.jsonl", sinks=open_sinks(cfg, run_dir))
        self.ops = blocking_ops(cfg)
        self._events_seen = 0  # SimWorld.events already counted in a round record
        self.round = 0
        self.step = 0
        tokens_per_step = d.batch_size * d.seq_len
        self.flops_per_step = train_flops_per_token(template, cfg) * tokens_per_step
        self.energy_label = energy_label(sim)
        self.t0 = time.perf_counter()
        self._prev = self._totals()
        self._prev_ops = [dict(w.comm.stats.blocking_by_op) for w in self.workers]
        self._snapshots: list | None = None
        self._down_since: float | None = None
        self.counts = {"rollbacks": 0, "rejoins": 0}
        self._take_snapshot()

    # ---- one virtual worker
    def _run_worker(self, i: int) -> None:
        w, cfg = self.workers[i], self.cfg
        H, steps = cfg.outer.H, cfg.run.steps
        for step in range(steps):
            if w.alive:
                loss, _, measured = inner_step(
                    w,
                    cfg,
                    step,
                    lambda step=step: w.sampler.batch(step),
                    device=torch.device("cpu"),
                    who=f"sim worker {i}",
                    compute=lambda: self.slots,
                )
                dt = measured if self.sim.compute == "measured" else self.step_draws[i, step]
                self.world.advance(i, float(dt))
                w.loss_sum += loss
                w.steps += 1
                boundary = w.strategy.after_step(step + 1)
            else:
                w.schedule.step()  # the schedule follows the step count while down
                boundary = (step + 1) % H == 0
            if boundary or step + 1 == steps:
                self.barrier.wait()

    def run(self) -> SimResult:
        errors: list[BaseException] = []

        def body(i: int) -> None:
            try:
                self._run_worker(i)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)
                self.world.abort(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(self.M)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            first = next(
                (e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0]
            )
            raise first
        summary = self._summary()
        if self.log is not None:
            self.log.close()
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return SimResult([w.model for w in self.workers], self.world, self.records, summary)

    # ---- round end (one thread, all others waiting at the barrier)
    def _totals(self) -> dict:
        wd = self.world
        return {
            "compute": list(wd.compute_s),
            "blocking": list(wd.blocking_s),
            "sent": [w.comm.stats.bytes_sent for w in self.workers],
            "received": [w.comm.stats.bytes_received for w in self.workers],
        }

    def _round_end(self) -> None:
        cfg, s = self.cfg, self.sim
        self.round += 1
        self.step = min(self.round * cfg.outer.H, cfg.run.steps)
        wd = self.world
        rolled_back = False
        if wd.round_failed:
            self._restore_snapshot()
            wd.round_failed = False
            rolled_back = True
            self.counts["rollbacks"] += 1
        self._record(rolled_back)
        if s.crash_worker >= 0:
            if self.round == s.crash_round:
                self._crash(s.crash_worker)
            elif self.round == s.crash_round + s.crash_rounds:
                self._rejoin(s.crash_worker)
        self._take_snapshot()

    def _take_snapshot(self) -> None:
        if not (self.sim.drop_prob > 0 and self.sim.allreduce_policy == "rollback"):
            return
        self._snapshots = [
            (
                [p.detach().clone() for p in w.model.parameters()],
                copy.deepcopy(w.strategy.state_dict()),
            )
            for w in self.workers
        ]

    def _restore_snapshot(self) -> None:
        with torch.no_grad():
            for w, (params, state) in zip(self.workers, self._snapshots, strict=True):
                if not w.alive:
                    continue
                for p, saved in zip(w.model.parameters(), params, strict=True):
                    p.copy_(saved)
                w.strategy.load_state_dict(copy.deepcopy(state))
        self.world.events.append({"round": self.round, "kind": "rollback"})

    def _set_members(self) -> None:
        live = [i for i, w in enumerate(self.workers) if w.alive]
        self.world.members = live
        for i in live:
            self.workers[i].comm.members = list(live)

    def _crash(self, i: int) -> None:
        self.workers[i].alive = False
        self._down_since = self.world.clock[i]
        self._set_members()
        self.world.events.append({"round": self.round, "kind": "crash", "worker": i})

    def _rejoin(self, i: int) -> None:
        """Worker i copies model, inner and outer state from its live ring neighbour and pays
        the transfer of that state over the slower of the two links."""
        wd, w = self.world, self.workers[i]
        nb = next(j % self.M for j in range(i + 1, i + self.M) if self.workers[j % self.M].alive)
        src = self.workers[nb]
        state = {
            "model": src.model.state_dict(),
            "inner": src.inner.state_dict(),
            "outer": src.strategy.state_dict(),
        }
        nbytes = _tensor_bytes(state)
        with torch.no_grad():
            w.model.load_state_dict(copy.deepcopy(state["model"]))
        w.inner.load_state_dict(copy.deepcopy(state["inner"]))
        w.strategy.load_state_dict(copy.deepcopy(state["outer"]), own=False)
        # the rendezvous keys of algorithm and metric collectives (the guard's norm exchange)
        w.comm.seq, w.comm._op_seq = src.comm.seq, src.comm._op_seq
        w.comm.metric_seq = src.comm.metric_seq
        start = max(wd.clock[nb], wd.link_free[nb])
        done = start + wd.net.pair_s(nbytes, i, nb)
        wd.link_free[nb] = done
        wd.events.append(
            {
                "round": self.round,
                "kind": "rejoin",
                "worker": i,
                "from": nb,
                "bytes": nbytes,
                "down_s": done - (self._down_since or 0.0),
            }
        )
        wd.clock[i] = done
        w.alive = True
        self.counts["rejoins"] += 1
        self._set_members()

    @torch.no_grad()
    def _record(self, rolled_back: bool) -> None:
        cfg, wd = self.cfg, self.world
        live = [i for i, w in enumerate(self.workers) if w.alive]
        now, prev = self._totals(), self._prev
        self._prev = now
        d = {k: [now[k][i] - prev[k][i] for i in live] for k in now}
        compute, blocking = sum(d["compute"]), sum(d["blocking"])
        steps_done = sum(self.workers[i].steps for i in live)
        s = self.sim
        energy = {
            "energy/compute_j": compute * s.compute_w,
            "energy/idle_j": blocking * s.idle_w,
            "energy/comm_j": sum(d["sent"]) * s.link_j_per_byte,
        }
        rec = {
            "kind": "round",
            "round": self.round,
            "step": self.step,
            "strategy": cfg.outer.strategy,
            "workers": self.M,
            "live_workers": len(live),
            "clock": "simulated",
            "tokens": self.step * cfg.data.batch_size * cfg.data.seq_len * self.M,
            "tokens_per_worker": self.step * cfg.data.batch_size * cfg.data.seq_len,
            "loss/train": sum(self.workers[i].loss_sum for i in live) / max(1, steps_done),
            "time/sim_s": max(wd.clock),
            "time/compute_s": compute / len(live),
            "time/blocking_s": blocking / len(live),
            "util/compute": compute / (compute + blocking) if compute + blocking > 0 else None,
            "util/cluster": sum(wd.compute_s) / (self.M * max(wd.clock)) if max(wd.clock) else None,
            "comm/bytes_sent": int(sum(d["sent"]) / len(live)),
            "comm/bytes_received": int(sum(d["received"]) / len(live)),
            "faults/drops": wd.counts["drops"],
            "faults/allreduce_failures": wd.counts["allreduce_failures"],
            "faults/rollbacks": self.counts["rollbacks"],
            "faults/rolled_back": rolled_back,
            "time/real_s": time.perf_counter() - self.t0,
            **energy,
            "energy/joules": sum(energy.values()),
            "energy/label": self.energy_label,
            "flops/train": self.flops_per_step * steps_done,
            "flops/label": "estimated (analytic)",
        }
        rec.update(self._comm_fields(live, d))
        for i in live:
            self.workers[i].loss_sum, self.workers[i].steps = 0.0, 0
        r = cfg.run
        due = r.eval_every and self.step // r.eval_every > (self.step - cfg.outer.H) // r.eval_every
        if due or self.step >= r.steps:
            rec.update(self._evaluate(live))
        self.records.append(rec)
        if self.log is not None:
            self.log.write(rec)
            self.log.flush()

    def _comm_fields(self, live: list[int], d: dict[str, list]) -> dict:
        """Per-peer figures of the round (metrics/peers.py; `d`: its per-live-worker deltas),
        the guard's rejections and the crashes and rejoins since the last record. Rejection
        records (the same verdict on every worker) are logged once, as worker 0 does."""
        figures = {"bytes_sent": d["sent"], "bytes_received": d["received"]}
        figures.update(blocking_s=d["blocking"], compute_s=d["compute"])
        strategies = [self.workers[i].strategy for i in live]
        figures["feedback_norm"] = [s.diagnostics().feedback_norm for s in strategies]
        now = [dict(w.comm.stats.blocking_by_op) for w in self.workers]
        by_op = [{k: v - self._prev_ops[i].get(k, 0.0) for k, v in now[i].items()} for i in live]
        self._prev_ops = now
        out = sim_fields(self.M, live, figures, by_op, self.ops)
        drained = [w.comm.drain_rejections() for w in self.workers]
        rejected = [{"round": self.round, **e} for e in drained[live[0]]]
        if self.log is not None:
            for e in rejected:
                self.log.write(e)
        events = self.world.events[self._events_seen :]
        self._events_seen = len(self.world.events)
        changes = [{"kind": "membership"} for e in events if e["kind"] in ("crash", "rejoin")]
        out.update(count_events(rejected + changes))
        return out

    def _evaluate(self, live: list[int]) -> dict:
        models = [self.workers[i].model for i in live]
        params = [list(m.parameters()) for m in models]
        mean = [
            torch.stack([ps[k] for ps in params]).double().mean(0).float()
            for k in range(len(params[0]))
        ]
        groups = dict.fromkeys(GROUPS, 0.0)
        for model in models:
            for g, d in squared_distance(model, mean).items():
                groups[g] += d / len(models)
        vals = [evaluate(m, self.val_batches) for m in models]
        out = {
            "loss/val": sum(vals) / len(vals),
            "loss/val_workers": vals,
            "loss/val_avg_model": evaluate(averaged_model(models[0], mean), self.val_batches),
            "consensus/total": sum(groups.values()),
        }
        out.update({f"consensus/{g}": v for g, v in groups.items()})
        momenta = [self.workers[i].strategy.diagnostics().momenta for i in live]
        if all(m is not None for m in momenta):
            m_mean = [torch.stack(ms).double().mean(0).float() for ms in zip(*momenta, strict=True)]
            out["consensus/momentum"] = sum(spread(m, m_mean) for m in momenta) / len(momenta)
        if self.floor is not None:
            out["loss/floor"] = self.floor
            out["loss/excess"] = out["loss/val"] - self.floor
            out["loss/excess_avg_model"] = out["loss/val_avg_model"] - self.floor
            out["loss/excess_paired"] = out["loss/val"] - self.source_nll
        return out

    def _summary(self) -> dict:
        wd, recs = self.world, self.records
        evals = [r for r in recs if "loss/val" in r]
        compute, blocking = sum(wd.compute_s), sum(wd.blocking_s)
        last = evals[-1] if evals else {}
        host = self.host_meter.stop()
        energy = {k: sum(r[k] for r in recs) for k in ENERGY_KEYS}
        energy["energy/label"] = self.energy_label
        energy["flops/train"] = sum(r["flops/train"] for r in recs)
        energy["flops/label"] = "estimated (analytic)"
        if host.joules is not None:  # unavailable: the label says why, and no number
            energy["energy/host_joules"] = host.joules
        energy["energy/host_label"] = host.label
        return {
            "strategy": self.cfg.outer.strategy,
            "workers": self.M,
            "clock": "simulated",
            "num_params": self.num_params,
            "steps": self.cfg.run.steps,
            "tokens_per_worker": recs[-1]["tokens_per_worker"] if recs else 0,
            "time/sim_s": max(wd.clock),
            "util/compute": compute / (compute + blocking) if compute + blocking else None,
            "util/cluster": compute / (self.M * max(wd.clock)) if max(wd.clock) else None,
            "comm/bytes_sent_per_worker": sum(w.comm.stats.bytes_sent for w in self.workers)
            / self.M,
            "loss/val": last.get("loss/val"),
            "loss/val_avg_model": last.get("loss/val_avg_model"),
            "loss/excess": last.get("loss/excess"),
            "loss/floor": self.floor,
            "loss/excess_paired": last.get("loss/excess_paired"),
            "loss/source_nll": self.source_nll,
            "consensus/total": last.get("consensus/total"),
            "faults": {**wd.counts, **self.counts},
            "events": wd.events[:200],
            "time/real_s": time.perf_counter() - self.t0,
            "bandwidth_Bps": wd.net.B[:4],
            **energy,
        }


def validation_batches(
    cfg: Config, val_tokens: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches every worker and the averaged model are scored on (from the
    corpus's validation tokens; read here when not given)."""
    d = cfg.data
    if val_tokens is None:
        val_tokens = load_corpus(d.path, d.max_bytes, d.val_fraction).val
    sampler = BatchSampler(val_tokens, d.seq_len, d.batch_size, seed=10_007 + cfg.run.seed)
    return [sampler.batch(i) for i in range(cfg.run.eval_batches)]


def simulate(cfg: Config, sim: SimSection, run_dir: Path | None = None) -> SimResult:
    """Run cfg's workers as virtual workers on sim's clock; metrics go to run_dir (optional)."""
    check_sinks(cfg)  # a missing TensorBoard or wandb package: refused before any work
    sim.check_against(cfg)  # callers that built the two apart (benchmarks, tests)
    # Parallelism comes from worker threads (sim.compute_threads), one core each.
    torch.set_num_threads(1)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg) + section_toml("sim", to_dict(sim)))
    return _Sim(cfg, sim, run_dir).run()
