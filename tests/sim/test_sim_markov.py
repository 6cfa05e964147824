"""The Markov corpus: its entropy rate matches an empirical estimate, and its spec is checked."""

from __future__ import annotations

import numpy as np
import pytest

from frugaltrain.config import ConfigError
from frugaltrain.data.corpus import load_corpus
from frugaltrain.data.markov import MarkovSource, parse_spec


def test_entropy_rate_matches_empirical_conditional_entropy():
    src = MarkovSource(parse_spec("markov:order=1,symbols=16,branching=3,seed=4"))
    x = src.sample(200_000, 0).astype(np.int64)
    counts = np.zeros((16, 16))
    np.add.at(counts, (x[:-1], x[1:]), 1)
    p = counts / counts.sum()
    cond = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    empirical = -np.sum(p[p > 0] * np.log(cond[p > 0]))
    assert src.entropy_rate() == pytest.approx(empirical, abs=0.01)
    # The window floor is above the rate only through the first k - 1 positions.
    assert src.loss_floor(64) == pytest.approx(src.entropy_rate())
    src2 = MarkovSource(parse_spec("markov:order=2,symbols=8,branching=2"))
    assert src2.loss_floor(4) > src2.entropy_rate()


def test_markov_path_loads_and_rejects_bad_keys():
    corpus = load_corpus("markov:order=1,symbols=32,branching=4,tokens=20000")
    assert corpus.train.numel() == 20_000 and int(corpus.train.max()) < 32
    with pytest.raises(ConfigError, match="unknown markov key 'states'"):
        parse_spec("markov:states=4")


def test_source_nll_on_windows_averages_to_the_floor():
    # Order 2, so the first position sees only one symbol (the marginal conditional).
    src = MarkovSource(parse_spec("markov:order=2,symbols=8,branching=3,seed=1"))
    stream = src.sample(40_001 * 2, 1).astype(np.int64)
    T = 8
    starts = np.arange(0, 80_000 - T - 1, T + 1)
    x = np.stack([stream[s : s + T] for s in starts])
    y = np.stack([stream[s + 1 : s + T + 1] for s in starts])
    # ~8,900 windows: per-window NLL has std < 1 nat, so the mean is within ~0.01 of the floor.
    assert src.nll(x, y) == pytest.approx(src.loss_floor(T), abs=0.03)
    # Position 0 is scored with P(next | one symbol); a hand computation for one window.
    marg, cond = src._early_conditionals(T)[0]
    ctx = x[0, 0] * 8 + x[0, 1]
    by_hand = -(np.log(cond[x[0, 0], y[0, 0]]) + np.log(src.P[ctx, y[0, 1]])) / 2
    assert src.nll(x[:1, :2], y[:1, :2]) == pytest.approx(by_hand, rel=1e-12)
