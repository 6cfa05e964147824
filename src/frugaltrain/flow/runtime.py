"""The execution modes over one data stream, one packing plan and one set of weights.

- monolithic: one process (run.mono_threads threads) does, per global batch, encoder forward of
  every sample, the packed backbone micro-batches, encoder backward (trainable), both steps.
- monolithic_dp: the fair baseline for a flow run of P + C processes: P + C processes, each a
  whole model on its share of the micro-batches (the plan deals them to P + C ranks), the
  gradients of both modules all-reduced every step (plain data parallelism).
- sync (batch-synchronized disaggregated, DistTrain-like): P encoder and C backbone processes.
  The encoder hands a whole global batch over; the backbone starts only when all of it arrived,
  and the encoder starts the next batch only after every backbone rank acknowledged the handoff
  (frozen: the handoff also frees the encoder's slots, as a send to the backbone would).
- flow (FlowTrain-like): same processes, but samples stream through the pool one by one in the
  plan's consume order and the encoder runs ahead, bounded only by the pool's slots.

Encoder semantics. Frozen: embeddings are a pure function of the image, so any run-ahead is exact.
Trainable, staleness 0 (exact): the consumer writes dL/demb back through the pool; the producer
back-propagates in the plan's order and steps on batch k before it encodes batch k+1.
Trainable, staleness s >= 1 (opt-in): the producer encodes up to s batches ahead on older weights
and recomputes forward with its current weights for backward. This changes the optimization.

The encoder runs on the plan's encoder batches (a micro-batch's samples of one visual shape) in
every mode, so an embedding comes from the same kernel calls whatever the mode.

Both modules use AdamW; the loss is the caption cross-entropy summed over a global batch divided
by its target count, so packing, dispatch and data parallelism never change the result.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from frugaltrain import processes
from frugaltrain.config import ConfigError
from frugaltrain.flow.config import FlowConfig
from frugaltrain.flow.data import build_dataset
from frugaltrain.flow.models import build_consumer, build_encoder, encoder_width
from frugaltrain.flow.packing import BatchPlan, plan_batch
from frugaltrain.flow.pool import DistPool, ShmPool
from frugaltrain.flow.samples import CaptionSet
from frugaltrain.flow.trace import Tracer

# What the fork server imports once for the workers (processes.py).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "frugaltrain.flow.runtime"]
# A worker that left no log died before its entry ran: in the launching script, which every
# worker imports again before its entry runs.
BEFORE_ENTRY = (
    "it died before its entry ran, importing the launching script again, whose error is on the "
    'launcher\'s stderr; a script that starts a run needs an `if __name__ == "__main__":` guard'
)


class FlowWorkerError(RuntimeError):
    """A worker process failed; the message carries its role and traceback."""


@dataclass
class RunResult:
    losses: list[float]
    enc_state: dict[str, torch.Tensor]
    cons_state: dict[str, torch.Tensor]
    traces: list[dict]
    delivered: dict[int, list[int]] = field(default_factory=dict)
    """consumer index -> sample ids in the order the pool delivered them (exactly-once check)."""


def ranks(cfg: FlowConfig) -> int:
    """Backbone ranks the plan deals micro-batches to: the consumers, or every process of a
    data-parallel monolithic run."""
    if cfg.run.mode == "monolithic_dp":
        return cfg.run.producers + cfg.run.consumers
    return cfg.run.consumers


def make_plans(cfg: FlowConfig, ds: CaptionSet, cost=None) -> list[BatchPlan]:
    """The schedule of every global batch; identical for all modes (lengths are known upfront:
    fixed patching makes visual token counts a function of the tile count or image side)."""
    s = cfg.sched
    return [
        plan_batch(
            k,
            {x.sample_id: x.length for x in ds.batch(k)},
            L=s.capacity,
            ranks=ranks(cfg),
            policy=s.policy,
            how=s.dispatch,
            cost=cost,
            visual={x.sample_id: x.n_visual for x in ds.batch(k)},
        )
        for k in range(cfg.run.steps)
    ]


def min_slots(plans: list[BatchPlan], producers: int, mode: str) -> int:
    """Slots per producer that rule out a pool deadlock: a consumer holds every sample of the
    micro-batch it is assembling, so each producer's share of a wave (micro-batch j of every rank)
    must fit; sync mode holds a whole global batch."""
    need = 1
    for pl in plans:
        shares = pl.wave_shares(producers)
        if mode == "sync":
            need = max(need, *(sum(w[p] for w in shares) for p in range(producers)))
        else:
            need = max(need, *(max(w) for w in shares))
    return need


def _opt(module: nn.Module, cfg: FlowConfig) -> torch.optim.Optimizer:
    if cfg.run.optimizer == "sgd":
        return torch.optim.SGD(module.parameters(), lr=cfg.run.lr)
    return torch.optim.AdamW(module.parameters(), lr=cfg.run.lr, weight_decay=0.0, foreach=False)


def _texts(ds: CaptionSet, ids: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(ds.sample(i).tokens) for i in ids]


def _device(cfg: FlowConfig) -> torch.device:
    return torch.device("cuda:0" if cfg.run.device == "cuda" else "cpu")


def _all_reduce_grads(module: nn.Module, group) -> None:
    import torch.distributed as dist

    params = list(module.parameters())
    for p in params:
        if p.grad is None:  # a rank with no micro-batch still joins the sum
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    i = 0
    for p in params:
        p.grad.copy_(flat[i : i + p.numel()].view_as(p))
        i += p.numel()


# ------------------------------------------------------------------- monolithic


def run_monolithic(cfg: FlowConfig, plans: list[BatchPlan]) -> RunResult:
    """Lockstep reference in this process (run.mono_threads threads)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(cfg.run.mono_threads)
    try:
        return _monolithic(cfg, plans)
    finally:
        torch.set_num_threads(saved)


