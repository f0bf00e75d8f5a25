"""Dequantization of GGUF tensor data with torch (vectorized over blocks), after ggml's block layouts.

Each function takes the raw bytes of a tensor as uint8 [n_blocks, block_bytes] and returns float32
[n_blocks, block_values]. A block stores float16 scales and packed integer quants; the layouts are those of
ggml-quants.c (block_q8_0, block_q4_0, block_q4_1, block_q4_K, block_q6_K).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian float16 bytes -> float32 [n, 1]."""
    return raw.contiguous().view(torch.float16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d: f16, qs: int8[32]
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit quants: the low nibbles are the first half of the block, the high ones the second."""
    out = torch.empty(qs.shape[0], 2, qs.shape[1])  # written in place: no concatenated uint8 copy
    out[:, 0] = qs & 0xF
    out[:, 1] = qs >> 4
    return out.view(qs.shape[0], -1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d: f16, qs: u8[16]; x = d * (q - 8)
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]) - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d: f16, m: f16, qs: u8[16]; x = d * q + m
    return torch.addcmul(_f16(b[:, 2:4]), _f16(b[:, :2]), _nibbles(b[:, 4:]))


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin: f16; scales: 12 bytes packing 8 six-bit (scale, min) pairs; qs: u8[128] for 256 values."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    s = b[:, 4:16].int()
    # Sub-blocks 0-3 keep their 6 bits in bytes 0-7; 4-7 split theirs across bytes 8-11 and the top bits of 0-7.
    scale = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=1).float()
    mins = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1).float()
    qs = b[:, 16:].reshape(-1, 4, 32)
    # Each 32 bytes hold two sub-blocks of 32: low nibbles first, then high nibbles.
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32).float()
    return (d[:, :, None] * scale[:, :, None] * q - dmin[:, :, None] * mins[:, :, None]).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """ql: u8[128] low 4 bits, qh: u8[64] high 2 bits, scales: int8[16] (one per 16 values), d: f16."""
    ql = b[:, :128].reshape(-1, 2, 64).int()
    qh = b[:, 128:192].reshape(-1, 2, 32).int()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    lo, hi = ql[:, :, :32], ql[:, :, 32:]
    # Per half of 128 values: four runs of 32, each from a nibble of ql and a 2-bit field of qh.
    q = torch.stack(
        [
            (lo & 0xF) | ((qh & 3) << 4),
            (hi & 0xF) | (((qh >> 2) & 3) << 4),
            (lo >> 4) | (((qh >> 4) & 3) << 4),
            (hi >> 4) | (((qh >> 6) & 3) << 4),
        ],
        dim=2,
    ).reshape(-1, 256)
    return d * scales.repeat_interleave(16, dim=1) * (q - 32).float()


QUANTIZED: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
PLAIN = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
SUPPORTED = tuple(t.name for t in (*PLAIN, *QUANTIZED))


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's data (as gguf.GGUFReader exposes it) as float32 of `shape` (rows first, torch order).

    Raises ValueError for a type not listed in SUPPORTED.
    """
    raw = torch.from_numpy(np.ascontiguousarray(data)).reshape(-1)
    if qtype in PLAIN:
        return raw.view(torch.uint8).view(PLAIN[qtype]).float().reshape(shape)
    fn = QUANTIZED.get(qtype)
    if fn is None:
        raise ValueError(f"unsupported quantization type {qtype.name} (supported: {', '.join(SUPPORTED)})")
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    return fn(raw.view(torch.uint8).reshape(-1, block_bytes)).reshape(shape)
