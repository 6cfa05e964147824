"""Energy: meters with provenance, analytic proxies, fitted time/energy models (issue 7).

    from frugaltrain.energy import open_meter, transformer_train_flops
    m = open_meter("cpu"); m.start(); ...; reading = m.stop()   # reading.label says how it was got

See docs/energy.md for the models and their validation.
"""

from frugaltrain.energy.meter import EnergyReading, open_meter
from frugaltrain.energy.models import EnergyPredictor, EnergyRoofline, LogLinearLaw, StepTimeModel
from frugaltrain.energy.proxies import (
    DEVICE_PROFILES,
    Layout,
    TransformerShape,
    step_proxies,
    transformer_train_flops,
)
from frugaltrain.energy.records import load_records

__all__ = [
    "DEVICE_PROFILES",
    "EnergyPredictor",
    "EnergyReading",
    "EnergyRoofline",
    "Layout",
    "LogLinearLaw",
    "StepTimeModel",
    "TransformerShape",
    "load_records",
    "open_meter",
    "step_proxies",
    "transformer_train_flops",
]
