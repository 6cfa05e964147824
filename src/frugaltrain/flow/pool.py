"""The memory pool between encoder producers and backbone consumers.

Two backends with one interface:

- `ShmPool`: one host. Each producer owns a segment: a preallocated shared-memory slab
  [slots, max_tokens, Dv] plus a gradient slab of the same shape. The slot table (descriptors)
  is shared memory too; process-shared semaphores do the blocking.
- `DistPool`: across processes or hosts over torch.distributed point-to-point (gloo on CPU).
  A producer's segment is its local slab; `put` posts an isend from the slot, and the slot is
  free again once the send (and, with a trainable encoder, the returning gradient) completes.

Addresses follow FlowTrain's global virtual address idea: gva = segment << 40 | byte offset.

Slot state machine (ShmPool keeps it in a shared tensor and asserts every transition):

    FREE -> WRITING (producer) -> READY (descriptor published) -> LEASED (consumer took it)
    LEASED -> FREE                                (frozen encoder: consumer released it)
    LEASED -> GRAD_READY (consumer wrote dL/demb) -> FREE (producer read the gradient)

Exactly once: a slot is published READY for the one consumer the plan names, and only that
consumer moves it to LEASED.
Backpressure: `put` blocks while its segment has no FREE slot (traced as "backpressure").
Failure: every blocking call polls a shared `closed` flag and a deadline, so a crashed peer or a
deadlock raises `PoolClosed` / `TimeoutError` instead of hanging.
"""

from __future__ import annotations

import time
from dataclasses import InitVar, dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

FREE, WRITING, READY, LEASED, GRAD_READY = range(5)
_POLL_S = 0.01  # how often a blocked call re-checks the closed flag


class PoolClosed(RuntimeError):
    """The pool was closed (shutdown or a failure elsewhere) while a call was blocked on it."""


def encode_gva(segment: int, offset_bytes: int) -> int:
    assert 0 <= offset_bytes < 1 << 40 and segment >= 0
    return segment << 40 | offset_bytes


def decode_gva(gva: int) -> tuple[int, int]:
    return gva >> 40, gva & ((1 << 40) - 1)


