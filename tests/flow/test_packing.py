"""Packing: BFD against a naive reference, packed vs unpacked, plan-independence of the loss."""

import itertools
import random

import pytest
import torch

from frugaltrain.flow import load_flow_config
from frugaltrain.flow.data import DigitCaptions, build_dataset
from frugaltrain.flow.models import build_models
from frugaltrain.flow.packing import (
    dispatch,
    fit_cost,
    pack_bfd,
    pack_bfd_naive,
    pack_fifo,
    paper_cost,
)
from frugaltrain.flow.runtime import make_plans, run_monolithic


def random_lengths(seed: int) -> tuple[dict[int, int], int]:
    r = random.Random(seed)
    L = r.randint(16, 120)
    return {i: r.randint(1, L) for i in range(r.randint(1, 60))}, L


@pytest.mark.parametrize("seed", range(100))
def test_bfd_segment_tree_matches_naive(seed: int) -> None:
    lengths, L = random_lengths(seed)
    fast, slow = pack_bfd(lengths, L), pack_bfd_naive(lengths, L)
    fill = lambda bins: sorted(sum(lengths[s] for s in b) for b in bins)  # noqa: E731
    # Bins with equal free space are interchangeable, so compare fill levels, not ids.
    assert fill(fast) == fill(slow)
    for bins in (fast, pack_fifo(lengths, L)):
        assert sorted(s for b in bins for s in b) == sorted(lengths)  # each placed once
        assert all(sum(lengths[s] for s in b) <= L for b in bins)


def test_oversized_sample_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="sched.capacity"):
        pack_bfd({0: 10, 1: 200}, 100)


def test_lpt_within_four_thirds_of_optimal() -> None:
    for seed in range(30):
        r = random.Random(seed)
        costs = [r.uniform(0.1, 2.0) for _ in range(r.randint(2, 8))]
        ranks = r.randint(2, 3)
        opt = min(
            max(sum(c for c, a in zip(costs, assign, strict=True) if a == k) for k in range(ranks))
            for assign in itertools.product(range(ranks), repeat=len(costs))
        )
        for how in ("snake", "lpt", "round_robin"):
            out = dispatch(costs, ranks, how)
            assert sorted(j for js in out for j in js) == list(range(len(costs)))
        lpt = max(sum(costs[j] for j in js) for js in dispatch(costs, ranks, "lpt"))
        assert lpt <= 4 / 3 * opt + 1e-12


def test_cost_fit_recovers_a_quadratic_model() -> None:
    r = random.Random(0)
    bins = [[r.randint(5, 80) for _ in range(r.randint(1, 5))] for _ in range(60)]
    secs = [1e-4 * sum(b) + 2e-6 * sum(x * x for x in b) + 1e-3 for b in bins]
    fit = fit_cost(bins, secs, 160)
    assert fit.best == "fitted" and fit.r2["fitted"] > 0.999
    assert fit.seconds(bins[0], 160) == pytest.approx(secs[0], rel=1e-6)
    assert paper_cost([80, 40], 160) == pytest.approx(120 / 160 + 80**2 / 160**2)


# The tiny modules, and the transformers ones (whose Llama builds the block-diagonal mask itself
# from position ids that restart per sample).
TINY = ["run.dtype='float64'"]
HF = TINY + [
    "data.source='shapes'",
    "data.patch=16",
    "model.encoder='vit'",
    "model.backbone='llama'",
    "model.enc_dim=32",
    "model.lm_dim=32",
    "model.lm_kv_heads=2",
]


@pytest.mark.parametrize("sets", [TINY, HF], ids=["tiny", "transformers"])
def test_packed_equals_unpacked_loss_and_gradients(sets) -> None:
    """Block-diagonal mask + per-sample positions: packing is invisible to the maths (float64,
    allclose only because the packed attention sums over masked zeros in another order)."""
    cfg = load_flow_config(None, sets)
    ds = build_dataset(cfg)
    enc, cons = build_models(cfg, ds)
    samples = ds.batch(0)[:5]
    assert len({s.n_visual for s in samples}) > 1  # samples of several visual lengths
    texts = [torch.tensor(s.tokens) for s in samples]
    with torch.no_grad():
        base = [enc(ds.encoder_input([s.sample_id], torch.float64))[0] for s in samples]

    def loss_and_grads(groups):
        cons.zero_grad(set_to_none=True)
        embs = [e.clone().requires_grad_(True) for e in base]
        total = sum(cons.loss_sum([embs[i] for i in g], [texts[i] for i in g]) for g in groups)
        total.backward()
        grads = [p.grad.clone() for p in cons.parameters()] + [e.grad for e in embs]
        return total.detach(), grads

    packed = loss_and_grads([[0, 1, 2], [3, 4]])
    unpacked = loss_and_grads([[i] for i in range(5)])
    torch.testing.assert_close(packed[0], unpacked[0], rtol=1e-12, atol=0)
    for a, b in zip(packed[1], unpacked[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_plan_never_changes_the_result() -> None:
    """BFD vs FIFO, one vs two backbone ranks: same parameters (global-token normalisation)."""
    states = []
    for sets in (["sched.policy='bfd'"], ["sched.policy='fifo'"], ["run.consumers=2"]):
        cfg = load_flow_config(
            None,
            [
                "run.dtype='float64'",
                "run.steps=2",
                "run.mono_threads=1",
                "run.optimizer='sgd'",
                "data.global_batch=8",
                *sets,
            ],
        )
        states.append(run_monolithic(cfg, make_plans(cfg, DigitCaptions.from_config(cfg))))
    for other in states[1:]:
        for k, v in states[0].cons_state.items():
            torch.testing.assert_close(other.cons_state[k], v, rtol=1e-10, atol=1e-13)
