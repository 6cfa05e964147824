"""Factored Gossip DiLoCo, NoLoCo and Streaming DiLoCo against DiLoCo and against the algebra
they promise, on one worker and on real 4-process gloo runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.gloo_pool import free_port

from frugaltrain.comm import LocalComm
from frugaltrain.comm.torchdist import TorchDistComm
from frugaltrain.config import to_toml
from frugaltrain.models import build_model
from frugaltrain.models.parts import fragments, select
from frugaltrain.outer import FactoredGossipDiLoCo, OuterSGD
from frugaltrain.train.launch import new_run_dir
from frugaltrain.train.loop import train_worker

WORLD = 4


def _start(cfg) -> Path:
    run_dir = new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return run_dir


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v), (u - v).abs().max()


# ---------------------------------------------------------------- one worker


@pytest.mark.parametrize(
    "sets",
    [
        ("outer.strategy='fgd'", "outer.fgd.mix2='pairs'"),
        (
            "outer.strategy='fgd'",
            "outer.fgd.preset='GlobalM1'",
            "outer.fgd.momentum_policy='mixed'",
        ),
        ("outer.strategy='streaming'", "outer.streaming.fragments=1", "outer.streaming.overlap=0"),
        ("outer.strategy='noloco'", "outer.nesterov=false"),
    ],
)
def test_one_worker_reduces_to_diloco(make_config, sets):
    nesterov = "outer.nesterov=false" if "noloco" in sets[0] else "outer.nesterov=true"
    ref = make_config("outer.strategy='diloco'", nesterov, "run.name=ref")
    got = make_config(*sets, "run.name=got")
    a = train_worker(ref, LocalComm(), _start(ref)).model
    b = train_worker(got, LocalComm(), _start(got)).model
    _assert_same(_params(a), _params(b))


def test_momentum_reset_is_outer_sgd_with_a_larger_rate(make_config):
    # Cleared before every step, Nesterov's buffer is the step's own pseudo-gradient g, so the
    # step is gamma (g + mu g): plain outer SGD at gamma (1 + mu). Equal up to the rounding of
    # gamma (1 + mu) g against gamma g + gamma mu g (float32, a few rounds of a tiny model).
    reset = make_config("outer.strategy='fgd'", "outer.fgd.momentum_policy='reset'")
    sgd = make_config(f"outer.lr={0.7 * 1.9}", "outer.momentum=0.0", "run.name=sgd")
    a = _params(train_worker(reset, LocalComm(), _start(reset)).model)
    b = _params(train_worker(sgd, LocalComm(), _start(sgd)).model)
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_mix2_momentum_makes_pair_partners_equal(make_config):
    # GlobalM1 plus a pairwise Mix2 of pseudo-gradients and momenta on all tensors: after the
    # last round the two workers of each pair took the same update from the same Mix1 result,
    # so they hold the same parameters; with the raw pseudo-gradients only, their local momenta
    # keep them apart.
    from frugaltrain.comm.topology import mixing_matrix
    from frugaltrain.sim import SimSection, simulate

    sets = ("run.workers=4", "outer.strategy='fgd'", "outer.fgd.mix2='pairs'", "run.eval_every=0")
    sets += ("run.steps=24",)  # 4 rounds: the last round pairs workers the earlier ones did not
    finals = {}
    for flag in ("true", "false"):
        cfg = make_config(*sets, f"outer.fgd.mix2_momentum={flag}")
        finals[flag] = [_params(m) for m in simulate(cfg, SimSection(ratio=0.5)).models]
    rounds = 24 // 6
    w2 = mixing_matrix("pairs", 4, rounds - 1, seed=1)  # the last round's pairs (seed + 1)
    partner = int(w2[0, 1:].argmax()) + 1
    other = next(i for i in (1, 2, 3) if i != partner)

    def same(flag: str, i: int, j: int) -> bool:
        return all(torch.equal(u, v) for u, v in zip(finals[flag][i], finals[flag][j], strict=True))

    assert same("true", 0, partner) and not same("true", 0, other)
    assert not same("false", 0, partner)


def test_delayed_mix2_steps_with_the_early_delta_and_keeps_the_late_steps(make_config):
    # One worker, Mix2 on the head only, sent 2 steps before the end of a 5-step round: the
    # head steps with its Delta at the send and keeps the last 2 steps on top of the new x;
    # the other tensors step with the whole round's Delta and restart from the new x.
    model = build_model(make_config("model.n_layer=1"))
    fgd = FactoredGossipDiLoCo(
        model, LocalComm(), H=5, lr=0.5, momentum=0.0, mix2="pairs", mix2_params="head",
        mix2_delay=2,
    )  # fmt: skip
    head = fgd.in_mix2
    gen = torch.Generator().manual_seed(0)
    for rnd in range(2):
        x0 = [x.clone() for x in fgd.outer]
        for step in range(5 * rnd, 5 * rnd + 5):
            fgd.before_step(step)
            with torch.no_grad():
                for p in fgd.params:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.01)
            if step == 5 * rnd + 2:
                at_send = _params(model)
            end = _params(model)
            assert fgd.after_step(step + 1) == (step == 5 * rnd + 4)
        for k, keep in enumerate(head):
            delta = x0[k] - (at_send[k] if keep else end[k])
            torch.testing.assert_close(fgd.outer[k], x0[k] - 0.5 * delta)
            kept = end[k] - at_send[k] if keep else torch.zeros_like(end[k])
            torch.testing.assert_close(fgd.params[k].detach(), fgd.outer[k] + kept)
    assert any(head) and not all(head)


def test_param_subsets_and_fragments(make_config):
    names = [n for n, _ in build_model(make_config("model.n_layer=3")).named_parameters()]
    chosen = dict(zip(names, select(names, "embed+head+blocks:1"), strict=True))
    assert chosen["wte.weight"] and chosen["head.weight"] and chosen["ln_f.weight"]
    assert chosen["blocks.0.attn.qkv.weight"] and not chosen["blocks.1.attn.qkv.weight"]
    assert select(names, "blocks.2.*") == [n.startswith("blocks.2.") for n in names]
    with pytest.raises(ValueError, match="part .decoder. selects no tensor"):
        select(names, "embed+decoder")
    owner = dict(zip(names, fragments(names, 2), strict=True))
    assert owner["blocks.0.mlp.fc.weight"] == owner["blocks.2.mlp.fc.weight"] == 0
    assert owner["blocks.1.mlp.fc.weight"] == 1 == owner["head.weight"]


# ---------------------------------------------------------------- real gloo workers


def _gloo_worker(rank, port, jobs, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        results = {}
        for name, cfg, run_dir, resume in jobs:
            comm = TorchDistComm(deterministic=cfg.run.deterministic_comm)
            if name == "mean-recursion":
                results[name] = _mean_recursion_rounds(cfg, comm)
                continue
            if name == "mix1-delta-rounds":
                results[name] = _mix1_delta_rounds(cfg, comm)
                continue
            result = train_worker(cfg, comm, Path(run_dir), Path(resume) if resume else None)
            results[name] = (_params(result.model), comm.stats.bytes_sent)
            dist.barrier()  # rank 0 writes the COMPLETE marker after the others finish
        out[rank] = results
    finally:
        dist.destroy_process_group()


def _mean_recursion_rounds(cfg, comm) -> list[dict]:
    """Drive fgd by hand: inner phases replaced by per-worker random moves; record what the mean
    recursion needs."""
    model = build_model(cfg)
    fgd = FactoredGossipDiLoCo(
        model,
        comm,
        H=1,
        lr=0.7,
        momentum=0.9,
        mix1="ring",
        mix2="pairs",
        seed=5,
    )
    gen = torch.Generator().manual_seed(comm.rank)
    rounds = []
    for t in range(4):
        fgd.before_step(t)
        with torch.no_grad():
            for p in fgd.params:
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        before = {
            "x": [x.clone() for x in fgd.outer],
            "delta": [x - p.detach() for x, p in zip(fgd.outer, fgd.params, strict=True)],
            "m": [m.clone() for m in fgd.momenta()]
            if t
            else [torch.zeros_like(x) for x in fgd.outer],
        }
        fgd.after_step(t + 1)
        rounds.append(
            {
                **before,
                "x_next": [x.clone() for x in fgd.outer],
                "m_next": [m.clone() for m in fgd.momenta()],
            }
        )
    return rounds


def _mix1_delta_rounds(cfg, comm) -> list[dict]:
    """Drive GlobalM1 with Mix1 coded as deltas in e3m0 by hand (random inner moves); record per
    round the x_i sent, and the anchor and Mix1 residual after the round."""
    fgd = FactoredGossipDiLoCo(
        build_model(cfg), comm, H=1, lr=0.7, momentum=0.9, param_codec="e3m0", mix1_delta=True
    )
    gen = torch.Generator().manual_seed(comm.rank)
    rounds = []
    for t in range(4):
        fgd.before_step(t)
        x = torch.cat([v.flatten() for v in fgd.outer])
        with torch.no_grad():
            for p in fgd.params:
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        fgd.after_step(t + 1)
        anchor = torch.cat([a.flatten() for a in fgd._anchor])
        rounds.append({"x": x, "anchor": anchor, "residual": fgd.feedback("mix1").residual})
    return rounds


def _cases(factory, root: Path) -> list[tuple]:
    base = ("run.workers=4", "run.deterministic_comm=true", "model.n_layer=2", "run.steps=18")

    def job(name, *sets, resume=None):
        cfg = factory(root, *base, f"run.name={name!r}", *sets)
        return (name, cfg, str(_start(cfg)), resume)

    jobs = [
        job("diloco"),
        job("fgd-exact", "outer.strategy='fgd'", "outer.fgd.mix2='complete'"),
        job("fgd-globalm2", "outer.strategy='fgd'", "outer.fgd.preset='GlobalM2'"),
        job("diloco-hb", "outer.nesterov=false", "outer.momentum=0.5"),
        job(
            "noloco-all",
            "outer.strategy='noloco'",
            "outer.noloco.group_size=4",
            "outer.noloco.consensus_pull=0.0",
            "outer.momentum=0.5",
        ),
        job(
            "streaming-1",
            "outer.strategy='streaming'",
            "outer.streaming.fragments=1",
            "outer.streaming.overlap=0",
        ),
        job(
            "streaming-2",
            "outer.strategy='streaming'",
            "outer.streaming.fragments=2",
            "outer.streaming.overlap=1",
            "outer.codec='e3m0'",
        ),
    ]
    gossip = (
        "outer.strategy='fgd'",
        "outer.fgd.mix1='ring'",
        "outer.fgd.mix2='pairs'",
        "outer.fgd.mix2_params='embed+head'",
        "run.checkpoint_every=1",
    )
    moved = (
        ("fgd", ()),
        ("fgd-delay", ("outer.fgd.mix2_delay=2",)),
    )
    for name, late in moved:
        whole = job(f"{name}-full", *gossip, *late)
        part = job(f"{name}-part", *gossip, *late, "run.stop_at_round=2")
        ckpt = str(Path(part[2]) / "checkpoints" / "round_000002")
        jobs += [whole, part, (f"{name}-resumed", part[1], part[2], ckpt)]
    coded = ("outer.codec='e3m0'", "outer.coded_average='reduce_scatter'", "run.checkpoint_every=1")
    early = ("outer.diloco.overlap=1", *coded)
    part = job("diloco-early-part", *early, "run.stop_at_round=2")
    ckpt = str(Path(part[2]) / "checkpoints" / "round_000002")
    jobs += [job("diloco-early", *early), part, ("diloco-early-resumed", *part[1:3], ckpt)]
    globalm2 = ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM2'", "outer.fgd.mix2_delay=1")
    jobs += [job("fgd-globalm2-early", *globalm2, *coded)]
    m1 = ("outer.strategy='fgd'", "outer.fgd.mix2='pairs'")
    delta = (*m1, "outer.fgd.mix1_delta=true")
    jobs += [job("fgd-m1", *m1), job("fgd-m1-delta", *delta)]
    e3m0 = (*delta, "outer.param_codec='e3m0'", "run.checkpoint_every=1")
    part = job("fgd-delta-e3m0-part", *e3m0, "run.stop_at_round=2")
    ckpt = str(Path(part[2]) / "checkpoints" / "round_000002")
    jobs += [job("fgd-delta-e3m0-full", *e3m0), part, ("fgd-delta-e3m0-resumed", *part[1:3], ckpt)]
    jobs += [
        ("mean-recursion", factory(root, *base), None, None),
        ("mix1-delta-rounds", factory(root, *base), None, None),
    ]
    return jobs


@pytest.fixture(scope="module")
def gloo_runs(config_factory, tmp_path_factory) -> dict:
    """One group of 4 gloo processes runs every real-runtime case, one after another;
    returns {rank: {case: result}}."""
    jobs = _cases(config_factory, tmp_path_factory.mktemp("outer"))
    out = mp.Manager().dict()
    mp.start_processes(
        _gloo_worker, args=(free_port(), jobs, out), nprocs=WORLD, start_method="spawn"
    )
    return dict(out)


def test_fgd_with_exact_mixes_equals_diloco(gloo_runs):
    for rank in range(WORLD):
        _assert_same(gloo_runs[rank]["diloco"][0], gloo_runs[rank]["fgd-exact"][0])


def test_fgd_globalm2_is_diloco_to_the_bit_and_the_byte(gloo_runs):
    # No Mix1 and a complete Mix2: DiLoCo's round, with nothing more on the wire.
    for rank in range(WORLD):
        _assert_same(gloo_runs[rank]["diloco"][0], gloo_runs[rank]["fgd-globalm2"][0])
        assert gloo_runs[rank]["fgd-globalm2"][1] == gloo_runs[rank]["diloco"][1]


def test_diloco_sent_a_step_early_is_fgd_globalm2_delayed_to_the_bit_and_the_byte(gloo_runs):
    # The default job's method: DiLoCo's round in 4 bits as a reduce-scatter, sent one step
    # before the round's end, as FGD's GlobalM2 with its Mix2 delayed by one step.
    for rank in range(WORLD):
        diloco, fgd = gloo_runs[rank]["diloco-early"], gloo_runs[rank]["fgd-globalm2-early"]
        _assert_same(diloco[0], fgd[0])
        assert diloco[1] == fgd[1]
    early, blocking = gloo_runs[0]["diloco-early"][0], gloo_runs[0]["diloco"][0]
    assert not all(torch.equal(u, v) for u, v in zip(early, blocking, strict=True))


def test_diloco_sent_early_resumes_exactly(gloo_runs):
    # Nothing is in flight at a round's end: the step it keeps lives in the model's parameters.
    for rank in range(WORLD):
        _assert_same(gloo_runs[rank]["diloco-early"][0], gloo_runs[rank]["diloco-early-resumed"][0])


def test_noloco_one_group_no_pull_equals_heavy_ball_diloco(gloo_runs):
    for rank in range(WORLD):
        _assert_same(gloo_runs[rank]["diloco-hb"][0], gloo_runs[rank]["noloco-all"][0])


def test_streaming_one_fragment_equals_diloco(gloo_runs):
    for rank in range(WORLD):
        _assert_same(gloo_runs[rank]["diloco"][0], gloo_runs[rank]["streaming-1"][0])


def test_streaming_fragments_send_the_same_total_in_4bit(gloo_runs):
    # Same parameters per H, e3m0 on the wire: about 1/8 of fp32's gather bytes, plus scales.
    full = gloo_runs[0]["streaming-1"][1]
    quarter = gloo_runs[0]["streaming-2"][1]
    assert 0.12 < quarter / full < 0.16
    workers = [gloo_runs[r]["streaming-2"][0] for r in range(WORLD)]
    assert all(torch.isfinite(p).all() for w in workers for p in w)


def test_fgd_gossip_workers_disagree_and_resume_exactly(gloo_runs):
    finals = [gloo_runs[r]["fgd-full"][0] for r in range(WORLD)]
    assert not torch.equal(finals[0][0], finals[1][0])  # gossip leaves workers apart
    for rank in range(WORLD):
        _assert_same(gloo_runs[rank]["fgd-full"][0], gloo_runs[rank]["fgd-resumed"][0])


def test_fgd_delayed_mix2_resumes_exactly_and_sends_what_blocking_mix2_sends(gloo_runs):
    # Nothing is in flight at a round's end: the steps it keeps live in the model's parameters.
    for rank in range(WORLD):
        delayed = gloo_runs[rank]["fgd-delay-full"]
        _assert_same(delayed[0], gloo_runs[rank]["fgd-delay-resumed"][0])
        assert delayed[1] == gloo_runs[rank]["fgd-full"][1]
    delayed, blocking = gloo_runs[0]["fgd-delay-full"][0], gloo_runs[0]["fgd-full"][0]
    assert not all(torch.equal(u, v) for u, v in zip(delayed, blocking, strict=True))


def test_fgd_mean_follows_diloco_recursion(gloo_runs):
    # W1 and W2 doubly stochastic: the workers' mean steps as DiLoCo's does.
    mu, gamma = 0.9, 0.7
    for t in range(4):
        per = [gloo_runs[r]["mean-recursion"][t] for r in range(WORLD)]

        def mean(key, k, per=per):
            return torch.stack([p[key][k].double() for p in per]).mean(0)

        for k in range(len(per[0]["x"])):
            g = mean("delta", k)
            m_next = mu * mean("m", k) + g
            x_next = mean("x", k) - gamma * (g + mu * m_next)
            torch.testing.assert_close(mean("m_next", k), m_next, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(mean("x_next", k), x_next, rtol=1e-5, atol=1e-6)
        if t > 0:
            assert not torch.equal(per[0]["x"][0], per[1]["x"][0])  # the test is not trivial


def test_mix1_as_deltas_in_fp32_is_mix1(gloo_runs):
    # x_i - a sent and a + mean added back: the same mean up to fp32 rounding.
    for rank in range(WORLD):
        plain, delta = gloo_runs[rank]["fgd-m1"][0], gloo_runs[rank]["fgd-m1-delta"][0]
        for u, v in zip(plain, delta, strict=True):
            torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)


def test_mix1_as_deltas_in_4bit_resumes_exactly_and_sends_an_eighth(gloo_runs):
    for rank in range(WORLD):
        full, resumed = (
            gloo_runs[rank]["fgd-delta-e3m0-full"],
            gloo_runs[rank]["fgd-delta-e3m0-resumed"],
        )
        _assert_same(full[0], resumed[0])
        # Mix2 in fp32 in both; Mix1 (as many bytes as Mix2 in fp32) in 4 bits plus scales.
        assert full[1] < 0.6 * gloo_runs[rank]["fgd-m1"][1]


def test_mix1_deltas_keep_one_anchor_and_lose_nothing(gloo_runs):
    # Every worker adds the same sent values to the same anchor, so the anchors agree bit for
    # bit; and the error feedback loses nothing: a + mean(residual) after a round equals the
    # exact mean of the x_i sent plus the mean residual before it.
    per = [gloo_runs[r]["mix1-delta-rounds"] for r in range(WORLD)]
    before = torch.zeros_like(per[0][0]["x"])
    for t in range(4):
        for r in range(1, WORLD):
            assert torch.equal(per[r][t]["anchor"], per[0][t]["anchor"])
        x = torch.stack([p[t]["x"].double() for p in per]).mean(0)
        residual = torch.stack([p[t]["residual"].double() for p in per]).mean(0)
        # Round 0 sends x_i - a = 0; later rounds' updates do not go whole in 4 bits.
        assert t == 0 or residual.abs().max() > 0
        got = per[0][t]["anchor"].double() + residual
        torch.testing.assert_close(got, x + before, rtol=0, atol=1e-6)
        before = residual


def test_consensus_metrics_match_brute_force(gloo_runs, tmp_path_factory):
    from frugaltrain.metrics.log import read_metrics

    def last_round(name):
        run_dir = next(tmp_path_factory.getbasetemp().glob(f"outer*/{name}"))
        return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"][-1]

    exact = last_round("diloco")
    assert exact["consensus/total"] == 0 and exact["disagreement/logit_js"] == 0
    gossip = last_round("fgd-full")
    finals = [gloo_runs[r]["fgd-full"][0] for r in range(WORLD)]
    mean = [torch.stack([f[k].double() for f in finals]).mean(0) for k in range(len(finals[0]))]
    brute = (
        sum((f[k].double() - mean[k]).pow(2).sum().item() for f in finals for k in range(len(mean)))
        / WORLD
    )
    assert gossip["consensus/total"] == pytest.approx(brute, rel=1e-4)
    groups = sum(gossip[f"consensus/{g}"] for g in ("embed", "blocks", "head", "other"))
    assert groups == pytest.approx(gossip["consensus/total"], rel=1e-9)
    assert 0 < gossip["disagreement/logit_js"] < 0.6931


@pytest.mark.parametrize("momentum, nesterov", [(0.9, True), (0.5, False), (0.0, True)])
def test_outer_sgd_is_torch_sgd_bit_for_bit(momentum, nesterov):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 2, 4)]
    ref = [torch.randn(s, generator=gen) for s in shapes]
    mine = [x.clone() for x in ref]
    torch_sgd = torch.optim.SGD(ref, lr=0.7, momentum=momentum, nesterov=nesterov and momentum > 0)
    outer = OuterSGD(mine, 0.7, momentum, nesterov)
    for step in range(4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        chosen = [0, 2] if step == 1 else [0, 1, 2]  # a step over some tensors (Streaming)
        for i, x in enumerate(ref):
            x.grad = grads[i] if i in chosen else None
        torch_sgd.step()
        outer.step(chosen, [grads[i] for i in chosen])
        _assert_same(ref, mine)
    if momentum:
        bufs = [torch_sgd.state[x]["momentum_buffer"] for x in ref]
        _assert_same(bufs, outer.momenta)
    again = OuterSGD([x.clone() for x in mine], 0.1, 0.0, False)
    again.load_state_dict(torch_sgd.state_dict())  # torch's layout loads, and ours round-trips
    assert again.state_dict()["param_groups"][0]["lr"] == 0.7
    if momentum:
        _assert_same(again.momenta, outer.momenta)
        assert again.momenta[0] is not outer.momenta[0]
