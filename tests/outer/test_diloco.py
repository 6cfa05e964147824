"""DiLoCo and DDP against references: plain AdamW, a hand computation of the outer step, and an
uninterrupted run (for resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from frugaltrain.comm import LocalComm
from frugaltrain.config import ConfigError, to_toml
from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens, worker_seed
from frugaltrain.metrics.log import read_metrics
from frugaltrain.models import build_model
from frugaltrain.optim import build_inner_optimizer, build_schedule
from frugaltrain.train import checkpoint
from frugaltrain.train.launch import new_run_dir, prepare, run
from frugaltrain.train.loop import train_worker


def _start(cfg) -> Path:
    run_dir = new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return run_dir


class HandWorker:
    """One worker's inner loop rebuilt from the parts, with no outer strategy attached."""

    def __init__(self, cfg, rank: int, world: int) -> None:
        d = cfg.data
        corpus = load_corpus(d.path, d.max_bytes, d.val_fraction)
        shard = shard_tokens(corpus.train, rank, world, d.num_shards, d.sharding)
        self.sampler = BatchSampler(shard, d.seq_len, d.batch_size, worker_seed(cfg.run.seed, rank))
        self.model = build_model(cfg)
        self.opt = build_inner_optimizer(self.model, cfg.optim)
        self.sched = build_schedule(self.opt, cfg.optim, cfg.run.steps)
        self.clip = cfg.optim.grad_clip
        self.step = 0

    def inner_steps(self, n: int) -> None:
        for _ in range(n):
            x, y = self.sampler.batch(self.step)
            self.model(x, y)[1].backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def test_one_worker_diloco_with_unit_outer_sgd_is_adamw(make_config, tmp_path):
    cfg = make_config("outer.lr=1.0", "outer.momentum=0.0", "run.steps=18")
    result = train_worker(cfg, LocalComm(), _start(cfg))
    ref = HandWorker(cfg, 0, 1)
    ref.inner_steps(cfg.run.steps)
    for p, q in zip(result.model.parameters(), ref.model.parameters(), strict=True):
        # x - 1.0 * (x - theta) may differ from theta by one rounding per round.
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_two_gloo_workers_match_hand_computed_outer_steps(make_config):
    cfg = make_config("run.workers=2", "outer.lr=0.7", "outer.momentum=0.9")
    run_dir = _start(cfg)
    run(cfg, run_dir)
    H, lr, mu = cfg.outer.H, cfg.outer.lr, cfg.outer.momentum
    workers = [HandWorker(cfg, r, 2) for r in range(2)]
    x = workers[0].params()  # identical init everywhere
    m = [torch.zeros_like(t) for t in x]
    for _ in range(cfg.run.steps // H):
        for w in workers:
            with torch.no_grad():
                for p, xi in zip(w.model.parameters(), x, strict=True):
                    p.copy_(xi)
            w.inner_steps(H)
        thetas = [w.params() for w in workers]
        delta = [
            (a0 - a1 + a0 - b1) / 2 for a0, a1, b1 in zip(x, thetas[0], thetas[1], strict=True)
        ]
        m = [mu * mi + di for mi, di in zip(m, delta, strict=True)]
        x = [xi - lr * (di + mu * mi) for xi, di, mi in zip(x, delta, m, strict=True)]
    ckpt = checkpoint.latest_complete(run_dir)
    for rank in range(2):
        state = torch.load(ckpt / f"worker_{rank}.pt", weights_only=False)
        for got, want in zip(state["outer"]["outer"], x, strict=True):
            # Same math, different association (fused add vs separate multiply): ~1 ulp per round.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _final_state(run_dir: Path) -> list[dict]:
    ckpt = checkpoint.latest_complete(run_dir)
    return [torch.load(ckpt / f"worker_{r}.pt", weights_only=False) for r in range(2)]


def _losses(run_dir: Path) -> list:
    return [
        (r["kind"], r["step"], r["loss/train"], r.get("loss/val"))
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def test_stop_and_resume_is_bit_identical(make_config):
    sets = ("run.workers=2", "run.steps=24", "run.checkpoint_every=1")
    full = make_config(*sets, "run.name=full")
    full_dir = _start(full)
    run(full, full_dir)

    part = make_config(*sets, "run.name=part", "run.stop_at_round=2")
    part_dir = _start(part)
    run(part, part_dir)
    assert checkpoint.latest_complete(part_dir).name == "round_000002"
    cfg, run_dir, ckpt = prepare(None, [], str(part_dir))
    run(cfg, run_dir, ckpt)

    for a, b in zip(_final_state(full_dir), _final_state(part_dir), strict=True):
        assert a["step"] == b["step"] == 24
        for key, value in a["model"].items():
            assert torch.equal(value, b["model"][key]), key
        for u, v in zip(a["outer"]["outer"], b["outer"]["outer"], strict=True):
            assert torch.equal(u, v)
    assert _losses(full_dir) == _losses(part_dir)


def test_resume_refuses_mismatch_and_corruption(make_config):
    cfg = make_config("run.steps=12", "run.checkpoint_every=1")
    run_dir = _start(cfg)
    train_worker(cfg, LocalComm(), run_dir)
    # Refused in prepare, before any worker process starts, and again by each worker.
    with pytest.raises(ConfigError, match="different model/data/optim/outer config"):
        prepare(None, ["model.n_embd=64"], str(run_dir))
    with pytest.raises(ConfigError, match=r"written by 1 workers but run.workers = 2"):
        prepare(None, ["run.workers=2"], str(run_dir))
    changed = make_config("run.steps=12", "run.checkpoint_every=1", "model.n_embd=64")
    with pytest.raises(ConfigError, match="different model/data/optim/outer config"):
        checkpoint.load_worker(checkpoint.latest_complete(run_dir), 0, changed)
    latest = checkpoint.latest_complete(run_dir)
    (latest / "worker_0.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="corrupt or unreadable"):
        checkpoint.load_worker(latest, 0, cfg)
    meta = json.loads((latest / "COMPLETE").read_text())
    assert meta["workers"] == 1


def test_ddp_workers_stay_identical(make_config):
    cfg = make_config("run.workers=2", "outer.strategy=ddp")
    run_dir = _start(cfg)
    run(cfg, run_dir)
    a, b = _final_state(run_dir)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    rounds = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]
    assert all(r["comm/bytes_sent"] > 0 and r["time/blocking_s"] > 0 for r in rounds)