@dataclass
class _Lockstep:
    """A whole model in one process: what monolithic and each monolithic_dp replica run."""

    cfg: FlowConfig
    ds: CaptionSet
    enc: nn.Module
    cons: nn.Module
    tr: Tracer

    @classmethod
    def build(cls, cfg: FlowConfig, tr: Tracer) -> _Lockstep:
        ds, dev = build_dataset(cfg), _device(cfg)
        enc, cons = build_encoder(cfg).to(dev), build_consumer(cfg, ds).to(dev)
        enc.requires_grad_(cfg.run.train_encoder)
        return cls(cfg, ds, enc, cons, tr)

    def step(self, k: int, plan: BatchPlan, ranks: list[int], producers: int) -> float:
        """Forward and backward of `ranks`' micro-batches of batch k (gradients accumulate; no
        optimizer step); the encoder's backward runs per call in each producer's order, as in
        flow. Returns this share's loss."""
        cfg, ds, tr, train = self.cfg, self.ds, self.tr, self.cfg.run.train_encoder
        dtype, dev = getattr(torch, cfg.run.dtype), _device(cfg)
        calls = [(b, s) for b, (s, r) in enumerate(plan.encoder_batches()) if r in ranks]
        outs, embs = {}, {}
        for b, sids in calls:
            x = ds.encoder_input(sids, dtype).to(dev)
            with tr.span("compute", k), torch.set_grad_enabled(train):
                outs[b] = self.enc(x)
            for i, sid in enumerate(sids):
                embs[sid] = outs[b][i].detach().requires_grad_(train)
        denom, total = ds.target_tokens(k), 0.0
        for r in ranks:
            for mb in plan.rank_bins[r]:
                with tr.span("compute", k):
                    loss = self.cons.loss_sum([embs[s] for s in mb], _texts(ds, mb)) / denom
                    loss.backward()
                total += loss.item()
        if train:
            with tr.span("compute", k):
                for p in range(producers):
                    for b, sids in calls:
                        if b % producers == p:
                            outs[b].backward(torch.stack([embs[s].grad for s in sids]))
        return total


def _monolithic(cfg: FlowConfig, plans: list[BatchPlan]) -> RunResult:
    m = _Lockstep.build(cfg, Tracer("mono"))
    enc_opt, cons_opt = _opt(m.enc, cfg), _opt(m.cons, cfg)
    losses = []
    for k, plan in enumerate(plans):
        total = m.step(k, plan, list(range(len(plan.rank_bins))), cfg.run.producers)
        with m.tr.span("optim", k):
            _step(cons_opt)
            if cfg.run.train_encoder:
                _step(enc_opt)
        m.tr.step_end[k] = time.perf_counter()
        losses.append(total)
    return RunResult(losses, _state(m.enc), _state(m.cons), [m.tr.to_dict()])


