"""Outer strategies, one file each. A plain dict maps config names to classes."""

from frugaltrain.outer.ddp import DDP
from frugaltrain.outer.diloco import DiLoCo

STRATEGIES = {"ddp": DDP, "diloco": DiLoCo}

__all__ = ["DDP", "DiLoCo", "STRATEGIES"]
