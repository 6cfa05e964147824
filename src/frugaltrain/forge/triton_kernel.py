"""Triton kernel: one program per (BV x BH) tile of W computes dW in fp32 registers, then the rule.

The whole token reduction stays inside one program (no split-K: partial sums would need a
cross-program reduction before the non-linear update). W and the states are read and written
once per element; the full dW never reaches memory. The rule is the same function as the torch
path's (rules.py), rebound to the Triton helpers below and jitted.

Runs on CUDA GPUs, and on CPU tensors under TRITON_INTERPRET=1 (set before importing triton),
which CI uses for correctness. fp32 dot products use input_precision="ieee" (no TF32), so the
kernel matches the torch path to rounding. Divisions and square roots are Triton's fast ones on a
GPU (exact under the interpreter): the IEEE-rounded tl.div_rn / tl.sqrt_rn were measured on an
H100 to change the 20-step AdamW parity only from 5.9e-7 to 5.5e-7 but to slow the kernel by
4-16% at 512 tokens, so they are not used.

States are fp32, bf16 (loaded to fp32, stored with stochastic rounding from the same Philox call
as a bf16 weight's: one `tl.randint4x` gives the three streams), or 8-bit codes. The launch is
one kernel per layer whatever the number of tiles (the grid covers them all), so its host cost
does not grow with the layer's size.

Shapes: BT tokens, V out_features (rows of W), H in_features; BV x BH a W tile, BK a token block.
    dy_BTV (512, 4096) fp32   x_BTH (512, 1024) fp32   w_VH (4096, 1024) fp32 or bf16
"""

from __future__ import annotations

import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - exercised only where triton is missing
    raise ImportError(
        "FORGE backend='triton' needs the triton package (pip install triton, or the "
        "frugaltrain[triton] extra); backend='torch' works without it"
    ) from e

from frugaltrain.forge.precision import QBLOCK
from frugaltrain.forge.rules import RULES, Rule


@triton.jit
def _lerp(a, b, weight):
    # torch's lerp formula, chosen by the weight as on CPU and CUDA
    if weight < 0.5:
        out = a + weight * (b - a)
    else:
        out = b - (b - a) * (1 - weight)
    return out


@triton.jit
def _addcmul(a, b, c, value):
    return a + value * b * c


@triton.jit
def _addcdiv(a, b, c, value):
    return a + value * (b / c)


@triton.jit
def _add(a, b, alpha):
    return a + alpha * b


@triton.jit
def _sign(a):
    return tl.where(a > 0, 1.0, tl.where(a < 0, -1.0, 0.0))


@triton.jit
def _sqrt(a):
    return tl.sqrt(a)


_HELPERS = {
    "_lerp": _lerp,
    "_addcmul": _addcmul,
    "_addcdiv": _addcdiv,
    "_add": _add,
    "_sign": _sign,
    "_sqrt": _sqrt,
    "tl": tl,
}


def _jit_rule(rule: Rule):
    """The rule's own code object, with the Triton helpers as its globals, jitted."""
    fn = types.FunctionType(rule.update.__code__, dict(_HELPERS), rule.update.__name__)
    fn.__module__ = rule.update.__module__
    fn.__qualname__ = rule.update.__qualname__
    return triton.jit(fn)


_TL_RULES = {name: _jit_rule(rule) for name, rule in RULES.items()}


@triton.jit
def _dequant(q_ptr, sc_ptr, idx, sidx, mask, row_mask, SIGNED: tl.constexpr):
    """8-bit codes -> fp32, as precision.dequantize (zero code of a sqrt state: half a step)."""
    q = tl.load(q_ptr + idx, mask=mask, other=0).to(tl.float32)
    scale = tl.load(sc_ptr + sidx, mask=row_mask, other=0.0)
    if SIGNED:
        x = q * scale[:, None]
    else:
        r = tl.maximum(q, 0.5) * scale[:, None]
        x = r * r
    return x


@triton.jit
def _round_half_even(t):
    """torch.round of an fp32 tile: to nearest, ties to even (libdevice rint is not available
    under the interpreter). floor(t + 0.5) would round ties up, and t + 0.5 itself rounds for
    some t (0.49999997 + 0.5 == 1.0 in fp32). Here a = |t|, f = floor(a), and d = a - f is
    exact (f == 0, or f >= a / 2 and Sterbenz), so ties are detected exactly."""
    a = tl.abs(t)
    f = tl.floor(a)
    d = a - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    return tl.where(t < 0, -r, r)


