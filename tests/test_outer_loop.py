"""frugaltrain.wrap: a plain user loop with wrap ends bitwise where `frugaltrain train`'s own loop
ends (one worker, and 4 real gloo processes), resumes bitwise from a user checkpoint, refuses
bad input before it hooks anything, and the example script trains under torchrun."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.gloo_pool import free_port
from torch import nn

import frugaltrain
from frugaltrain import ConfigError
from frugaltrain.comm import LocalComm
from frugaltrain.comm.torchdist import TorchDistComm
from frugaltrain.config import flat_items, nest_outer_keys, to_toml
from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens, worker_seed
from frugaltrain.forge import forge_optimizer
from frugaltrain.models import build_model
from frugaltrain.train.launch import new_run_dir
from frugaltrain.train.loop import train_worker

WORLD = 4
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_loop.py"
# Constant lr and no clipping, so a user loop without a schedule or clipping is the same math.
BASE = (
    *("optim.warmup_steps=0", "optim.min_lr_ratio=1.0", "optim.grad_clip=0"),
    *("model.n_layer=2", "run.steps=12", "outer.H=4", "run.eval_every=0", "run.threads=1"),
)
# wrap's keywords per case; the same keys, as outer.* overrides (a strategy's own keys in its
# sub-section, e.g. outer.fgd.preset), configure `frugaltrain train`.
CASES = {
    "ddp": {"strategy": "ddp"},
    "diloco": {"strategy": "diloco"},
    # The default job's method: 4 bits as a reduce-scatter, sent a step before the round's end.
    "diloco-overlap": {
        "strategy": "diloco",
        "codec": "e3m0",
        "coded_average": "reduce_scatter",
        "overlap": 1,
    },  # fmt: skip
    "fgd": {"strategy": "fgd", "preset": "GlobalM1LocalM2"},  # gossip: Mix2 over random pairs
    "noloco": {"strategy": "noloco", "momentum": 0.5},
    "streaming": {"strategy": "streaming", "fragments": 2, "overlap": 1},
}


def _config(factory, root: Path, name: str, workers: int):
    table = nest_outer_keys(CASES[name])  # wrap's flat keywords, as [outer] and its sub-sections
    sets = [f"outer.{k}={v!r}" for k, v in flat_items(table).items()]
    cfg = factory(root, *BASE, *sets, f"run.workers={workers}", f"run.name={name!r}")
    run_dir = new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return cfg, run_dir


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v), (u - v).abs().max()


def _user_loop(cfg, rank: int, world: int, outer: dict, stop: int = 0, saved: bytes = b""):
    """What a user writes: their model, their AdamW, their batches and a checkpoint of the three
    state dicts; frugaltrain enters only through `wrap`. The model, the AdamW groups (decay on
    dim >= 2, as optim.build_inner_optimizer) and the batches (as train.loop.setup) are the ones
    `frugaltrain train` builds, so the two runs can be compared bit for bit."""
    model = build_model(cfg)
    o, d = cfg.optim, cfg.data
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
    corpus = load_corpus(d.path, d.max_bytes, d.val_fraction)
    shard = shard_tokens(corpus.train, rank, world, d.num_shards, d.sharding)
    sampler = BatchSampler(shard, d.seq_len, d.batch_size, worker_seed(cfg.run.seed, rank))
    with frugaltrain.wrap(model, opt, H=cfg.outer.H, seed=cfg.run.seed, **outer) as loop:
        if saved:
            state = torch.load(io.BytesIO(saved))
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            loop.load_state_dict(state["outer"])
        while loop.step < (stop or cfg.run.steps):
            x, y = sampler.batch(loop.step)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    checkpoint = {"model": model.state_dict(), "opt": opt.state_dict(), "outer": loop.state_dict()}
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    return _params(model), loop, buf.getvalue()


# ---------------------------------------------------------------- one worker


@pytest.mark.parametrize("name", CASES)
def test_user_loop_equals_train_loop_on_one_worker(config_factory, tmp_path, name):
    cfg, run_dir = _config(config_factory, tmp_path, name, workers=1)
    ref = train_worker(cfg, LocalComm(), run_dir).model
    got, loop, _ = _user_loop(cfg, 0, 1, CASES[name])  # no process group: LocalComm
    assert isinstance(loop.comm, LocalComm)
    assert (loop.step, loop.round) == (12, 3)
    _assert_same(_params(ref), got)


@pytest.mark.parametrize("name", CASES)
def test_state_dict_resumes_bitwise(config_factory, tmp_path, name):
    cfg, _ = _config(config_factory, tmp_path, name, workers=1)
    straight, _, _ = _user_loop(cfg, 0, 1, CASES[name])
    _, _, saved = _user_loop(cfg, 0, 1, CASES[name], stop=8)  # two rounds, then a checkpoint
    resumed, loop, _ = _user_loop(cfg, 0, 1, CASES[name], saved=saved)
    assert (loop.step, loop.round) == (12, 3)
    _assert_same(straight, resumed)


# ---------------------------------------------------------------- real gloo workers


def _gloo_worker(rank, port, jobs, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        results = {}
        for name, cfg, run_dir in jobs:
            comm = TorchDistComm()  # native ring all-reduce, like wrap's default
            ref = train_worker(cfg, comm, Path(run_dir)).model
            dist.barrier()
            got, loop, _ = _user_loop(cfg, rank, WORLD, CASES[name])  # the default group
            results[name] = (_params(ref), got, comm.stats.bytes_sent, loop.comm.stats.bytes_sent)
            if name == "fgd":
                _, _, saved = _user_loop(cfg, rank, WORLD, CASES[name], stop=8)
                results["fgd-resumed"] = _user_loop(cfg, rank, WORLD, CASES[name], saved=saved)[0]
        out[rank] = results
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_runs(config_factory, tmp_path_factory) -> dict:
    """4 gloo processes run every case through train_worker and through a wrapped user loop."""
    root = tmp_path_factory.mktemp("wrap")
    jobs = [(name, *_config(config_factory, root, name, WORLD)) for name in CASES]
    out = mp.Manager().dict()
    mp.start_processes(
        _gloo_worker, args=(free_port(), jobs, out), nprocs=WORLD, start_method="spawn"
    )
    return dict(out)


@pytest.mark.parametrize("name", CASES)
def test_user_loop_equals_train_loop_on_4_gloo_workers(gloo_runs, name):
    # Bitwise: the same strategy object makes the same collectives on the same tensors in the
    # same order; only fgd's Mix1 is posted later (at the round's first opt.step, not before its
    # forward), which changes when it overlaps, not what it sums.
    for rank in range(WORLD):
        ref, got, ref_bytes, got_bytes = gloo_runs[rank][name]
        _assert_same(ref, got)
        assert ref_bytes == got_bytes > 0
    if name == "fgd":  # the gossip case leaves workers apart, so the check is not trivial
        assert not torch.equal(gloo_runs[0][name][1][0], gloo_runs[1][name][1][0])


def test_fgd_resumes_bitwise_on_4_gloo_workers(gloo_runs):
    for rank in range(WORLD):
        _assert_same(gloo_runs[rank]["fgd"][1], gloo_runs[rank]["fgd-resumed"])


# ---------------------------------------------------------------- the hooks and bad input


class _CountingComm(LocalComm):
    """One worker (every collective is the identity and complete) that counts all-reduces."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def all_reduce_mean_(self, tensors, **kwargs):
        self.calls += 1
        return super().all_reduce_mean_(tensors, **kwargs)


