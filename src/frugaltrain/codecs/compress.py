"""Codecs for anything that crosses a link.

Dense: fp32, bf16, int8 (blockwise absmax scale) and 4-bit E3M0 (sign + 3 exponent bits, no
mantissa, blockwise scale; the Streaming DiLoCo format). A worker never quantizes its own
contribution to a dense mix: only what it receives is lossy.

Dense with error feedback: `2bit` (a sign bit and one bit choosing between two magnitudes per
block, the means of the block's smaller and larger magnitudes) and `1bit` (the sign, times the
block's mean magnitude; signSGD's scaled sign). They lose too much to send alone, so like the
sparse codecs a worker's own contribution is what it sent and the rest goes to the operation's
error feedback (`keeps_residual`).

Sparse (SparseLoCo's chunked top-k): `topk:F` keeps the ceil(F * CHUNK) largest-magnitude
entries of every CHUNK consecutive values and sends their positions in the chunk (12-bit,
bit-packed) and their values (fp32; `topk:F+2bit`: a sign bit and one bit choosing between two
magnitudes per chunk, the means of the chunk's smaller and larger half). A worker's own
contribution is what it sent, so every worker of an average holds the same sum; what it did not
send goes to the operation's error feedback (codecs/feedback.py).

`encode` returns the tensors that actually go on the wire (so their byte size is the honest
count, scales and indices included); `decode` turns them back into fp32. Receivers accumulate
in fp32 or wider.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from frugaltrain.codecs.grammar import CODECS, is_sparse, parse_codec

BLOCK = 256
"""Elements per scale block for int8 and e3m0 (one fp32 scale each)."""

CHUNK = 4096
"""Elements per top-k chunk; a position in it takes INDEX_BITS bits."""
INDEX_BITS = 12

_E3M0_LEVELS = 7  # non-zero magnitudes scale * 2^-e for e = 0..6; code 0 is exact zero


@lru_cache(maxsize=64)
def _topk(codec: str) -> tuple[int, bool]:
    """(kept entries per chunk, 2-bit values) of a `topk:F[+2bit]` codec."""
    fraction, two_bit = parse_codec(codec)
    return max(1, math.ceil(fraction * CHUNK)), two_bit


def wire_bytes(numel: int, codec: str) -> int:
    """Bytes `numel` values take on the wire under `codec`, scales and indices included."""
    blocks = -(-numel // BLOCK)
    if is_sparse(codec):
        k, two_bit = _topk(codec)
        kept = -(-numel // CHUNK) * k
        values = -(-kept * 2 // 8) + 8 * -(-numel // CHUNK) if two_bit else 4 * kept
        return -(-kept * INDEX_BITS // 8) + values
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    if codec == "int8":
        return numel + 4 * blocks
    if codec == "e3m0":
        return -(-numel // 2) + 4 * blocks
    if codec == "2bit":  # whole blocks of codes, two fp32 levels each
        return blocks * (BLOCK // 4 + 8)
    if codec == "1bit":
        return blocks * (BLOCK // 8 + 4)
    raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")


def chunk_numel(numel: int, parts: int) -> int:
    """Values in each of `parts` equal chunks that cover `numel`: whole scale blocks, so each
    chunk codes alone exactly as it would inside the whole (the last one padded)."""
    return -(-numel // (parts * BLOCK)) * BLOCK


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    pad = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def encode(flat: torch.Tensor, codec: str) -> list[torch.Tensor]:
    """Encode a flat fp32 tensor; the returned tensors are exactly what is sent."""
    if is_sparse(codec):
        return _encode_topk(flat.float(), *_topk(codec))
    if codec == "fp32":
        return [flat.float()]
    if codec == "bf16":
        return [flat.to(torch.bfloat16)]
    blocks = _blocks(flat.float())
    if codec == "2bit":
        codes, levels = _two_levels(blocks, _counts(flat.numel()))
        return [_pack_crumbs(codes), levels.flatten()]
    if codec == "1bit":
        return [_pack_signs(blocks), blocks.abs().sum(dim=1) / _counts(flat.numel())]
    scale = blocks.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    unit = blocks / safe[:, None]  # in [-1, 1]
    if codec == "int8":
        q = torch.round(unit * 127).to(torch.int8)
        return [q.flatten()[: flat.numel()], scale]
    if codec == "e3m0":
        # Nearest level in log2: |u| -> 2^-e, e = round(-log2 |u|) in [0, 6]; tiny values -> 0.
        # In place on one buffer: the coding runs in the worker's CPU share, every round.
        mag = unit.abs()
        e = mag.clamp_min(2.0**-30).log2_().neg_().round_().clamp_(0, _E3M0_LEVELS - 1)
        code = e.add_(1).to(torch.uint8)  # 1..7
        code.masked_fill_(mag < 2.0 ** -(_E3M0_LEVELS - 0.5), 0)  # 0: zero
        code.bitwise_or_((unit < 0).to(torch.uint8) << 3)  # sign in bit 3
        code = code.flatten()[: flat.numel()]
        if code.numel() % 2:
            code = torch.cat([code, code.new_zeros(1)])
        packed = code[0::2] | (code[1::2] << 4)
        return [packed, scale]
    raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")


def decode(parts: list[torch.Tensor], codec: str, numel: int) -> torch.Tensor:
    """Inverse of `encode`: a flat fp32 tensor of `numel` values."""
    if is_sparse(codec):
        return _decode_topk(parts, numel, *_topk(codec))
    if codec in ("fp32", "bf16"):
        return parts[0].float()
    if codec == "2bit":
        codes = _unpack_crumbs(parts[0]).view(-1, BLOCK)
        mag = parts[1].view(-1, 2).gather(1, (codes >> 1).long())
        return torch.where((codes & 1) > 0, -mag, mag).flatten()[:numel]
    if codec == "1bit":
        signs = _unpack_signs(parts[0]).view(-1, BLOCK)
        return (signs * parts[1][:, None]).flatten()[:numel]
    payload, scale = parts
    if codec == "int8":
        unit = _blocks(payload.float()) / 127
    elif codec == "e3m0":  # each byte holds two codes: look both up at once
        pairs = torch.index_select(_e3m0_table(), 0, payload.to(torch.int32))
        unit = _blocks(pairs.flatten()[:numel])
    else:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return (unit * scale[:, None]).flatten()[:numel]


@lru_cache(maxsize=1)
def _e3m0_table() -> torch.Tensor:
    """(256, 2): the values of a packed byte's low and high code, in units of the block scale:
    code c is sign (bit 3) times 2^-(m - 1) for magnitude m = c & 7 > 0, and zero (signed) for
    m = 0."""
    byte = torch.arange(256, dtype=torch.int32)
    code = torch.stack([byte & 0xF, byte >> 4], dim=1)
    m = (code & 0x7).float()
    mag = torch.where(m > 0, torch.exp2(-(m - 1)), torch.zeros_like(m))
    return torch.where((code & 0x8) > 0, -mag, mag)


def e3m0_by_formula(flat: torch.Tensor) -> torch.Tensor:
    """What e3m0 makes of `flat`, elementwise as the format reads (no packing, no table): the
    block scale times sign(u) 2^-e for e = round(-log2 |u|) in [0, 6], and zero below 2^-6.5
    (a negative one signed). The reference the packed codec is tested against, to the bit."""
    blocks = _blocks(flat.float())
    scale = blocks.abs().amax(1)
    unit = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    mag = unit.abs()
    e = torch.round(-torch.log2(mag.clamp_min(2.0**-30))).clamp(0, _E3M0_LEVELS - 1)
    level = torch.where(mag < 2.0 ** -(_E3M0_LEVELS - 0.5), torch.zeros_like(e), torch.exp2(-e))
    return (torch.where(unit < 0, -level, level) * scale[:, None]).flatten()[: flat.numel()]


def roundtrip(flat: torch.Tensor, codec: str) -> torch.Tensor:
    """What a receiver sees of `flat` (fp32), without a link: decode(encode(flat))."""
    if codec == "fp32":
        return flat
    return decode(encode(flat, codec), codec, flat.numel())


# ---- dense with error feedback: 2bit, 1bit (whole blocks, so the counts divide by 4 and 8)

_CRUMB_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _counts(numel: int) -> torch.Tensor:
    """Values per block of `numel`: BLOCK each, fewer in a last block that padding fills."""
    counts = torch.full((-(-numel // BLOCK),), float(BLOCK))
    counts[-1] = numel - BLOCK * (len(counts) - 1)
    return counts


def _two_levels(blocks: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (row) of `counts` values (the padding after them is zero): code = sign bit |
    (magnitude at least the block's mean) << 1; levels = the mean magnitude below and at or
    above it. The mean splits a Gaussian block near where the best two levels would (0.35 of
    its norm lost, against 0.34 at the optimum)."""
    mag = blocks.abs()
    total = mag.sum(1)
    large = mag >= (total / counts)[:, None]
    n_large = large.sum(1)
    big = (mag * large).sum(1)
    levels = torch.stack(
        [(total - big) / (counts - n_large).clamp_min(1), big / n_large.clamp_min(1)], dim=1
    )
    return (blocks < 0).to(torch.uint8) | (large.to(torch.uint8) << 1), levels


