"""netlab: run real training jobs over rate-limited links between network namespaces."""

from frugaltrain.netlab.lab import NetLab, cleanup, why_not_available

__all__ = ["NetLab", "cleanup", "why_not_available"]
