import dataclasses
import warnings

import pytest

from frugaltrain.config import (
    OUTER_KEYS,
    SHARED_KEYS,
    Config,
    ConfigError,
    build_config,
    load_config,
    to_toml,
)
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
            "min_workers",
            "shards",
            "activation_checkpointing",
            "seed",
            "steps",
            "eval_every",
            "eval_batches",
            "eval_diagnostics",
            "checkpoint_every",
            "stop_at_round",
            "threads",
            "backend",
            "device",
            "dtype",
            "timeout_s",
            "deterministic_comm",
            "link_mbit",
            "progress",
            "tensorboard",
            "wandb",
            "guard",
            "guard_factor",
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
            "decay_steps",
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
            "coded_average",
            "param_codec",
            "diloco",
            "fgd",
            "noloco",
            "streaming",
            "auto",
        ],
        "fault_tolerance": [
            "enabled",
            "mix1_deadline_s",
            "max_restarts",
            "deadline_factor",
            "deadline_floor_s",
            "coordinator_wait_s",
            "resume_wait_s",
            "inject",
        ],
    }
    outer = Config().outer
    assert {s: [f.name for f in dataclasses.fields(getattr(outer, s))] for s in OUTER_SUBS} == {
        "diloco": ["overlap"],
        "fgd": [
            "preset",
            "mix1",
            "mix2",
            "mix2_params",
            "momentum_policy",
            "mix1_weight",
            "mix2_momentum",
            "mix2_delay",
            "mix1_delta",
        ],
        "noloco": ["group_size", "consensus_pull"],
        "streaming": ["fragments", "overlap", "merge_alpha"],
        "auto": ["link_mbit", "link_json", "penalties", "methods"],
    }


OUTER_SUBS = ("diloco", "fgd", "noloco", "streaming", "auto")


def test_keys_each_strategy_reads_come_from_the_sections():
    assert OUTER_KEYS["diloco"] == ("strategy", *SHARED_KEYS["diloco"], "diloco.overlap")
    assert OUTER_KEYS["noloco"][-2:] == ("noloco.group_size", "noloco.consensus_pull")
    assert "fgd.mix2_params" in OUTER_KEYS["fgd"] and "fgd.mix1" not in OUTER_KEYS["streaming"]
    cfg = build_config(Config, {}, ["outer.strategy=fgd", "outer.fgd.preset=GlobalM1LocalM2"])
    keys = cfg.outer.strategy_keys()
    assert "preset" not in keys and (keys["mix1"], keys["mix2"]) == ("complete", "pairs")


def test_nested_tables_round_trip_and_presets_resolve_in_the_config(tmp_path):
    sets = ["outer.strategy=fgd", "outer.fgd.preset=GlobalM1LocalM2", "outer.fgd.mix1=complete"]
    cfg = build_config(Config, {}, sets)
    assert (cfg.outer.fgd.mix2, cfg.outer.fgd.mix2_params) == ("pairs", "all")
    text = to_toml(cfg)
    assert "[outer.fgd]" in text and "[outer.streaming]" in text
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"outer": {"mix1": "ring"}}, "unknown key outer.mix1: it is now outer.fgd.mix1"),
        ({"outer": {"fragments": 2}}, "unknown key outer.fragments: it is now outer.streaming."),
        ({"outer": {"group_size": 4}}, "unknown key outer.group_size: it is now outer.noloco."),
    ],
)
def test_old_flat_outer_keys_name_their_new_place(tmp_path, raw, message):
    with pytest.raises(ConfigError, match=message):
        build_config(Config, raw)
    path = tmp_path / "old.toml"
    ((key, value),) = raw["outer"].items()
    path.write_text(f"[outer]\n{key} = {value!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_toml_round_trip(tmp_path):
    cfg = build_config(Config, {}, ["outer.H=10", "run.steps=100", "optim.betas=[0.8, 0.9]"])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["outer.Hh=5"],
            "unknown key outer.Hh; valid keys here: H, auto, codec, coded_average, diloco, "
            "feedback_decay",
        ),
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
        (
            ["outer.strategy=fgd", "outer.fgd.mix2_overlap=true"],
            "unknown key outer.fgd.mix2_overlap",
        ),
        (
            ["outer.strategy=fgd", "outer.fgd.mix2_delay=1"],
            "outer.fgd.mix2_delay = 1: delays a Mix2; set mix2 or drop it",
        ),
        (
            ["outer.strategy=fgd", "outer.fgd.mix2=pairs", "outer.fgd.mix2_delay=-1"],
            "outer.fgd.mix2_delay = -1: must be >= 0",
        ),
        (
            ["outer.strategy=fgd", "outer.fgd.mix2=pairs", "outer.H=5", "outer.fgd.mix2_delay=5"],
            "outer.fgd.mix2_delay = 5: must be below outer.H = 5 so Mix2 is sent inside its round",
        ),
        (
            ["outer.strategy=fgd", "outer.fgd.mix2=pairs", "outer.fgd.mix2_delay=1"]
            + ["fault_tolerance.enabled=true"],
            "outer.fgd.mix2_delay = 1: the fault-tolerant runtime runs Mix2 blocking only",
        ),
        (
            ["outer.H=5", "outer.diloco.overlap=5"],
            "outer.diloco.overlap = 5: must be below outer.H = 5 so the average is sent inside "
            "its round",
        ),
        (
            ["outer.diloco.overlap=1", "fault_tolerance.enabled=true"],
            "outer.diloco.overlap = 1: the fault-tolerant runtime averages at the round's end only",
        ),
        (
            ["outer.strategy=fgd", "outer.fgd.mix1=ring", "outer.fgd.mix1_delta=true"],
            "outer.fgd.mix1_delta = True: codes against the mean every worker holds, which needs "
            "mix1 = 'complete' and mix1_weight = 1",
        ),
        (
            ["outer.strategy=fgd", "outer.fgd.momentum_policy=mixed", "outer.fgd.mix1_delta=true"],
            "outer.fgd.mix1_delta = True: codes parameters, not momenta",
        ),
        (
            ["outer.strategy=fgd", "outer.fgd.mix1_delta=true", "fault_tolerance.enabled=true"],
            "outer.fgd.mix1_delta = True: the fault-tolerant runtime's Mix1 drops a late message",
        ),
        (
            ["outer.coded_average=ring"],
            "outer.coded_average = 'ring': choose one of all_gather, reduce_scatter",
        ),
        (
            ["outer.coded_average=reduce_scatter", "fault_tolerance.enabled=true"],
            "outer.coded_average = 'reduce_scatter': the fault-tolerant runtime averages as a "
            "gather over the members that delivered",
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

    examples = Path(__file__).resolve().parents[2] / "examples"
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
    with pytest.warns(UserWarning, match=r"outer.fgd.mix2 = 'pairs'.*outer.strategy = 'noloco'"):
        make_config("outer.strategy=noloco", "outer.fgd.mix2=pairs")
    with pytest.warns(UserWarning, match=r"outer.streaming.fragments = 2.*'diloco'"):
        make_config("outer.strategy=diloco", "outer.streaming.fragments=2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same keys where they are read: silent
        make_config("outer.strategy=fgd", "outer.codec=int8", "outer.fgd.mix2=pairs")


@pytest.mark.parametrize(
    "old, new",
    [
        ("run.fault_tolerance=true", "fault_tolerance.enabled"),
        ("run.inject=''", "fault_tolerance.inject"),
    ],
)
def test_fault_tolerance_keys_moved_to_their_section(old, new):
    with pytest.raises(ConfigError, match=f"unknown key {old.split('=')[0]}: it is now {new}$"):
        build_config(Config, {}, [old])
