"""Naming parts of a model for the outer strategies: Mix2 subsets, Streaming fragments, and the
tensor groups the consensus metrics are reported over.

Parts are found by module names, so one rule serves every model family:

    embed   modules named wte, wpe (built-in GPT, gpt2), embed_tokens (llama, qwen2) and
            other *_embeddings
    blocks  blocks.N (built-in GPT), layers.N (llama, qwen2), h.N (gpt2)
    head    head, lm_head, and the final norm (ln_f, norm). With tied embeddings the LM head is
            the embedding's tensor and is not a separate parameter: `head` then holds the norm.
    other   anything else

transformers models sit under `hf.` (models/hf.py): hf.model.embed_tokens.weight is embed,
hf.model.layers.3.mlp.up_proj.weight is block 3, hf.lm_head.weight is head.
"""

from __future__ import annotations

import fnmatch
import re

from frugaltrain.config import ConfigError

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.")
_BLOCK_MODULE = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.\d+$")
_EMBED = {"wte", "wpe", "embed_tokens", "embed_positions", "word_embeddings"}
_HEAD = {"head", "lm_head", "ln_f", "norm", "final_layernorm", "final_layer_norm"}


def block_index(name: str) -> int | None:
    m = _BLOCK.search(name)
    return int(m.group(1)) if m else None


def is_block_module(name: str) -> bool:
    """Whether the module named `name` (model.named_modules) is one transformer block: the unit
    FSDP shards and activation checkpointing recomputes."""
    return _BLOCK_MODULE.search(name) is not None


def group_of(name: str) -> str:
    """embed, blocks, head or other."""
    if block_index(name) is not None:
        return "blocks"
    modules = set(name.split(".")[:-1])
    if modules & _EMBED:
        return "embed"
    if modules & _HEAD:
        return "head"
    return "other"


def select(names: list[str], spec: str) -> list[bool]:
    """Which of `names` a Mix2 subset `spec` covers.

    spec: "all", "none", or '+'-joined parts: embed, head (LM head and final norm), blocks:K (the
    first K blocks), or an fnmatch pattern of parameter names (e.g. "blocks.0.attn.*"). A part
    that selects nothing is a ConfigError (config.mix2_params_error checks the grammar)."""
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
            raise ConfigError(
                f"outer.fgd.mix2_params = {spec!r}: part {part!r} selects no tensor of this "
                f"model; name parts that exist (names look like {', '.join(names[:4])}, ...)"
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
