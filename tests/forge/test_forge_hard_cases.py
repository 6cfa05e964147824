"""The hard cases, handled loudly: clipping, accumulation, tied and reused weights, fp16,
autocast and loss scaling, Linear subclasses, param groups."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from frugaltrain.forge import ForgeOptimizer

# fp64 tolerance for the clipped runs: the two-pass norm sums squared tiles in another order than
# clip_grad_norm_'s norm of norms, so the clip coefficient differs in the last ulps.
CLIP_RTOL = 1e-12


def _max_rel(a, b) -> float:
    return max(
        ((p - q).abs().max() / p.abs().max()).item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def test_two_pass_clipping_equals_clip_grad_norm_then_adamw(kit):
    a = kit.make_gpt()
    b = kit.twin(a)
    ref = kit.reference("adamw", a, 3e-3)
    opt = ForgeOptimizer(
        b, kit.forge_groups(b, "adamw"), tile_rows=16, max_grad_norm=0.5, **kit.HYPER["adamw"]
    )
    clipped = 0
    for x, y in kit.batches(6):
        a(x, y)[1].backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.5)
        ref.step()
        ref.zero_grad()
        norm = opt.backward(b(x, y)[1])
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(norm.double(), ref_norm.double(), rtol=CLIP_RTOL, atol=0)
        clipped += int(ref_norm > 0.5)
    assert clipped >= 3  # the threshold really clips
    assert _max_rel(a, b) <= CLIP_RTOL


def test_plain_backward_with_clipping_trains_nothing_and_step_refuses(kit):
    """loss.backward() is not the optimizer's backward (with clipping or without): it leaves
    nn.Linear's gradients, which step() refuses to ignore silently; nothing moves."""
    b = kit.make_gpt()
    opt = ForgeOptimizer(b, max_grad_norm=1.0, lr=1e-3)
    before = _snapshot(b)
    x, y = kit.batches(1)[0]
    b(x, y)[1].backward()
    with pytest.raises(ValueError, match=r"not opt.backward\(loss\).*Nothing was updated"):
        opt.step()
    assert _unchanged(b, before) and not any(opt.state.values())


def test_non_finite_norm_skips_the_update_loudly():
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).double()
    opt = ForgeOptimizer(net, max_grad_norm=1.0, lr=1e-2)
    before = [p.clone() for p in net.parameters()]
    loss = net(torch.full((2, 4), float("inf"), dtype=torch.float64)).sum()
    with pytest.warns(UserWarning, match="update is skipped"):
        norm = opt.backward(loss)
    assert not torch.isfinite(norm) and opt.num_skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(before, net.parameters(), strict=True))


def test_second_backward_before_step_is_refused(kit):
    b = kit.make_gpt()
    opt = ForgeOptimizer(b, lr=1e-3)
    (x, y), (x2, y2) = kit.batches(2)
    opt.backward(b(x, y)[1])
    after_first = _snapshot(b)
    with pytest.raises(ValueError, match="accumulation_steps=K.*nothing was updated"):
        opt.backward(b(x2, y2)[1])
    assert _unchanged(b, after_first)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_accumulation_mode_equals_one_big_batch(kit, clip):
    a = kit.make_gpt()
    b = kit.twin(a)
    ref = kit.reference("adamw", a, 3e-3)
    opt = ForgeOptimizer(
        b,
        kit.forge_groups(b, "adamw"),
        tile_rows=16,
        accumulation_steps=2,
        max_grad_norm=clip,
        **kit.HYPER["adamw"],
    )
    for x, y in kit.batches(4):
        a(x, y)[1].backward()  # the big batch: mean over 2 x 16 tokens
        if clip:
            torch.nn.utils.clip_grad_norm_(a.parameters(), clip)
        ref.step()
        ref.zero_grad()
        for i in range(2):  # two micro-batches of one sequence; losses scaled by 1/K
            loss = b(x[i : i + 1], y[i : i + 1])[1] / 2
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
    assert _max_rel(a, b) <= 1e-12  # fp64: only the micro-batch summation order differs


