"""A synthetic corpus with a known loss floor: a k-th order Markov source over a small alphabet.

Each context (the last k symbols) has `branching` possible successors with Dirichlet(alpha)
probabilities, drawn once from the seed. The source's entropy rate h (nats per token) is exact:
h = -sum_c pi(c) sum_s P(s | c) log P(s | c), with pi the stationary distribution of contexts
(power iteration). A model that sees a window of T tokens cannot beat, per position t, the
conditional entropy given the t + 1 tokens it has; `loss_floor` averages that over the window,
so training loss can be reported as excess over the floor.

Selected with data.path = "markov:KEY=VALUE,..." (keys: order, symbols, branching, alpha,
tokens, seed), e.g. "markov:order=2,symbols=32,branching=4". Tokens are symbol ids (uint8).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import numpy as np
import torch

from frugaltrain.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class MarkovSpec:
    order: int = 2
    """k, symbols of context."""
    symbols: int = 32
    """Alphabet size (at most 256: tokens are bytes)."""
    branching: int = 4
    """Successors per context with non-zero probability."""
    alpha: float = 0.5
    """Dirichlet concentration of the successor probabilities (small: peaky)."""
    tokens: int = 1_000_000
    """Training tokens generated (validation: a tenth, from an independent stream)."""
    seed: int = 0
    """Seeds the transition table and the streams."""


def parse_spec(path: str) -> MarkovSpec:
    """MarkovSpec from "markov:key=value,..."; unknown keys are errors."""
    body = path.split(":", 1)[1]
    known = {f.name: f.type for f in fields(MarkovSpec)}
    kwargs: dict = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, _, raw = item.partition("=")
        if key not in known:
            raise ConfigError(
                f"data.path = {path!r}: unknown markov key {key!r}; valid: {', '.join(known)}"
            )
        kwargs[key] = float(raw) if known[key] in (float, "float") else int(raw)
    spec = MarkovSpec(**kwargs)
    if not 2 <= spec.symbols <= 256 or not 1 <= spec.branching <= spec.symbols:
        raise ConfigError(
            f"data.path = {path!r}: need 2 <= symbols <= 256 and 1 <= branching <= symbols"
        )
    if spec.order < 1 or spec.symbols**spec.order > 1 << 20:
        raise ConfigError(f"data.path = {path!r}: need order >= 1 and symbols^order <= 2^20")
    return spec


class MarkovSource:
    """Transition table P[context, symbol] of a MarkovSpec; contexts are base-`symbols` ints."""

    def __init__(self, spec: MarkovSpec) -> None:
        self.spec = spec
        rng = np.random.default_rng([spec.seed, 0x3A7])
        n_ctx = spec.symbols**spec.order
        self.P = np.zeros((n_ctx, spec.symbols))
        for c in range(n_ctx):
            succ = rng.choice(spec.symbols, size=spec.branching, replace=False)
            self.P[c, succ] = rng.dirichlet(np.full(spec.branching, spec.alpha))

    def _next_ctx(self, ctx: np.ndarray, sym: np.ndarray) -> np.ndarray:
        return (ctx * self.spec.symbols + sym) % (self.spec.symbols**self.spec.order)

    def stationary(self, iters: int = 2000) -> np.ndarray:
        """Stationary distribution over contexts (power iteration from uniform)."""
        n_ctx, V = self.P.shape
        pi = np.full(n_ctx, 1.0 / n_ctx)
        ctx = np.arange(n_ctx)
        for _ in range(iters):
            new = np.zeros(n_ctx)
            for s in range(V):
                np.add.at(new, self._next_ctx(ctx, np.full(n_ctx, s)), pi * self.P[:, s])
            if np.abs(new - pi).sum() < 1e-12:
                return new
            pi = new
        return pi

    def entropy_rate(self) -> float:
        """h in nats per token."""
        pi = self.stationary()
        with np.errstate(divide="ignore", invalid="ignore"):
            row_h = -np.nansum(np.where(self.P > 0, self.P * np.log(self.P), 0.0), axis=1)
        return float(pi @ row_h)

    def _early_conditionals(self, seq_len: int) -> list[np.ndarray]:
        """For positions t < k - 1 (which see only t + 1 symbols): the joint table
        P(seen, next) and the conditional P(next | seen), seen as base-V ints of those symbols
        (the newest is the least significant digit, as in contexts)."""
        k, V = self.spec.order, self.spec.symbols
        joint = self.stationary()[:, None] * self.P  # P(context, next)
        tables = []
        for t in range(min(k - 1, seq_len)):
            n_seen = V ** (t + 1)  # marginalize the oldest k - (t + 1) context symbols
            marg = np.zeros((n_seen, V))
            np.add.at(marg, np.arange(V**k) % n_seen, joint)
            tables.append((marg, marg / np.maximum(marg.sum(1, keepdims=True), 1e-300)))
        return tables

    def loss_floor(self, seq_len: int) -> float:
        """Lowest mean cross-entropy over a window of seq_len predictions: position t (0-based)
        sees t + 1 symbols, so positions t < k - 1 are bounded by H(X_{t+1} | X_0..X_t)."""
        early = []
        for marg, cond in self._early_conditionals(seq_len):
            with np.errstate(divide="ignore", invalid="ignore"):
                early.append(-np.nansum(np.where(marg > 0, marg * np.log(cond), 0.0)))
        return float((sum(early) + self.entropy_rate() * (seq_len - len(early))) / seq_len)

    def nll(self, x: np.ndarray, y: np.ndarray) -> float:
        """Mean negative log-likelihood (nats per token) of targets y given windows x (both
        B x T, y = x shifted by one) under the source itself, seeing only the window like a
        model does: the floor on these exact tokens, whose expectation is loss_floor(T)."""
        V, n_ctx = self.spec.symbols, self.spec.symbols**self.spec.order
        x, y = x.astype(np.int64), y.astype(np.int64)
        early = self._early_conditionals(x.shape[1])
        ctx = np.zeros(x.shape[0], dtype=np.int64)
        total = 0.0
        for t in range(x.shape[1]):
            ctx = (ctx * V + x[:, t]) % n_ctx  # < V ** (t + 1) while t + 1 < k
            table = early[t][1] if t < len(early) else self.P
            total -= np.log(table[ctx, y[:, t]]).sum()
        return float(total / x.size)

    def sample(self, n: int, stream: int) -> np.ndarray:
        """n symbols of stream `stream` (0: train, 1: validation), started from a random context."""
        rng = np.random.default_rng([self.spec.seed, stream, 0x5EED])
        cdf = np.cumsum(self.P, axis=1)
        cdf[:, -1] = 1.0
        u = rng.random(n)
        out = np.empty(n, dtype=np.uint8)
        ctx = int(rng.integers(self.spec.symbols**self.spec.order))
        V, n_ctx = self.spec.symbols, self.spec.symbols**self.spec.order
        for i in range(n):  # sequential by nature; ~1 s per million tokens
            s = int(np.searchsorted(cdf[ctx], u[i], side="right"))
            out[i] = s
            ctx = (ctx * V + s) % n_ctx
        return out


@functools.lru_cache(maxsize=4)
def markov_tokens(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) uint8 token tensors of a "markov:..." data path (cached)."""
    spec = parse_spec(path)
    src = MarkovSource(spec)
    train = torch.from_numpy(src.sample(spec.tokens, 0))
    val = torch.from_numpy(src.sample(max(spec.tokens // 10, 10_000), 1))
    return train, val


@functools.lru_cache(maxsize=16)
def markov_floor(path: str, seq_len: int) -> float:
    """The loss floor (nats per token) of a "markov:..." data path at window seq_len."""
    return MarkovSource(parse_spec(path)).loss_floor(seq_len)


def markov_source_nll(path: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The source's own mean NLL on `batches` of a "markov:..." data path (equal-sized batches):
    subtracted from a model's loss on the same batches, it removes the sampling noise of a small
    evaluation set from the excess over the floor."""
    src = MarkovSource(parse_spec(path))
    return sum(src.nll(x.numpy(), y.numpy()) for x, y in batches) / len(batches)
