"""The three execution modes over one data stream, one packing plan and one set of weights.

- monolithic: one process (run.mono_threads threads) does, per global batch, encoder forward of
  every sample, the packed backbone micro-batches, encoder backward (trainable), both steps.
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

Both modules use AdamW; the loss is the caption cross-entropy summed over a global batch divided
by its target count, so packing, dispatch and data parallelism never change the result.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn

from frugaltrain.config import ConfigError
from frugaltrain.flow.config import FlowConfig
from frugaltrain.flow.data import DigitCaptions, patches
from frugaltrain.flow.models import build_models
from frugaltrain.flow.packing import BatchPlan, plan_batch
from frugaltrain.flow.pool import DistPool, ShmPool
from frugaltrain.flow.trace import Tracer


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


def make_plans(cfg: FlowConfig, ds: DigitCaptions, cost=None) -> list[BatchPlan]:
    """The schedule of every global batch; identical for all modes (lengths are known upfront:
    fixed patching makes visual token counts a function of the tile count)."""
    s = cfg.sched
    return [
        plan_batch(
            k,
            {x.sample_id: x.length for x in ds.batch(k)},
            L=s.capacity,
            ranks=cfg.run.consumers,
            policy=s.policy,
            how=s.dispatch,
            cost=cost,
        )
        for k in range(cfg.run.steps)
    ]


def min_slots(plans: list[BatchPlan], producers: int, mode: str) -> int:
    """Slots per producer that rule out a pool deadlock: a consumer holds every sample of the
    micro-batch it is assembling, so each producer's share of a wave (micro-batch j of every rank)
    must fit; sync mode holds a whole global batch."""
    need = 1
    for pl in plans:
        if mode == "sync":
            need = max(need, -(-len(pl.consume_order()) // producers))
            continue
        for j in range(max(len(b) for b in pl.rank_bins)):
            wave = sum(len(b[j]) for b in pl.rank_bins if j < len(b))
            need = max(need, -(-wave // producers))
    return need


def _opt(module: nn.Module, cfg: FlowConfig) -> torch.optim.Optimizer:
    if cfg.run.optimizer == "sgd":
        return torch.optim.SGD(module.parameters(), lr=cfg.run.lr)
    return torch.optim.AdamW(module.parameters(), lr=cfg.run.lr, weight_decay=0.0, foreach=False)


def _texts(ds: DigitCaptions, ids: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(ds.sample(i).tokens) for i in ids]


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


def _monolithic(cfg: FlowConfig, plans: list[BatchPlan]) -> RunResult:
    ds, dtype, train = (
        DigitCaptions.from_config(cfg),
        getattr(torch, cfg.run.dtype),
        cfg.run.train_encoder,
    )
    enc, cons = build_models(cfg)
    enc_opt, cons_opt = _opt(enc, cfg), _opt(cons, cfg)
    tr, losses = Tracer("mono"), []
    for k, plan in enumerate(plans):
        order = [sid for sid, _ in plan.consume_order()]
        outs, embs = {}, {}
        with tr.span("compute", k), torch.set_grad_enabled(train):
            for sid in order:
                outs[sid] = enc(patches(ds.sample(sid), cfg.data.patch, dtype))
                embs[sid] = outs[sid].detach().requires_grad_(train)
        denom, total = ds.target_tokens(k), 0.0
        for bins in plan.rank_bins:
            for b in bins:
                with tr.span("compute", k):
                    loss = cons.loss_sum([embs[s] for s in b], _texts(ds, b)) / denom
                    loss.backward()
                total += loss.item()
        if train:  # encoder backward per sample, in each producer's consume order (as in flow)
            with tr.span("compute", k):
                for p in range(cfg.run.producers):
                    for i, sid in enumerate(order):
                        if i % cfg.run.producers == p:
                            outs[sid].backward(embs[sid].grad)
        with tr.span("optim", k):
            cons_opt.step()
            cons_opt.zero_grad(set_to_none=True)
            if train:
                enc_opt.step()
                enc_opt.zero_grad(set_to_none=True)
        tr.step_end[k] = time.perf_counter()
        losses.append(total)
    return RunResult(losses, _state(enc), _state(cons), [tr.to_dict()])


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


# ------------------------------------------------------------------- producer


class _GradReturn:
    """A trainable encoder's half of the gradient return through the pool.

    It stashes what backward needs, back-propagates returning gradients in the plan's order (a
    gradient that arrives early waits in `arrived`), holds a slot per sample until its gradient
    is back, and steps the optimizer once a batch's gradients are all in (`version` counts steps).
    """

    def __init__(self, cfg: FlowConfig, enc: nn.Module, end, group, tr: Tracer) -> None:
        self.enc, self.opt, self.end, self.group, self.tr = enc, _opt(enc, cfg), end, group, tr
        self.P, self.S, self.s_max = cfg.run.producers, cfg.pool.slots, cfg.run.staleness
        self.stash: dict[int, torch.Tensor] = {}  # sample_id -> output (s = 0) or input (s >= 1)
        self.expected: deque[tuple[int, int]] = deque()  # (step, sample_id) in backward order
        self.arrived: dict[int, torch.Tensor] = {}
        self.outstanding = 0  # samples put whose gradient has not come back (slots held)
        self.version = 0

    def catch_up(self, k: int) -> None:
        """Version barrier before encoding batch k: staleness 0 steps on batch k-1 first."""
        while self.version < k - self.s_max:
            self.finish(self.version)

    def hold(self, k: int, sid: int, emb: torch.Tensor, x: torch.Tensor) -> None:
        """Stash sample `sid` for backward and wait for the slot its `put` will take."""
        self.stash[sid] = emb if self.s_max == 0 else x
        self.expected.append((k, sid))
        while self.outstanding >= self.S:  # slots are held until their gradient returns
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
        while self.expected and self.expected[0][1] in self.arrived:
            k, sid = self.expected.popleft()
            with self.tr.span("compute", k):
                if self.s_max == 0:
                    self.stash.pop(sid).backward(self.arrived.pop(sid))
                else:  # stale: recompute with the current weights (changes the optimization)
                    self.enc(self.stash.pop(sid)).backward(self.arrived.pop(sid))

    def finish(self, k: int) -> None:
        """Wait for the rest of batch k's gradients, then all-reduce and step."""
        while any(step == k for step, _ in self.expected):
            self.take(True, k)
        with self.tr.span("optim", k):
            if self.P > 1:
                _all_reduce_grads(self.enc, self.group)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.version += 1
        self.tr.step_end[k] = time.perf_counter()


