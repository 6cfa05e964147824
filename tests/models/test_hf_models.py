"""transformers models (a tiny Llama, grouped-query attention) under every strategy and FORGE,
against the same references as the built-in GPT (tests/outer/test_outer.py): with exact mixes fgd is
DiLoCo, one-group NoLoCo without pull is heavy-ball DiLoCo, one-fragment Streaming is DiLoCo, all
bitwise, and a simulated run equals the real one bitwise. Also: named parts on the transformers
module tree, export to the transformers format, and clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.gloo_pool import train_in_gloo_pool
from helpers.tiny_models import TINY_LLAMA

from frugaltrain.config import ConfigError, to_toml
from frugaltrain.models import build_model, evaluate
from frugaltrain.models.parts import fragments, group_of, select
from frugaltrain.sim import SimSection, simulate
from frugaltrain.train import launch
from frugaltrain.train.export import export

transformers = pytest.importorskip("transformers")

WORLD = 4
LLAMA = (
    *TINY_LLAMA,
    "run.steps=8",
    "outer.H=4",
    "run.eval_every=0",
    "run.threads=1",
)
JOBS = {
    "diloco": (),
    "fgd-exact": ("outer.strategy='fgd'", "outer.fgd.mix2='complete'"),
    "diloco-hb": ("outer.nesterov=false", "outer.momentum=0.5"),
    "noloco-all": (
        "outer.strategy='noloco'",
        "outer.noloco.group_size=4",
        "outer.noloco.consensus_pull=0.0",
        "outer.momentum=0.5",
    ),
    "streaming-1": (
        "outer.strategy='streaming'",
        "outer.streaming.fragments=1",
        "outer.streaming.overlap=0",
    ),
    "fgd-subset": (
        "outer.strategy='fgd'",
        "outer.fgd.mix1='ring'",
        "outer.fgd.mix2='pairs'",
        "outer.fgd.mix2_params='embed+head+blocks:1'",
    ),
    "streaming-2": (
        "outer.strategy='streaming'",
        "outer.streaming.fragments=2",
        "outer.streaming.overlap=1",
    ),
    "ddp": ("outer.strategy='ddp'",),
    "diloco-forge": ("optim.name='forge-adamw'",),
}


def _job(factory, root: Path, name: str, *sets: str):
    cfg = factory(root, *LLAMA, f"run.workers={WORLD}", f"run.name='{name}'", *sets)
    run_dir = launch.new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return name, cfg, str(run_dir)


@pytest.fixture(scope="module")
def runs(config_factory, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    jobs = [_job(config_factory, root, name, *sets) for name, sets in JOBS.items()]
    det = (
        "run.deterministic_comm=true",
        "outer.strategy='fgd'",
        "outer.fgd.preset='GlobalM1LocalM2'",
    )
    jobs.append(_job(config_factory, root, "fgd-det", *det))
    out = train_in_gloo_pool(jobs, WORLD)
    sim_cfg = config_factory(root, *LLAMA, f"run.workers={WORLD}", *det)
    sim = simulate(sim_cfg, SimSection(ratio=0.5), root / "sim")
    return {"real": dict(out), "sim": [list(m.parameters()) for m in sim.models]}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "job, reference",
    [("fgd-exact", "diloco"), ("noloco-all", "diloco-hb"), ("streaming-1", "diloco")],
)
def test_llama_strategy_equals_its_diloco_reference_bitwise(runs, job, reference):
    for rank in range(WORLD):
        assert _same(runs["real"][rank][job], runs["real"][rank][reference]), (job, rank)


def test_llama_simulated_equals_real_bitwise(runs):
    for rank in range(WORLD):
        assert _same(runs["real"][rank]["fgd-det"], runs["sim"][rank]), rank
    assert not _same(runs["sim"][0], runs["sim"][1])  # gossip leaves workers apart


def test_llama_ddp_workers_stay_identical_and_gossip_moves_them(runs):
    real = runs["real"]
    assert all(_same(real[0]["ddp"], real[r]["ddp"]) for r in range(1, WORLD))
    for job in ("fgd-subset", "streaming-2"):
        finals = [real[r][job] for r in range(WORLD)]
        assert all(torch.isfinite(p).all() for w in finals for p in w)
        assert not _same(finals[0], real[0]["diloco"])


def test_llama_forge_matches_adamw(runs):
    # FORGE's fused AdamW equals torch AdamW to ~1e-6 relative per step (tests/forge); two
    # outer rounds of a tiny model keep it within 1e-4.
    for a, b in zip(runs["real"][0]["diloco-forge"], runs["real"][0]["diloco"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_parts_map_onto_transformers_module_trees(make_config):
    cfg = make_config(*LLAMA)
    names = [n for n, _ in build_model(cfg).named_parameters()]
    groups = {n: group_of(n) for n in names}
    assert groups["hf.model.embed_tokens.weight"] == "embed"
    assert groups["hf.lm_head.weight"] == groups["hf.model.norm.weight"] == "head"
    assert groups["hf.model.layers.1.mlp.up_proj.weight"] == "blocks"
    chosen = [
        n for n, keep in zip(names, select(names, "embed+head+blocks:1"), strict=True) if keep
    ]
    assert all(".layers.1." not in n for n in chosen) and "hf.lm_head.weight" in chosen
    assert sorted(set(fragments(names, 2))) == [0, 1]
    tied = [
        n
        for n, _ in build_model(make_config(*LLAMA, "model.tie_embeddings=true")).named_parameters()
    ]
    assert "hf.lm_head.weight" not in tied  # the head is the embedding: `head` is the final norm
    assert [n for n, k in zip(tied, select(tied, "head"), strict=True) if k] == [
        "hf.model.norm.weight"
    ]
    gpt2 = [n for n, _ in build_model(make_config("model.family='gpt2'")).named_parameters()]
    assert {group_of(n) for n in gpt2} == {"embed", "blocks", "head"}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_export_loads_in_transformers_with_the_same_loss(make_config, tmp_path, family):
    sets = ("run.workers=2", "outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'")
    sets += ("run.steps=8", "outer.H=4", "run.eval_every=0", "run.threads=1")
    cfg = make_config(*(LLAMA if family == "llama" else ()), *sets)
    run_dir = launch.new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    launch.run(cfg, run_dir)
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    averaged_loss = [r for r in last if "loss/val_avg_model" in r][-1]["loss/val_avg_model"]

    out = export(run_dir, tmp_path / "exported")
    with pytest.raises(ConfigError, match="not empty"):  # nothing already written is replaced
        export(run_dir, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    from frugaltrain.sim.engine import validation_batches

    batches = validation_batches(cfg)

    class Loss(torch.nn.Module):  # the exported model behind frugaltrain's (logits, loss) forward
        def forward(self, x, y):
            logits = model(input_ids=x).logits
            return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    assert abs(evaluate(Loss(), batches) - averaged_loss) < 1e-5
    ids = tokenizer("def main(", return_tensors="pt").input_ids
    text = tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0])
    assert text.startswith("def main(") and len(text) > len("def main(")


def test_export_refuses_a_missing_run(tmp_path):
    with pytest.raises(ConfigError, match="no config.toml"):
        export(tmp_path / "nothing", tmp_path / "out")


def test_transformers_config_errors_are_named(make_config, tmp_path):
    with pytest.raises(ConfigError, match="model.family = 'mamba9'"):
        make_config("model.family='mamba9'")
    with pytest.raises(ConfigError, match="set model.family = 'hf'"):
        make_config(f"model.pretrained='{tmp_path}'")
    missing = make_config("model.family='hf'", f"model.pretrained='{tmp_path / 'nope'}'")
    with pytest.raises(ConfigError, match="model.pretrained = .*nope.*not found"):
        launch.check_data(missing)
    vit = tmp_path / "vit.json"
    vit.write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    with pytest.raises(ConfigError, match="no causal LM for model_type 'vit'"):
        build_model(make_config("model.family='hf'", f"model.config_json='{vit}'"))
    small = make_config(*LLAMA, "model.vocab_size=100")  # byte tokens need 256 ids
    with pytest.raises(ConfigError, match="model.vocab_size = 100: the model has 100 token ids"):
        launch.check_data(small)
    with pytest.raises(ConfigError, match="FORGE updates weights inside backward"):
        make_config("optim.name='forge-adamw'", "run.dtype='bf16'")


def test_pretrained_directory_round_trip(make_config, tmp_path):
    """A local transformers directory trains from its own weights (nothing downloaded)."""
    model = build_model(make_config(*LLAMA))
    model.hf.save_pretrained(tmp_path / "tiny-llama")
    cfg = make_config("model.family='hf'", f"model.pretrained='{tmp_path / 'tiny-llama'}'")
    launch.check_data(cfg)
    again = build_model(cfg)
    assert _same(list(model.parameters()), list(again.parameters()))


def test_llama_on_token_shards_resumes_bitwise_after_a_kill(config_factory, text_dir, tmp_path):
    """A run killed (SIGKILL, all its processes) after some checkpoint and resumed ends with the
    parameters, outer state and data position of an uninterrupted run, bit for bit."""
    from frugaltrain.data.prepare import prepare
    from frugaltrain.data.tokenizer import train_tokenizer
    from frugaltrain.train import checkpoint

    tok = train_tokenizer("", 300, tmp_path / "tok", max_bytes=100_000)
    shards = tmp_path / "shards"
    prepare(str(text_dir), str(tok), str(shards), val_fraction=0.2)
    sets = (*LLAMA, "run.workers=2", "run.steps=80", "run.checkpoint_every=1")
    sets += (f"data.path='{shards}'", "model.vocab_size=300", "run.progress=false")
    full = config_factory(tmp_path, *sets, "run.name='full'")
    full_dir = launch.new_run_dir(full)
    launch.run(full, full_dir)

    config = tmp_path / "killed.toml"
    config.write_text(to_toml(config_factory(tmp_path, *sets, "run.name='killed'")))
    cmd = [sys.executable, "-m", "frugaltrain", "train", "--config", str(config)]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    marker = tmp_path / "killed" / "checkpoints" / "round_000002" / "COMPLETE"
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers, mid-run
    proc.wait()
    run_dir = tmp_path / "killed"
    assert checkpoint.latest_complete(run_dir).name < "round_000020"  # killed before the end
    cfg, run_dir, ckpt = launch.prepare(None, [], str(run_dir))
    launch.run(cfg, run_dir, ckpt)

    for rank in range(2):
        a, b = (
            torch.load(checkpoint.latest_complete(d) / f"worker_{rank}.pt", weights_only=False)
            for d in (full_dir, run_dir)
        )
        assert a["step"] == b["step"] == 80 and a["data"] == b["data"]
        assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
        assert _same(a["outer"]["outer"], b["outer"]["outer"])