def test_accumulation_mode_checks_the_micro_batch_count(kit):
    b = kit.make_gpt()
    opt = ForgeOptimizer(b, lr=1e-3, accumulation_steps=2)
    x, y = kit.batches(1)[0]
    opt.backward(b(x, y)[1])
    with pytest.raises(ValueError, match="accumulation_steps=2 but the parameters saw"):
        opt.step()


def test_tied_weights_fall_back_reported_and_exact(kit):
    a = kit.make_gpt(tie=True)
    b = kit.twin(a)
    ref = kit.reference("adamw", a, 3e-3)
    with pytest.warns(UserWarning, match="head.weight"):
        opt = ForgeOptimizer(b, kit.forge_groups(b, "adamw"), tile_rows=16, **kit.HYPER["adamw"])
    assert opt.fallback == {"head.weight": "tied or shared with another module"}
    for x, y in kit.batches(5):
        a(x, y)[1].backward()
        ref.step()
        ref.zero_grad()
        opt.backward(b(x, y)[1])
        opt.step()
        opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_reused_linear_is_refused():
    lin = nn.Linear(4, 4)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(self.lin(x))

    net = Twice()
    ForgeOptimizer(net, lr=1e-3)
    with pytest.raises(ValueError, match="ran forward twice before its backward"):
        net(torch.randn(2, 4))


def test_weight_used_outside_its_linear_is_refused_before_any_update():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = ForgeOptimizer(lin, lr=1e-3)
    before = _snapshot(lin)
    x = torch.randn(2, 4)
    loss = lin(x).sum() + torch.nn.functional.linear(x, lin.weight).sum()
    with pytest.raises(ValueError, match="also used outside its Linear.*by TBackward0.*n == ''"):
        opt.backward(loss)
    assert _unchanged(lin, before) and not any(opt.state.values())


