"""Int8 K/V: symmetric quantization of K and V rotated by a fixed orthonormal matrix R, with one scale per
(token, KV head, group of 32 channels): one per head_dim vector up to head_dim 32, two at 64.

x ≈ q * scale with q in [-127, 127]. Each token is quantized on its own as it is written, so a block never
needs requantizing as it fills, a partially filled block converts like a full one, and an outlier token (the
first ones often are) costs no precision elsewhere. Keys have a few channels much larger than the rest, which
would set every key's step; rotating (a Hadamard matrix with random signs) spreads them over all channels,
and attention needs no un-rotation of the cache: q·k = (qR)·(kR), and values stay rotated until the output
(worker/attention.py). The measurements behind these choices are in docs/kv_cache.md.

A scale takes one byte: a code c for 2 ** (c / 8 - 20), i.e. eight steps per octave from 2**-20 to ~2**12,
rounded up from max|x| / 127 so that nothing clips. A step is then at most 2 ** (1/8) (9 %) coarser than the
exact max|x| / 127, and a group of 32 int8 values costs 33 bytes, against 64 in bfloat16 and 128 in float32.
"""

from __future__ import annotations

import math

import torch

SCALE_DTYPE = torch.uint8
QMAX = 127
STEPS = 8  # scale codes per octave
MIN_LOG2 = -20  # code 0 is 2**-20; groups with max|x| under 127 * 2**-20 (1.2e-4) share that step
MAX_CODE = 255
GROUP = 32  # channels per scale (a head_dim that is not a multiple of it gets one scale per vector)


def groups(dim: int) -> int:
    """Scales per head_dim vector."""
    return dim // GROUP if dim % GROUP == 0 else 1


def rotation(dim: int) -> torch.Tensor:
    """The fixed orthonormal float32 [dim, dim] matrix: a Hadamard matrix with random row signs when dim is a power
    of two, else a random orthogonal one (seeded: the same on every run)."""
    g = torch.Generator().manual_seed(dim)
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        signs = torch.randint(0, 2, (dim, 1), generator=g) * 2 - 1
        return signs * h / math.sqrt(dim)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ matrix, computed in float32, returned in x's dtype."""
    return (x.float() @ matrix).to(x.dtype)


def decode_scale(code: torch.Tensor) -> torch.Tensor:
    """Scale codes -> float32 scales."""
    return torch.exp2(code.float().mul_(1 / STEPS).add_(MIN_LOG2))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] (any float dtype) -> (int8 [..., D], scale codes [..., groups(D)])."""
    dim = x.shape[-1]
    xf = x.float().reshape(*x.shape[:-1], groups(dim), -1)
    amax = xf.abs().amax(-1)  # an all-zero group: log2 is -inf, code 0, q 0
    code = ((amax.log2() - (math.log2(QMAX) + MIN_LOG2)) * STEPS).ceil_().clamp_(0, MAX_CODE).to(SCALE_DTYPE)
    q = (xf / decode_scale(code).unsqueeze(-1)).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(x.shape), code


def dequantize(q: torch.Tensor, code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize`, in `dtype`: a conversion, then a multiply in place. Two passes, both in one
    dtype: on the CPU one multiply of int8 by floats (mixed dtypes) is not vectorized and took 3-4x longer."""
    x = q.to(dtype)
    x.view(*code.shape, -1).mul_(decode_scale(code).to(dtype).unsqueeze(-1))
    return x
