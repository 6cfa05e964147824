"""Replicas x shards (train/sharding.py): 2 replicas of 2 FSDP2 shards train to the parameters of
2 unsharded replicas, for DiLoCo and FGD, the built-in GPT and a transformers Llama; a DCP
checkpoint written by 2 shards resumes at 4 shards and at 1 (and 2 replicas x 2 at 2 x 1) to
the parameters of the uninterrupted run; activation checkpointing changes nothing.

One pool of 4 gloo processes runs every job (tests/helpers/shard_pool.py), 2 outer rounds of 3
steps.

Tolerance (TOL, absolute, on parameters of magnitude below 1): the sharded and unsharded runs do
the same arithmetic in another order. Each shard takes half of its replica's batch and FSDP2's
reduce-scatter averages the two halves' gradients, where one process sums the whole batch's
in one backward; the gradient-norm clip sums squares shard by shard. In fp32 that moves each
gradient by about 1e-7 of its size, and through 6 AdamW steps and two outer Nesterov steps
(which multiply a round's change by up to 0.7 x 1.9) the parameters by at most a few 1e-6
(measured: 2e-6). A real error moves them by far more: one inner step of one shard lost, or a
shard trained on the wrong rows, changes parameters by about optim.lr = 3e-3. TOL = 2e-5 sits
ten times above the noise and a hundred times below the smallest real error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.shard_pool import train_sharded
from helpers.tiny_models import TINY_LLAMA

from frugaltrain import cli
from frugaltrain.comm import LocalComm
from frugaltrain.config import to_toml
from frugaltrain.metrics.log import read_metrics
from frugaltrain.train import checkpoint, launch
from frugaltrain.train.loop import train_worker

TOL = 2e-5
BASE = ("model.n_layer=2", "run.steps=6", "outer.H=3", "run.eval_every=6", "run.threads=1")
MODELS = {"gpt": (), "llama": TINY_LLAMA}
STRATEGIES = {
    "diloco": ("outer.strategy='diloco'",),
    "fgd": ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'"),
}
CASES = [(m, s) for m in MODELS for s in STRATEGIES]


def _run_dir(config_factory, root: Path, name: str, *sets: str) -> tuple:
    cfg = config_factory(root, *BASE, *sets, f"run.name='{name}'")
    run_dir = launch.new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return cfg, run_dir


def _round(run_dir: Path, k: int) -> str:
    return str(checkpoint.round_dir(run_dir, k))


@pytest.fixture(scope="module")
def runs(config_factory, tmp_path_factory) -> dict:
    """Every job's final parameters, run directories and configs."""
    root = tmp_path_factory.mktemp("sharding")
    dirs, jobs = {}, []

    def job(name: str, *sets: str, resume: str | None = None) -> Path:
        cfg, run_dir = _run_dir(config_factory, root, name, *sets)
        jobs.append((name, cfg, str(run_dir), resume))
        dirs[name] = run_dir
        return run_dir

    for model, strategy in CASES:
        case = (*MODELS[model], *STRATEGIES[strategy], "run.workers=2", "run.checkpoint_every=1")
        job(f"{model}-{strategy}-2x2", *case, "run.shards=2")
        job(f"{model}-{strategy}-2x1", *case, "run.shards=1")
    # DCP: one replica of 2 shards, resumed after round 1 at 4 shards and at 1; 2 x 2 at 2 x 1.
    one = ("run.workers=1", "run.checkpoint_every=1", "outer.strategy='diloco'")
    saved = job("1x2", *one, "run.shards=2")
    job("1x2-to-1x4", *one, "run.shards=4", resume=_round(saved, 1))
    job("1x2-to-1x1", *one, "run.shards=1", resume=_round(saved, 1))
    two = dirs["gpt-diloco-2x2"]
    job("2x2-to-2x1", "run.workers=2", "outer.strategy='diloco'", resume=_round(two, 1))
    job("1x2-stopped", *one, "run.shards=2", "run.stop_at_round=1")  # for the CLI's --resume
    return {"finals": train_sharded(jobs, world=4), "dirs": dirs}


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _last_eval(run_dir: Path) -> dict:
    records = read_metrics(run_dir / "metrics.jsonl")
    return [r for r in records if r.get("kind") == "round" and "loss/val" in r][-1]