def _producer(
    cfg: FlowConfig, plans: list[BatchPlan], end, p: int, group, tr: Tracer, fault=None
) -> dict:
    ds, dtype = DigitCaptions.from_config(cfg), getattr(torch, cfg.run.dtype)
    P, train, s_max = cfg.run.producers, cfg.run.train_encoder, cfg.run.staleness
    enc, _ = build_models(cfg)
    enc.requires_grad_(train)
    grads = _GradReturn(cfg, enc, end, group, tr) if train else None
    for k, plan in enumerate(plans):
        _inject(fault, tr.role, k)
        if grads:
            grads.catch_up(k)
        mine = [(sid, r) for i, (sid, r) in enumerate(plan.consume_order()) if i % P == p]
        for sid, dest in mine:
            x = patches(ds.sample(sid), cfg.data.patch, dtype)
            with tr.span("compute", k), torch.set_grad_enabled(train and s_max == 0):
                emb = enc(x)
            if grads:
                grads.hold(k, sid, emb, x)
            end.put(sid, k, dest, emb.detach())
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

    ds, train = DigitCaptions.from_config(cfg), cfg.run.train_encoder
    _, cons = build_models(cfg)
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
                (got.pop(sid) if sid in got else end.take(sid, k)).requires_grad_(train)
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
            opt.step()
            opt.zero_grad(set_to_none=True)
        end.flush()
        tr.step_end[k] = time.perf_counter()
        losses.append(total)
    return {"cons_state": _state(cons), "losses": losses, "delivered": list(end.delivered)}


# ------------------------------------------------------------------- processes


def _inject(fault: tuple[str, int] | None, role: str, step: int) -> None:
    """Test hook: fail `role` (e.g. "producer0") at the start of `step`."""
    if fault == (role, step):
        raise RuntimeError(f"injected fault in {role} at step {step}")