def _pack_crumbs(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (uint8 below 4), four to a byte, the first in the low bits."""
    return (codes.reshape(-1, 4) << _CRUMB_SHIFTS).sum(1, dtype=torch.uint8)


def _unpack_crumbs(packed: torch.Tensor) -> torch.Tensor:
    return ((packed[:, None] >> _CRUMB_SHIFTS) & 3).flatten()


def _pack_signs(blocks: torch.Tensor) -> torch.Tensor:
    """One bit per value, set where it is negative, eight to a byte."""
    return ((blocks < 0).to(torch.uint8).reshape(-1, 8) << _BIT_SHIFTS).sum(1, dtype=torch.uint8)


@lru_cache(maxsize=1)
def _sign_table() -> torch.Tensor:
    """(256, 8): +1 or -1 for each bit of a byte."""
    bits = (torch.arange(256, dtype=torch.uint8)[:, None] >> _BIT_SHIFTS) & 1
    return 1.0 - 2.0 * bits.float()


def _unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    return torch.index_select(_sign_table(), 0, packed.to(torch.int32)).flatten()


# ---- sparse: chunked top-k


def _encode_topk(flat: torch.Tensor, k: int, two_bit: bool) -> list[torch.Tensor]:
    pad = (-flat.numel()) % CHUNK
    chunks = torch.nn.functional.pad(flat, (0, pad)).view(-1, CHUNK)
    idx = chunks.abs().topk(k, dim=1, sorted=False).indices
    idx = idx.sort(dim=1).values  # a canonical order: the same entries give the same bytes
    values = chunks.gather(1, idx)
    packed_idx = pack_bits(idx.flatten(), INDEX_BITS)
    if not two_bit:
        return [packed_idx, values.flatten()]
    codes, levels = _two_bit(values)
    return [packed_idx, pack_bits(codes.flatten(), 2), levels.flatten()]


def _two_bit(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk (row): code = sign bit | (large magnitude) << 1; levels = the mean magnitude
    of the entries below and above the midpoint of the row's magnitudes (one Lloyd step)."""
    mag = values.abs()
    mid = (mag.amin(dim=1, keepdim=True) + mag.amax(dim=1, keepdim=True)) / 2
    large = mag >= mid
    levels = torch.stack(
        [(mag * ~large).sum(1) / (~large).sum(1).clamp_min(1), (mag * large).sum(1) / large.sum(1)],
        dim=1,
    )
    codes = (values < 0).to(torch.uint8) | (large.to(torch.uint8) << 1)
    return codes, levels


def _decode_topk(parts: list[torch.Tensor], numel: int, k: int, two_bit: bool) -> torch.Tensor:
    chunks = -(-numel // CHUNK)
    idx = unpack_bits(parts[0], INDEX_BITS, chunks * k).long().view(chunks, k)
    if two_bit:
        codes = unpack_bits(parts[1], 2, chunks * k).view(chunks, k)
        levels = parts[2].view(chunks, 2)
        mag = levels.gather(1, (codes >> 1).long())
        values = torch.where((codes & 1) > 0, -mag, mag)
    else:
        values = parts[1].view(chunks, k)
    out = torch.zeros(chunks, CHUNK, dtype=torch.float32)
    out.scatter_(1, idx, values)
    return out.flatten()[:numel]


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below 2^bits, `bits` each, packed into uint8 (little-endian bit
    order)."""
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((values.to(torch.int64)[:, None] >> shifts) & 1).flatten()
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8)).view(-1, 8)
    return (stream << torch.arange(8, dtype=torch.int64)).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `count` integers."""
    stream = (packed.to(torch.int64)[:, None] >> torch.arange(8, dtype=torch.int64)) & 1
    stream = stream.flatten()[: count * bits].view(count, bits)
    return (stream << torch.arange(bits, dtype=torch.int64)).sum(1)
