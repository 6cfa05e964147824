"""Analytic cost proxies for a GPT/BERT-style Transformer step and a parallel layout.

Symbols (per step, one data-parallel replica unless said otherwise):
    L layers, d width, h heads, f = ffn_mult*d FFN width, s sequence, b micro-batch, V vocabulary,
    G gradient-accumulation micro-steps, t tensor-parallel, p pipeline, r data-parallel (DP/FSDP).

Conventions: a multiply-add is 2 FLOPs; only matrix products are counted (biases, norms,
softmax, GELU and the loss are omitted: they are <1% of FLOPs beyond toy widths, and they are
what `torch.utils.flop_counter.FlopCounterMode` also leaves out). Attention scores and A.V are
counted as full s x s products even under a causal mask, as dense kernels compute them.
Training = forward + backward = 3 x forward (the backward computes input and weight gradients);
activation recompute adds one more forward.

Memory traffic and communication bytes are first-order estimates (research note 3.2); they
are proxies to be scaled by fitted coefficients, not predictions of profiler counters.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A Transformer training step. Defaults follow frugaltrain's GPT (untied head, no bias)."""

    n_layer: int
    """Blocks (L)."""
    n_embd: int
    """Width (d)."""
    n_head: int
    """Attention heads (h); d must be a multiple of h."""
    seq_len: int
    """Tokens per sequence in the step (s)."""
    vocab_size: int = 256
    """Vocabulary (V); 0 for a model without an LM head."""
    batch_size: int = 1
    """Sequences per micro-step per data-parallel replica (b)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step (G)."""
    ffn_mult: int = 4
    """FFN width as a multiple of d (f = ffn_mult * d)."""
    block_size: int | None = None
    """Rows of the learned position table (None: seq_len); 0 for no position table."""
    bias: bool = False
    """Bias vectors in Linear and LayerNorm layers."""
    tie_embeddings: bool = False
    """LM head shares the token embedding."""
    head_tokens: str = "all"
    """Which tokens go through the LM head: 'all' (GPT), 'none' (classification via pooled)."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd = {self.n_embd} must be a multiple of n_head = {self.n_head}")
        if self.head_tokens not in ("all", "none"):
            raise ValueError(f"head_tokens = {self.head_tokens!r}: use 'all' or 'none'")

    @property
    def d_ff(self) -> int:
        return self.ffn_mult * self.n_embd

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Parallel layout and numeric formats. N = tp * pp * dp devices."""

    dp: int = 1
    """Data-parallel replicas (r)."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over the dp replicas (ZeRO-3)."""
    tp: int = 1
    """Tensor-parallel degree (t), Megatron-style column/row split of attention and MLP."""
    pp: int = 1
    """Pipeline stages (p)."""
    recompute: bool = False
    """Activation checkpointing: one extra forward per step."""
    flash: bool = True
    """Fused attention (no s x s score matrix in memory)."""
    act_bytes: int = 2
    """Bytes per activation / compute weight element (2 for bf16, 4 for fp32)."""
    grad_bytes: int = 4
    """Bytes per gradient element."""

    @property
    def n_devices(self) -> int:
        return self.dp * self.tp * self.pp


def gpt_param_count(shape: TransformerShape) -> int:
    """Exact parameter count of frugaltrain.models.gpt.GPT (and any block of that layout)."""
    d, f, V = shape.n_embd, shape.d_ff, shape.vocab_size
    bias = 1 if shape.bias else 0
    ln = d * (1 + bias)
    block = 2 * ln + (3 * d * d + 3 * d * bias) + (d * d + d * bias)
    block += (d * f + f * bias) + (f * d + d * bias)
    pos = shape.seq_len if shape.block_size is None else shape.block_size
    head = 0 if (shape.tie_embeddings or shape.head_tokens == "none") else V * d
    return shape.n_layer * block + V * d + pos * d + ln + head


def forward_flops_per_token(shape: TransformerShape) -> float:
    """Forward FLOPs per token: L*(2*(4d^2 + 2*d*f) + 4*s*d) + 2*d*V (matmuls only)."""
    d, f, s = shape.n_embd, shape.d_ff, shape.seq_len
    per_layer = 2 * (4 * d * d + 2 * d * f) + 4 * s * d
    head = 2 * d * shape.vocab_size if shape.head_tokens == "all" else 0
    return shape.n_layer * per_layer + head