@dataclass(kw_only=True, eq=False)
class _PoolShape:
    """The sizes both backends share: P producer segments of S slots, each [T, D] of `dtype`."""

    producers: int
    """P: producer processes, one segment each."""
    consumers: int
    """C: consumer processes."""
    slots: int
    """S: slots per segment (samples); bounds a producer's run-ahead."""
    max_tokens: int
    """T: visual tokens one slot holds (the largest sample's)."""
    dim: int
    """D: embedding width (the encoder's d_v)."""
    dtype: torch.dtype
    """Embedding and gradient dtype."""
    timeout_s: float
    """Deadline of every blocking call (seconds)."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"pool.slots = {self.slots}: must be at least 1")
        # the short names of the module docstring, used throughout the pool's arithmetic
        self.P, self.C, self.S = self.producers, self.consumers, self.slots
        self.T, self.D = self.max_tokens, self.dim


@dataclass(kw_only=True, eq=False)
class ShmPool(_PoolShape):
    """Shared-memory pool for P producers and C consumers on one host (see module docstring).

    The slot table (sample_id, step, n_tokens, state, destination) lives in shared memory next
    to the slabs; blocking uses process-shared semaphores (free slots per segment, READY slots
    per consumer, returned gradients per segment, handoff acks), so publishing a sample is a
    copy, four integer stores and one semaphore release: no pickling, no feeder threads.
    Build it in the parent, pass it to `spawn`ed children (or threads), then call
    `producer(p)` / `consumer(c)` there. `close()` from anywhere unblocks everyone.
    """

    ctx: InitVar[Any]
    """A multiprocessing context (e.g. spawn) that makes the semaphores and the closed flag."""
    device: str = "cpu"
    """Where consumers want embeddings and producers want gradients: with "cuda" they are
    copied from the slab straight to the GPU (DMA once each process has called `pin`)."""

    def __post_init__(self, ctx) -> None:
        super().__post_init__()
        self.emb = torch.zeros(self.P, self.S, self.T, self.D, dtype=self.dtype).share_memory_()
        self.grad = torch.zeros_like(self.emb).share_memory_()
        # per slot: sample_id, step, n_tokens, state, destination consumer
        self.meta = torch.zeros(self.P, self.S, 5, dtype=torch.int64).share_memory_()
        self.free = [ctx.Semaphore(self.S) for _ in range(self.P)]
        self.ready = [ctx.Semaphore(0) for _ in range(self.C)]
        self.grads = [ctx.Semaphore(0) for _ in range(self.P)]
        self.acks = [ctx.Semaphore(0) for _ in range(self.P)]
        self.closed = ctx.Event()

    def close(self) -> None:
        self.closed.set()

    def pin(self) -> None:
        """Page-lock this process's mapping of both slabs (cudaHostRegister), so copies between
        them and the GPU are DMA with no staging copy. Call once in every process that copies
        to or from a GPU; it needs CUDA."""
        cudart = torch.cuda.cudart()
        for t in (self.emb, self.grad):
            if t.is_pinned():
                continue
            err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) != 0:  # cudaSuccess
                raise RuntimeError(f"pool: cudaHostRegister of a {tuple(t.shape)} slab: {err}")

    def producer(self, p: int, tracer=None) -> _ShmProducer:
        return _ShmProducer(self, p, tracer)

    def consumer(self, c: int, tracer=None) -> _ShmConsumer:
        return _ShmConsumer(self, c, tracer)

    def states(self) -> torch.Tensor:
        return self.meta[..., 3].clone()

    @property
    def m(self):
        """numpy view of the shared slot table (made per process; unpickling drops it)."""
        if getattr(self, "_m", None) is None:
            self._m = self.meta.numpy()
        return self._m

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_m"}

    def _acquire(self, sem, what: str) -> None:
        """Blocking acquire that still notices `close()` and gives up after the timeout."""
        if sem.acquire(False):
            return
        deadline = time.monotonic() + self.timeout_s
        while not sem.acquire(True, _POLL_S):
            if self.closed.is_set():
                raise PoolClosed(f"pool closed while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"pool: waited {self.timeout_s}s for {what}; raise "
                    "run.timeout_s if the peer is just slow"
                )

    def _find(self, p: int, state: int, dest: int = -1) -> int:
        """A slot of segment p in `state` (and for `dest`); the semaphore says one exists."""
        m = self.m[p]
        ok = m[:, 3] == state
        if dest >= 0:
            ok &= m[:, 4] == dest
        idx = np.flatnonzero(ok)
        assert len(idx), (p, state, dest)
        # oldest first (lowest step, then sample id) keeps delivery in publication order
        return int(idx[np.lexsort((m[idx, 0], m[idx, 1]))[0]])

    def _move(self, p: int, s: int, old: int, new: int) -> None:
        assert self.m[p, s, 3] == old, (p, s, int(self.m[p, s, 3]), old, new)
        self.m[p, s, 3] = new


class _ShmProducer:
    def __init__(self, pool: ShmPool, p: int, tracer) -> None:
        self.pool, self.p, self.tr = pool, p, tracer
        self.in_flight = 0  # slots this producer filled that are not FREE again (occupancy)

    def put(self, sample_id: int, step: int, dest: int, emb_ND: torch.Tensor) -> None:
        """Write one sample's embeddings and publish it to consumer `dest` (blocks when full)."""
        pool, p = self.pool, self.p
        t0 = time.perf_counter()
        pool._acquire(pool.free[p], f"a free slot of producer {p} (pool full)")
        t1 = time.perf_counter()
        s = pool._find(p, FREE)  # only this producer takes FREE slots of its segment
        n = emb_ND.shape[0]
        pool._move(p, s, FREE, WRITING)
        pool.emb[p, s, :n].copy_(emb_ND)
        pool.m[p, s, :3] = (sample_id, step, n)
        pool.m[p, s, 4] = dest
        pool._move(p, s, WRITING, READY)
        pool.ready[dest].release()  # publishes: the semaphore orders the stores above
        if self.tr:
            self.tr.add("backpressure", t0, t1, step)
            self.tr.add("copy", t1, time.perf_counter(), step)
            used = int((pool.m[p, :, 3] != FREE).sum())
            self.tr.occupancy.append((time.perf_counter(), used))

    def _read_grad(self) -> tuple[int, torch.Tensor]:
        pool, p = self.pool, self.p
        s = pool._find(p, GRAD_READY)
        sample_id, n = int(pool.m[p, s, 0]), int(pool.m[p, s, 2])
        g = pool.grad[p, s, :n].to(pool.device, copy=True)
        pool._move(p, s, GRAD_READY, FREE)
        pool.free[p].release()
        return sample_id, g

    def poll_grad(self) -> tuple[int, torch.Tensor] | None:
        return self._read_grad() if self.pool.grads[self.p].acquire(False) else None

    def wait_grad(self) -> tuple[int, torch.Tensor]:
        self.pool._acquire(self.pool.grads[self.p], "a returning gradient")
        return self._read_grad()

    def flush(self) -> None:
        """Nothing in flight: shared-memory writes are complete when `put` returns."""

    def wait_ack(self, step: int) -> None:
        """Batch-synchronized handoff: wait until every consumer has received batch `step`."""
        for _ in range(self.pool.C):
            self.pool._acquire(self.pool.acks[self.p], f"handoff ack of batch {step}")


