"""Config surface and the simulator's basic contracts."""

import dataclasses

import pytest
import torch

from frugaltrain.config import ConfigError
from frugaltrain.flow import load_flow_config, run
from frugaltrain.flow.config import FlowConfig
from frugaltrain.flow.data import DigitCaptions
from frugaltrain.flow.runtime import make_plans
from frugaltrain.flow.sim import simulate, simulate_monolithic

KEYS = {
    "run": [
        "mode",
        "backend",
        "producers",
        "consumers",
        "threads",
        "mono_threads",
        "steps",
        "warmup_steps",
        "seed",
        "dtype",
        "lr",
        "optimizer",
        "train_encoder",
        "staleness",
        "timeout_s",
        "out_dir",
        "device",
    ],
    "data": [
        "source",
        "path",
        "caption_field",
        "tokenizer",
        "global_batch",
        "max_tiles",
        "tile_weights",
        "patch",
        "image_sides",
        "side_weights",
        "max_shapes",
    ],
    "model": [
        "encoder",
        "backbone",
        "encoder_pretrained",
        "backbone_pretrained",
        "enc_dim",
        "enc_layers",
        "enc_heads",
        "lm_dim",
        "lm_layers",
        "lm_heads",
        "lm_kv_heads",
    ],
    "pool": ["slots", "max_tokens"],
    "sched": ["capacity", "policy", "dispatch", "cost"],
    "alloc": ["budget", "max_threads", "profile_steps"],
}


def test_key_set_is_pinned() -> None:
    cfg = FlowConfig()
    got = {
        f.name: [g.name for g in dataclasses.fields(getattr(cfg, f.name))]
        for f in dataclasses.fields(cfg)
    }
    assert got == KEYS


@pytest.mark.parametrize(
    "sets,match",
    [
        (["run.nope=1"], "unknown key run.nope"),
        (["run.staleness=1"], "run.train_encoder"),
        (["run.mode='warp'"], "run.mode"),
        (["data.tile_weights=[1.0]"], "data.max_tiles = 4"),
        (["data.source='shapes'"], "model.encoder"),
        (["model.encoder='vit'", "data.source='shapes'", "data.patch=5"], "data.image_sides"),
        (["data.source='shapes'", "data.side_weights=[1.0]"], "data.side_weights"),
        (["data.source='folder'"], "data.path"),
        (["run.device='cuda'", "run.backend='dist'"], "run.device"),
        (["model.lm_kv_heads=3"], "model.lm_kv_heads"),
    ],
)
def test_bad_values_name_the_key(sets, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_flow_config(None, sets)


def test_too_few_slots_is_refused_before_any_work() -> None:
    with pytest.raises(ConfigError, match="pool.slots"):
        run(load_flow_config(None, ["run.mode='sync'", "pool.slots=2"]))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_cuda_without_a_gpu_is_refused_before_any_work() -> None:
    with pytest.raises(ConfigError, match="run.device = 'cuda'"):
        run(load_flow_config(None, ["run.device='cuda'"]))


def test_simulator_contracts() -> None:
    cfg = load_flow_config(None, ["run.steps=4"])
    ds = DigitCaptions.from_config(cfg)
    plans = make_plans(cfg, ds)
    enc = lambda s: 1e-3 * ds.sample(s).n_visual  # noqa: E731
    bb = lambda b: 4e-4 * sum(ds.sample(s).length for s in b)  # noqa: E731
    kw = dict(producers=1, enc_s=enc, bin_s=bb, optim_s=1e-3, warmup_steps=1)
    flow = simulate(plans, mode="flow", slots=16, **kw)
    sync = simulate(plans, mode="sync", slots=16, **kw)
    mono = simulate_monolithic(plans, enc_s=enc, bin_s=bb, optim_s=1e-3, warmup_steps=1)
    # overlap can only help, and nothing beats the slower module running flat out
    assert mono.samples_per_s < sync.samples_per_s <= flow.samples_per_s
    n = sum(len(b) for p in plans[1:] for bins in p.rank_bins for b in bins)
    bound = n / max(
        sum(enc(s) for p in plans[1:] for s, _ in p.consume_order()),
        sum(bb(b) for p in plans[1:] for bins in p.rank_bins for b in bins),
    )
    assert flow.samples_per_s <= bound * 1.0001
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(plans, mode="sync", slots=4, **kw)