@triton.jit
def _requant(x, q_ptr, sc_ptr, idx, sidx, mask, row_mask, SIGNED: tl.constexpr):
    """fp32 tile -> 8-bit codes and one absmax scale per row of the tile (= one block).

    Rounds exactly as precision.quantize: IEEE division and square root (tl.div_rn, tl.sqrt_rn:
    Triton's default ones are approximate on a GPU) and ties to even, so the same fp32 tile gives
    the same codes and scales on both paths (tests/forge/test_forge_triton_interpret.py).
    """
    if SIGNED:
        qmax = 127.0
        y = x
    else:
        qmax = 255.0
        y = tl.sqrt_rn(tl.maximum(x, 0.0))
    scale = tl.div_rn(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1), qmax)
    safe = tl.where(scale > 0, scale, 1.0)
    q = _round_half_even(tl.div_rn(y, safe[:, None]))
    q = tl.minimum(tl.maximum(q, -qmax if SIGNED else 0.0), qmax)
    tl.store(q_ptr + idx, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(sc_ptr + sidx, scale, mask=row_mask)


@triton.jit
def _round_bf16(x, noise, SR: tl.constexpr):
    """fp32 tile -> the fp32 value of its bf16 store. SR: add a uniform 16-bit integer below the
    kept bits and truncate (unbiased); otherwise round to nearest even. NaNs pass through."""
    if SR:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (noise & 0xFFFF)) & 0xFFFF0000
        out = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        out = x.to(tl.bfloat16).to(tl.float32)
    return out


