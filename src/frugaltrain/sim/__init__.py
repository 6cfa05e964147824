"""The simulated runtime: many virtual workers in one process on a virtual clock with a network
and fault model, running the same outer strategies as real runs (docs/sim.md)."""

from frugaltrain.sim.config import SimSection, load_sim_config
from frugaltrain.sim.engine import SimResult, simulate
from frugaltrain.sim.world import SimComm, SimWorld

__all__ = ["SimComm", "SimResult", "SimSection", "SimWorld", "load_sim_config", "simulate"]
