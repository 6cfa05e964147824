"""Outer strategies, one file each, the contract they keep, and the one factory that builds them.

Every strategy is written for one worker against comm.Comm and keeps the same small contract
(outer.base.Strategy), called by the training loop (real runs), the simulator and `wrap` alike:

    before_step(step)   before inner step `step` + 1 (fgd posts its non-blocking Mix1 here)
    sync_grads()        after backward, before the inner optimizer step (ddp all-reduces here)
    after_step(step)    after `step` inner steps; returns True at an outer-round boundary
    diagnostics()       outer momenta and error-feedback norm (ddp: empty), for the metrics
    state_dict() / load_state_dict(state, own)   outer parameters, outer optimizer, round counter

The DiLoCo family shares one round (outer/round.py) and one outer optimizer (outer/sgd.py). To
add a strategy: a file here, a line in STRATEGIES, the shared [outer] keys it reads in
config.SHARED_KEYS and, if it has keys of its own, a sub-section of config.OuterSection named
after it (its constructor takes both as keywords).
"""

from __future__ import annotations

from torch import nn

from frugaltrain.comm import Comm
from frugaltrain.config import Config, ConfigError, OuterSection
from frugaltrain.outer.base import Diagnostics, Strategy
from frugaltrain.outer.ddp import DDP
from frugaltrain.outer.diloco import DiLoCo
from frugaltrain.outer.fgd import FactoredGossipDiLoCo
from frugaltrain.outer.noloco import NoLoCo
from frugaltrain.outer.round import OuterRound
from frugaltrain.outer.sgd import OuterSGD
from frugaltrain.outer.streaming import StreamingDiLoCo

STRATEGIES = {
    "ddp": DDP,
    "diloco": DiLoCo,
    "fgd": FactoredGossipDiLoCo,
    "noloco": NoLoCo,
    "streaming": StreamingDiLoCo,
}


def build_strategy(
    cfg: Config | OuterSection, model: nn.Module, comm: Comm, *, seed: int = 0
) -> Strategy:
    """This worker's outer strategy: outer.strategy's class with the [outer] keys it reads.
    `cfg`: a whole config (seeded by its run.seed), or an [outer] section alone seeded by
    `seed` (wrap)."""
    o, seed = (cfg.outer, cfg.run.seed) if isinstance(cfg, Config) else (cfg, seed)
    if o.strategy not in STRATEGIES:  # auto: the launcher replaces it before any worker starts
        raise ConfigError(
            f"outer.strategy = {o.strategy!r} is resolved by `frugaltrain train` before its "
            f"workers start; here name the method (one of {', '.join(STRATEGIES)}): "
            "`frugaltrain plan` says which"
        )
    return STRATEGIES[o.strategy](model, comm, **o.strategy_keys(), seed=seed)


__all__ = [
    "DDP",
    "STRATEGIES",
    "DiLoCo",
    "Diagnostics",
    "FactoredGossipDiLoCo",
    "NoLoCo",
    "OuterRound",
    "OuterSGD",
    "Strategy",
    "StreamingDiLoCo",
    "build_strategy",
]