def _replica(cfg: FlowConfig, plans: list[BatchPlan], r: int, group, tr: Tracer, fault) -> dict:
    """One monolithic_dp replica: its rank's micro-batches, then all-reduce and step."""
    import torch.distributed as dist

    m = _Lockstep.build(cfg, tr)
    enc_opt, cons_opt = _opt(m.enc, cfg), _opt(m.cons, cfg)
    losses = []
    for k, plan in enumerate(plans):
        _inject(fault, tr.role, k)
        total = m.step(k, plan, [r], 1)
        with tr.span("optim", k):
            _all_reduce_grads(m.cons, group)
            if cfg.run.train_encoder:
                _all_reduce_grads(m.enc, group)
            t = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(t, group=group)
            _step(cons_opt)
            if cfg.run.train_encoder:
                _step(enc_opt)
        tr.step_end[k] = time.perf_counter()
        losses.append(float(t))
    return {"enc_state": _state(m.enc), "cons_state": _state(m.cons), "losses": losses}


def _step(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}


# ------------------------------------------------------------------- producer


class _GradReturn:
    """A trainable encoder's half of the gradient return through the pool.

    It stashes what backward needs per encoder call, back-propagates a call once every one of
    its samples' gradients is back, in the plan's order (gradients that arrive early wait in
    `arrived`), holds a slot per sample until its gradient is back, and steps the optimizer
    once a batch's gradients are all in (`version` counts steps).
    """

    def __init__(self, cfg: FlowConfig, enc: nn.Module, end, group, tr: Tracer) -> None:
        self.enc, self.opt, self.end, self.group, self.tr = enc, _opt(enc, cfg), end, group, tr
        self.P, self.S, self.s_max = cfg.run.producers, cfg.pool.slots, cfg.run.staleness
        # (step, sample ids, output (s = 0) or input (s >= 1)) per call, in backward order
        self.expected: deque[tuple[int, list[int], torch.Tensor]] = deque()
        self.arrived: dict[int, torch.Tensor] = {}
        self.outstanding = 0  # samples put whose gradient has not come back (slots held)
        self.version = 0

    def catch_up(self, k: int) -> None:
        """Version barrier before encoding batch k: staleness 0 steps on batch k-1 first."""
        while self.version < k - self.s_max:
            self.finish(self.version)

    def hold(self, k: int, sids: list[int], out: torch.Tensor, x: torch.Tensor) -> None:
        """Stash one encoder call for backward."""
        self.expected.append((k, sids, out if self.s_max == 0 else x))

    def reserve(self) -> None:
        """Wait for the slot the next `put` takes: slots are held until their gradient returns."""
        while self.outstanding >= self.S:
            self.take(True, -1)
        self.outstanding += 1

    def drain(self, k: int) -> None:
        """Back-propagate every gradient that has already come back, without blocking."""
        while self.take(False, k):
            pass

    def take(self, block: bool, step: int) -> bool:
        """Take one returning gradient and back-propagate what is now in order; False if none
        was there (non-blocking). A blocking wait is traced as a barrier at a step's end
        (step >= 0) and as backpressure while waiting for a slot (step = -1)."""
        t0 = time.perf_counter()
        got = self.end.wait_grad() if block else self.end.poll_grad()
        if block:
            self.tr.add("barrier" if step >= 0 else "backpressure", t0, time.perf_counter(), step)
        if got is None:
            return False
        self.arrived[got[0]] = got[1]
        self.outstanding -= 1
        self._backward_ready()
        return True

    def _backward_ready(self) -> None:
        while self.expected and all(s in self.arrived for s in self.expected[0][1]):
            k, sids, saved = self.expected.popleft()
            with self.tr.span("compute", k):
                out = saved if self.s_max == 0 else self.enc(saved)  # stale: recompute
                grad = torch.stack([self.arrived.pop(s) for s in sids]).to(out.device)
                out.backward(grad)

    def finish(self, k: int) -> None:
        """Wait for the rest of batch k's gradients, then all-reduce and step."""
        while any(step == k for step, _, _ in self.expected):
            self.take(True, k)
        with self.tr.span("optim", k):
            if self.P > 1:
                _all_reduce_grads(self.enc, self.group)
            _step(self.opt)
        self.version += 1
        self.tr.step_end[k] = time.perf_counter()


