"""Naming parts of a model for the outer strategies: Mix2 subsets, Streaming fragments, and the
tensor groups the consensus metrics are reported over.

Parameter names follow models/gpt.py: `wte`/`wpe` (embeddings), `blocks.<i>.*`, `ln_f` and
`head` (the LM head; tied to `wte` when model.tie_embeddings, in which case it is not a separate
parameter). Other models work too: names that are neither embeddings, blocks nor head fall in
group "other".
"""

from __future__ import annotations

import fnmatch
import re

_BLOCK = re.compile(r"^(?:.*\.)?blocks\.(\d+)\.")


def block_index(name: str) -> int | None:
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def group_of(name: str) -> str:
    """embed, blocks, head or other."""
    if name.split(".")[0] in ("wte", "wpe"):
        return "embed"
    if block_index(name) is not None:
        return "blocks"
    if name.split(".")[0] in ("head", "ln_f"):
        return "head"
    return "other"


def select(names: list[str], spec: str) -> list[bool]:
    """Which of `names` a Mix2 subset `spec` covers.

    spec: "all", "none", or '+'-joined parts: embed, head (LM head and final norm), blocks:K (the
    first K blocks), or an fnmatch pattern of parameter names (e.g. "blocks.0.attn.*")."""
    if spec == "all":
        return [True] * len(names)
    if spec == "none":
        return [False] * len(names)
    chosen = [False] * len(names)
    for part in spec.split("+"):
        part = part.strip()
        if part in ("embed", "head"):
            hit = [group_of(n) == part for n in names]
        elif part.startswith("blocks:"):
            k = int(part.split(":", 1)[1])
            hit = [(b := block_index(n)) is not None and b < k for n in names]
        else:
            hit = [fnmatch.fnmatchcase(n, part) for n in names]
        if not any(hit):
            raise ValueError(
                f"outer.mix2_params part {part!r} matches no parameter; names look like "
                f"{', '.join(names[:4])}, ..."
            )
        chosen = [a or b for a, b in zip(chosen, hit, strict=True)]
    return chosen


def fragments(names: list[str], P: int) -> list[int]:
    """Streaming DiLoCo fragment of each parameter: block i goes to fragment i mod P (the paper's
    strided assignment); embeddings join fragment 0 and the head and final norm fragment P-1."""
    out = []
    for n in names:
        b = block_index(n)
        if b is not None:
            out.append(b % P)
        elif group_of(n) == "embed":
            out.append(0)
        else:
            out.append(P - 1)
    return out
