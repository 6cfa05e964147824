"""Codecs for anything that crosses a link: fp32, bf16, int8 (blockwise absmax scale) and 4-bit
E3M0 (sign + 3 exponent bits, no mantissa, blockwise scale; the Streaming DiLoCo format).

`encode` returns the tensors that actually go on the wire (so their byte size is the honest
count, scales included); `decode` turns them back into fp32. Receivers accumulate in fp32 or
wider. A worker never quantizes its own contribution: only what it receives is lossy.
"""

from __future__ import annotations

import torch

from frugaltrain.config import CODECS  # the names the config accepts; each is handled below

BLOCK = 256
"""Elements per scale block for int8 and e3m0 (one fp32 scale each)."""

_E3M0_LEVELS = 7  # non-zero magnitudes scale * 2^-e for e = 0..6; code 0 is exact zero


def wire_bytes(numel: int, codec: str) -> int:
    """Bytes `numel` values take on the wire under `codec`, scales included."""
    blocks = -(-numel // BLOCK)
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    if codec == "int8":
        return numel + 4 * blocks
    if codec == "e3m0":
        return -(-numel // 2) + 4 * blocks
    raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    pad = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def encode(flat: torch.Tensor, codec: str) -> list[torch.Tensor]:
    """Encode a flat fp32 tensor; the returned tensors are exactly what is sent."""
    if codec == "fp32":
        return [flat.float()]
    if codec == "bf16":
        return [flat.to(torch.bfloat16)]
    blocks = _blocks(flat.float())
    scale = blocks.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    unit = blocks / safe[:, None]  # in [-1, 1]
    if codec == "int8":
        q = torch.round(unit * 127).to(torch.int8)
        return [q.flatten()[: flat.numel()], scale]
    if codec == "e3m0":
        # Nearest level in log2: |u| -> 2^-e, e = round(-log2 |u|) in [0, 6]; tiny values -> 0.
        mag = unit.abs()
        e = torch.round(-torch.log2(mag.clamp_min(2.0**-30))).clamp(0, _E3M0_LEVELS - 1)
        zero = mag < 2.0 ** -(_E3M0_LEVELS - 0.5)
        code = torch.where(zero, torch.zeros_like(e), e + 1).to(torch.uint8)  # 0..7
        code = code | ((unit < 0).to(torch.uint8) << 3)  # sign in bit 3
        code = code.flatten()[: flat.numel()]
        if code.numel() % 2:
            code = torch.cat([code, code.new_zeros(1)])
        packed = code[0::2] | (code[1::2] << 4)
        return [packed, scale]
    raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")


def decode(parts: list[torch.Tensor], codec: str, numel: int) -> torch.Tensor:
    """Inverse of `encode`: a flat fp32 tensor of `numel` values."""
    if codec in ("fp32", "bf16"):
        return parts[0].float()
    payload, scale = parts
    if codec == "int8":
        unit = _blocks(payload.float()) / 127
    elif codec == "e3m0":
        code = torch.stack([payload & 0xF, payload >> 4], dim=1).flatten()[:numel]
        mag_code = (code & 0x7).float()
        mag = torch.where(mag_code > 0, torch.exp2(-(mag_code - 1)), torch.zeros_like(mag_code))
        unit = _blocks(torch.where((code & 0x8) > 0, -mag, mag))
    else:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return (unit * scale[:, None]).flatten()[:numel]


def roundtrip(flat: torch.Tensor, codec: str) -> torch.Tensor:
    """What a receiver sees of `flat` (fp32), without a link: decode(encode(flat))."""
    if codec == "fp32":
        return flat
    return decode(encode(flat, codec), codec, flat.numel())