def transformer_train_flops(
    n_layer: int,
    n_embd: int,
    n_head: int,
    seq_len: int,
    vocab_size: int,
    tokens: int,
    ffn_mult: int = 4,
) -> float:
    """Forward+backward FLOPs to train on `tokens` tokens of sequence length `seq_len`.

    Counted, per token and per layer, as 2 FLOPs per multiply-add: the qkv (3d^2), output
    (d^2) and two MLP (2*d*ffn_mult*d) projections, the attention scores QK^T and A.V
    (2*s*d each, full s x s even with a causal mask), plus the LM head (d*V); the total is
    3 x forward (backward = input + weight gradients). Not counted: embeddings, biases,
    LayerNorm, softmax, GELU, loss, optimizer. n_head does not change the count (it splits d).
    Matches torch's FlopCounterMode on frugaltrain's GPT with the math SDPA backend.
    """
    shape = TransformerShape(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        seq_len=seq_len,
        vocab_size=vocab_size,
        ffn_mult=ffn_mult,
    )
    return 3.0 * forward_flops_per_token(shape) * tokens


@dataclass(frozen=True)
class StepProxies:
    """Analytic costs of one optimizer step, per device (global figures where said)."""

    params: int
    """Parameters of the whole model."""
    flops: float
    """Training FLOPs per device per step."""
    flops_matmul: float
    """Of which dense projections (weights x activations)."""
    flops_attention: float
    """Of which QK^T and A.V."""
    hbm_bytes: float
    """Device-memory traffic per device per step (weights, grads, optimizer, activations)."""
    act_bytes: float
    """Of which activation traffic linear in s."""
    score_bytes: float
    """Of which attention-score traffic (b*h*s^2 terms; 0 with flash attention)."""
    comm_bytes: float
    """Collective bytes sent per device per step (ring algorithms)."""
    arithmetic_intensity: float
    """flops / hbm_bytes, FLOP/byte."""
    tokens: int
    """Tokens per step, all replicas."""
    n_devices: int

    def as_dict(self) -> dict:
        return asdict(self)


# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
# activation bytes per (b, s, d) element per layer in 16-bit, without/with tensor parallelism,
# and the attention-score coefficient multiplying h*s/d.
_ACT_COEF = 34.0
_SCORE_COEF = 5.0


def step_proxies(shape: TransformerShape, layout: Layout = Layout()) -> StepProxies:
    """FLOPs, memory traffic and communication of one optimizer step on one device."""
    L, d, s, h = shape.n_layer, shape.n_embd, shape.seq_len, shape.n_head
    b, G, t, p, r = shape.batch_size, shape.grad_accum, layout.tp, layout.pp, layout.dp
    P = gpt_param_count(shape)
    tokens_rep = shape.tokens_per_step
    passes = 3 + (1 if layout.recompute else 0)
    head = 2 * d * shape.vocab_size if shape.head_tokens == "all" else 0
    f_mm = passes * tokens_rep * (L * 2 * (4 * d * d + 2 * d * shape.d_ff) + head) / (t * p)
    f_att = passes * tokens_rep * L * 4 * s * d / (t * p)
    # HBM traffic per device.
    P_loc = P / (t * p)
    L_loc = L / p
    q_w = G * passes * P_loc * layout.act_bytes  # weights read by each pass (gathered under FSDP)
    q_g = 2 * P_loc * layout.grad_bytes
    shard = r if layout.fsdp else 1
    q_opt = 2 * (4 + 4 + 4 + layout.grad_bytes) * P_loc / shard  # AdamW: master, m, v, grad
    act_coef = _ACT_COEF if t == 1 else 10 + 24 / t
    q_act = 2 * G * b * s * d * L_loc * act_coef
    q_score = 0.0 if layout.flash else 2 * G * b * s * d * L_loc * _SCORE_COEF * h * s / d / t
    Q = q_w + q_g + q_opt + q_act + q_score
    X = comm_bytes(shape, layout, P)
    return StepProxies(
        params=P,
        flops=f_mm + f_att,
        flops_matmul=f_mm,
        flops_attention=f_att,
        hbm_bytes=Q,
        act_bytes=q_act,
        score_bytes=q_score,
        comm_bytes=X,
        arithmetic_intensity=(f_mm + f_att) / Q,
        tokens=tokens_rep * r,
        n_devices=layout.n_devices,
    )


def comm_bytes(shape: TransformerShape, layout: Layout, params: int | None = None) -> float:
    """Bytes sent per device per optimizer step by ring collectives and pipeline sends.

    DP: gradient all-reduce 2(r-1)/r * P_loc * grad_bytes.
    FSDP: per micro-step two all-gathers (forward, backward) plus one reduce-scatter at the end:
        (2G + 1)(r-1)/r * P_loc * act_bytes.
    TP: four all-reduces of b*s*d per layer per micro-step: 4 L G 2(t-1)/t b s d act_bytes.
    PP: activations forward and gradients back across each stage boundary: 2 G b s d act_bytes.
    """
    P = gpt_param_count(shape) if params is None else params
    L, d, s = shape.n_layer, shape.n_embd, shape.seq_len
    b, G, t, p, r = shape.batch_size, shape.grad_accum, layout.tp, layout.pp, layout.dp
    P_loc = P / (t * p)
    x = 0.0
    if r > 1:
        ring = (r - 1) / r
        if layout.fsdp:
            x += (2 * G + 1) * ring * P_loc * layout.act_bytes
        else:
            x += 2 * ring * P_loc * layout.grad_bytes
    if t > 1:
        x += 4 * (L / p) * G * 2 * (t - 1) / t * b * s * d * layout.act_bytes
    if p > 1:
        x += 2 * G * b * s * d * layout.act_bytes
    return x


