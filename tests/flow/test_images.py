"""Image-caption data: generated scenes and their captions, a user folder, variable patch counts.

The caption is written from the scene, so a parser must read the same scene back (parity), and
the image must show it: the pixel at each occupied cell's centre has the shape's colour, every
other cell's centre is background. Images come at several sides, so the packer sees several
visual token counts.
"""

import json

import numpy as np
import pytest
import torch

from frugaltrain.config import ConfigError
from frugaltrain.flow import load_flow_config
from frugaltrain.flow.data import build_dataset
from frugaltrain.flow.runtime import make_plans
from frugaltrain.flow.scenes import (
    BACKGROUND,
    COLOURS,
    caption,
    cell_centre,
    make_scene,
    parse_caption,
    render,
)

SHAPES = [
    "data.source='shapes'",
    "data.patch=16",
    "model.encoder='vit'",
    "model.backbone='llama'",
    "data.global_batch=16",
    "run.steps=3",
]


@pytest.mark.parametrize("seed", range(200))
def test_caption_reads_back_as_its_scene(seed: int) -> None:
    scene = make_scene(np.random.default_rng(seed), max_shapes=1 + seed % 9)
    assert parse_caption(caption(scene)) == scene


def test_parser_refuses_what_no_scene_says() -> None:
    for bad in (
        "one red square at top left",
        "two red square at top left.",
        "one red blob at top.",
    ):
        with pytest.raises(ValueError):
            parse_caption(bad)


@pytest.mark.parametrize("side", [32, 48, 96])
def test_image_shows_its_scene(side: int) -> None:
    for seed in range(20):
        scene = make_scene(np.random.default_rng(seed), max_shapes=9)
        pixels = np.asarray(render(scene, side))
        colour = {it.cell: COLOURS[it.colour] for it in scene}
        for cell in range(9):
            x, y = cell_centre(cell, side)
            assert tuple(pixels[y, x]) == colour.get(cell, BACKGROUND), (seed, cell)


def test_shapes_samples_decode_and_reach_the_packer_with_their_patch_counts() -> None:
    cfg = load_flow_config(None, SHAPES)
    ds = build_dataset(cfg)
    plans = make_plans(cfg, ds)
    for k, plan in enumerate(plans):
        for s in ds.batch(k):
            assert parse_caption(ds.decode(s.tokens)) == s.image  # the tokens carry the scene
            assert s.n_visual == (s.side // 16) ** 2 + 1  # patches + ViT's CLS token
            assert plan.visual[s.sample_id] == s.n_visual
        # each encoder call is one image side, and the calls cover the batch once
        calls = plan.encoder_batches()
        assert sorted(i for ids, _ in calls for i in ids) == ds.batch_ids(k)
        assert all(len({plan.visual[i] for i in ids}) == 1 for ids, _ in calls)
    counts = {ds.sample(i).n_visual for k in range(3) for i in ds.batch_ids(k)}
    assert len(counts) >= 3  # variable resolution: several patch counts in three batches
    pixels = ds.encoder_input(calls[0][0], torch.float32)
    side = ds.sample(calls[0][0][0]).side
    assert tuple(pixels.shape) == (len(calls[0][0]), 3, side, side)


@pytest.fixture
def image_folder(tmp_path):
    """Six images of four sizes and their captions, as a user would lay them out."""
    from PIL import Image

    sizes = [(30, 20), (64, 64), (100, 70), (40, 50), (64, 64), (90, 96)]
    with open(tmp_path / "metadata.jsonl", "w") as f:
        for i, size in enumerate(sizes):
            Image.new("RGB", size, (10 * i, 0, 0)).save(tmp_path / f"img{i}.png")
            f.write(json.dumps({"file_name": f"img{i}.png", "caption": f"picture {i}"}) + "\n")
    return tmp_path


def test_folder_images_keep_their_resolution(image_folder) -> None:
    cfg = load_flow_config(
        None,
        SHAPES[1:]
        + ["data.source='folder'", f"data.path='{image_folder}'", "data.caption_field='caption'"],
    )
    ds = build_dataset(cfg)
    got = {ds.decode(ds.sample(i).tokens): ds.sample(i).side for i in range(6)}
    # the side nearest each image's longer edge, among data.image_sides = 32, 48, 64, 96
    assert got == {
        "picture 0": 32,
        "picture 1": 64,
        "picture 2": 96,
        "picture 3": 48,
        "picture 4": 64,
        "picture 5": 96,
    }
    assert ds.sample(6).tokens == ds.sample(0).tokens  # the folder repeats as epochs
    call = [i for i in range(6) if ds.sample(i).side == 64]
    assert tuple(ds.encoder_input(call, torch.float32).shape) == (2, 3, 64, 64)


def test_folder_errors_name_the_key(image_folder, tmp_path) -> None:
    base = SHAPES[1:] + ["data.source='folder'"]
    with pytest.raises(ConfigError, match="data.path"):
        build_dataset(load_flow_config(None, base + [f"data.path='{tmp_path / 'nope'}'"]))
    with pytest.raises(ConfigError, match="data.caption_field = 'text'"):
        build_dataset(load_flow_config(None, base + [f"data.path='{image_folder}'"]))
