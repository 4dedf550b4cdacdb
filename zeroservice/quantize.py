"""Block quantization of communicated tensors (ZeRO++'s qwZ and qgZ).

[Note: block quantization]
A tensor of n elements is cut into blocks of B elements (the last one zero-padded).
Each block gets one fp32 scale, symmetric over its largest magnitude:
``scale = absmax / q_max`` with q_max = 127 (int8) or 7 (int4), and each element becomes
``q = round(x / scale)`` in [-q_max, q_max]; a block of zeros has scale 0 and q = 0.
Dequantizing gives ``q * scale``, so every element is off by at most ``scale / 2`` (the
rounding of x / scale to the nearest integer, times scale; no clamping ever happens,
since |x| <= absmax). int4 stores ``q + 8`` (1..15) two to a byte, the even element in
the low nibble.

The wire format of one quantized tensor is one uint8 row: ``payload | scales`` with
``payload`` n_blocks x B bytes (int8) or n_blocks x B / 2 bytes (int4) and ``scales``
n_blocks x 4 bytes. ``packed_bytes`` gives its size, so that rows of equal-sized inputs
can be stacked and sent in one collective.

[Note: blocks within a parameter]
A block that straddles two parameters takes its scale from the larger: a LayerNorm gain
near 1 beside a bias near 0 leaves the bias with a step of 1/127, and a bias of 0.004
comes back as 0 or 0.008. A flat shard is therefore cut into *pieces* where a parameter
(or the unit's padding) begins (``pieces``), and each piece is quantized on its own, in
blocks from its own start: ``payload | scales`` per piece, one after the other in the
row (``pieces_bytes``). Each cut adds at most one block to the row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Q_MAX = {8: 127, 4: 7}
BITS = {"int8": 8, "int4": 4}


def blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def packed_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of one quantized tensor of ``numel`` elements (payload and scales)."""
    n_blocks = blocks(numel, block)
    return n_blocks * block * bits // 8 + 4 * n_blocks


def quantize_into(x: torch.Tensor, bits: int, block: int, out: torch.Tensor) -> None:
    """Write ``x`` (1-D, any float dtype) quantized into the uint8 row ``out``."""
    n_blocks = blocks(x.numel(), block)
    padded = torch.zeros(n_blocks * block, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    grid = padded.view(n_blocks, block)
    scales = grid.abs().amax(dim=1) / Q_MAX[bits]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(grid / safe[:, None]).to(torch.int8)
    payload_bytes = n_blocks * block * bits // 8
    if bits == 8:
        out[:payload_bytes].copy_(q.view(-1).view(torch.uint8))
    else:
        nibbles = (q.view(-1, 2).to(torch.int16) + 8).to(torch.uint8)
        out[:payload_bytes].copy_(nibbles[:, 0] | (nibbles[:, 1] << 4))
    out[payload_bytes : payload_bytes + 4 * n_blocks].copy_(scales.view(torch.uint8))


def quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """``x`` quantized into a new uint8 row. See [Note: block quantization]."""
    out = torch.empty(packed_bytes(x.numel(), bits, block), dtype=torch.uint8, device=x.device)
    quantize_into(x.reshape(-1), bits, block, out)
    return out


def dequantize(row: torch.Tensor, numel: int, bits: int, block: int) -> torch.Tensor:
    """The fp32 values of a row written by ``quantize`` (the first ``numel``)."""
    n_blocks = blocks(numel, block)
    payload_bytes = n_blocks * block * bits // 8
    scales = row[payload_bytes : payload_bytes + 4 * n_blocks].view(torch.float32)
    raw = row[:payload_bytes]
    if bits == 8:
        q = raw.view(torch.int8).to(torch.float32)
    else:
        low = (raw & 0xF).to(torch.float32) - 8
        high = (raw >> 4).to(torch.float32) - 8
        q = torch.stack((low, high), dim=1).view(-1)
    return (q.view(n_blocks, block) * scales[:, None]).view(-1)[:numel]


def block_scales(row: torch.Tensor, numel: int, bits: int, block: int) -> torch.Tensor:
    """The per-block fp32 scales stored in a row."""
    n_blocks = blocks(numel, block)
    start = n_blocks * block * bits // 8
    return row[start : start + 4 * n_blocks].view(torch.float32)


def pieces(numel: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of the pieces of a tensor of ``numel`` elements cut at ``cuts``. See
    [Note: blocks within a parameter]."""
    bounds = sorted({0, numel, *(c for c in cuts if 0 < c < numel)})
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def pieces_bytes(spans: Sequence[tuple[int, int]], bits: int, block: int) -> int:
    """Bytes of a row that holds every piece quantized on its own."""
    return sum(packed_bytes(b - a, bits, block) for a, b in spans)


def _rows_of(spans: Sequence[tuple[int, int]], bits: int, block: int):
    """Per piece: its [start, end) in the tensor and its [start, end) in the row."""
    at = 0
    for a, b in spans:
        size = packed_bytes(b - a, bits, block)
        yield a, b, at, at + size
        at += size


def quantize_pieces_into(
    x: torch.Tensor, spans: Sequence[tuple[int, int]], bits: int, block: int, out: torch.Tensor
) -> None:
    """Write each piece of ``x`` (1-D) quantized, one after the other, into ``out``."""
    for a, b, r0, r1 in _rows_of(spans, bits, block):
        quantize_into(x[a:b], bits, block, out[r0:r1])


def dequantize_pieces_into(
    row: torch.Tensor, spans: Sequence[tuple[int, int]], bits: int, block: int, out: torch.Tensor
) -> None:
    """The inverse of ``quantize_pieces_into``: each piece's values into ``out``."""
    for a, b, r0, r1 in _rows_of(spans, bits, block):
        out[a:b].copy_(dequantize(row[r0:r1], b - a, bits, block))
