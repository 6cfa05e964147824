"""Network model of the simulator: what an operation costs in simulated seconds.

Per worker i: bandwidth B_i (bytes/s, full duplex) and latency l. With n participants and a
payload of S bytes per worker:

    ring all-reduce   T = 2 (n-1)/n * S / min_i B_i + 2 (n-1) l     (the ring runs at its
                                                                     slowest link)
    all-gather        T = (n-1) S / min_i B_i + (n-1) l
    gossip / pairs    worker i sends d_out S and receives d_in S:
                      its part takes max(d_out, d_in) S / B_i + l, and a message from j is in
                      no sooner than j's own sending is done: d_out_j S / B_j + l after j starts
    rejoin state copy T = S / min(B_a, B_b) + l

In the point-to-point forms (gossip, pairs, rejoin) B is p B_i with p = sim.p2p_bandwidth_ratio
(default 1): a real stack may move a pair exchange slower than its all-reduce over the same link
(gloo on tbf-shaped links: p = 0.93-1.07 with the runtime's exchange, 0.55 with its sends posted
first, docs/results/netlab.md). All-reduce and all-gather use B_i.

Each worker's link is one FIFO queue: an operation starts on it when the worker has posted it
and the link has finished every earlier operation (so Mix1 and Mix2 serialize, Mix1 first).
"""

from __future__ import annotations

from frugaltrain.config import Config
from frugaltrain.sim.config import SimSection


class Network:
    def __init__(
        self, bandwidth_Bps: list[float], latency_s: float, p2p_ratio: float = 1.0
    ) -> None:
        self.B = list(bandwidth_Bps)
        self.B_p2p = [b * p2p_ratio for b in self.B]  # b * 1.0 == b: the default is exact
        self.latency_s = latency_s

    def ring_allreduce_s(self, nbytes: float, ranks: list[int]) -> float:
        n = len(ranks)
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n * nbytes / min(self.B[r] for r in ranks) + 2 * (n - 1) * (
            self.latency_s
        )

    def allgather_s(self, nbytes: float, ranks: list[int]) -> float:
        n = len(ranks)
        if n <= 1:
            return 0.0
        return (n - 1) * nbytes / min(self.B[r] for r in ranks) + (n - 1) * self.latency_s

    def send_s(self, nbytes: float, rank: int) -> float:
        return nbytes / self.B_p2p[rank] + self.latency_s

    def pair_s(self, nbytes: float, a: int, b: int) -> float:
        return nbytes / min(self.B_p2p[a], self.B_p2p[b]) + self.latency_s


def build_network(sim: SimSection, cfg: Config, num_params: int) -> Network:
    """Network of a run; with sim.ratio > 0 the bandwidth is set from r (all workers equal; r
    fixes the all-reduce's time, so p2p_bandwidth_ratio still slows point-to-point transfers)."""
    M = cfg.run.workers
    if sim.ratio > 0:
        S = 4 * num_params  # fp32 parameters: the payload of DiLoCo's and GlobalM1's all-reduce
        budget = sim.ratio * cfg.outer.H * sim.step_s - 2 * (M - 1) * sim.latency_s
        if M == 1:
            return Network([float("inf")], sim.latency_s, sim.p2p_bandwidth_ratio)
        if budget <= 0:
            from frugaltrain.config import ConfigError

            raise ConfigError(
                f"sim.ratio = {sim.ratio}: the latency terms alone exceed r * H * step_s; "
                "lower sim.latency_s or raise sim.ratio"
            )
        B = 2 * (M - 1) / M * S / budget
        return Network([B] * M, sim.latency_s, sim.p2p_bandwidth_ratio)
    bw = sim.bandwidth_bps * (M if len(sim.bandwidth_bps) == 1 else 1)
    return Network([b / 8 for b in bw], sim.latency_s, sim.p2p_bandwidth_ratio)
