"""Vision-language samples: the interface every source shares, and the digits source.

`CaptionSet` is what the runtime sees: global batch k holds sample ids k*B .. (k+1)*B - 1, a
`Sample` knows its visual and text token counts before anything is encoded, and
`encoder_input(ids)` gives one batched encoder input for samples of one visual shape.
`build_dataset(cfg)` picks the source: digits (here), or shapes and folder (flow/images.py).

Digits come from scikit-learn's bundled 8x8 images (no download). A sample tiles 1..max_tiles
digit images side by side, which varies the number of visual tokens the way dynamic resolution
does, and pairs them with a caption drawn from templates of varied length ("digits : seven one
."). Tokens are words from a ~60-word vocabulary.

Shapes: patches [n_visual, patch*patch]; tokens [n_text] (BOS ... EOS).
Everything is a pure function of (seed, sample_id), so every process rebuilds identical data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
COUNTS = ("one", "two", "three", "four", "five", "six", "seven", "eight")
# Templates of very different lengths, so text tokens vary as much as visual tokens.
TEMPLATES = (
    "digits : {d} .",
    "{d} .",
    "the picture shows {d} .",
    "a handwritten sequence of {n} digits : {d} .",
    "here we see the digits {d} written by hand in thick strokes on a dark background .",
    "this image is a scan of {n} handwritten digits which read {d} from left to right .",
)
SPECIAL = ("<pad>", "<bos>", "<eos>")


@lru_cache(maxsize=1)
def vocab() -> dict[str, int]:
    words = set(DIGITS) | set(COUNTS)
    for t in TEMPLATES:
        words |= {w for w in t.split() if not w.startswith("{")}
    return {w: i for i, w in enumerate(SPECIAL + tuple(sorted(words)))}


@lru_cache(maxsize=1)
def _digit_images() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # bundled csv inside scikit-learn, no network

    d = load_digits()
    return (d.images / 16.0).astype(np.float64), d.target.astype(np.int64)


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


def make_sample(
    sample_id: int, *, seed: int, tile_weights: tuple[float, ...], patch: int
) -> Sample:
    rng = np.random.default_rng([seed, sample_id])
    images, targets = _digit_images()
    w = np.asarray(tile_weights, dtype=np.float64)
    n_tiles = int(rng.choice(len(w), p=w / w.sum())) + 1
    ids = tuple(int(i) for i in rng.integers(0, len(images), size=n_tiles))
    digits = tuple(int(targets[i]) for i in ids)
    template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    text = template.format(d=" ".join(DIGITS[x] for x in digits), n=COUNTS[n_tiles - 1])
    v = vocab()
    tokens = (v["<bos>"], *(v[w] for w in text.split()), v["<eos>"])
    return Sample(sample_id, tokens, n_tiles * (8 // patch) ** 2, ids)


def patches(sample: Sample, patch: int, dtype: torch.dtype) -> torch.Tensor:
    """Pixels as patch vectors, tile after tile: [n_visual, patch*patch]."""
    images, _ = _digit_images()
    tiles = images[list(sample.image)]  # [k, 8, 8]
    k, g = len(tiles), 8 // patch
    x = tiles.reshape(k, g, patch, g, patch).transpose(0, 1, 3, 2, 4).reshape(k * g * g, -1)
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


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


class DigitCaptions(CaptionSet):
    """Tiled digits with template captions, for the tiny encoder."""

    def __init__(
        self, *, seed: int, global_batch: int, tile_weights: tuple[float, ...], patch: int
    ) -> None:
        super().__init__(seed=seed, global_batch=global_batch)
        self.tile_weights, self.patch = tile_weights, patch
        self.vocab_size = len(vocab())
        longest = max(TEMPLATES, key=lambda t: len(t.split()))
        self.max_text_tokens = len(longest.split()) + 8 + 2  # {d} is up to 8 words; BOS, EOS

    def _make(self, sample_id: int) -> Sample:
        return make_sample(
            sample_id, seed=self.seed, tile_weights=self.tile_weights, patch=self.patch
        )

    def encoder_input(self, sample_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Patches of samples with equal tile counts: [B, n_visual, patch*patch]."""
        return torch.stack([patches(self.sample(i), self.patch, dtype) for i in sample_ids])

    @classmethod
    def from_config(cls, cfg) -> DigitCaptions:  # cfg: FlowConfig
        d = cfg.data
        return cls(
            seed=cfg.run.seed,
            global_batch=d.global_batch,
            tile_weights=d.tile_weights,
            patch=d.patch,
        )


def build_dataset(cfg) -> CaptionSet:  # cfg: FlowConfig
    """The dataset of data.source (digits, or shapes and folder through flow/images.py)."""
    if cfg.data.source == "digits":
        return DigitCaptions.from_config(cfg)
    from frugaltrain.flow.images import ImageCaptions

    return ImageCaptions.from_config(cfg)
