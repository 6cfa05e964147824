"""`Comm` over torch.distributed: gloo on CPU, NCCL on GPU.

All-reduces flatten tensors into one buffer per call so a round costs one collective, not one per
parameter. Gossip exchanges use isend/irecv of the encoded payload, tagged by an operation
counter that every worker advances in the same order, so a non-blocking Mix1 and a blocking Mix2
between the same pair of workers never mix up their messages. Every operation uses the process
group's timeout (run.timeout_s), so a dead peer raises instead of hanging.

`group` may be a subgroup (with run.shards > 1, shard s of every replica: train/sharding.py);
ranks and peers are then positions in it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from frugaltrain.comm.base import Comm, Exchange, Handle
from frugaltrain.comm.guard import Guard
from frugaltrain.comm.replica_shards import ReplicaShards

_PARTS = 4  # tag space per operation: one tag per encoded part


class TorchDistComm(Comm):
    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        deterministic: bool = False,
        guard: Guard | None = None,
        shard_link: ReplicaShards | None = None,
    ):
        super().__init__(deterministic=deterministic, guard=guard, shard_link=shard_link)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.members = list(range(self.world_size))
        # NCCL reduces only GPU tensors: logging scalars take a round trip through the GPU.
        nccl = dist.get_backend(group) == "nccl"
        self._metric_device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def _all_reduce_sum(self, tensors: list[torch.Tensor], scale: float) -> Handle:
        flat = _flatten_dense_tensors(tensors)
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def finish() -> None:
            work.wait()
            flat.mul_(scale)
            for t, r in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                t.copy_(r)

        return Handle(self.stats, finish, work.is_completed)

    def _all_gather(self, parts: list[torch.Tensor], seq: int) -> Exchange:
        n = len(self.members)
        buffers = [[torch.empty_like(p) for _ in range(n)] for p in parts]
        works = [
            dist.all_gather(buf, p.contiguous(), group=self.group, async_op=True)
            for buf, p in zip(buffers, parts, strict=True)
        ]

        def wait_all() -> dict[int, list[torch.Tensor]]:
            for w in works:
                w.wait()
            return {rank: [buf[i] for buf in buffers] for i, rank in enumerate(self.members)}

        return Exchange(wait_all, lambda: all(w.is_completed() for w in works))

    def _exchange(
        self, parts: list[torch.Tensor], send_to: list[int], recv_from: list[int], seq: int
    ) -> Exchange:
        return self._send_receive(dict.fromkeys(send_to, parts), recv_from, parts, seq)

    def _scatter(self, parts_to: dict[int, list[torch.Tensor]], seq: int) -> Exchange:
        like = next(iter(parts_to.values()))  # every chunk codes to the same shapes
        return self._send_receive(parts_to, list(parts_to), like, seq)

    def _send_all_later(self, parts: Callable[[], list[torch.Tensor]], seq: int) -> Exchange:
        """In a thread of its own, started now: `parts()` (the two-phase average's chunk mean,
        once the first phase has arrived) goes to every peer at once, so it moves during the
        inner step a step-early round overlaps instead of after the round's end. Point to
        point and tagged, so it cannot reorder against collectives this worker's own thread
        posts meanwhile; an error in the thread is raised by `wait_all`."""
        peers = [r for r in self.members if r != self.rank]
        out: dict = {}

        def move() -> None:
            try:
                own = parts()
                out["parts"] = {**self._exchange(own, peers, peers, seq).wait_all(), self.rank: own}
            except BaseException as e:  # handed to the thread that waits
                out["error"] = e

        thread = threading.Thread(target=move, name="coded-means", daemon=True)
        thread.start()

        def wait_all() -> dict[int, list[torch.Tensor]]:
            thread.join()
            if "error" in out:
                raise out["error"]
            return out["parts"]

        return Exchange(wait_all, lambda: not thread.is_alive())

    def _send_receive(
        self,
        parts_to: dict[int, list[torch.Tensor]],
        recv_from: list[int],
        like: list[torch.Tensor],
        seq: int,
    ) -> Exchange:
        """Send `parts_to[peer]` to each peer and receive parts shaped `like` from each of
        `recv_from`, all in flight at once."""
        tag = (seq % (1 << 20)) * _PARTS
        # Receives first. gloo's TCP pair writes its messages in order on one socket, and a
        # receive is announced to the sender by a message: posted after a send that is already
        # streaming, the announcement waits behind the whole payload and the peer's payload
        # cannot start until it arrives, so the two directions run one after the other.
        received = {peer: [torch.empty_like(p) for p in like] for peer in recv_from}
        works = [
            dist.irecv(buf, group=self.group, tag=tag + k, group_src=peer)
            for peer in recv_from
            for k, buf in enumerate(received[peer])
        ]
        for peer, parts in parts_to.items():
            for k, p in enumerate(parts):
                works.append(
                    dist.isend(p.contiguous(), group=self.group, tag=tag + k, group_dst=peer)
                )

        def wait_all() -> dict[int, list[torch.Tensor]]:
            for w in works:
                w.wait()
            return received

        return Exchange(wait_all, lambda: all(w.is_completed() for w in works))

    def _metric_sum(self, t: torch.Tensor) -> None:
        self._metric_sum_async(t)()

    def _metric_sum_async(self, t: torch.Tensor):
        on_device = t if self._metric_device is None else t.to(self._metric_device)
        work = dist.all_reduce(on_device, group=self.group, async_op=True)

        def wait() -> None:
            work.wait()
            if on_device is not t:
                t.copy_(on_device)

        return wait

    def _metric_max(self, t: torch.Tensor) -> None:
        on_device = t if self._metric_device is None else t.to(self._metric_device)
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=self.group)
        t.copy_(on_device)
