"""Analytic proxies against torch: exact parameter counts, FLOPs against FlopCounterMode."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from frugaltrain.energy.proxies import (
    DEVICE_PROFILES,
    Layout,
    TransformerShape,
    calibrate_cpu_profile,
    comm_bytes,
    gpt_param_count,
    paper_proxies,
    roofline_time,
    step_proxies,
    transformer_train_flops,
)
from frugaltrain.models.gpt import GPT, GPTConfig

CASES = [  # (n_layer, n_embd, n_head, seq_len, batch, vocab, bias, tie)
    (1, 64, 4, 16, 2, 256, False, False),
    (2, 64, 4, 64, 3, 256, True, False),
    (2, 128, 8, 32, 2, 512, False, True),
]


def _shape(L, d, h, s, b, V, bias, tie) -> TransformerShape:
    return TransformerShape(
        n_layer=L, n_embd=d, n_head=h, seq_len=s, vocab_size=V, batch_size=b, bias=bias,
        tie_embeddings=tie, block_size=s,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_param_count_exact(case) -> None:
    L, d, h, s, b, V, bias, tie = case
    model = GPT(GPTConfig(n_layer=L, n_head=h, n_embd=d, vocab_size=V, block_size=s, bias=bias,
                          tie_embeddings=tie))  # fmt: skip
    assert gpt_param_count(_shape(*case)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", CASES)
def test_train_flops_match_flop_counter(case) -> None:
    L, d, h, s, b, V, bias, tie = case
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=L, n_head=h, n_embd=d, vocab_size=V, block_size=s, bias=bias,
                          tie_embeddings=tie))  # fmt: skip
    idx = torch.randint(0, V, (b, s))
    # The math SDPA backend runs attention as bmm ops that FlopCounterMode counts; the fused
    # CPU kernel has no registered FLOP formula and would be silently skipped.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    counted = counter.get_total_flops()
    analytic = transformer_train_flops(L, d, h, s, V, tokens=b * s)
    # Both count the same matmuls (bias adds are not FLOPs in either): equal to float precision;
    # the bound is 1%.
    assert analytic == pytest.approx(counted, rel=1e-9)
    assert step_proxies(_shape(*case)).flops == pytest.approx(counted, rel=1e-9)


def test_recompute_adds_one_forward() -> None:
    shape = _shape(*CASES[0])
    base = step_proxies(shape).flops
    assert step_proxies(shape, Layout(recompute=True)).flops == pytest.approx(base * 4 / 3)


def test_megatron_step_formula() -> None:
    # 72 B s L d^2 (1 + s/(6d) + V/(12 L d)) for d_ff = 4d (Narayanan et al. 2021).
    L, d, s, B, V = 24, 1024, 512, 8, 32000
    shape = TransformerShape(n_layer=L, n_embd=d, n_head=16, seq_len=s, vocab_size=V, batch_size=B)
    expect = 72 * B * s * L * d * d * (1 + s / (6 * d) + V / (12 * L * d))
    assert step_proxies(shape).flops == pytest.approx(expect, rel=1e-12)


def test_paper_proxies_identities() -> None:
    # Research note 3.4: L = 10, d = 640, B = 32, s = 66 gives M = 13,516,800, P = 81,920,000.
    p = paper_proxies(10, 640, 66, 32, tokens=1000)
    assert p["M"] == 13_516_800 and p["P"] == 81_920_000
    assert p["C"] == 81_920_000 * 1000


def test_comm_bytes_layouts() -> None:
    shape = TransformerShape(n_layer=2, n_embd=64, n_head=4, seq_len=16, batch_size=2)
    P = gpt_param_count(shape)
    assert comm_bytes(shape, Layout()) == 0
    assert comm_bytes(shape, Layout(dp=4)) == pytest.approx(2 * 3 / 4 * P * 4)  # ring all-reduce
    assert comm_bytes(shape, Layout(dp=4, fsdp=True)) == pytest.approx(3 * 3 / 4 * P * 2)
    tp = comm_bytes(shape, Layout(tp=2))
    assert tp == pytest.approx(4 * 2 * 2 * (1 / 2) * 2 * 16 * 64 * 2)
    assert comm_bytes(shape, Layout(pp=2)) == pytest.approx(2 * 2 * 16 * 64 * 2)
    # FSDP shards optimizer traffic, so per-device HBM bytes fall with more replicas.
    q1 = step_proxies(shape, Layout(dp=2, fsdp=True)).hbm_bytes
    q4 = step_proxies(shape, Layout(dp=4, fsdp=True)).hbm_bytes
    assert q4 < q1


def test_roofline_time_and_intensity() -> None:
    shape = TransformerShape(n_layer=24, n_embd=2048, n_head=16, seq_len=2048, batch_size=8)
    px = step_proxies(shape)
    h100 = DEVICE_PROFILES["h100-sxm"]
    t = roofline_time(px, h100)
    assert t == pytest.approx(max(px.flops / h100.peak_flops, px.hbm_bytes / h100.mem_bw))
    assert px.arithmetic_intensity > h100.peak_flops / h100.mem_bw  # compute-bound at this size
    assert roofline_time(px, h100, u_c=0.5, tau0=0.01) == pytest.approx(2 * t + 0.01)


def test_calibrated_cpu_profile_is_labelled() -> None:
    prof = calibrate_cpu_profile(seconds=0.2, n=128)
    assert prof.source.startswith("measured") and prof.peak_flops > 0 and prof.mem_bw > 0
