"""The digits source of vision-language samples, and `build_dataset`, which picks the source.

Every source is a `CaptionSet` of `Sample`s (flow/samples.py). `build_dataset(cfg)` picks it:
digits (here), or shapes and folder (flow/images.py).

Digits come from scikit-learn's bundled 8x8 images (no download). A sample tiles 1..max_tiles
digit images side by side, which varies the number of visual tokens the way dynamic resolution
does, and pairs them with a caption drawn from templates of varied length ("digits : seven one
."). Tokens are words from a ~60-word vocabulary.

Shapes: patches [n_visual, patch*patch]; tokens [n_text] (BOS ... EOS).
Everything is a pure function of (seed, sample_id), so every process rebuilds identical data.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from frugaltrain.flow.samples import CaptionSet, Sample

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
