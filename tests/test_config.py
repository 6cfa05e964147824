import dataclasses
import warnings

import pytest

from frugaltrain.config import Config, ConfigError, build_config, load_config, to_toml
from frugaltrain.data.corpus import load_corpus
from frugaltrain.train.launch import check_data


def test_key_set_is_pinned():
    # Adding or renaming a config key is a user-visible change: update this list on purpose.
    keys = {
        s.name: [f.name for f in dataclasses.fields(getattr(Config(), s.name))]
        for s in dataclasses.fields(Config)
    }
    assert keys == {
        "run": [
            "name",
            "out_dir",
            "workers",
            "shards",
            "activation_checkpointing",
            "seed",
            "steps",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "stop_at_round",
            "threads",
            "backend",
            "device",
            "dtype",
            "timeout_s",
            "deterministic_comm",
            "progress",
            "tensorboard",
            "wandb",
            "fault_tolerance",
            "mix1_deadline_s",
            "max_restarts",
            "deadline_factor",
            "deadline_floor_s",
            "guard",
            "guard_factor",
            "inject",
        ],
        "data": [
            "path",
            "max_bytes",
            "val_fraction",
            "sharding",
            "num_shards",
            "seq_len",
            "batch_size",
        ],
        "model": [
            "family",
            "pretrained",
            "config_json",
            "n_layer",
            "n_head",
            "n_kv_head",
            "n_embd",
            "intermediate_size",
            "vocab_size",
            "dropout",
            "bias",
            "tie_embeddings",
        ],
        "optim": [
            "name",
            "lr",
            "betas",
            "eps",
            "weight_decay",
            "warmup_steps",
            "min_lr_ratio",
            "grad_clip",
        ],
        "outer": [
            "strategy",
            "H",
            "lr",
            "momentum",
            "nesterov",
            "codec",
            "feedback_decay",
            "param_codec",
            "preset",
            "mix1",
            "mix2",
            "mix2_params",
            "momentum_policy",
            "mix1_weight",
            "mix2_momentum",
            "group_size",
            "consensus_pull",
            "fragments",
            "overlap",
            "merge_alpha",
        ],
    }


def test_toml_round_trip(tmp_path):
    cfg = build_config(Config, {}, ["outer.H=10", "run.steps=100", "optim.betas=[0.8, 0.9]"])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "sets, message",
    [
        (["outer.Hh=5"], "unknown key outer.Hh; valid keys here: H, codec, consensus_pull"),
        (["run.workers=two"], "run.workers = 'two': expected int, got str"),
        (["run.workers=1.5"], "run.workers = 1.5: expected int, got float"),
        (["outer.H=0"], "outer.H = 0: must be at least 1"),
        (["outer.strategy=fedavg"], "outer.strategy = 'fedavg': choose one of ddp, diloco"),
        (
            ["run.workers=4", "data.num_shards=2"],
            "data.num_shards = 2: fewer shards than run.workers = 4",
        ),
        (["run.steps=100", "outer.H=30"], "run.steps = 100: must be a multiple of outer.H = 30"),
        (["model.n_head=3"], "model.n_head = 3: must divide model.n_embd = 128"),
        (["optim.betas=[0.9]"], "optim.betas = [0.9]: expected 2 values"),
        (["run.progress=1"], "run.progress = 1: expected true or false"),
        (["H=5"], "unknown key H"),
        (["outer.H"], "expected section.key=value"),
        (
            ["optim.name=sgd"],
            "optim.name = 'sgd': choose one of adamw, forge-adamw, forge-sgd, forge-lion",
        ),
        (
            ["optim.name=forge-adamw", "outer.strategy=ddp", "run.workers=2"],
            "optim.name = 'forge-adamw': FORGE updates weights inside backward, so no gradient "
            "exists for outer.strategy = 'ddp' to all-reduce over run.workers = 2; use "
            "optim.name = 'adamw' with ddp",
        ),
    ],
)
def test_bad_config_is_named(sets, message):
    with pytest.raises(ConfigError) as e:
        build_config(Config, {}, sets)
    assert message in str(e.value)


@pytest.mark.parametrize("name", ["adamw", "forge-adamw", "forge-sgd", "forge-lion"])
def test_inner_optimizers_accepted(name):
    assert build_config(Config, {}, [f"optim.name={name}"]).optim.name == name
    # One worker of ddp has nothing to all-reduce, so FORGE is allowed there.
    build_config(Config, {}, [f"optim.name={name}", "outer.strategy=ddp", "run.workers=1"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_missing_and_empty_data_paths(tmp_path):
    with pytest.raises(ConfigError, match="no such file or directory"):
        load_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="contains no readable text"):
        load_corpus(str(tmp_path / "empty"))


def test_shard_too_small_fails_before_work(make_config):
    cfg = make_config("data.max_bytes=2000", "run.workers=4")
    with pytest.raises(ConfigError, match="a worker's shard has only"):
        check_data(cfg)


def test_every_example_config_loads():
    from pathlib import Path

    from frugaltrain.flow.config import load_flow_config
    from frugaltrain.sim.config import load_sim_config

    examples = Path(__file__).resolve().parent.parent / "examples"
    flow_configs = sorted(examples.glob("flow*.toml"))  # FlowTrain's own config
    assert [p.name for p in flow_configs] == ["flow.toml", "flow_vlm.toml"]
    for path in flow_configs:
        load_flow_config(str(path))
    train_configs = [p for p in examples.glob("*.toml") if p not in flow_configs]
    assert len(train_configs) >= 9
    strategies = set()
    for path in train_configs:
        # A config with a [sim] table is for `simulate`/`compare`; its sim section is checked too.
        if "[sim]" in path.read_text():
            cfg, _ = load_sim_config(str(path))
        else:
            cfg = load_config(path)
        strategies.add(cfg.outer.strategy)
    assert strategies == {"ddp", "diloco", "fgd", "noloco", "streaming"}


def test_outer_keys_the_strategy_ignores_are_warned_about(make_config):
    with pytest.warns(UserWarning, match=r"outer.codec = 'int8'.*no effect with outer.strategy"):
        make_config("outer.strategy=ddp", "outer.codec=int8")
    with pytest.warns(UserWarning, match=r"outer.param_codec = 'bf16'.*outer.strategy = 'diloco'"):
        make_config("outer.strategy=diloco", "outer.param_codec=bf16")
    with pytest.warns(UserWarning, match=r"outer.mix2 = 'pairs'"):
        make_config("outer.strategy=noloco", "outer.mix2=pairs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same keys where they are read: silent
        make_config("outer.strategy=fgd", "outer.codec=int8", "outer.mix2=pairs")