class _ShmConsumer:
    def __init__(self, pool: ShmPool, c: int, tracer) -> None:
        self.pool, self.c, self.tr = pool, c, tracer
        self.held: dict[int, tuple[int, int]] = {}  # sample_id -> (segment, slot)
        self.delivered: list[int] = []

    def _receive(self, what: str) -> None:
        pool = self.pool
        pool._acquire(pool.ready[self.c], what)
        for p in range(pool.P):  # the semaphore promises one READY slot for us somewhere
            m = pool.m[p]
            if ((m[:, 3] == READY) & (m[:, 4] == self.c)).any():
                s = pool._find(p, READY, self.c)
                break
        else:
            raise AssertionError("ready semaphore without a READY slot")
        sample_id = int(pool.m[p, s, 0])
        assert sample_id not in self.held, f"sample {sample_id} delivered twice"
        pool._move(p, s, READY, LEASED)
        self.held[sample_id] = (p, s)
        self.delivered.append(sample_id)

    def take(self, sample_id: int, step: int = -1, wait_kind: str = "starvation") -> torch.Tensor:
        """A copy of a sample's embeddings [N, Dv]; blocks (starvation) until it is READY."""
        t0 = time.perf_counter()
        while sample_id not in self.held:
            self._receive(f"sample {sample_id} (pool empty)")
        t1 = time.perf_counter()
        p, s = self.held[sample_id]
        out = self.pool.emb[p, s, : int(self.pool.m[p, s, 2])].to(self.pool.device, copy=True)
        if self.tr:
            self.tr.add(wait_kind, t0, t1, step)
            self.tr.add("copy", t1, time.perf_counter(), step)
        return out

    def release(self, sample_id: int) -> None:
        p, s = self.held.pop(sample_id)
        self.pool._move(p, s, LEASED, FREE)
        self.pool.free[p].release()

    def give_grad(self, sample_id: int, grad_ND: torch.Tensor) -> None:
        p, s = self.held.pop(sample_id)
        self.pool.grad[p, s, : grad_ND.shape[0]].copy_(grad_ND)
        self.pool._move(p, s, LEASED, GRAD_READY)
        self.pool.grads[p].release()

    def ack(self, step: int) -> None:
        for p in range(self.pool.P):
            self.pool.acks[p].release()

    def flush(self) -> None:
        """Nothing in flight: gradients are in the shared slab when `give_grad` returns."""


