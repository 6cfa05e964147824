"""frugaltrain: training on cheap, scattered compute.

Factored Gossip DiLoCo and its baselines (outer/, comm/), FORGE (forge/), energy measurement and
prediction (energy/) and FlowTrain vision-language dataflow (flow/). See README.md for a tour.
"""

from frugaltrain.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
__version__ = "0.1.0"
