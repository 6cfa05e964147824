"""Procedural scenes of coloured shapes, the caption each scene generates, and its inverse.

A scene puts 1..max_shapes shapes (square, circle, triangle) in one of six colours on distinct
cells of a 3x3 grid. The caption is written from the scene, grouped by colour and shape with a
count and the cells, in a fixed order:

    "two red circles at top left and centre; one blue square at bottom right."

so the caption is predictable from the image and the loss can fall. `parse_caption` reads the
scene back from its caption (the tests prove parity on many seeds), and `render` draws it at any
side, so one scene gives images of different resolutions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHAPES = ("square", "circle", "triangle")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 230),
    "yellow": (230, 210, 40),
    "white": (240, 240, 240),
    "purple": (150, 60, 190),
}
CELLS = (
    "top left",
    "top",
    "top right",
    "left",
    "centre",
    "right",
    "bottom left",
    "bottom",
    "bottom right",
)
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
BACKGROUND = (0, 0, 0)


@dataclass(frozen=True, order=True)
class Item:
    """One shape on one cell of the 3x3 grid (cells numbered row by row from the top left)."""

    shape: str
    colour: str
    cell: int


Scene = tuple[Item, ...]


def canonical(items) -> Scene:
    """The scene's one order: shape, then colour (in declaration order), then cell."""
    colours = list(COLOURS)
    key = lambda i: (SHAPES.index(i.shape), colours.index(i.colour), i.cell)  # noqa: E731
    return tuple(sorted(items, key=key))


def make_scene(rng: np.random.Generator, max_shapes: int) -> Scene:
    """A random scene of 1..max_shapes shapes on distinct cells."""
    n = int(rng.integers(1, max_shapes + 1))
    cells = rng.choice(len(CELLS), size=n, replace=False)
    colours = list(COLOURS)
    pick = lambda names: names[int(rng.integers(len(names)))]  # noqa: E731
    return canonical(Item(pick(SHAPES), pick(colours), int(c)) for c in cells)


def caption(scene: Scene) -> str:
    """The scene in words: one clause per (colour, shape) group, with its count and cells."""
    groups: dict[tuple[str, str], list[int]] = {}
    for it in canonical(scene):
        groups.setdefault((it.shape, it.colour), []).append(it.cell)
    clauses = []
    for (shape, colour), cells in groups.items():
        n = len(cells)
        names = [CELLS[c] for c in cells]
        where = names[0] if n == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        clauses.append(f"{NUMBERS[n]} {colour} {shape}{'s' if n > 1 else ''} at {where}")
    return "; ".join(clauses) + "."


def parse_caption(text: str) -> Scene:
    """The scene a caption describes; ValueError if it is not one `caption` could write."""
    if not text.endswith("."):
        raise ValueError(f"caption {text!r}: no final full stop")
    items = []
    for clause in text[:-1].split("; "):
        head, sep, where = clause.partition(" at ")
        words = head.split()
        if not sep or len(words) != 3 or words[0] not in NUMBERS or words[1] not in COLOURS:
            raise ValueError(f"caption clause {clause!r}: expected 'COUNT COLOUR SHAPE at CELLS'")
        n, colour, noun = NUMBERS.index(words[0]), words[1], words[2]
        shape = noun[:-1] if n > 1 and noun.endswith("s") else noun
        cells = where.replace(" and ", ", ").split(", ")
        if shape not in SHAPES or len(cells) != n or any(c not in CELLS for c in cells):
            raise ValueError(f"caption clause {clause!r}: shape, count and cells disagree")
        items += [Item(shape, colour, CELLS.index(c)) for c in cells]
    if len({it.cell for it in items}) != len(items):
        raise ValueError(f"caption {text!r}: two shapes on one cell")
    return canonical(items)


def render(scene: Scene, side: int):
    """The scene drawn as a side x side RGB PIL image on a black background."""
    from frugaltrain.flow.hf import require

    Image, ImageDraw = require("PIL.Image"), require("PIL.ImageDraw")
    img = Image.new("RGB", (side, side), BACKGROUND)
    draw = ImageDraw.Draw(img)
    cell = side / 3
    r = 0.35 * cell  # half the shape's extent: shapes never touch a neighbouring cell
    for it in scene:
        cx, cy = (it.cell % 3 + 0.5) * cell, (it.cell // 3 + 0.5) * cell
        box = (cx - r, cy - r, cx + r, cy + r)
        fill = COLOURS[it.colour]
        if it.shape == "square":
            draw.rectangle(box, fill=fill)
        elif it.shape == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


def cell_centre(cell: int, side: int) -> tuple[int, int]:
    """Pixel (x, y) at the centre of a cell: inside every shape drawn there."""
    c = side / 3
    return int((cell % 3 + 0.5) * c), int((cell // 3 + 0.5) * c)
