"""Image-caption samples for the transformers vision towers: generated scenes or a user folder.

- shapes: sample i is a scene made from (seed, i) (flow/scenes.py), drawn at a side drawn from
  data.image_sides with data.side_weights, and captioned from the scene.
- folder: data.path holds images and a metadata.jsonl ({"file_name": ..., "text": ...} per
  line), read offline with datasets' `imagefolder` builder. Sample i is row i % rows, resized to
  the entry of data.image_sides nearest its longer edge, so its resolution follows the file's.

Pixels go through the encoder's transformers image processor (ViT or SigLIP, built from
arguments, never fetched); captions through a tokenizer (byte-level, or the data.tokenizer
directory), between BOS and EOS. A sample's visual token count, (side / patch)^2 (+1 for ViT's
CLS token), is known before encoding, so the packer sees every image's own count.

Shapes: pixel_values [B, 3, side, side]; tokens [n_text].
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from frugaltrain.config import ConfigError
from frugaltrain.data.sources import offline_datasets
from frugaltrain.flow import scenes
from frugaltrain.flow.hf import require
from frugaltrain.flow.samples import CaptionSet, Sample

# The longest clause one shape can add to a caption ("one purple triangle at bottom right; "),
# so a scene of n shapes has at most n times this many characters (and tokens) plus the stop.
_CLAUSE_CHARS = len("one purple triangle at bottom right; ")


class ImageCaptions(CaptionSet):
    """shapes or folder samples (see the module docstring); every process rebuilds the same."""

    def __init__(self, cfg) -> None:  # cfg: FlowConfig
        d = cfg.data
        super().__init__(seed=cfg.run.seed, global_batch=d.global_batch)
        self.source, self.sides = d.source, tuple(d.image_sides)
        self.side_weights = np.asarray(d.side_weights, dtype=np.float64)
        self.max_shapes, self.visual_tokens = d.max_shapes, cfg.visual_tokens
        self._tok, self.bos, self.eos, self.vocab_size = _tokenizer(d.tokenizer)
        self._processor = _image_processor(cfg.model.encoder, resize=d.source == "folder")
        if d.source == "folder":
            self.rows = read_folder(d.path, d.caption_field)
            self.max_text_tokens = 2 + max(len(self._encode(text)) for _, text, _ in self.rows)
        else:
            self.max_text_tokens = 2 + _CLAUSE_CHARS * self.max_shapes + 1

    @classmethod
    def from_config(cls, cfg) -> ImageCaptions:
        return cls(cfg)

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, tokens: tuple[int, ...]) -> str:
        """The caption text of a sample's tokens (BOS and EOS dropped)."""
        return self._tok.decode([t for t in tokens if t not in (self.bos, self.eos)])

    def _make(self, sample_id: int) -> Sample:
        if self.source == "shapes":
            rng = np.random.default_rng([self.seed, sample_id])
            scene = scenes.make_scene(rng, self.max_shapes)
            p = self.side_weights / self.side_weights.sum()
            side = self.sides[int(rng.choice(len(self.sides), p=p))]
            text, image = scenes.caption(scene), scene
        else:
            image = sample_id % len(self.rows)
            _, text, (w, h) = self.rows[image]
            side = min(self.sides, key=lambda s: (abs(s - max(w, h)), s))
        tokens = (self.bos, *self._encode(text), self.eos)
        return Sample(sample_id, tokens, self.visual_tokens(side), image, side)

    def pil_image(self, sample_id: int):
        s = self.sample(sample_id)
        if self.source == "shapes":
            return scenes.render(s.image, s.side)
        with require("PIL.Image").open(self.rows[s.image][0]) as img:
            return img.convert("RGB")

    def encoder_input(self, sample_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
        """pixel_values [B, 3, side, side] of samples with one side, from the image processor."""
        sides = {self.sample(i).side for i in sample_ids}
        assert len(sides) == 1, f"one encoder call needs one image side, got {sorted(sides)}"
        side = sides.pop()
        images = [self.pil_image(i) for i in sample_ids]
        out = self._processor(
            images=images, size={"height": side, "width": side}, return_tensors="pt"
        )
        return out["pixel_values"].to(dtype)


def _tokenizer(path: str):
    """(tokenizer, BOS id, EOS id, vocabulary size): byte-level when `path` is empty. A tokenizer
    without an EOS token (the byte-level one) gets BOS and EOS ids just past its vocabulary."""
    from frugaltrain.data.tokenizer import byte_tokenizer, load_tokenizer

    tok = load_tokenizer(path) if path else byte_tokenizer()
    n = len(tok)
    if tok.eos_token_id is not None:
        bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        return tok, bos, tok.eos_token_id, n
    return tok, n, n + 1, n + 2


def _image_processor(encoder: str, *, resize: bool):
    """The tower's image processor from arguments (the PIL backend: no torchvision needed)."""
    tf = require("transformers")
    cls = tf.ViTImageProcessorPil if encoder == "vit" else tf.SiglipImageProcessorPil
    return cls(do_resize=resize)


def read_folder(path: str, caption_field: str) -> list[tuple[str, str, tuple[int, int]]]:
    """(image file, caption, (width, height)) per row of a folder read by datasets' imagefolder;
    a ConfigError naming the key and the fix for a missing folder, metadata file or column."""
    root = Path(path).expanduser()
    layout = 'a folder of images with a metadata.jsonl ({"file_name": ..., "text": ...} lines)'
    if not root.is_dir():
        raise ConfigError(f"data.path = {path!r}: no such directory; give {layout}")
    if not (root / "metadata.jsonl").is_file():
        raise ConfigError(f"data.path = {path!r}: holds no metadata.jsonl; give {layout}")
    datasets = require("datasets")
    with offline_datasets(), tempfile.TemporaryDirectory(prefix="flow-imagefolder-") as cache:
        ds = datasets.load_dataset(
            "imagefolder", data_dir=str(root), split="train", cache_dir=cache, keep_in_memory=True
        )
    if caption_field not in ds.column_names:
        raise ConfigError(
            f"data.caption_field = {caption_field!r}: metadata.jsonl has the columns "
            f"{[c for c in ds.column_names if c != 'image']}; name the caption column"
        )
    Image = require("PIL.Image")
    rows = []
    for r in ds.cast_column("image", datasets.Image(decode=False)):
        with Image.open(r["image"]["path"]) as img:  # reads the header, not the pixels
            rows.append((r["image"]["path"], str(r[caption_field]), img.size))
    return rows
