"""Precision regimes for the weight store and the optimizer states (torch path).

- Weights: fp32/fp64 are updated exactly. bf16 weights are up-cast to fp32 for the rule and
  written back either with seeded stochastic rounding (unbiased: E[SR(x)] = x, and updates below
  bf16 resolution still move the weight on average) or with round-to-nearest-even.
- States: "fp32" keeps each state in float32 (float64 for float64 parameters). "int8" keeps
  8-bit codes with one fp32 scale per (row, QBLOCK columns) block. A tile is a block of whole
  rows, so every quantization block lies inside one tile and requantization is tile-local.
  Signed states (momenta) use absmax/127 int8 codes; non-negative states (Adam's v) store
  sqrt(v) as absmax/255 uint8 codes, which spends the 8 bits on the square root's range.
  The zero code of sqrt(v) dequantizes to half a step, the mean of its bucket, so an element
  whose sqrt(v) rounds to zero still gets a denominator of at least s/2, never eps alone.

Shapes: R rows of a tile, H columns (a parameter is viewed as 2-D: (rows, H)), NB = ceil(H/QBLOCK).
"""

from __future__ import annotations

import torch

QBLOCK = 64  # columns per 8-bit quantization block; the Triton tile width must be a multiple
_LOW16 = 0xFFFF
_HIGH16 = -65536  # 0xFFFF0000 as a signed int32


def stochastic_round_to_bf16(x_RH: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding up in magnitude with probability (dropped 16 bits) / 2^16.

    bf16 is the top half of fp32, so adding a uniform 16-bit integer to the bit pattern and
    truncating carries into the kept bits with exactly that probability. NaNs pass through.
    """
    bits = x_RH.contiguous().view(torch.int32)
    noise = torch.randint(
        0, _LOW16 + 1, x_RH.shape, generator=gen, dtype=torch.int32, device=x_RH.device
    )
    rounded = ((bits + noise) & _HIGH16).view(torch.float32)
    rounded = torch.where(torch.isnan(x_RH), x_RH, rounded)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero


def _pad_blocks(x_RH: torch.Tensor) -> torch.Tensor:
    """(R, H) -> (R, NB, QBLOCK), zero padded on the right."""
    R, H = x_RH.shape
    NB = -(-H // QBLOCK)
    if NB * QBLOCK != H:
        x_RH = torch.nn.functional.pad(x_RH, (0, NB * QBLOCK - H))
    return x_RH.reshape(R, NB, QBLOCK)


def quantize(x_RH: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tile -> (codes (R, H) int8 or uint8, scales (R, NB) fp32), round to nearest."""
    R, H = x_RH.shape
    if not signed:
        # correctly rounded: an fp64 square root rounded once to fp32 (53 >= 2 * 24 + 2 bits, so
        # the double rounding is innocuous). torch's own fp32 sqrt is off by one ulp for ~18% of
        # inputs on some CPU builds (torch 2.13, AVX2), which moved block scales by one ulp
        # against the Triton kernel's IEEE tl.sqrt_rn.
        x_RH = x_RH.clamp_min(0).double().sqrt().float()
    qmax = 127.0 if signed else 255.0
    xb = _pad_blocks(x_RH.float())
    scale_RN = xb.abs().amax(dim=2) / qmax
    safe = torch.where(scale_RN > 0, scale_RN, torch.ones_like(scale_RN))
    codes = torch.round(xb / safe[..., None]).clamp_(-qmax if signed else 0.0, qmax)
    codes = codes.to(torch.int8 if signed else torch.uint8).reshape(R, -1)[:, :H]
    return codes, scale_RN


def dequantize(codes_RH: torch.Tensor, scale_RN: torch.Tensor, signed: bool) -> torch.Tensor:
    """Inverse of `quantize` (with the half-step floor for the zero code of sqrt states)."""
    R, H = codes_RH.shape
    cb = _pad_blocks(codes_RH.float())
    if not signed:
        cb = cb.clamp_min(0.5)
    x_RH = (cb * scale_RN[..., None]).reshape(R, -1)[:, :H]
    return x_RH if signed else x_RH.square()
