"""Outer strategies, one file each. A plain dict maps config names to classes.

Every strategy is written for one worker against comm.Comm and has the same small interface,
called by the training loop (real runs) and the simulator alike:

    before_step(step)   before inner step `step` + 1 (fgd posts its non-blocking Mix1 here)
    sync_grads()        after backward, before the inner optimizer step (ddp all-reduces here)
    after_step(step)    after `step` inner steps; returns True at an outer-round boundary
    state_dict() / load_state_dict(state)   outer parameters, outer optimizer, round counter
"""

from frugaltrain.outer.ddp import DDP
from frugaltrain.outer.diloco import DiLoCo
from frugaltrain.outer.fgd import FactoredGossipDiLoCo
from frugaltrain.outer.noloco import NoLoCo
from frugaltrain.outer.streaming import StreamingDiLoCo

STRATEGIES = {
    "ddp": DDP,
    "diloco": DiLoCo,
    "fgd": FactoredGossipDiLoCo,
    "noloco": NoLoCo,
    "streaming": StreamingDiLoCo,
}

__all__ = ["DDP", "DiLoCo", "FactoredGossipDiLoCo", "NoLoCo", "StreamingDiLoCo", "STRATEGIES"]
