"""frugaltrain: training on cheap, scattered compute.

Factored Gossip DiLoCo and its baselines (outer/, comm/), FORGE (forge/), energy measurement and
prediction (energy/) and FlowTrain vision-language dataflow (flow/). See README.md for a tour;
`wrap` puts an outer strategy around a training loop of your own (docs/library.md).
"""

from frugaltrain.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "OuterLoop", "load_config", "wrap"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # wrap and OuterLoop import torch; `frugaltrain --help` and the config stay light without it.
    if name in ("OuterLoop", "wrap"):
        from frugaltrain import outer_loop

        return getattr(outer_loop, name)
    raise AttributeError(f"module 'frugaltrain' has no attribute {name!r}")
