"""Sparse pseudo-gradients: chunked top-k against a NumPy reference, bit packing, honest byte
counts, error feedback's conservation law, top-k of everything being bitwise the dense method,
and the residual in checkpoints (exact resume) and on rejoin (dropped)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from frugaltrain.codecs import compress
from frugaltrain.codecs.feedback import ErrorFeedback
from frugaltrain.comm import LocalComm
from frugaltrain.comm.base import encode_own
from frugaltrain.config import to_toml
from frugaltrain.metrics.log import read_metrics
from frugaltrain.models import build_model
from frugaltrain.outer import build_strategy
from frugaltrain.sim import SimSection, simulate
from frugaltrain.train import checkpoint
from frugaltrain.train.launch import new_run_dir, prepare, run

SPARSE = ("topk:0.01", "topk:0.1", "topk:0.01+2bit", "topk:0.3+2bit", "topk:1")


def _reference_topk(x: np.ndarray, fraction: float) -> np.ndarray:
    """Keep the ceil(fraction * CHUNK) largest |x| of every chunk, zero the rest (float64)."""
    k = int(np.ceil(fraction * compress.CHUNK))
    out = np.zeros_like(x)
    for start in range(0, len(x), compress.CHUNK):
        chunk = x[start : start + compress.CHUNK]
        keep = np.argsort(-np.abs(chunk), kind="stable")[:k]
        out[start + keep] = chunk[keep]
    return out


@pytest.mark.parametrize("numel", [1, 4095, 4096, 10_000])
@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.25, 1.0])
def test_topk_equals_numpy_reference(numel, fraction):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    got = compress.roundtrip(x, f"topk:{fraction}")
    np.testing.assert_array_equal(got.numpy(), _reference_topk(x.numpy(), fraction))


@pytest.mark.parametrize("bits", [1, 2, 5, 12])
def test_bit_packing_round_trips(bits):
    values = torch.randint(0, 2**bits, (1001,), generator=torch.Generator().manual_seed(bits))
    packed = compress.pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-1001 * bits // 8)
    assert torch.equal(compress.unpack_bits(packed, bits, 1001), values)


def test_two_bit_values_are_a_sign_and_one_of_two_chunk_levels():
    x = torch.randn(3 * compress.CHUNK, generator=torch.Generator().manual_seed(0))
    kept = compress.roundtrip(x, "topk:0.05")
    got = compress.roundtrip(x, "topk:0.05+2bit")
    assert torch.equal(got != 0, kept != 0)  # the same positions
    for c in range(3):
        chunk = slice(c * compress.CHUNK, (c + 1) * compress.CHUNK)
        v = kept[chunk][kept[chunk] != 0].double()
        mag, q = v.abs(), got[chunk][kept[chunk] != 0].double()
        large = mag >= (mag.min() + mag.max()) / 2
        want = torch.where(large, mag[large].mean(), mag[~large].mean()) * v.sign()
        torch.testing.assert_close(q, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("codec", SPARSE)
def test_wire_bytes_count_what_is_sent(codec):
    parts = compress.encode(torch.randn(10_000), codec)
    assert sum(p.numel() * p.element_size() for p in parts) == compress.wire_bytes(10_000, codec)


def test_a_hundredth_in_two_bits_is_over_a_hundred_times_smaller():
    n = 1_000_000
    assert 4 * n / compress.wire_bytes(n, "topk:0.01+2bit") > 100


@pytest.mark.parametrize("codec", ["topk:0.01+2bit", "2bit", "1bit"])
def test_error_feedback_conserves_the_sum_of_pseudo_gradients(codec):
    """With decay 1, everything sent plus the residual equals everything there was to send."""
    gen = torch.Generator().manual_seed(1)
    fb, sent_total, pg_total = ErrorFeedback(1.0), torch.zeros(9000), torch.zeros(9000)
    for _ in range(20):
        delta = torch.randn(9000, generator=gen)
        sent, parts = encode_own([delta.view(90, 100)], codec, fb)
        assert torch.equal(sent, compress.decode(parts, codec, 9000))
        sent_total += sent
        pg_total += delta
    torch.testing.assert_close(sent_total + fb.residual, pg_total, rtol=0, atol=1e-4)
    assert fb.residual.norm() > 0


def test_no_feedback_with_decay_zero():
    fb = ErrorFeedback(0.0)
    encode_own([torch.randn(5000)], "topk:0.01", fb)
    assert fb.residual is None and fb.norm() == 0.0


def _params(result) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in m.parameters()] for m in result.models]


@pytest.mark.parametrize(
    "sets",
    [
        ("outer.strategy='diloco'",),
        ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'"),
        ("outer.strategy='streaming'", "outer.streaming.fragments=2", "model.n_layer=2"),
        ("outer.strategy='noloco'",),
    ],
    ids=["diloco", "fgd", "streaming", "noloco"],
)
def test_topk_of_everything_is_bitwise_the_dense_method(make_config, tmp_path, sets):
    runs = {}
    for codec in ("fp32", "topk:1"):
        cfg = make_config(*sets, "run.workers=3", f"outer.codec='{codec}'")
        runs[codec] = simulate(cfg, SimSection(ratio=0.5), tmp_path / codec.replace(":", ""))
    for a, b in zip(_params(runs["fp32"]), _params(runs["topk:1"]), strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_simulated_bytes_are_the_encoded_bytes(make_config, tmp_path):
    """DiLoCo with a sparse codec gathers every worker's encoded payload: (M - 1) copies."""
    cfg = make_config("run.workers=3", "outer.codec='topk:0.01+2bit'")
    result = simulate(cfg, SimSection(ratio=0.5), tmp_path / "sim")
    numel = sum(p.numel() for p in result.models[0].parameters())
    rounds = [r for r in result.records if r.get("kind") == "round"]
    per_round = compress.wire_bytes(numel, "topk:0.01+2bit") * 2
    assert [r["comm/bytes_sent"] for r in rounds] == [per_round] * len(rounds)
    assert all(
        len(r["peer/feedback_norm"]) == 3 and min(r["peer/feedback_norm"]) > 0 for r in rounds
    )
    assert 4 * numel * 2 / per_round > 20  # far below the same gather in fp32