# Over the 80-line limit the rest of the code keeps: 36 of its lines are the launch arguments,
# one per line with its shape; the body (about 50 lines) is one tile's K loop, then the update of
# that tile while its weight gradient is still in registers.
@triton.jit
def _fused_wgrad_kernel(
    dy_ptr,  # (BT, V) fp32, or bf16 when X is bf16; row-major
    x_ptr,  # (BT, H) same dtype as dY, row-major
    w_ptr,  # (V, H) fp32 or bf16, row-major; updated in place
    s1_ptr,  # (V, H) fp32 or bf16 state, or its 8-bit codes when Q8
    s2_ptr,  # (V, H) second state (unused when NUM_STATES == 1)
    sc1_ptr,  # (V, NB) fp32 block scales of s1 when Q8 (NB = cdiv(H, BH), BH == QBLOCK)
    sc2_ptr,  # (V, NB) block scales of s2 when Q8
    sumsq_ptr,  # (num tiles,) fp32: per-tile sum of squares (MODE == 1)
    BT,
    V,
    H,
    NB,
    coef,  # gradient scale (clip coefficient)
    h0,
    h1,
    h2,
    h3,
    h4,
    h5,
    h6,
    h7,
    seed,
    RULE: tl.constexpr,
    NUM_STATES: tl.constexpr,
    MODE: tl.constexpr,  # 0: update, 1: sum of squares only
    SR: tl.constexpr,  # stochastic rounding of bf16 stores (else round to nearest even)
    BF16W: tl.constexpr,  # the weight is stored in bf16
    BF16S: tl.constexpr,  # the states are stored in bf16
    Q8: tl.constexpr,  # 8-bit states, one scale per (row, BH columns)
    SIGNED1: tl.constexpr,  # s1 is signed (int8 absmax codes) or non-negative (sqrt, uint8)
    SIGNED2: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 products ("ieee", no TF32)
    BV: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_v = pid_v * BV + tl.arange(0, BV)
    offs_h = pid_h * BH + tl.arange(0, BH)
    acc = tl.zeros((BV, BH), dtype=tl.float32)
    for k0 in range(0, BT, BK):
        offs_k = k0 + tl.arange(0, BK)
        # dY^T block (BV, BK): a transposed view by index arithmetic, no copy
        a = tl.load(
            dy_ptr + offs_k[None, :] * V + offs_v[:, None],
            mask=(offs_k[None, :] < BT) & (offs_v[:, None] < V),
            other=0.0,
        )
        b = tl.load(
            x_ptr + offs_k[:, None] * H + offs_h[None, :],
            mask=(offs_k[:, None] < BT) & (offs_h[None, :] < H),
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:  # bf16 x bf16 products are exact in fp32; tensor cores accumulate in fp32
            acc = tl.dot(a, b, acc)
    g = acc * coef
    mask = (offs_v[:, None] < V) & (offs_h[None, :] < H)
    if MODE == 1:
        tile = pid_v * tl.num_programs(1) + pid_h
        tl.store(sumsq_ptr + tile, tl.sum(tl.where(mask, g * g, 0.0)))
    else:
        idx = offs_v[:, None] * H + offs_h[None, :]
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if Q8:
            sidx = offs_v * NB + pid_h
            s1 = _dequant(s1_ptr, sc1_ptr, idx, sidx, mask, offs_v < V, SIGNED1)
            s2 = _dequant(s2_ptr, sc2_ptr, idx, sidx, mask, offs_v < V, SIGNED2)
        else:
            s1 = tl.load(s1_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(s2_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        w, s1, s2 = RULE(w, g, s1, s2, h0, h1, h2, h3, h4, h5, h6, h7)
        if SR:  # one Philox call: the rounding streams of the weight, s1 and s2 of this element
            r_w, r_s1, r_s2, _ = tl.randint4x(seed, idx)
        else:
            r_w, r_s1, r_s2 = idx, idx, idx  # unused: round to nearest
        if Q8:
            _requant(s1, s1_ptr, sc1_ptr, idx, offs_v * NB + pid_h, mask, offs_v < V, SIGNED1)
            if NUM_STATES == 2:
                _requant(s2, s2_ptr, sc2_ptr, idx, offs_v * NB + pid_h, mask, offs_v < V, SIGNED2)
        else:
            if BF16S:
                s1 = _round_bf16(s1, r_s1, SR)
                s2 = _round_bf16(s2, r_s2, SR)
            tl.store(s1_ptr + idx, s1.to(s1_ptr.dtype.element_ty), mask=mask)
            if NUM_STATES == 2:
                tl.store(s2_ptr + idx, s2.to(s2_ptr.dtype.element_ty), mask=mask)
        if BF16W:
            w = _round_bf16(w, r_w, SR)
        tl.store(w_ptr + idx, w.to(w_ptr.dtype.element_ty), mask=mask)


def default_block(dtype: torch.dtype, q8: bool, tokens: int) -> tuple[int, ...]:
    """(BV, BH, BK, num_warps, num_stages) for a layer whose activations have `dtype`.

    Measured on an H100 (docs/forge.md, benchmarks/forge_gpu.py): 64 x 64 x 32 is the fastest
    of the tiles tried at 512 tokens in fp32 and bf16; with bf16 at 4096 tokens 64 x 128 x 64
    runs 1.7x faster. BH stays QBLOCK for 8-bit states (one quantization block per tile row).
    """
    if dtype == torch.bfloat16 and not q8 and tokens >= 2048:
        return (64, 128, 64, 4, 3)
    return (64, 64, 32, 4, 3)


# The tiles the autotuner times: (BV, BH, BK, num_warps, num_stages). The first is the default;
# 8-bit states keep only the QBLOCK-wide ones (one quantization block per tile row).
CANDIDATES = (
    (64, 64, 32, 4, 3),
    (64, 128, 64, 4, 3),
    (128, 64, 32, 4, 3),
    (128, 128, 32, 8, 3),
    (64, 64, 64, 4, 4),
    (32, 64, 32, 2, 3),
)
_TUNED: dict[tuple, tuple] = {}  # (layer shape, dtypes, rule, state format) -> fastest tile


def tuned_block(dy_BTV, x_BTH, w, state, rule: Rule, scalars, timer=None) -> tuple[int, ...]:
    """The fastest candidate tile for this layer, timed once per (V, H, tokens, dtypes, rule,
    state format) and cached. Each candidate runs on copies of W and its states, so the real
    ones are untouched. `timer(run) -> seconds`; on a GPU, triton.testing.do_bench. Without a
    GPU and without a timer (the interpreter, where timing means nothing) the default tile.
    """
    q8 = any(k.endswith("_scale") for k in state)
    key = (*w.shape, x_BTH.shape[0], dy_BTV.dtype, x_BTH.dtype, w.dtype, rule.name)
    key += tuple((k, v.dtype) for k, v in sorted(state.items()) if torch.is_tensor(v))
    if key in _TUNED:
        return _TUNED[key]
    if timer is None and not w.is_cuda:
        return default_block(x_BTH.dtype, q8, x_BTH.shape[0])
    if timer is None:
        timer = lambda run: triton.testing.do_bench(run, warmup=5, rep=20)  # noqa: E731
    candidates = [c for c in CANDIDATES if not q8 or c[1] == QBLOCK]
    times = []
    for block in candidates:
        w_copy = w.clone()
        s_copy = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        times.append(
            timer(
                lambda b=block, wc=w_copy, sc=s_copy: fused_linear_update(
                    dy_BTV, x_BTH, wc, sc, rule, scalars, 1.0, None, b
                )
            )
        )
    _TUNED[key] = candidates[min(range(len(times)), key=times.__getitem__)]
    return _TUNED[key]


def _launch(dy_BTV, x_BTH, w, s, sc, sumsq, rule, scalars, coef, seed, mode, block):
    BV, BH, BK = block[:3]
    opts = dict(zip(("num_warps", "num_stages"), block[3:], strict=False))
    if dy_BTV.is_cuda and dy_BTV.dtype == x_BTH.dtype == torch.bfloat16:
        # bf16 dot, fp32 accumulator. Not under the interpreter (CPU tensors): its bf16 dot
        # returns garbage (Triton 3.9), so there both are up-cast like any other dtype.
        dy_BTV, x_BTH = dy_BTV.contiguous(), x_BTH.contiguous()
    else:
        dy_BTV, x_BTH = dy_BTV.float().contiguous(), x_BTH.float().contiguous()
    BT, V = dy_BTV.shape
    H = x_BTH.shape[1]
    grid = (triton.cdiv(V, BV), triton.cdiv(H, BH))
    signed = rule.state_signed + rule.state_signed[-1:]
    _fused_wgrad_kernel[grid](
        dy_BTV, x_BTH, w, s[0], s[1], sc[0], sc[1], sumsq, BT, V, H, triton.cdiv(H, BH),
        float(coef), *scalars, int(seed),
        RULE=_TL_RULES[rule.name],
        NUM_STATES=len(rule.state_names),
        MODE=mode,
        SR=seed >= 0,
        BF16W=w.dtype == torch.bfloat16,
        BF16S=s[0].dtype == torch.bfloat16,
        Q8=sc[0] is not None,
        SIGNED1=signed[0], SIGNED2=signed[1],
        IEEE=x_BTH.dtype == torch.float32,
        BV=BV, BH=BH, BK=BK, **opts,
    )  # fmt: skip


def fused_linear_update(
    dy_BTV, x_BTH, w, state, rule: Rule, scalars, coef: float, seed: int | None, block=None
) -> None:
    """Update W (V, H) and its states in place from dY and X. seed: the Philox seed of the
    stochastic rounding of every bf16 store (a bf16 weight, bf16 states); None: round to nearest.

    States are fp32 or bf16 tensors of W's shape, or 8-bit codes with `<name>_scale` (V, NB)
    tensors, in which case the tile width BH must equal precision.QBLOCK so a tile row is one
    block.
    dY and X in bf16 (both, on a GPU) feed the tensor cores with an fp32 accumulator; anything
    else is up-cast to fp32 and multiplied exactly ("ieee"). block: (BV, BH, BK[, num_warps,
    num_stages]); None: default_block; "auto": tuned_block (timed once per layer shape).
    """
    names = rule.state_names + rule.state_names[-1:]
    s = [state[n] for n in names[:2]]
    q8 = f"{names[0]}_scale" in state
    sc = [state[f"{n}_scale"] for n in names[:2]] if q8 else [None, None]
    if block is None:
        block = default_block(x_BTH.dtype, q8, x_BTH.shape[0])
    elif block == "auto":
        block = tuned_block(dy_BTV, x_BTH, w, state, rule, scalars)
    if q8 and block[1] != QBLOCK:
        raise ValueError(f"FORGE: 8-bit states need a Triton tile width of {QBLOCK} columns")
    for t in (w, *s):
        if not t.is_contiguous():
            raise ValueError("FORGE triton backend needs contiguous weights and states")
    seed = -1 if seed is None else seed
    _launch(dy_BTV, x_BTH, w, s, sc, s[0], rule, scalars, coef, seed, 0, block)


def fused_linear_sumsq(dy_BTV, x_BTH, block=None) -> torch.Tensor:
    """Sum of squares of dW = dY^T X, tile by tile, without storing dW (pass 1 of clipping)."""
    if block is None or block == "auto":  # the update pass is the one worth tuning
        block = default_block(x_BTH.dtype, False, x_BTH.shape[0])
    BV, BH = block[:2]
    V, H = dy_BTV.shape[1], x_BTH.shape[1]
    sumsq = torch.zeros(triton.cdiv(V, BV) * triton.cdiv(H, BH), device=dy_BTV.device)
    rule = RULES["sgd"]
    _launch(
        dy_BTV, x_BTH, sumsq, [sumsq] * 2, [None] * 2, sumsq, rule, (0.0,) * 8, 1.0, -1, 1, block
    )
    return sumsq.double().sum()  # a 0-d tensor on the device: no host sync here