def _producer(
    cfg: FlowConfig, plans: list[BatchPlan], end, p: int, group, tr: Tracer, fault=None
) -> dict:
    ds, dtype, dev = build_dataset(cfg), getattr(torch, cfg.run.dtype), _device(cfg)
    P, train, s_max = cfg.run.producers, cfg.run.train_encoder, cfg.run.staleness
    enc = build_encoder(cfg).to(dev)
    enc.requires_grad_(train)
    grads = _GradReturn(cfg, enc, end, group, tr) if train else None
    for k, plan in enumerate(plans):
        _inject(fault, tr.role, k)
        if grads:
            grads.catch_up(k)
        for b, (sids, dest) in enumerate(plan.encoder_batches()):
            if b % P != p:
                continue
            x = ds.encoder_input(sids, dtype).to(dev)
            with tr.span("compute", k), torch.set_grad_enabled(train and s_max == 0):
                emb_BND = enc(x)
            if grads:
                grads.hold(k, sids, emb_BND, x)
            for i, sid in enumerate(sids):
                if grads:
                    grads.reserve()
                end.put(sid, k, dest, emb_BND[i].detach())
            if grads:
                grads.drain(k)
        if cfg.run.mode == "sync":
            with tr.span("barrier", k):
                end.wait_ack(k)
        if not grads:  # trainable: the step ends at the optimizer step, in `finish`
            tr.step_end[k] = time.perf_counter()
    while grads and grads.version < len(plans):
        grads.finish(grads.version)
    end.flush()
    return {"enc_state": _state(enc)}


# ------------------------------------------------------------------- consumer


def _consumer(
    cfg: FlowConfig, plans: list[BatchPlan], end, c: int, group, tr: Tracer, fault=None
) -> dict:
    import torch.distributed as dist

    ds, train, dev = build_dataset(cfg), cfg.run.train_encoder, _device(cfg)
    cons = build_consumer(cfg, ds).to(dev)
    opt = _opt(cons, cfg)
    losses = []
    for k, plan in enumerate(plans):
        _inject(fault, tr.role, k)
        bins = plan.rank_bins[c]
        got: dict[int, torch.Tensor] = {}
        if cfg.run.mode == "sync":  # the whole global batch must arrive before compute starts
            got = {sid: end.take(sid, k, wait_kind="barrier") for b in bins for sid in b}
            if not train:  # handoff done: the batch now lives here, the encoder's slots are free
                for sid in got:
                    end.release(sid)
            end.ack(k)
        denom, total = ds.target_tokens(k), 0.0
        for b in bins:
            embs = [
                (got.pop(sid) if sid in got else end.take(sid, k)).to(dev).requires_grad_(train)
                for sid in b
            ]
            with tr.span("compute", k):
                loss = cons.loss_sum(embs, _texts(ds, b)) / denom
                loss.backward()
            total += loss.item()
            with tr.span("copy", k):
                for sid, e in zip(b, embs, strict=True):
                    if train:
                        end.give_grad(sid, e.grad)
                    elif cfg.run.mode == "flow":
                        end.release(sid)
        with tr.span("optim", k):
            if cfg.run.consumers > 1:
                _all_reduce_grads(cons, group)
                t = torch.tensor([total], dtype=torch.float64)
                dist.all_reduce(t, group=group)
                total = float(t)
            _step(opt)
        end.flush()
        tr.step_end[k] = time.perf_counter()
        losses.append(total)
    return {"cons_state": _state(cons), "losses": losses, "delivered": list(end.delivered)}


# ------------------------------------------------------------------- processes


def _inject(fault: tuple | None, role: str, step: int) -> None:
    """Test hook: fail `role` (e.g. "producer0") at the start of `step`; a third element
    "crash" kills the process the way a fault in native code would (no Python exception)."""
    if fault is None or tuple(fault[:2]) != (role, step):
        return
    if fault[2:] == ("crash",):
        os.abort()
    raise RuntimeError(f"injected fault in {role} at step {step}")


def _role(cfg: FlowConfig, rank: int) -> str:
    P = cfg.run.producers
    if cfg.run.mode == "monolithic_dp":
        return f"replica{rank}"
    return f"producer{rank}" if rank < P else f"consumer{rank - P}"