class _EmbeddingTiedToHead(nn.Module):
    """The head's weight also serves as the embedding table through F.embedding: a functional
    use no module structure shows, visible only in the autograd graph."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, idx):
        return self.head(torch.relu(self.body(F.embedding(idx, self.head.weight))))


def _full_snapshot(model, opt) -> list[torch.Tensor]:
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return [t.detach().clone() for t in [*model.parameters(), *state]]


def test_functional_reuse_is_refused_before_the_first_tile():
    """The head is reached first in the backward; the refusal comes before it is updated, so
    weights and optimizer state stay bitwise as they were (one step taken before, so there is
    state to compare)."""
    torch.manual_seed(0)
    model = _EmbeddingTiedToHead()
    with pytest.warns(UserWarning, match="head.weight"):
        first = ForgeOptimizer(model, lr=1e-2, exclude=lambda n: n == "head")
    idx = torch.randint(0, 10, (3, 5))
    first.backward(model(idx).square().mean())  # excluded head: the hook takes the summed grad
    first.step()
    saved = copy.deepcopy(first.state_dict())
    first.remove()
    opt = ForgeOptimizer(model, lr=1e-2)  # the head fused: the forward's F.embedding is unseen
    opt.load_state_dict(saved)
    before = _full_snapshot(model, opt)
    with pytest.raises(ValueError, match="'head.weight' is also used outside.*EmbeddingBackward0"):
        opt.backward(model(idx).square().mean())
    after = _full_snapshot(model, opt)
    assert len(after) == len(before) and all(map(torch.equal, before, after))


def test_layer_twice_in_one_graph_is_refused_before_any_update():
    """A forward, an input-gradient pass (which ends that forward's backward), another forward:
    both outputs in one loss put the layer in the graph twice."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = ForgeOptimizer(lin, lr=1e-2)
    x = torch.randn(2, 4, requires_grad=True)
    out1 = lin(x)
    torch.autograd.grad(out1.sum(), x, retain_graph=True)
    out2 = lin(x)
    before = [p.detach().clone() for p in lin.parameters()]
    with pytest.raises(ValueError, match="'' appears twice in this loss's graph"):
        opt.backward(out1.sum() + out2.sum())
    assert all(map(torch.equal, before, lin.parameters())) and not any(opt.state.values())


def test_fp16_weights_are_refused():
    with pytest.raises(ValueError, match="float16.*Use bf16 or fp32"):
        ForgeOptimizer(nn.Linear(4, 4).half(), lr=1e-3)


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop:FutureWarning")
@pytest.mark.parametrize("autocast", [False, True])
def test_grad_scaler_is_refused_before_any_update(kit, autocast):
    """The AMP recipe (fp16 autocast + GradScaler) stops in the forward; a scaler on a model
    without autocast stops in scaler.scale(loss). Either way before the backward: no weight and
    no optimizer state is touched."""
    model = kit.make_gpt(torch.float32, n_layer=1)
    opt = ForgeOptimizer(model, kit.forge_groups(model, "adamw"), **kit.HYPER["adamw"])
    before = _snapshot(model)
    scaler = torch.amp.GradScaler("cpu")
    ((x, y),) = kit.batches(1)
    if autocast:
        with pytest.raises(ValueError, match="autocast.*no weight was updated"):
            with torch.autocast("cpu", dtype=torch.float16):
                scaler.scale(model(x, y)[1]).backward()
    else:
        loss = model(x, y)[1]
        with pytest.raises(ValueError, match="GradScaler.*no weight was updated"):
            scaler.scale(loss).backward()
        del loss
    assert _unchanged(model, before)
    assert not any(opt.state.values())
    opt.step()  # the optimizer is still usable without the scaler
    opt.backward(model(x, y)[1])
    opt.step()
    assert not _unchanged(model, before)


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop:FutureWarning")
def test_grad_scaler_elsewhere_is_untouched():
    """The scale() guard refuses only losses that reach FORGE parameters."""
    ForgeOptimizer(nn.Linear(4, 4), lr=1e-3)
    other = nn.Linear(4, 4)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(other(torch.randn(2, 4)).sum()).backward()
    assert other.weight.grad is not None


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop:FutureWarning")
def test_grad_scaler_step_still_refuses():
    """Last line: a scaler whose scale() was bypassed is refused in step()."""
    lin = nn.Linear(4, 4)
    opt = ForgeOptimizer(lin, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))  # as scale() would
    with pytest.raises(ValueError, match="GradScaler"):
        scaler.step(opt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_is_refused_in_the_forward(kit, dtype):
    model = kit.make_gpt(torch.float32, n_layer=1)
    ForgeOptimizer(model, kit.forge_groups(model, "adamw"), **kit.HYPER["adamw"])
    before = _snapshot(model)
    ((x, y),) = kit.batches(1)
    with pytest.raises(ValueError, match=r"torch.autocast.*model.to\(torch.bfloat16\)"):
        with torch.autocast("cpu", dtype=dtype):
            model(x, y)[1].backward()
    assert _unchanged(model, before)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        model(x, y)  # inference under autocast is not a FORGE step: allowed


def test_bad_arguments_name_the_option():
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="rule='adam' is unknown"):
        ForgeOptimizer(lin, rule="adam")
    with pytest.raises(ValueError, match=r"\['momentum'\] are not hyperparameters of rule 'adamw'"):
        ForgeOptimizer(lin, momentum=0.9)
    with pytest.raises(ValueError, match="states='int4' is unknown"):
        ForgeOptimizer(lin, states="int4")


def test_second_optimizer_on_the_same_model_is_refused_until_remove():
    lin = nn.Linear(4, 4)
    opt = ForgeOptimizer(lin, lr=1e-3)
    with pytest.raises(ValueError, match="already belong to another ForgeOptimizer"):
        ForgeOptimizer(lin, lr=1e-3)
    opt.remove()
    ForgeOptimizer(lin, lr=1e-3)


