"""Mixing topologies: doubly stochastic matrices W over the current set of workers.

"Mixing" a tensor means x_i <- sum_j W[i, j] x_j. Every worker builds the same W for a round from
(topology, round, seed, number of live workers) alone, so no coordination is needed to agree on
who talks to whom. Row i says whom worker i receives from; column i says whom it sends to.

    complete     W = J (1/n everywhere): exact average, rho = 0
    ring         1/3 to self, left and right neighbour (1/2 each for n = 2)
    pairs        a random perfect matching, reseeded every round, pair averaging (odd n: one idle)
    exponential  one peer: receive from i - 2^k, send to i + 2^k, k = round mod ceil(log2 n);
                 W = (I + P_k) / 2; exact average after log2 n rounds when n is a power of two
    none         W = I: no communication

The contraction factor rho is the smallest rho with E||W X - X_bar||^2 <= rho ||X - X_bar||^2
(research note 0.2): for a fixed W it is the largest eigenvalue of W^T (I - J) W, for random or
cycling W it is measured as the largest eigenvalue of the mean of W^T (I - J) W over draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from frugaltrain.config import TOPOLOGIES  # the names the config accepts; each is built below


def mixing_matrix(topology: str, n: int, round_idx: int = 0, seed: int = 0) -> np.ndarray:
    """The n x n doubly stochastic mixing matrix of `topology` for outer round `round_idx`."""
    if n < 1:
        raise ValueError(f"mixing needs at least one worker, got n = {n}")
    eye = np.eye(n)
    if topology == "none" or n == 1:
        return eye
    if topology == "complete":
        return np.full((n, n), 1.0 / n)
    if topology == "ring":
        if n == 2:
            return np.full((2, 2), 0.5)
        w = eye / 3
        for i in range(n):
            w[i, (i - 1) % n] += 1 / 3
            w[i, (i + 1) % n] += 1 / 3
        return w
    if topology == "pairs":
        # Same permutation on every worker: a generator seeded by (seed, round) only.
        order = np.random.default_rng([seed, round_idx, 0x9A125]).permutation(n)
        w = eye.copy()
        for a, b in zip(order[0::2], order[1::2], strict=False):
            w[a, a] = w[b, b] = w[a, b] = w[b, a] = 0.5
        return w
    if topology == "exponential":
        k = round_idx % max(1, math.ceil(math.log2(n)))
        shift = (2**k) % n
        w = eye / 2
        for i in range(n):
            w[i, (i - shift) % n] += 0.5
        return w
    raise ValueError(f"unknown topology {topology!r}; choose one of {', '.join(TOPOLOGIES)}")


@dataclass(frozen=True)
class Contraction:
    rho: float
    how: str  # "analytic" or "measured over N draws"


def contraction_factor(topology: str, n: int, seed: int = 0, draws: int = 256) -> Contraction:
    """rho of `topology` over n workers (see the module docstring for the definition):
    analytic where the value is known, measured over `draws` rounds otherwise."""
    if n == 1 or topology == "complete":
        return Contraction(0.0, "analytic")
    if topology == "none":
        return Contraction(1.0, "analytic")
    if topology == "ring":
        lam2 = 0.0 if n == 2 else (1 + 2 * math.cos(2 * math.pi / n)) / 3
        return Contraction(lam2**2, "analytic")
    if topology == "pairs" and n % 2 == 0:
        # W = (I + P) / 2 with P a uniform perfect matching: W^T (I - J) W = (I - J)(I + P) / 2,
        # and E[P] = (11^T - I) / (n - 1) acts as -1 / (n - 1) off the mean (research note a.7).
        return Contraction(0.5 * (n - 2) / (n - 1), "analytic")
    rounds = max(1, math.ceil(math.log2(n))) if topology == "exponential" else draws
    return measured_contraction_factor(topology, n, rounds, seed)


def measured_contraction_factor(topology: str, n: int, rounds: int, seed: int = 0) -> Contraction:
    """rho measured as the largest eigenvalue of the mean of W^T (I - J) W over rounds 0..rounds-1,
    restricted to the subspace orthogonal to the all-ones vector (the mean never changes)."""
    centre = np.eye(n) - np.full((n, n), 1.0 / n)
    acc = np.zeros((n, n))
    for t in range(rounds):
        w = mixing_matrix(topology, n, t, seed)
        acc += w.T @ centre @ w
    acc /= rounds
    rho = float(np.linalg.eigvalsh(centre @ acc @ centre).max())
    return Contraction(max(rho, 0.0), f"measured over {rounds} rounds")


def peers(w: np.ndarray, rank: int) -> tuple[list[int], list[int]]:
    """(ranks that `rank` sends to, ranks it receives from), excluding itself, in rank order."""
    n = w.shape[0]
    send_to = [j for j in range(n) if j != rank and w[j, rank] > 0]
    recv_from = [j for j in range(n) if j != rank and w[rank, j] > 0]
    return send_to, recv_from


def messages_per_worker(topology: str, n: int) -> float:
    """Payload copies one worker sends per mixing round (its bytes are this times the payload;
    `complete` is an all-reduce and is counted by the comm's ring model instead)."""
    if n == 1 or topology == "none":
        return 0.0
    if topology == "ring":
        return 1.0 if n == 2 else 2.0
    if topology == "pairs":
        return (n - n % 2) / n  # the idle worker of an odd n sends nothing
    if topology == "exponential":
        return 1.0
    if topology == "complete":
        return 2 * (n - 1) / n
    raise ValueError(f"unknown topology {topology!r}; choose one of {', '.join(TOPOLOGIES)}")


def groups_matrix(n: int, size: int, round_idx: int, seed: int = 0) -> np.ndarray:
    """NoLoCo's mixing: a seeded random partition into groups of `size` (the last group takes the
    remainder), each averaged exactly; redrawn every round, identical on every worker."""
    order = np.random.default_rng([seed, round_idx, 0x90C0]).permutation(n)
    w = np.zeros((n, n))
    for start in range(0, n, size):
        group = order[start : start + size]
        w[np.ix_(group, group)] = 1.0 / len(group)
    return w