def _residuals(feedback: dict) -> list[torch.Tensor]:
    """An operation's residuals in a checkpoint: its own coding's, and its chunk mean's."""
    return [feedback["residual"]] + ([feedback["mean"]["residual"]] if "mean" in feedback else [])


@pytest.mark.parametrize(
    "strategy, codec, average",
    [
        ("diloco", "topk:0.05", "all_gather"),
        ("fgd", "topk:0.05", "all_gather"),
        ("diloco", "2bit", "reduce_scatter"),  # a second residual: the chunk mean's coding
    ],
)
def test_error_feedback_resumes_exactly_and_is_dropped_on_rejoin(
    make_config, strategy, codec, average
):
    sets = (
        f"outer.strategy='{strategy}'",
        f"outer.codec='{codec}'",
        f"outer.coded_average='{average}'",
        "run.workers=2",
        "run.steps=24",
        "run.checkpoint_every=1",
    )
    if strategy == "fgd":
        sets += ("outer.fgd.preset='GlobalM1LocalM2'",)
    full = make_config(*sets, "run.name=full")
    full_dir = new_run_dir(full)
    (full_dir / "config.toml").write_text(to_toml(full))
    run(full, full_dir)
    part = make_config(*sets, "run.name=part", "run.stop_at_round=2")
    part_dir = new_run_dir(part)
    (part_dir / "config.toml").write_text(to_toml(part))
    run(part, part_dir)
    cfg, run_dir, ckpt = prepare(None, [], str(part_dir))
    run(cfg, run_dir, ckpt)

    states = []
    for d in (full_dir, part_dir):
        last = checkpoint.latest_complete(d)
        states.append([torch.load(last / f"worker_{r}.pt", weights_only=False) for r in range(2)])
    for a, b in zip(*states, strict=True):
        for key, value in a["model"].items():
            assert torch.equal(value, b["model"][key]), key
        fa, fb = a["outer"]["feedback"], b["outer"]["feedback"]
        assert fa.keys() == fb.keys() and fa
        for op in fa:
            assert len(_residuals(fa[op])) == (2 if average == "reduce_scatter" else 1)
            for x, y in zip(_residuals(fa[op]), _residuals(fb[op]), strict=True):
                assert x.norm() > 0 and torch.equal(x, y)

    rounds = [r for r in read_metrics(full_dir / "metrics.jsonl") if r["kind"] == "round"]
    if strategy == "diloco":  # real gloo processes count the same encoded bytes
        numel = sum(p.numel() for p in build_model(full).parameters())
        wire = compress.wire_bytes(numel, codec)
        if average == "reduce_scatter":  # a chunk each way: 2 (n - 1) chunks at n = 2
            wire = 2 * compress.wire_bytes(compress.chunk_numel(numel, 2), codec)
        assert [r["comm/bytes_sent"] for r in rounds] == [wire] * len(rounds)
    last = rounds[-1]
    for rank, state in enumerate(states[0]):  # the logged norm is the checkpointed residuals'
        norms = [
            x.double().norm() ** 2
            for fb in state["outer"]["feedback"].values()
            for x in _residuals(fb)
        ]
        assert last["peer/feedback_norm"][rank] == pytest.approx(float(sum(norms) ** 0.5))

    strat = build_strategy(full, build_model(full), LocalComm())
    strat.load_state_dict(states[0][0]["outer"], own=True)
    assert strat.feedback_norm() > 0
    strat.load_state_dict(states[0][0]["outer"], own=False)  # a rejoining worker's view
    assert strat.feedback_norm() == 0
