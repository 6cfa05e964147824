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