def _entry(rank: int, payload: bytes, port: int, pool, result_q, log: str) -> None:
    """A worker process's entry. Its stderr is `log` from here on, and a crash in native code
    leaves the Python stack there. The run (config, plans, fault hook) arrives pickled and is
    unpickled here, so a failure to rebuild it in the child reaches the launcher with its
    traceback like any other error."""
    with open(log, "wb") as f:
        os.dup2(f.fileno(), 2)
    faulthandler.enable()
    try:
        cfg, plans, fault = pickle.loads(payload)
    except BaseException:
        if isinstance(pool, ShmPool):
            pool.close()  # unblock peers waiting on the pool
        result_q.put(("error", rank, f"worker {rank}: {traceback.format_exc()}"))
        return
    _worker(rank, cfg, plans, port, pool, result_q, fault)


def _worker(
    rank: int, cfg: FlowConfig, plans: list[BatchPlan], port: int, pool, result_q, fault
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(cfg.run.threads)
    P, C = cfg.run.producers, cfg.run.consumers
    tr = Tracer(_role(cfg, rank))
    try:
        timeout = timedelta(seconds=cfg.run.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=P + C, timeout=timeout)
        if cfg.run.mode == "monolithic_dp":
            out = _replica(cfg, plans, rank, None, tr, fault)
        else:
            out = _pool_worker(cfg, plans, rank, pool, tr, fault)
        out = {
            k: ({n: t.numpy() for n, t in v.items()} if k.endswith("_state") else v)
            for k, v in out.items()
        }  # numpy pickles by value; no shared fds outlive us
        result_q.put(("ok", rank, {"trace": tr.to_dict(), **out}))
        dist.barrier(group=None)  # nobody tears down the group while a peer still sends
        dist.destroy_process_group()
    except BaseException:
        if isinstance(pool, ShmPool):
            pool.close()  # unblock peers waiting on the pool
        result_q.put(("error", rank, f"{tr.role}: {traceback.format_exc()}"))


def _pool_worker(cfg: FlowConfig, plans: list[BatchPlan], rank: int, pool, tr: Tracer, fault):
    """A producer or a consumer of a sync or flow run, on its module's process group."""
    import torch.distributed as dist

    P, C = cfg.run.producers, cfg.run.consumers
    groups = [dist.new_group(list(range(P))), dist.new_group(list(range(P, P + C)))]
    if pool is None:
        pool = _dist_pool(cfg)
    elif cfg.run.device == "cuda":
        pool.pin()  # page-lock this process's mapping of the slabs: copies to the GPU are DMA
    if rank < P:
        return _producer(cfg, plans, pool.producer(rank, tr), rank, groups[0], tr, fault)
    if isinstance(pool, ShmPool):
        end = pool.consumer(rank - P, tr)
    else:
        owner = {sid: p for pl in plans for sid, p in pl.owners(P).items()}
        end = pool.consumer(rank - P, owner.__getitem__, tr)
    return _consumer(cfg, plans, end, rank - P, groups[1], tr, fault)


def _pool_shape(cfg: FlowConfig) -> dict:
    """The sizes both pool backends are built with."""
    return dict(
        producers=cfg.run.producers,
        consumers=cfg.run.consumers,
        slots=cfg.pool.slots,
        max_tokens=cfg.slot_tokens,
        dim=encoder_width(cfg),
        dtype=getattr(torch, cfg.run.dtype),
        timeout_s=cfg.run.timeout_s,
    )


def _dist_pool(cfg: FlowConfig) -> DistPool:
    return DistPool(**_pool_shape(cfg), train_encoder=cfg.run.train_encoder)


def run(
    cfg: FlowConfig, plans: list[BatchPlan] | None = None, fault: tuple | None = None
) -> RunResult:
    """Run `cfg.run.mode`; monolithic_dp, sync and flow spawn P + C worker processes (gloo,
    store on port 0).

    A failure in any worker raises `FlowWorkerError` here within the timeout, with the worker's
    traceback, and every worker this call started is gone when it returns. `fault=(role, step)`
    injects one (tests).
    """
    import torch.distributed as dist

    _check_device(cfg)
    plans = plans if plans is not None else make_plans(cfg, build_dataset(cfg))
    if cfg.run.mode == "monolithic":
        return run_monolithic(cfg, plans)
    if cfg.run.mode != "monolithic_dp":
        _check_slots(cfg, plans)
    ctx = processes.context(PRELOAD)
    timeout = timedelta(seconds=cfg.run.timeout_s)
    # the workers rendezvous here; it must outlive them, so it stays referenced until we return
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    pooled = cfg.run.mode != "monolithic_dp" and cfg.run.backend == "shm"
    pool = ShmPool(**_pool_shape(cfg), device=cfg.run.device, ctx=ctx) if pooled else None
    result_q = ctx.Queue()
    payload = pickle.dumps((cfg, plans, fault))
    # local-only launcher: the workers' gloo stays on loopback
    env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    logs = Path(tempfile.mkdtemp(prefix="frugaltrain-flow-"))
    procs: list = []
    finished = False
    try:
        for r in range(cfg.run.producers + cfg.run.consumers):
            log = str(logs / f"worker{r}.log")
            args = (r, payload, store.port, pool, result_q, log)
            procs.append(processes.start(_entry, args, PRELOAD, env))
        results = _collect(procs, result_q, time.monotonic() + cfg.run.timeout_s * 2 + 60, logs)
        for pr in procs:
            pr.join(timeout=cfg.run.timeout_s)
        finished = True
    finally:
        _stop(procs, pool)
        if finished:  # a failed run keeps the workers' logs; its error names them
            shutil.rmtree(logs, ignore_errors=True)
    if pool is not None:
        leaked = int((pool.states() != 0).sum())
        assert leaked == 0, f"{leaked} pool slots not FREE at shutdown"
    return _run_result(results, cfg)


def _check_device(cfg: FlowConfig) -> None:
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "run.device = 'cuda': torch sees no CUDA device here; use run.device = 'cpu'"
        )