def _worker(
    rank: int, cfg: FlowConfig, plans: list[BatchPlan], port: int, pool, result_q, fault
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(cfg.run.threads)
    P, C = cfg.run.producers, cfg.run.consumers
    role = f"producer{rank}" if rank < P else f"consumer{rank - P}"
    tr = Tracer(role)
    try:
        timeout = timedelta(seconds=cfg.run.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=P + C, timeout=timeout)
        groups = [dist.new_group(list(range(P))), dist.new_group(list(range(P, P + C)))]
        if pool is None:
            pool = _dist_pool(cfg)
        if rank < P:
            out = _producer(cfg, plans, pool.producer(rank, tr), rank, groups[0], tr, fault)
        else:
            owner = {sid: i % P for pl in plans for i, (sid, _) in enumerate(pl.consume_order())}
            end = (
                pool.consumer(rank - P, tr)
                if isinstance(pool, ShmPool)
                else pool.consumer(rank - P, owner.__getitem__, tr)
            )
            out = _consumer(cfg, plans, end, rank - P, groups[1], tr, fault)
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
        result_q.put(("error", rank, f"{role}: {traceback.format_exc()}"))


def _pool_shape(cfg: FlowConfig) -> dict:
    """The sizes both pool backends are built with."""
    return dict(
        producers=cfg.run.producers,
        consumers=cfg.run.consumers,
        slots=cfg.pool.slots,
        max_tokens=cfg.slot_tokens,
        dim=cfg.model.enc_dim,
        dtype=getattr(torch, cfg.run.dtype),
        timeout_s=cfg.run.timeout_s,
    )


def _dist_pool(cfg: FlowConfig) -> DistPool:
    return DistPool(**_pool_shape(cfg), train_encoder=cfg.run.train_encoder)


def run(
    cfg: FlowConfig, plans: list[BatchPlan] | None = None, fault: tuple[str, int] | None = None
) -> RunResult:
    """Run `cfg.run.mode`; sync and flow spawn P + C worker processes (gloo, store on port 0).

    A failure in any worker raises `FlowWorkerError` here within the timeout, and every worker
    this call started is gone when it returns. `fault=(role, step)` injects one (tests).
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    plans = plans if plans is not None else make_plans(cfg, DigitCaptions.from_config(cfg))
    if cfg.run.mode == "monolithic":
        return run_monolithic(cfg, plans)
    _check_slots(cfg, plans)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local-only launcher: stay on loopback
    ctx = mp.get_context("spawn")
    timeout = timedelta(seconds=cfg.run.timeout_s)
    # the workers rendezvous here; it must outlive them, so it stays referenced until we return
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    pool = ShmPool(**_pool_shape(cfg), ctx=ctx) if cfg.run.backend == "shm" else None
    result_q = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, cfg, plans, store.port, pool, result_q, fault))
        for r in range(cfg.run.producers + cfg.run.consumers)
    ]
    for pr in procs:
        pr.start()
    try:
        results = _collect(procs, result_q, time.monotonic() + cfg.run.timeout_s * 2 + 60)
        for pr in procs:
            pr.join(timeout=cfg.run.timeout_s)
    finally:
        _stop(procs, pool)
    if pool is not None:
        leaked = int((pool.states() != 0).sum())
        assert leaked == 0, f"{leaked} pool slots not FREE at shutdown"
    return _run_result(results, cfg.run.producers, cfg.run.consumers)


def _check_slots(cfg: FlowConfig, plans: list[BatchPlan]) -> None:
    need = min_slots(plans, cfg.run.producers, cfg.run.mode)
    if cfg.pool.slots < need:
        raise ConfigError(
            f"pool.slots = {cfg.pool.slots}: the plan needs at least {need} slots "
            f"per producer in {cfg.run.mode} mode, or the pool deadlocks; raise it"
        )


def _collect(procs: list, result_q, deadline: float) -> dict[int, dict]:
    """Every worker's payload by rank; raises at the first reported error, on a worker that died
    without reporting, or after `deadline` (time.monotonic)."""
    results: dict[int, dict] = {}
    while len(results) < len(procs):
        try:
            status, rank, payload = result_q.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
            if dead and not any(r in results for r in dead):
                raise FlowWorkerError(
                    f"worker(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                ) from None
            if time.monotonic() > deadline:
                raise TimeoutError("flow run: workers did not finish in time") from None
            continue
        if status == "error":
            raise FlowWorkerError(payload)
        results[rank] = payload
    return results


def _stop(procs: list, pool: ShmPool | None) -> None:
    """Unblock anyone still waiting on the pool, then end the workers still alive."""
    if pool is not None:
        pool.close()
    for pr in procs:  # only the processes this call started, by handle
        if pr.is_alive():
            pr.terminate()
            pr.join(5)


def _run_result(results: dict[int, dict], P: int, C: int) -> RunResult:
    """Producer 0 and consumer 0 hold the (data-parallel identical) weights and the losses."""
    return RunResult(
        results[P]["losses"],
        _tensors(results[0]["enc_state"]),
        _tensors(results[P]["cons_state"]),
        [results[r]["trace"] for r in range(P + C)],
        {c: results[P + c]["delivered"] for c in range(C)},
    )


def _tensors(d: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in d.items()}