def test_dropped_model_and_optimizer_are_freed():
    """Nothing global keeps a trained model alive (the GPU benchmark ran out of memory when the
    owner registry held optimizers strongly: every model built in the process stayed)."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = ForgeOptimizer(model, lr=1e-3)
    opt.backward(model(torch.randn(3, 8)).sum())
    opt.step()
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(model[0].weight)]
    del model, opt
    gc.collect()
    assert all(r() is None for r in refs)


class _PlainSubclass(nn.Linear):
    """Keeps nn.Linear.forward: fused like nn.Linear."""


class _OwnForward(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 0.5


def _train_pair(net_a, net_b, make_opt, steps=3):
    ref = torch.optim.AdamW(net_a.parameters(), lr=1e-2, foreach=False)
    opt = make_opt(net_b)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(4, 3, 8, generator=g, dtype=torch.float64)
        net_a(x).square().sum().backward()
        ref.step()
        ref.zero_grad()
        opt.backward(net_b(x).square().sum())
        opt.step()
        opt.zero_grad()
    return opt


def test_linear_subclasses_fused_or_reported():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), _PlainSubclass(8, 8), _OwnForward(8, 8)).double()
    b = copy.deepcopy(a)
    with pytest.warns(UserWarning, match="_OwnForward overrides nn.Linear.forward"):
        opt = _train_pair(a, b, lambda m: ForgeOptimizer(m, lr=1e-2))
    assert {h.name for h in opt._handles} == {"0", "1"}
    assert opt.fallback == {"2.weight": "_OwnForward overrides nn.Linear.forward"}
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_multihead_attention_out_proj_falls_back_reported():
    """out_proj is a NonDynamicallyQuantizableLinear (a subclass) that MHA uses functionally."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(self.mha(x, x, x, need_weights=False)[0])

    torch.manual_seed(0)
    a = Attn().double()
    b = copy.deepcopy(a)
    with pytest.warns(UserWarning, match="mha.out_proj.weight"):
        opt = _train_pair(a, b, lambda m: ForgeOptimizer(m, lr=1e-2))
    assert opt.fallback == {"mha.out_proj.weight": "used functionally by nn.MultiheadAttention"}
    assert [h.name for h in opt._handles] == ["proj"]
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_add_param_group_installs_fusion_and_hooks():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)).double()
    b = copy.deepcopy(a)
    ref = torch.optim.AdamW(a[0].parameters(), lr=1e-2, foreach=False)
    ref.add_param_group({"params": list(a[1:].parameters()), "lr": 3e-3, "weight_decay": 0.0})
    opt = ForgeOptimizer(b, b[0].parameters(), lr=1e-2)
    opt.add_param_group({"params": list(b[1:].parameters()), "lr": 3e-3, "weight_decay": 0.0})
    assert [h.name for h in opt._handles] == ["0", "2"]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        a(x).square().sum().backward()
        ref.step()
        ref.zero_grad()
        opt.backward(b(x).square().sum())
        opt.step()
        opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not any(p.grad is not None for p in b.parameters())
    sd = opt.state_dict()
    assert sorted(sd["state"]) == list(range(6))
    assert [len(g["params"]) for g in sd["param_groups"]] == [2, 4]


def test_add_param_group_refusals_leave_the_optimizer_unchanged():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = ForgeOptimizer(net, net[0].parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        opt.add_param_group({"params": [net[0].weight]})
    other = nn.Linear(4, 4)
    ForgeOptimizer(other, lr=1e-3)
    with pytest.raises(ValueError, match="already belong to another ForgeOptimizer"):
        opt.add_param_group({"params": list(other.parameters())})
    half = nn.Linear(4, 4).half()
    with pytest.raises(ValueError, match="float16"):
        opt.add_param_group({"params": list(half.parameters())})
    assert len(opt.param_groups) == 1 and len(opt._params) == 2