def _check_slots(cfg: FlowConfig, plans: list[BatchPlan]) -> None:
    need = min_slots(plans, cfg.run.producers, cfg.run.mode)
    if cfg.pool.slots < need:
        raise ConfigError(
            f"pool.slots = {cfg.pool.slots}: the plan needs at least {need} slots "
            f"per producer in {cfg.run.mode} mode, or the pool deadlocks; raise it"
        )


def _collect(procs: list, result_q, deadline: float, logs: Path) -> dict[int, dict]:
    """Every worker's payload by rank; raises at the first reported error, on a worker that died
    without reporting (with its exit signal and the Python stack it left in its log), or after
    `deadline` (time.monotonic)."""
    results: dict[int, dict] = {}
    while len(results) < len(procs):
        try:
            status, rank, payload = result_q.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
            dead = [r for r in dead if r not in results]
            if dead:
                raise FlowWorkerError(_death_report(procs, dead, logs)) from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"flow run: workers did not finish in time; their logs are in {logs}"
                ) from None
            continue
        if status == "error":
            raise FlowWorkerError(payload)
        results[rank] = payload
    return results


def _death_report(procs: list, dead: list[int], logs: Path, tail: int = 40) -> str:
    """What is known of workers that died without a word: how they ended, and the end of what
    they wrote to stderr (a traceback, or the Python stack of a crash in native code)."""
    lines = []
    for r in dead:
        code = procs[r].exitcode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        log = logs / f"worker{r}.log"
        text = log.read_text(errors="replace").strip().splitlines()[-tail:] if log.exists() else []
        lines.append(f"worker {r} died ({how}); the end of {log}:")
        lines += ["  " + t for t in text] or [f"  (nothing: {BEFORE_ENTRY})"]
    return "\n".join(lines)


def _stop(procs: list, pool: ShmPool | None) -> None:
    """Unblock anyone still waiting on the pool, then end the workers still alive."""
    if pool is not None:
        pool.close()
    for pr in procs:  # only the processes this call started, by handle
        if pr.is_alive():
            pr.terminate()
            pr.join(5)


def _run_result(results: dict[int, dict], cfg: FlowConfig) -> RunResult:
    """The first backbone process holds the (data-parallel identical) backbone weights and the
    losses, the first process the encoder's."""
    P, C = cfg.run.producers, cfg.run.consumers
    if cfg.run.mode == "monolithic_dp":
        first, backbones = results[0], []
    else:
        first, backbones = results[P], range(C)
    return RunResult(
        first["losses"],
        _tensors(results[0]["enc_state"]),
        _tensors(first["cons_state"]),
        [results[r]["trace"] for r in range(P + C)],
        {c: results[P + c]["delivered"] for c in backbones},
    )


def _tensors(d: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in d.items()}