def paper_proxies(
    n_layer: int, n_embd: int, seq_len: int, batch_size: int, tokens: float
) -> dict[str, float]:
    """The artifact's proxies (research note 1.3b): P = 20 L d^2, C = P*D, M = B*s*d*L,
    FLOPs = D*L*(4d^2 + s*d), with D the tokens seen."""
    L, d, s = n_layer, n_embd, seq_len
    P = 20 * L * d * d
    M = batch_size * s * d * L
    return {"P": P, "C": P * tokens, "M": M, "FLOPs": tokens * L * (4 * d * d + s * d)}


# ----------------------------------------------------------------------------------------------
# Device profiles and the roofline


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline ceilings of one device. Datasheet figures are dense (no sparsity) 16-bit
    tensor-core peaks; `source` says whether a profile is from a datasheet or measured."""

    name: str
    peak_flops: float
    """FLOP/s."""
    mem_bw: float
    """Device memory bandwidth, bytes/s."""
    link_bw: float
    """Per-device collective bandwidth (NVLink or PCIe, one direction), bytes/s."""
    tdp_watts: float
    """Board power limit at default settings, W."""
    source: str = "datasheet"


DEVICE_PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("h100-sxm", 989e12, 3.35e12, 450e9, 700.0),
        DeviceProfile("h100-pcie", 756e12, 2.0e12, 64e9, 350.0),
        DeviceProfile("h200", 989e12, 4.8e12, 450e9, 700.0),
        DeviceProfile("a100-sxm4-40gb", 312e12, 1.555e12, 300e9, 400.0),
        DeviceProfile("a100-sxm4-80gb", 312e12, 2.039e12, 300e9, 400.0),
        DeviceProfile("v100-pcie-16gb", 112e12, 900e9, 16e9, 250.0),
        DeviceProfile("t4", 65e12, 320e9, 16e9, 70.0),
        DeviceProfile("l4", 121e12, 300e9, 32e9, 72.0),
        DeviceProfile("rtx-2080-ti", 53.8e12, 616e9, 16e9, 250.0),
        DeviceProfile("rtx-4090", 165e12, 1.008e12, 32e9, 450.0),
    )
}


def calibrate_cpu_profile(
    seconds: float = 1.0, threads: int | None = None, n: int = 512
) -> DeviceProfile:
    """Measure this host's attainable fp32 matmul FLOP/s and copy bandwidth (about `seconds`).

    The figures are what torch achieves here (shared cores included), not the datasheet peak.
    """
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm up the BLAS thread pool
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2:
            a @ b
            reps += 1
        flops = 2 * n**3 * reps / (time.perf_counter() - t0)
        src = torch.empty(8 * 2**20)  # 32 MiB: beyond typical L2/L3 per core
        dst = torch.empty_like(src)
        dst.copy_(src)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2:
            dst.copy_(src)
            reps += 1
        bw = 2 * src.numel() * 4 * reps / (time.perf_counter() - t0)  # read + write
    finally:
        torch.set_num_threads(old)
    return DeviceProfile("local-cpu", flops, bw, bw, 0.0, source="measured (local microbenchmark)")


def roofline_time(
    proxies: StepProxies,
    device: DeviceProfile,
    *,
    u_c: float = 1.0,
    u_m: float = 1.0,
    u_l: float = 1.0,
    overlap: float = 0.0,
    tau0: float = 0.0,
) -> float:
    """Roofline step time in s: max(F/(peak u_c), Q/(bw u_m)) + (1-overlap) X/(link u_l) + tau0.

    u_c, u_m, u_l are achieved fractions of the ceilings, `overlap` the share of communication
    hidden behind compute, `tau0` fixed per-step overhead (launches, Python) in s.
    """
    compute = proxies.flops / (device.peak_flops * u_c)
    memory = proxies.hbm_bytes / (device.mem_bw * u_m)
    comm = proxies.comm_bytes / (device.link_bw * u_l) if proxies.comm_bytes else 0.0
    return max(compute, memory) + (1 - overlap) * comm + tau0
