"""Int8 K/V: symmetric quantization with one scale per (token, KV head), i.e. per head_dim vector.

x ≈ q * scale with q in [-127, 127]. Each token is quantized on its own as it is written, so a block never
needs requantizing as it fills, a partially filled block converts like a full one, and an outlier token (the
first ones often are) costs no precision elsewhere. The measurements behind this choice (against one scale
per block and KV head) are in docs/kv_cache.md.

The scale takes one byte: a code c for 2 ** (c / 8 - 20), i.e. eight steps per octave from 2**-20 to ~2**12,
rounded up from max|x| / 127 so that nothing clips. A step is then at most 2 ** (1/8) (9 %) coarser than the
exact max|x| / 127, while a two-byte scale would cost 3 % of the cache's bytes at head_dim 64 (6 % at 32).
"""

from __future__ import annotations

import math

import torch

SCALE_DTYPE = torch.uint8
QMAX = 127
STEPS = 8  # scale codes per octave
MIN_LOG2 = -20  # code 0 is 2**-20; vectors with max|x| under 127 * 2**-20 (1.2e-4) share that step
MAX_CODE = 255


def decode_scale(code: torch.Tensor) -> torch.Tensor:
    """Scale codes -> float32 scales."""
    return torch.exp2(code * (1 / STEPS) + MIN_LOG2)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] (any float dtype) -> (int8 [..., D], scale codes [...]) with x ≈ q * decode_scale(code)."""
    xf = x.float()
    amax = xf.abs().amax(-1)  # an all-zero vector: log2 is -inf, code 0, q 0
    code = ((amax.log2() - (math.log2(QMAX) + MIN_LOG2)) * STEPS).ceil_().clamp_(0, MAX_CODE).to(SCALE_DTYPE)
    q = (xf / decode_scale(code).unsqueeze(-1)).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, code


def dequantize(q: torch.Tensor, code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize`, in `dtype`: one multiply that reads the int8 values directly."""
    return torch.mul(q, decode_scale(code).to(dtype).unsqueeze(-1))
