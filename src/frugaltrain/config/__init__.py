"""Configs: keyword-only dataclasses loaded from TOML plus `--set` (base.py), and the training
config (training.py). FlowTrain (flow/config.py) and the simulator (sim/config.py) build theirs
on the same base."""

from frugaltrain.config.base import (
    ArgumentParser,
    ConfigError,
    Section,
    add_set_flag,
    build_config,
    flat_items,
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
    SHARED_KEYS,
    SPARSE_CODEC,
    TOPOLOGIES,
    Config,
    DataSection,
    FgdSection,
    ModelSection,
    NolocoSection,
    OptimSection,
    OuterSection,
    RunSection,
    StreamingSection,
    codec_error,
    mix2_params_error,
    nest_outer_keys,
    outer_for,
    parse_codec,
    strategy_sections,
    unused_outer_keys,
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
    "SHARED_KEYS",
    "TOPOLOGIES",
    "codec_error",
    "mix2_params_error",
    "nest_outer_keys",
    "outer_for",
    "parse_codec",
    "strategy_sections",
    "unused_outer_keys",
    "Config",
    "ConfigError",
    "DataSection",
    "FgdSection",
    "ModelSection",
    "NolocoSection",
    "OptimSection",
    "OuterSection",
    "RunSection",
    "StreamingSection",
    "Section",
    "add_set_flag",
    "build_config",
    "flat_items",
    "load",
    "load_config",
    "read_toml",
    "require",
    "to_dict",
    "to_toml",
]