def _tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps: int, loop=None) -> None:
    for _ in range(steps):
        model(torch.randn(8, 4)).square().mean().backward()
        if loop is not None:
            loop.sync_grads()  # before clipping: clip the averaged gradient
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("strategy, calls", [("ddp", 6), ("diloco", 2)])
def test_hooks_sync_once_per_step_or_round_and_close_removes_them(strategy, calls):
    model, opt = _tiny()
    comm = _CountingComm()
    with frugaltrain.wrap(model, opt, strategy=strategy, H=3, comm=comm) as loop:
        _train(model, opt, 6, loop)  # sync_grads by hand: the step's hook does not repeat it
    assert (loop.step, loop.round, comm.calls) == (6, 2, calls)
    _train(model, opt, 1)
    assert (loop.step, comm.calls) == (6, calls)


def test_close_inside_a_round_warns_unless_an_error_ends_it():
    model, opt = _tiny()
    with pytest.warns(UserWarning, match="last 2 inner steps were never synchronized"):
        with frugaltrain.wrap(model, opt, H=4):
            _train(model, opt, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyboardInterrupt), frugaltrain.wrap(model, opt, H=4) as loop:
            _train(model, opt, 2)
            raise KeyboardInterrupt
    assert not opt._optimizer_step_pre_hooks and loop.step == 2


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"strategy": "sgd"}, "outer.strategy = 'sgd': choose one of ddp, diloco, fgd, noloco"),
        (
            {"strategy": "ddp", "codec": "int8"},
            "outer.codec = 'int8': no effect with outer.strategy = 'ddp'",
        ),
        (
            {"codec": "topk:0"},
            "outer.codec = 'topk:0': choose one of fp32, bf16, int8, e3m0, 2bit, 1bit, or",
        ),
        ({"param_codec": "topk:0.1"}, "outer.param_codec = 'topk:0.1': choose one of fp32"),
        (  # parameters have no error feedback to carry what 2 bits drop
            {"param_codec": "2bit"},
            "outer.param_codec = '2bit': choose one of fp32, bf16, int8, e3m0",
        ),
        ({"strategy": "fgd", "mixing": "ring"}, "unknown key outer.mixing; valid keys here"),
        ({"H": -1}, "outer.H = -1: must be at least 1"),
        (
            {"H": 6, "strategy": "streaming", "fragments": 4},
            "outer.streaming.fragments = 4: must divide",
        ),
    ],
)
def test_bad_keys_are_one_line_errors_before_any_hook(keys, message):
    model, opt = _tiny()
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        frugaltrain.wrap(model, opt, **keys)
    assert "\n" not in str(e.value)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_forge_optimizer_is_refused():
    model = nn.Sequential(nn.Linear(4, 4))
    opt = forge_optimizer(model, "adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ConfigError, match="FORGE optimizer.*use `frugaltrain train") as e:
        frugaltrain.wrap(model, opt)
    assert "\n" not in str(e.value)
    assert not opt._optimizer_step_pre_hooks


def test_state_of_another_strategy_is_refused():
    model, opt = _tiny()
    with frugaltrain.wrap(model, opt, strategy="diloco", H=2) as loop:
        state = loop.state_dict()
    with frugaltrain.wrap(model, opt, strategy="fgd", H=2) as loop:
        with pytest.raises(ValueError, match="state is from strategy 'diloco'"):
            loop.load_state_dict(state)


# ---------------------------------------------------------------- the example


def test_example_trains_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(EXAMPLE), "--strategy", "fgd", "--steps", "120", "-H", "20"]
    # TMPDIR: torchrun keeps its log directory there; the test's own, not the machine's /tmp.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rounds = re.findall(r"round +\d+  loss ([\d.]+)  sent ([\d.]+) MB", done.stdout)
    assert len(rounds) == 6, done.stdout  # rank 0 prints, once per round
    losses = [float(loss) for loss, _ in rounds]
    assert losses[-1] < losses[0] - 1.0, losses  # uniform bytes: ln 256 = 5.5
    assert 0 < float(rounds[0][1]) < float(rounds[-1][1])