@dataclass(kw_only=True, eq=False)
class DistPool(_PoolShape):
    """torch.distributed point-to-point pool; build one per process after init_process_group.

    Producers are ranks 0..P-1 and consumers ranks P..P+C-1. Each (producer, consumer) pair is an
    ordered stream: the producer sends in the plan's consume order, so the consumer knows which
    sample comes next from whom, and checks it against the header (exactly once, in order).
    Tags: 0 header [sample_id, step, n, gva], 1 payload, 2 gradient, 3 handoff ack.
    """

    train_encoder: bool
    """Gradients come back: a slot is free only once its sample's gradient has arrived."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.timeout = timedelta(seconds=self.timeout_s)

    def producer(self, p: int, tracer=None) -> _DistProducer:
        return _DistProducer(self, p, tracer)

    def consumer(self, c: int, owner_of, tracer=None) -> _DistConsumer:
        """`owner_of(sample_id) -> producer index` tells the consumer whose stream to read."""
        return _DistConsumer(self, c, owner_of, tracer)


class _DistProducer:
    def __init__(self, pool: DistPool, p: int, tracer) -> None:
        self.pool, self.p, self.tr = pool, p, tracer
        self.slab = torch.zeros(pool.S, pool.T, pool.D, dtype=pool.dtype)
        self.gslab = torch.zeros_like(self.slab)
        self.free = list(range(pool.S))
        # FIFO of (slot, sample_id, works, n, header); the header must outlive its isend
        self.pending: list[tuple[int, int, list, int, torch.Tensor]] = []

    def _retire_oldest(self) -> tuple[int, torch.Tensor | None]:
        s, sample_id, works, n, _ = self.pending.pop(0)
        for w in works:
            w.wait(self.pool.timeout)
        self.free.append(s)
        return sample_id, (self.gslab[s, :n].clone() if self.pool.train_encoder else None)

    def put(self, sample_id: int, step: int, dest: int, emb_ND: torch.Tensor) -> None:
        import torch.distributed as dist

        t0 = time.perf_counter()
        if not self.free:
            if self.pool.train_encoder:  # a slot is only free once its gradient came back
                raise AssertionError("trainable DistPool: call wait_grad before put when full")
            self._retire_oldest()
        t1 = time.perf_counter()
        s = self.free.pop(0)
        n = emb_ND.shape[0]
        self.slab[s, :n].copy_(emb_ND)
        gva = encode_gva(self.p, s * self.pool.T * self.pool.D * self.slab.element_size())
        dst = self.pool.P + dest
        head = torch.tensor([sample_id, step, n, gva], dtype=torch.int64)
        works = [dist.isend(head, dst, tag=0), dist.isend(self.slab[s, :n], dst, tag=1)]
        if self.pool.train_encoder:
            works.append(dist.irecv(self.gslab[s, :n], dst, tag=2))
        self.pending.append((s, sample_id, works, n, head))
        if self.tr:
            self.tr.add("backpressure", t0, t1, step)
            self.tr.add("copy", t1, time.perf_counter(), step)
            self.tr.occupancy.append((time.perf_counter(), len(self.pending)))

    def flush(self) -> None:
        while self.pending:
            self._retire_oldest()

    def poll_grad(self) -> tuple[int, torch.Tensor] | None:
        if self.pending and all(w.is_completed() for w in self.pending[0][2]):
            return self._retire_oldest()
        return None

    def wait_grad(self) -> tuple[int, torch.Tensor]:
        return self._retire_oldest()

    def wait_ack(self, step: int) -> None:
        import torch.distributed as dist

        for c in range(self.pool.C):
            t = torch.zeros(1, dtype=torch.int64)
            dist.irecv(t, self.pool.P + c, tag=3).wait(self.pool.timeout)
            assert int(t) == step, (int(t), step)


class _DistConsumer:
    def __init__(self, pool: DistPool, c: int, owner_of, tracer) -> None:
        self.pool, self.c, self.owner_of, self.tr = pool, c, owner_of, tracer
        self.held: dict[int, torch.Tensor] = {}
        self.delivered: list[int] = []
        self.sends: list = []

    def _receive_from(self, p: int) -> None:
        import torch.distributed as dist

        head = torch.zeros(4, dtype=torch.int64)
        dist.irecv(head, p, tag=0).wait(self.pool.timeout)
        sample_id, _, n, _ = (int(x) for x in head)
        buf = torch.empty(n, self.pool.D, dtype=self.pool.dtype)
        dist.irecv(buf, p, tag=1).wait(self.pool.timeout)
        assert sample_id not in self.held, f"sample {sample_id} delivered twice"
        self.held[sample_id] = buf
        self.delivered.append(sample_id)

    def take(self, sample_id: int, step: int = -1, wait_kind: str = "starvation") -> torch.Tensor:
        t0 = time.perf_counter()
        while sample_id not in self.held:
            self._receive_from(self.owner_of(sample_id))
        if self.tr:
            self.tr.add(wait_kind, t0, time.perf_counter(), step)
        return self.held[sample_id]

    def release(self, sample_id: int) -> None:
        del self.held[sample_id]

    def give_grad(self, sample_id: int, grad_ND: torch.Tensor) -> None:
        import torch.distributed as dist

        del self.held[sample_id]
        g = grad_ND.contiguous()
        self.sends.append((dist.isend(g, self.owner_of(sample_id), tag=2), g))

    def flush(self) -> None:
        for w, _ in self.sends:
            w.wait(self.pool.timeout)
        self.sends.clear()

    def ack(self, step: int) -> None:
        import torch.distributed as dist

        t = torch.tensor([step], dtype=torch.int64)
        for p in range(self.pool.P):
            dist.isend(t, p, tag=3).wait(self.pool.timeout)
