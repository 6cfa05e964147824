"""Energy: meters with provenance, analytic proxies, fitted time/energy models.

    from frugaltrain.energy import open_meter, transformer_train_flops
    m = open_meter("cpu"); m.start(); ...; reading = m.stop()   # reading.label says how it was got

See docs/energy.md for the models and their validation. Names are imported on first use, so a
worker that only needs the meter does not pay for scipy (the models) at import.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "EnergyReading": "meter",
    "open_meter": "meter",
    "EnergyPredictor": "models",
    "EnergyRoofline": "models",
    "LogLinearLaw": "models",
    "StepTimeModel": "models",
    "DEVICE_PROFILES": "proxies",
    "Layout": "proxies",
    "TransformerShape": "proxies",
    "step_proxies": "proxies",
    "transformer_train_flops": "proxies",
    "load_records": "records",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'frugaltrain.energy' has no attribute {name!r}")
    return getattr(importlib.import_module(f"frugaltrain.energy.{_WHERE[name]}"), name)
