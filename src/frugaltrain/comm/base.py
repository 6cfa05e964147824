"""The communication interface every outer strategy is written against.

A strategy sees one worker's view: its rank, the live members, and operations on lists of tensors
that may be started asynchronously and waited on later: `all_reduce_mean_` (exact average) and
`mix_` (gossip with a doubly stochastic matrix from comm.topology, optionally compressed with a
codec from comm.compress). Two runtimes implement it:
`LocalComm` (one worker: every operation is the identity, nothing is sent) and `TorchDistComm`
(torch.distributed); the simulator implements the same methods on a virtual clock.

Its parts: the codecs (frugaltrain/codecs/), the guard (`ContributionGuard`, comm/guard.py)
and the accounting (`CommStats`, comm/accounting.py), which every runtime shares.

With emulated links (run.link_mbit, comm/pacing.py) the bytes a public operation added are
queued on the worker's `pacer` when it is posted, and its handle's `wait()` returns no earlier
than the link would have moved them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from frugaltrain.codecs import compress
from frugaltrain.codecs.feedback import ErrorFeedback
from frugaltrain.comm import topology
from frugaltrain.comm.accounting import CommStats, payload_bytes, ring_allreduce_bytes
from frugaltrain.comm.guard import ContributionGuard, Guard, Verdict, guarded_weights
from frugaltrain.comm.pacing import Pacer


class Handle:
    """An operation in flight. `wait()` blocks until it is done (timed as blocking; time the
    fault-tolerant runtime spends recovering inside it counts as recovery instead) and runs the
    completion step (e.g. divide by M, copy back into the caller's tensors) exactly once."""

    def __init__(
        self,
        stats: CommStats,
        wait_fn: Callable[[], None] | None = None,
        done_fn: Callable[[], bool] | None = None,
    ) -> None:
        self._stats = stats
        self.op = stats.current_op
        self._wait_fn = wait_fn
        self._done_fn = done_fn
        self._finished = wait_fn is None
        self._pacer: Pacer | None = None  # an emulated link (comm/pacing.py)
        self._until = 0.0  # on the pacer's clock: when that link has moved this operation

    def pace(self, pacer: Pacer, until: float) -> None:
        """Make `wait()` return no earlier than `until` (on `pacer`'s clock)."""
        self._pacer, self._until = pacer, until
        if self._finished:  # nothing to wait for here, but the link is still busy
            self._wait_fn, self._done_fn, self._finished = lambda: None, lambda: True, False

    def is_completed(self) -> bool:
        if self._pacer is not None and self._pacer.clock() < self._until:
            return False
        return self._finished or (self._done_fn is not None and self._done_fn())

    def wait(self) -> None:
        if self._finished:
            return
        pacer = self._pacer
        clock = time.perf_counter if pacer is None else pacer.clock

        def done() -> None:
            self._wait_fn()
            if pacer is not None:  # the real transfer is done: sleep out the emulated link's rest
                pacer.sleep_until(self._until)

        self._stats.timed(done, self.op, clock)
        self._finished = True


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat fp32 copy of `tensors` (the unit every mixing operation sends)."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def encode_own(
    tensors: list[torch.Tensor], codec: str, feedback: ErrorFeedback | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This worker's value in a mix and the parts it sends. A dense codec without error
    feedback: its exact values (only what a worker receives is lossy). A sparse codec, or any
    codec with `feedback`: what it sent, so every worker of an average holds the same sum; the
    unsent rest (plus `feedback`'s carry) goes to `feedback`."""
    flat = flatten(tensors)
    if feedback is not None:
        flat = feedback.compensate(flat)
    parts = compress.encode(flat, codec)
    if feedback is None and not compress.is_sparse(codec):
        return flat, parts
    sent = compress.decode(parts, codec, flat.numel())
    if feedback is not None:
        feedback.keep(flat - sent)
    return sent, parts


def weighted_sum(weights: list[float], flats: list[torch.Tensor]) -> torch.Tensor:
    """sum_j w_j x_j accumulated in float64 in the given (rank) order, rounded once to fp32.

    Both runtimes reduce through this one function, which makes a mix of identical inputs return
    them unchanged and makes real and simulated runs agree bit for bit."""
    acc = torch.zeros_like(flats[0], dtype=torch.float64)
    for w, x in zip(weights, flats, strict=True):
        acc.add_(x.double(), alpha=float(w))
    return acc.float()


def finish_mix(
    rows: list[float],
    flats: list[torch.Tensor],
    tensors: list[torch.Tensor],
    renormalize: bool = False,
) -> None:
    """Write a mix's result into `tensors`: sum_j rows[j] flats[j] over the contributions that
    arrived (`rows`: their weights in this worker's row, in rank order). `renormalize` divides
    the weights by their sum first, so a row that lost contributions (dropped, late, rejected,
    a member gone) still sums to one; the fault-tolerant runtime always does, and the plain
    path never, so that neither changes by a bit."""
    if renormalize:
        total = sum(rows)
        rows = [x / total for x in rows]
    unflatten_into(weighted_sum(rows, flats), tensors)


class Wire:
    """What passes between this worker and the others, as its Comm sees it: here, exactly what
    is sent and received. Fault injection (comm/faulty.py) swaps in one that corrupts what this
    worker sends and loses messages it receives."""

    def outgoing(self, tensors: list[torch.Tensor]) -> None:
        """This worker's contribution, about to be sent (it may be changed in place)."""

    def received(self, seq: int, sender: int, receiver: int) -> bool:
        """Whether the message `sender` -> `receiver` of operation `seq` is taken."""
        return True


class Comm:
    """One worker's communication endpoint: what an outer strategy sees, and nothing more
    (collectives, members, byte and blocking counts, the guard's rejections). The training
    loop's side of a runtime (logging reductions, the round end, rejoin) is comm/runtime.py's
    `Runtime`, which holds the comm.

    Subclasses implement the transport primitives at the bottom. `members` is the ordered list
    of ranks taking part (all of them unless the fault-tolerance layer shrinks it); mixing
    matrices are indexed by position in `members`.

    deterministic: reduce every all-reduce as a gather plus `weighted_sum` (order-independent,
    bit-identical to the simulator) instead of the runtime's native ring all-reduce; it moves
    (M-1) S instead of 2 (M-1)/M S bytes per worker, and is counted as such.
    guard: keep bad contributions out of every average and mix (comm/guard.py); None: no check.
    shard_link: with run.shards > 1, the other shards of this worker's replica
        (comm/replica_shards.py): the guard then judges the replica's whole contribution.
    """

    rank: int = 0
    world_size: int = 1
    pacer: Pacer | None = None  # this worker's emulated link (run.link_mbit); None: as it is

    def __init__(
        self, *, deterministic: bool = False, guard: Guard | None = None, shard_link=None
    ) -> None:
        self.stats = CommStats()
        self.deterministic = deterministic
        self.guard = None if guard is None else ContributionGuard(guard, shard_link)
        self.shard_link = shard_link
        self.members: list[int] = []
        self.wire = Wire()  # what its traffic passes through (fault injection swaps it)
        self.coded_average = "all_gather"  # or "reduce_scatter": how a coded average travels
        self._op_seq = 0

    @property
    def position(self) -> int:
        """This worker's index in `members` (its row of a mixing matrix)."""
        return self.members.index(self.rank)

    def all_reduce_mean_(
        self,
        tensors: list[torch.Tensor],
        *,
        blocking: bool = True,
        codec: str = "fp32",
        feedback: ErrorFeedback | None = None,
        op: str = "outer",
    ) -> Handle:
        """Average `tensors` in place across `members` (the accepted ones, under a guard). With
        blocking=False the caller must `wait()` the handle before reading them. A codec other
        than fp32 gathers the encoded payloads (a quantized sum is not associative) and reduces
        in fp64. `feedback`: a sparse codec's error feedback for this operation. `op` names the
        operation in the blocking-time split (CommStats)."""
        self.stats.current_op = op
        if len(self.members) == 1 or not tensors:
            return Handle(self.stats)
        v = self._check(tensors, feedback)
        sent, received = self.stats.bytes_sent, self.stats.bytes_received
        handle = self._average(tensors, v, codec, feedback)
        return self._posted(handle, sent, received, blocking)

    def mix_(
        self,
        tensors: list[torch.Tensor],
        w: np.ndarray,
        *,
        codec: str = "fp32",
        blocking: bool = True,
        feedback: ErrorFeedback | None = None,
        op: str = "outer",
    ) -> Handle:
        """Gossip: replace `tensors` by sum_j w[me, j] x_j over `members` (in place, on wait).

        Every worker must call with the same doubly stochastic `w` (see comm.topology). A
        complete `w` is an all-reduce; otherwise each worker sends its (encoded) tensors to
        the members in its column and receives from those in its row. Own values are exact.
        Under a guard, rejected members' columns are dropped and rows renormalized. A sparse
        codec's own contribution is what was sent, the rest goes to `feedback`."""
        self.stats.current_op = op
        n = len(self.members)
        if w.shape != (n, n):
            raise ValueError(f"mixing matrix is {w.shape}, expected ({n}, {n}) for the members")
        if n == 1 or not tensors or np.array_equal(w, np.eye(n)):
            return Handle(self.stats)
        sent, received = self.stats.bytes_sent, self.stats.bytes_received
        handle = self._start_mix(tensors, w, codec, blocking, feedback)
        return self._posted(handle, sent, received, blocking)

    def _start_mix(
        self,
        tensors: list[torch.Tensor],
        w: np.ndarray,
        codec: str,
        blocking: bool,
        feedback: ErrorFeedback | None = None,
    ) -> Handle:
        """A validated, non-trivial mix, posted (the caller waits): a complete `w` is an
        all-reduce, else `_mix`; a non-blocking one may take a path of the runtime's own
        (`_mix_apart`)."""
        if not blocking:
            handle = self._mix_apart(tensors, w, codec, feedback)
            if handle is not None:
                return handle
        n = len(self.members)
        v = self._check(tensors, feedback)
        if np.allclose(w, 1.0 / n):
            return self._average(tensors, v, codec, feedback)
        if v is not None and v.rejected:
            w = guarded_weights(w, v)
        return self._mix(tensors, w, codec, feedback)

    def _posted(self, handle: Handle, sent: int, received: int, blocking: bool) -> Handle:
        """A public operation's end: queue the bytes it added since (`sent`, `received`) on the
        emulated link, if there is one, then wait for it when `blocking`."""
        pacer = self.pacer
        if pacer is not None:
            s = self.stats
            handle.pace(pacer, pacer.post(s.bytes_sent - sent, s.bytes_received - received))
        if blocking:
            handle.wait()
        return handle

    def _mix_apart(
        self, tensors: list[torch.Tensor], w: np.ndarray, codec: str, feedback: ErrorFeedback | None
    ) -> Handle | None:
        """A non-blocking mix on a path of the runtime's own (the fault-tolerant runtime's Mix1
        with a deadline); None: the common path."""
        return None

    def _average(
        self,
        tensors: list[torch.Tensor],
        v: Verdict | None,
        codec: str,
        feedback: ErrorFeedback | None = None,
    ) -> Handle:
        """Post an average (the caller waits): of the accepted ones under a guard, a native
        ring all-reduce, a coded reduce-scatter or a gather."""
        n = len(self.members)
        if v is not None and v.rejected:  # the mean of the accepted ones, taken by everyone
            k = int(v.accepted.sum())
            handle = self._mix(tensors, np.tile(v.accepted / k, (n, 1)), codec, feedback)
        elif codec == "fp32" and not self.deterministic:
            nbytes = ring_allreduce_bytes(payload_bytes(tensors), n)
            self.stats.count(nbytes, nbytes)
            handle = self._all_reduce_sum(tensors, scale=1.0 / n)
        elif self.coded_average == "reduce_scatter" and not compress.is_sparse(codec):
            handle = self._average_in_two_phases(tensors, codec, feedback)
        else:
            handle = self._mix(tensors, np.full((n, n), 1.0 / n), codec, feedback)
        return handle

    # ---- the guard (comm/guard.py)
    def _check(
        self, tensors: list[torch.Tensor], feedback: ErrorFeedback | None = None
    ) -> Verdict | None:
        """Share the norm of this worker's contribution with the members and judge them all
        (the same verdict everywhere); clip this worker's own contribution if it is told to.
        A rejected worker's error feedback is cleared (it was built from the bad values).
        Blocking: one small collective, counted as blocking time, not as traffic."""
        self.wire.outgoing(tensors)
        if self.guard is None:
            return None
        n, me = len(self.members), self.position
        norms = torch.zeros(n, dtype=torch.float64)
        norms[me] = self.guard.norm(tensors)
        self.stats.timed(lambda: self._metric_sum(norms), self.stats.current_op)
        v = self.guard.judge(norms.numpy(), self.members, me)
        if v.scale[me] != 1.0:
            for t in tensors:
                t.mul_(float(v.scale[me]))
        if me in v.rejected and feedback is not None:
            feedback.reset()
        return v

    def take_rejection(self) -> bool:
        """Whether this worker's own contribution was rejected since the last call (a strategy
        then drops what it kept locally from it, e.g. outer momentum)."""
        return self.guard is not None and self.guard.take_rejection()

    def drain_rejections(self) -> list[dict]:
        """The guard's records since the last call (`"kind": "rejected"`), for worker 0's
        metrics log; the runtime hands them to the loop at the round end."""
        return [] if self.guard is None else self.guard.drain()

    def _encode_counted(
        self,
        tensors: list[torch.Tensor],
        codec: str,
        feedback: ErrorFeedback | None,
        sends: int,
        receives: int,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`encode_own`, counting the encoded payload `sends` times sent and `receives` times
        received."""
        own, parts = encode_own(tensors, codec, feedback)
        wire = compress.wire_bytes(own.numel(), codec)
        self.stats.count(wire * sends, wire * receives)
        return own, parts

    def _mix(
        self, tensors: list[torch.Tensor], w: np.ndarray, codec: str, feedback: ErrorFeedback | None
    ) -> Handle:
        me = self.position
        send_to, recv_from = topology.peers(w, me)
        complete = len(send_to) == len(self.members) - 1 == len(recv_from)
        own, parts = self._encode_counted(tensors, codec, feedback, len(send_to), len(recv_from))
        seq = self._op_seq
        self._op_seq += 1
        if complete:
            fetch = self._all_gather(parts, seq)
        else:
            fetch = self._exchange(
                parts, [self.members[j] for j in send_to], [self.members[j] for j in recv_from], seq
            )

        def finish() -> None:
            received, rank = fetch.wait_all(), self.rank  # received: rank -> encoded parts
            order = [
                j for j in range(len(self.members)) if j in recv_from or (j == me and w[me, me])
            ]
            taken = [j for j in order if j == me or self.wire.received(seq, self.members[j], rank)]
            flats = [
                own if j == me else compress.decode(received[self.members[j]], codec, own.numel())
                for j in taken
            ]
            # A lost message leaves its row short: renormalized over what was taken.
            lost = len(taken) < len(order)
            finish_mix([w[me, j] for j in taken], flats, tensors, renormalize=lost)

        return Handle(self.stats, finish, fetch.is_completed)

    def _average_in_two_phases(
        self, tensors: list[torch.Tensor], codec: str, feedback: ErrorFeedback | None
    ) -> Handle:
        """A coded average as a reduce-scatter then an all-gather, each of coded chunks: worker
        j averages chunk j of everyone's contribution (its own exact, as in `_mix`), codes the
        mean and sends it to all. Each worker sends 2 (M-1)/M of its coded payload instead of
        the gather's M-1 (half at M = 4), at the price of coding the mean once more. Every
        worker, chunk j's owner included, takes the decoded means, so all hold the same result.
        The second phase starts when the first has arrived on runtimes that move it in the
        background (`_send_all_later`), else when the handle is waited on."""
        n, me = len(self.members), self.position
        flat = flatten(tensors)
        if feedback is not None:
            flat = feedback.compensate(flat)
        size = compress.chunk_numel(flat.numel(), n)
        chunks = torch.nn.functional.pad(flat, (0, n * size - flat.numel())).view(n, size)
        parts = [compress.encode(c, codec) for c in chunks]
        own = chunks[me]
        if feedback is not None:  # what was sent is what counts; the rest is carried
            sent = torch.cat([compress.decode(p, codec, size) for p in parts])
            feedback.keep(flat - sent[: flat.numel()])
            own = sent[me * size : (me + 1) * size]
        wire = compress.wire_bytes(size, codec) * 2 * (n - 1)
        self.stats.count(wire, wire)
        seq = self._op_seq
        self._op_seq += 2
        scatter = self._scatter({self.members[j]: parts[j] for j in range(n) if j != me}, seq)

        def coded_mean() -> list[torch.Tensor]:
            """The first phase's end: the mean of this worker's chunk, coded."""
            received, rank = scatter.wait_all(), self.rank
            taken = [
                j for j in range(n) if j == me or self.wire.received(seq, self.members[j], rank)
            ]
            flats = [
                own if j == me else compress.decode(received[self.members[j]], codec, size)
                for j in taken
            ]
            mean = weighted_sum([1.0 / len(taken)] * len(taken), flats)
            # The mean's coding carries its rest too, in a residual of its own.
            return encode_own([mean], codec, feedback and feedback.of_mean())[1]

        means = self._send_all_later(coded_mean, seq + 1)

        def finish() -> None:
            gathered = means.wait_all()
            decoded = [compress.decode(gathered[r], codec, size) for r in self.members]
            unflatten_into(torch.cat(decoded)[: flat.numel()], tensors)

        return Handle(self.stats, finish, means.is_completed)

    def _send_all_later(self, parts: Callable[[], list[torch.Tensor]], seq: int) -> Exchange:
        """Every member's `parts()` to every member (its own included in the result), where
        `parts()` waits on what they are made of. Here it starts when waited on; runtimes that
        can move it in the background start it as soon as `parts()` has returned."""
        return Exchange(lambda: self._all_gather(parts(), seq).wait_all(), lambda: False)

    # Transport primitives, one set per runtime. The `_metric_*` ones move logging and guard
    # scalars (not algorithm traffic); comm/runtime.py's Runtime reduces through them too.
    def _all_reduce_sum(self, tensors: list[torch.Tensor], scale: float) -> Handle:
        raise NotImplementedError

    def _all_gather(self, parts: list[torch.Tensor], seq: int) -> Exchange:
        raise NotImplementedError

    def _exchange(
        self, parts: list[torch.Tensor], send_to: list[int], recv_from: list[int], seq: int
    ) -> Exchange:
        raise NotImplementedError

    def _scatter(self, parts_to: dict[int, list[torch.Tensor]], seq: int) -> Exchange:
        """Send `parts_to[r]` to each rank r and receive one message from each: a shifted
        exchange per distance k = 1 .. M-1 (to the member k places on, from the one k back), so
        every worker posts the same operations in the same order. Runtimes that can post all
        of it at once override this."""
        n, me = len(self.members), self.position
        fetches = []
        for k in range(1, n):
            to, frm = self.members[(me + k) % n], self.members[(me - k) % n]
            fetches.append(self._exchange(parts_to[to], [to], [frm], seq))

        def wait_all() -> dict[int, list[torch.Tensor]]:
            received: dict[int, list[torch.Tensor]] = {}
            for fetch in fetches:
                received.update(fetch.wait_all())
            return received

        return Exchange(wait_all, lambda: all(f.is_completed() for f in fetches))

    def _metric_sum(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def _metric_max(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def _metric_sum_async(self, t: torch.Tensor) -> Callable[[], None]:
        """Runtimes with asynchronous collectives override this; the default is synchronous."""
        self._metric_sum(t)
        return lambda: None


class Exchange:
    """Point-to-point or gather traffic in flight: `wait_all()` returns {rank: received parts}."""

    def __init__(
        self,
        wait_all: Callable[[], dict[int, list[torch.Tensor]]],
        is_completed: Callable[[], bool],
    ) -> None:
        self.wait_all = wait_all
        self.is_completed = is_completed


class LocalComm(Comm):
    """A world of one: every collective is the identity and moves no bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.members = [0]
