"""Outer strategies, one file each, and the plain dict that maps config names to them.

Every strategy is written for one worker against comm.Comm and has the same small interface,
called by the training loop (real runs) and the simulator alike:

    before_step(step)   before inner step `step` + 1 (fgd posts its non-blocking Mix1 here)
    sync_grads()        after backward, before the inner optimizer step (ddp all-reduces here)
    after_step(step)    after `step` inner steps; returns True at an outer-round boundary
    state_dict() / load_state_dict(state)   outer parameters, outer optimizer, round counter

The DiLoCo family shares one round (outer/round.py). To add a strategy: a file here, a line in
STRATEGIES, and its name with the [outer] keys its constructor takes in config.OUTER_KEYS.
"""

from __future__ import annotations

from torch import nn

from frugaltrain.comm import Comm
from frugaltrain.config import OUTER_KEYS, Config
from frugaltrain.outer.ddp import DDP
from frugaltrain.outer.diloco import DiLoCo
from frugaltrain.outer.fgd import FactoredGossipDiLoCo
from frugaltrain.outer.noloco import NoLoCo
from frugaltrain.outer.round import OuterRound
from frugaltrain.outer.streaming import StreamingDiLoCo

STRATEGIES = {
    "ddp": DDP,
    "diloco": DiLoCo,
    "fgd": FactoredGossipDiLoCo,
    "noloco": NoLoCo,
    "streaming": StreamingDiLoCo,
}


def build_strategy(cfg: Config, model: nn.Module, comm: Comm):
    """This worker's outer strategy: outer.strategy's class with the [outer] keys it reads."""
    o = cfg.outer
    keys = {k: getattr(o, k) for k in OUTER_KEYS[o.strategy] if k != "strategy"}
    return STRATEGIES[o.strategy](model, comm, **keys, seed=cfg.run.seed)


__all__ = [
    "DDP",
    "STRATEGIES",
    "DiLoCo",
    "FactoredGossipDiLoCo",
    "NoLoCo",
    "OuterRound",
    "StreamingDiLoCo",
    "build_strategy",
]
