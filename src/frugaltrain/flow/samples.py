"""Vision-language samples: the interface every source shares.

`CaptionSet` is what the runtime sees: global batch k holds sample ids k*B .. (k+1)*B - 1, a
`Sample` knows its visual and text token counts before anything is encoded, and
`encoder_input(ids)` gives one batched encoder input for samples of one visual shape. The
sources are digits (flow/data.py), shapes and folder (flow/images.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Sample:
    sample_id: int
    tokens: tuple[int, ...]
    """BOS, the caption's tokens, EOS."""
    n_visual: int
    """Encoder output tokens; samples with equal counts share a visual shape and batch together."""
    image: Any
    """What the pixels are made from: digits image ids, a shapes Scene, or a folder row index."""
    side: int = 0
    """shapes and folder: the square image side in pixels."""

    @property
    def n_text(self) -> int:
        return len(self.tokens)

    @property
    def length(self) -> int:
        """Backbone tokens: visual + text."""
        return self.n_visual + len(self.tokens)

    @property
    def n_targets(self) -> int:
        """Caption tokens the loss is computed on (every text token after BOS)."""
        return len(self.tokens) - 1


class CaptionSet:
    """A dataset as the runtime sees it: global batch k holds sample ids k*B .. (k+1)*B - 1 in
    every mode; samples are made by `_make` and kept."""

    vocab_size: int
    """Token ids are below this (the backbone's embedding rows)."""
    max_text_tokens: int
    """The longest caption, BOS and EOS included (the backbone's position table)."""

    def __init__(self, *, seed: int, global_batch: int) -> None:
        self.seed, self.global_batch = seed, global_batch
        self._cache: dict[int, Sample] = {}

    def _make(self, sample_id: int) -> Sample:
        raise NotImplementedError

    def encoder_input(self, sample_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
        """One encoder call's input for samples of one visual shape (n_visual)."""
        raise NotImplementedError

    def sample(self, sample_id: int) -> Sample:
        if sample_id not in self._cache:
            self._cache[sample_id] = self._make(sample_id)
        return self._cache[sample_id]

    def batch_ids(self, step: int) -> list[int]:
        return list(range(step * self.global_batch, (step + 1) * self.global_batch))

    def batch(self, step: int) -> list[Sample]:
        return [self.sample(i) for i in self.batch_ids(step)]

    def target_tokens(self, step: int) -> int:
        """Loss denominator: caption targets in the whole global batch (packing-independent)."""
        return sum(s.n_targets for s in self.batch(step))
