"""Mixing topologies, codecs and the gossip operations of the comm on real gloo processes."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.gloo_pool import free_port

from frugaltrain.codecs import compress
from frugaltrain.codecs.feedback import ErrorFeedback
from frugaltrain.codecs.grammar import FEEDBACK_CODECS
from frugaltrain.comm import topology, torchdist
from frugaltrain.comm.base import weighted_sum
from frugaltrain.comm.torchdist import TorchDistComm


@pytest.mark.parametrize("name", topology.TOPOLOGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_matrices_are_doubly_stochastic(name, n):
    for t in range(5):
        w = topology.mixing_matrix(name, n, t, seed=3)
        assert (w >= 0).all()
        np.testing.assert_allclose(w.sum(0), 1, atol=1e-12)
        np.testing.assert_allclose(w.sum(1), 1, atol=1e-12)


def test_pairs_are_reseeded_and_agree():
    a = [topology.mixing_matrix("pairs", 8, t, seed=1) for t in range(4)]
    b = [topology.mixing_matrix("pairs", 8, t, seed=1) for t in range(4)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))  # same on every worker
    assert not all(np.array_equal(a[0], x) for x in a[1:])  # but a new draw each round


def test_exponential_reaches_the_exact_average_in_log2_rounds():
    n = 8
    x = np.random.default_rng(0).normal(size=(n, 5))
    for t in range(3):
        x = topology.mixing_matrix("exponential", n, t) @ x
    np.testing.assert_allclose(x, np.broadcast_to(x.mean(0), x.shape), atol=1e-12)


def test_contraction_factors():
    measured = topology.measured_contraction_factor
    assert topology.contraction_factor("none", 8).rho == 1
    # complete and ring are fixed matrices: one measured round is the exact value (up to fp64).
    assert topology.contraction_factor("complete", 8).rho == 0
    assert measured("complete", 8, rounds=1).rho == pytest.approx(0, abs=1e-12)
    ring = topology.contraction_factor("ring", 8)
    assert ring.how == "analytic"
    assert ring.rho == pytest.approx(((1 + 2 * math.cos(2 * math.pi / 8)) / 3) ** 2)
    assert measured("ring", 8, rounds=1).rho == pytest.approx(ring.rho, rel=1e-12)
    # pairs: the analytic 0.5 (n-2)/(n-1) against the mean over 4000 random matchings. Each
    # entry of the mean is an average of 4000 indicators with p = 1/15, std ~ 0.004; the top
    # eigenvalue of the 16 x 16 error matrix stays under ~4x that, so 0.02 is a loose bound.
    pairs = topology.contraction_factor("pairs", 16)
    assert pairs.how == "analytic" and pairs.rho == pytest.approx(0.5 * (1 - 1 / 15))
    assert measured("pairs", 16, rounds=4000).rho == pytest.approx(pairs.rho, abs=0.02)
    assert topology.contraction_factor("pairs", 7).how.startswith("measured")
    # Empirical contraction of random vectors never beats rho by more than noise.
    x = np.random.default_rng(1).normal(size=(16, 200))
    xc = x - x.mean(0)
    ratios = []
    for t in range(200):
        y = topology.mixing_matrix("pairs", 16, t) @ x
        ratios.append(((y - y.mean(0)) ** 2).sum() / (xc**2).sum())
    assert np.mean(ratios) <= pairs.rho + 0.02


@pytest.mark.parametrize("codec", compress.CODECS)
def test_codec_roundtrip_and_bytes(codec):
    x = torch.randn(1000) * torch.logspace(-3, 1, 1000)
    parts = compress.encode(x, codec)
    assert sum(p.numel() * p.element_size() for p in parts) == compress.wire_bytes(1000, codec)
    y = compress.decode(parts, codec, 1000)
    assert y.dtype == torch.float32 and y.shape == x.shape
    rel = {"fp32": 0, "bf16": 2**-8, "int8": 1 / 254, "e3m0": 1 / 3, "2bit": 1, "1bit": 1}[codec]
    blocks = torch.nn.functional.pad(x, (0, 24)).view(-1, compress.BLOCK).abs().amax(1)
    bound = rel * (
        blocks.repeat_interleave(compress.BLOCK)[:1000]
        if codec not in ("fp32", "bf16")
        else x.abs()
    )
    assert ((y - x).abs() <= bound + 1e-12).all()


def test_e3m0_keeps_sign_and_zero():
    x = torch.tensor([0.0, 1.0, -1.0, 0.5, -0.25, 1e-9])
    y = compress.roundtrip(x, "e3m0")
    assert y[0] == 0 and y[5] == 0
    assert torch.equal(torch.sign(y[1:5]), torch.sign(x[1:5]))
    assert torch.equal(y[1:5], x[1:5])  # powers of two of the block scale are exact


@pytest.mark.parametrize("n", [1, 255, 1001, 4096])
def test_e3m0_is_its_formula_to_the_bit(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-12, 2, n)
    x[::7] = 0.0
    x[3::11] = -0.0
    x[5::13] *= 1e-6  # below a block's smallest level: zero, keeping its sign
    got = compress.roundtrip(x, "e3m0")
    want = compress.e3m0_by_formula(x)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("codec", FEEDBACK_CODECS)
def test_low_bit_codecs_keep_each_signs_and_each_blocks_magnitude(codec):
    """2bit and 1bit send a sign per value and magnitudes that are means over the block (1bit:
    one, the block's mean; 2bit: two, split at it), so a block's sum of magnitudes survives; a
    last block short of BLOCK values averages only its own."""
    n = 1001
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 1, n)
    y = compress.roundtrip(x, codec)
    assert torch.equal(y.signbit(), x.signbit())
    for bx, by in zip(x.abs().split(compress.BLOCK), y.abs().split(compress.BLOCK), strict=True):
        groups = [bx >= bx.mean(), bx < bx.mean()] if codec == "2bit" else [bx >= 0]
        for g in groups:
            torch.testing.assert_close(by[g], bx[g].mean().expand(int(g.sum())))


def test_two_bits_are_about_half_of_e3m0s_bytes_and_one_bit_a_quarter():
    n = 1_000_000
    assert compress.wire_bytes(n, "2bit") / compress.wire_bytes(n, "e3m0") < 0.55
    assert compress.wire_bytes(n, "1bit") / compress.wire_bytes(n, "e3m0") < 0.28


def test_weighted_sum_of_identical_inputs_is_exact():
    x = torch.randn(10_000)
    for n in (3, 4, 7):
        assert torch.equal(weighted_sum([1 / n] * n, [x] * n), x)


# ---------------------------------------------------------------- real gloo processes


def _worker(rank, world, port, cases, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        results = []
        for name, codec, blocking, deterministic, average in cases:
            comm = TorchDistComm(deterministic=deterministic)
            comm.coded_average = average
            x = _inputs(rank)
            w = topology.mixing_matrix(name, world, round_idx=1, seed=7)
            h = comm.mix_(x, w, codec=codec, blocking=blocking)
            h.wait()
            results.append(
                ([t.clone() for t in x], comm.stats.bytes_sent, comm.stats.bytes_received)
            )
        out[rank] = (results, _feedback_rounds(rank), _completes_unwaited(rank))
    finally:
        dist.destroy_process_group()


ROUNDS = 3


def _feedback_rounds(rank: int) -> tuple:
    """ROUNDS reduce-scatter averages in 2bit with error feedback: this worker's payloads, the
    means it got, and its two residuals (its own coding's, its chunk mean's)."""
    comm, fb = TorchDistComm(), ErrorFeedback(1.0)
    comm.coded_average = "reduce_scatter"
    payloads, got = [], []
    for t in range(ROUNDS):
        x = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 * t + rank))]
        payloads.append(x[0].clone())
        comm.all_reduce_mean_(x, codec="2bit", feedback=fb)
        got.append(x[0].clone())
    return payloads, got, fb.residual, fb.of_mean().residual


def _completes_unwaited(rank: int) -> tuple[bool, torch.Tensor]:
    """A non-blocking reduce-scatter average in e3m0, not waited on until it has completed:
    whether it completed (its second phase moved without a wait), and its result."""
    comm = TorchDistComm()
    comm.coded_average = "reduce_scatter"
    x = _inputs(rank)
    handle = comm.all_reduce_mean_(x, codec="e3m0", blocking=False)
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while not handle.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    moved = handle.is_completed()
    handle.wait()
    return moved, torch.cat([t.flatten() for t in x])


@pytest.fixture(scope="module")
def gloo_results() -> dict:
    """Every worker's (CASES results, feedback rounds) from one spawn of 4 gloo processes."""
    out = mp.Manager().dict()
    mp.start_processes(_worker, args=(4, free_port(), CASES, out), nprocs=4, start_method="spawn")
    return dict(out)


def _inputs(rank: int) -> list[torch.Tensor]:
    # 3015 values: four reduce-scatter chunks of three scale blocks, the last one padded.
    return [
        torch.full((3, 5), float(rank + 1)) + torch.arange(15.0).view(3, 5) * 0.01,
        torch.randn(3000, generator=torch.Generator().manual_seed(rank)),
    ]


NUMEL = 3015
CASES = [
    ("complete", "fp32", True, False, "all_gather"),
    ("complete", "fp32", True, True, "all_gather"),
    ("complete", "int8", False, False, "all_gather"),
    ("ring", "fp32", False, False, "all_gather"),
    ("ring", "bf16", True, False, "all_gather"),
    ("pairs", "fp32", True, False, "all_gather"),
    ("exponential", "e3m0", False, False, "all_gather"),
    ("none", "fp32", True, False, "all_gather"),
    ("complete", "e3m0", False, False, "reduce_scatter"),
    ("complete", "int8", True, False, "reduce_scatter"),
    ("ring", "e3m0", True, False, "reduce_scatter"),  # not an average: a gossip exchange
]


def _two_phase_mean(flats: list[torch.Tensor], codec: str) -> torch.Tensor:
    """The reduce-scatter average written out: chunk j's owner averages its own chunk exact
    and the others' coded, codes the mean, and everyone decodes every mean."""
    n, size = len(flats), 768  # 3 blocks of 256: 4 x 768 >= NUMEL
    chunks = [torch.nn.functional.pad(f, (0, n * size - f.numel())).view(n, size) for f in flats]
    means = []
    for j in range(n):
        seen = [c[j] if r == j else compress.roundtrip(c[j], codec) for r, c in enumerate(chunks)]
        means.append(compress.roundtrip(weighted_sum([1 / n] * n, seen), codec))
    return torch.cat(means)[:NUMEL]


def test_gossip_on_gloo_matches_w_times_x(gloo_results):
    world = 4
    for c, (name, codec, _, deterministic, average) in enumerate(CASES):
        w = topology.mixing_matrix(name, world, round_idx=1, seed=7)
        flats = [torch.cat([t.flatten() for t in _inputs(r)]) for r in range(world)]
        two_phase = average == "reduce_scatter" and name == "complete"
        for r in range(world):
            got, sent, received = gloo_results[r][0][c]
            got = torch.cat([g.flatten() for g in got])
            if two_phase:  # the same means on every worker, to the bit
                assert torch.equal(got, _two_phase_mean(flats, codec))
                assert sent == received == 2 * 3 * compress.wire_bytes(768, codec)
                continue
            seen = [f if j == r else compress.roundtrip(f, codec) for j, f in enumerate(flats)]
            want = (torch.tensor(w[r]) @ torch.stack(seen).double()).float()
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            payload = compress.wire_bytes(NUMEL, codec)
            if name == "none":
                assert sent == received == 0
            elif name == "complete" and codec == "fp32" and not deterministic:
                assert sent == received == 2 * 3 * NUMEL * 4 // 4  # ring all-reduce model
            else:
                send_to, recv_from = topology.peers(w, r)
                assert (sent, received) == (payload * len(send_to), payload * len(recv_from))


def test_reduce_scatter_feedback_carries_both_codings(gloo_results):
    """With 2bit's error feedback on both codings of a reduce-scatter average, every worker
    holds the same means, and over the rounds those means plus the chunk owners' carried rest
    are the exact mean of what the workers sent: nothing is lost, only delayed."""
    world = 4
    out = {r: gloo_results[r][1] for r in range(world)}
    got = [torch.stack(out[r][1]) for r in range(world)]
    assert all(torch.equal(g, got[0]) for g in got)
    sent = [sum(out[r][0]) - out[r][2] for r in range(world)]  # all payloads less the carry
    size = compress.chunk_numel(NUMEL, world)
    carried = torch.cat([out[r][3] for r in range(world)])[:NUMEL]  # owner r holds chunk r
    assert all(out[r][3].numel() == size for r in range(world)) and carried.norm() > 0
    torch.testing.assert_close(got[0].sum(0) + carried, sum(sent) / world, rtol=0, atol=1e-5)


def test_a_two_phase_average_completes_without_being_waited_on(gloo_results):
    """The chunk means go out as soon as the first phase has arrived, not when the handle is
    waited on (what lets a step-early round hide both phases), with the same means."""
    flats = [torch.cat([t.flatten() for t in _inputs(r)]) for r in range(4)]
    for r in range(4):
        moved, got = gloo_results[r][2]
        assert moved
        assert torch.equal(got, _two_phase_mean(flats, "e3m0"))


def test_exchange_posts_every_receive_before_any_send(monkeypatch):
    """gloo's TCP pair sends its messages in order on one socket and announces a posted receive
    with a message: a receive posted after a send that is already streaming is announced only
    when the whole payload has gone, and the peer's payload waits for it (half the link rate in
    a pair exchange). So every receive is posted first."""
    calls = []

    class Done:
        def wait(self):
            pass

        def is_completed(self):
            return True

    def irecv(buf, *, group, tag, group_src):
        calls.append(("recv", group_src, tag))
        return Done()

    def isend(t, *, group, tag, group_dst):
        calls.append(("send", group_dst, tag))
        return Done()

    monkeypatch.setattr(torchdist.dist, "irecv", irecv)
    monkeypatch.setattr(torchdist.dist, "isend", isend)
    comm = TorchDistComm.__new__(TorchDistComm)  # no process group: only the posting order
    comm.group = None
    parts = [torch.zeros(4), torch.zeros(2)]
    got = comm._exchange(parts, send_to=[1, 3], recv_from=[3, 1], seq=5).wait_all()
    assert [c[0] for c in calls] == ["recv"] * 4 + ["send"] * 4
    assert {(p, t) for k, p, t in calls if k == "recv"} == {
        (p, 20 + k) for p in (1, 3) for k in (0, 1)
    }
    assert {(p, t) for k, p, t in calls if k == "send"} == {
        (p, 20 + k) for p in (1, 3) for k in (0, 1)
    }
    assert sorted(got) == [1, 3] and [b.shape for b in got[1]] == [p.shape for p in parts]