@pytest.mark.parametrize("model, strategy", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_two_shards_per_replica_train_as_one(runs, model, strategy):
    sharded, whole = (
        runs["finals"][f"{model}-{strategy}-2x2"],
        runs["finals"][f"{model}-{strategy}-2x1"],
    )
    assert sorted(sharded) == sorted(whole) == [0, 1]
    for replica in (0, 1):
        assert _max_diff(sharded[replica], whole[replica]) < TOL, replica
    # The round records agree too: losses, and the diagnostics summed over shards.
    a = _last_eval(runs["dirs"][f"{model}-{strategy}-2x2"])
    b = _last_eval(runs["dirs"][f"{model}-{strategy}-2x1"])
    for key in ("loss/train", "loss/val", "loss/val_avg_model", "consensus/total"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # Outer traffic per process falls by the shard count (payloads of 1/2 of the elements).
    assert a["comm/bytes_sent"] == pytest.approx(b["comm/bytes_sent"] / 2, rel=0.01)


@pytest.mark.parametrize("resumed", ["1x2-to-1x4", "1x2-to-1x1"])
def test_dcp_checkpoint_resumes_at_other_shard_counts(runs, resumed):
    uninterrupted = runs["finals"]["1x2"][0]
    assert _max_diff(runs["finals"][resumed][0], uninterrupted) < TOL


def test_dcp_checkpoint_of_two_replicas_resumes_unsharded(runs):
    finals = runs["finals"]
    for replica in (0, 1):
        got, want = finals["2x2-to-2x1"][replica], finals["gpt-diloco-2x2"][replica]
        assert _max_diff(got, want) < TOL, replica
    manifest = json.loads(
        (Path(_round(runs["dirs"]["gpt-diloco-2x2"], 1)) / "COMPLETE").read_text()
    )
    assert manifest["shards"] == 2
    assert sorted(manifest["files"]) == [
        f"replica_{r}/{f}" for r in (0, 1) for f in (".metadata", "__0_0.distcp", "__1_0.distcp")
    ]


def test_cli_resumes_a_sharded_checkpoint_in_one_process(runs, capsys):
    run_dir = runs["dirs"]["1x2-stopped"]
    code = cli.main(["train", "--resume", str(run_dir), "--set", "run.shards=1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "memory: " in out and "(estimated)" in out
    final = torch.load(Path(_round(run_dir, 2)) / "worker_0.pt", weights_only=False)["model"]
    assert _max_diff(list(final.values()), runs["finals"]["1x2"][0]) < TOL


def test_a_corrupted_dcp_file_is_caught_by_its_hash(runs):
    ckpt = Path(_round(runs["dirs"]["1x2"], 2))
    shard = ckpt / "replica_0" / "__1_0.distcp"
    checkpoint.verify(ckpt)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its SHA-256"):
        checkpoint.verify(ckpt)


def test_activation_checkpointing_changes_nothing(make_config, tmp_path):
    """Recomputing each block in backward gives the same parameters, bit for bit."""
    finals = []
    for ac in ("false", "true"):
        cfg = make_config(*BASE, f"run.activation_checkpointing={ac}", f"run.name='ac-{ac}'")
        model = train_worker(cfg, LocalComm(), launch.new_run_dir(cfg)).model
        recomputed = [b.forward.__name__ == "checkpointed" for b in model.blocks]
        assert recomputed == [ac == "true"] * 2
        finals.append([p.detach() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))


def test_sharded_cpu_workers_get_a_fixed_mmap_threshold(make_config, monkeypatch):
    # That a worker started with it has the threshold: tests/test_processes.py.
    from frugaltrain.train.supervisor import worker_env

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert worker_env(make_config("run.shards=1")) == {}
    sharded = make_config("run.shards=2", "data.batch_size=8")
    assert worker_env(sharded) == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own value wins
    assert worker_env(sharded) == {"MALLOC_MMAP_THRESHOLD_": "65536"}
