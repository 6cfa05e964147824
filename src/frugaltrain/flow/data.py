"""Vision-language samples from scikit-learn's bundled digits: no download.

A sample tiles 1..max_tiles digit images (8x8, values 0..1) side by side, which varies the number
of visual tokens the way dynamic resolution does, and pairs them with a caption drawn from
templates of varied length ("digits : seven one ."). Tokens are words from a ~60-word vocabulary.

Shapes: patches [n_visual, patch*patch]; tokens [n_text] (BOS ... EOS).
Everything is a pure function of (seed, sample_id), so every process rebuilds identical data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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
    image_ids: tuple[int, ...]
    digits: tuple[int, ...]
    tokens: tuple[int, ...]
    n_visual: int

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
    return Sample(sample_id, ids, digits, tokens, n_tiles * (8 // patch) ** 2)


def patches(sample: Sample, patch: int, dtype: torch.dtype) -> torch.Tensor:
    """Pixels as patch vectors, tile after tile: [n_visual, patch*patch]."""
    images, _ = _digit_images()
    tiles = images[list(sample.image_ids)]  # [k, 8, 8]
    k, g = len(tiles), 8 // patch
    x = tiles.reshape(k, g, patch, g, patch).transpose(0, 1, 3, 2, 4).reshape(k * g * g, -1)
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


class DigitCaptions:
    """The dataset: global batch k holds sample ids k*B .. (k+1)*B - 1, in every mode."""

    def __init__(
        self, *, seed: int, global_batch: int, tile_weights: tuple[float, ...], patch: int
    ) -> None:
        self.seed, self.global_batch = seed, global_batch
        self.tile_weights, self.patch = tile_weights, patch
        self._cache: dict[int, Sample] = {}

    def sample(self, sample_id: int) -> Sample:
        if sample_id not in self._cache:
            self._cache[sample_id] = make_sample(
                sample_id, seed=self.seed, tile_weights=self.tile_weights, patch=self.patch
            )
        return self._cache[sample_id]

    def batch_ids(self, step: int) -> list[int]:
        return list(range(step * self.global_batch, (step + 1) * self.global_batch))

    def batch(self, step: int) -> list[Sample]:
        return [self.sample(i) for i in self.batch_ids(step)]

    def target_tokens(self, step: int) -> int:
        """Loss denominator: caption targets in the whole global batch (packing-independent)."""
        return sum(s.n_targets for s in self.batch(step))

    @classmethod
    def from_config(cls, cfg) -> DigitCaptions:  # cfg: FlowConfig
        d = cfg.data
        return cls(
            seed=cfg.run.seed,
            global_batch=d.global_batch,
            tile_weights=d.tile_weights,
            patch=d.patch,
        )


def max_text_tokens() -> int:
    longest = max(TEMPLATES, key=lambda t: len(t.split()))
    return len(longest.split()) + 8 + 2  # {d} expands to up to 8 words; BOS and EOS
