"""Configs: keyword-only dataclasses loaded from TOML plus `--set` (base.py), and the training
config (training.py). FlowTrain (flow/config.py) and the simulator (sim/config.py) build theirs
on the same base."""

from frugaltrain.config.base import (
    ArgumentParser,
    ConfigError,
    Section,
    add_set_flag,
    build_config,
    load,
    read_toml,
    require,
    to_dict,
    to_toml,
)
from frugaltrain.config.training import (
    CODECS,
    FGD_PRESETS,
    INNER_OPTIMIZERS,
    MODEL_FAMILIES,
    OUTER_KEYS,
    SPARSE_CODEC,
    TOPOLOGIES,
    Config,
    DataSection,
    ModelSection,
    OptimSection,
    OuterSection,
    RunSection,
    codec_error,
    parse_codec,
)


def load_config(path=None, overrides: list[str] | None = None) -> Config:
    """Load a training `Config` from an optional TOML file and `--set` overrides."""
    return load(Config, path, overrides)


__all__ = [
    "ArgumentParser",
    "CODECS",
    "SPARSE_CODEC",
    "FGD_PRESETS",
    "INNER_OPTIMIZERS",
    "MODEL_FAMILIES",
    "OUTER_KEYS",
    "TOPOLOGIES",
    "codec_error",
    "parse_codec",
    "Config",
    "ConfigError",
    "DataSection",
    "ModelSection",
    "OptimSection",
    "OuterSection",
    "RunSection",
    "Section",
    "add_set_flag",
    "build_config",
    "load",
    "load_config",
    "read_toml",
    "require",
    "to_dict",
    "to_toml",
]
