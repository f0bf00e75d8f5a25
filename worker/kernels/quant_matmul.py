"""Weight-only quantized matmuls for small batches on the CPU (quant_matmul.cpp), behind worker/quant_linear.py.

Why: a decode step of a few sequences reads every weight once per step, so on a CPU it is bound by memory
bandwidth, and by the fixed cost of each op. Reading 4-bit weights moves a quarter of bfloat16's bytes. The
kernel quantizes the activations to int8 per group of 32 (llama.cpp's way), so each group's 32 products are one
integer instruction, and it takes in what surrounds a linear in a decoder layer (the RMSNorm before it, the
SiLU gating before the MLP's down projection, the residual add after it), so one call replaces up to five ops.

The formats, per output channel (row of W [N, K]), per group of 32 input channels:
- int4 (`bits=4`, llama.cpp's Q4_1): w ~ code * d + m, code in 0..15, d and m float16; the codes packed two per
  byte, a group's byte i holding element i (low nibble) and element 16 + i (high nibble). 0.625 bytes a weight.
- int8 (`bits=8`, llama.cpp's Q8_0): w ~ code * d, code in -127..127, d float16. 1.0625 bytes a weight.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Literal

import torch

from worker.kernels.build import load

GROUP = 32
_lib = load("quant_matmul")
_PROLOGUE = {None: 0, "rms_norm": 1, "silu_gate": 2}
Prologue = Literal["rms_norm", "silu_gate"] | None


class _Args(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("m", "n", "k", "bits", "x_bf16", "out_bf16", "prologue", "accumulate")),
        ("eps", ctypes.c_float),
    ]


@dataclass(slots=True)
class Packed:
    """A weight [n, k] in one of the formats above."""

    bits: int
    codes: torch.Tensor  # int4: uint8 [n, k / 2]; int8: int8 [n, k]
    d: torch.Tensor  # float16 [n, k / 32]
    m: torch.Tensor | None  # int4: float16 [n, k / 32]

    @property
    def shape(self) -> tuple[int, int]:
        n = self.codes.shape[0]
        return n, self.d.shape[1] * GROUP


def available() -> bool:
    """Whether the kernel is built here (a C++ compiler was found)."""
    return _lib is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether a weight [N, K] can be packed: whole groups of input channels."""
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0


def pack(weight: torch.Tensor, bits: Literal[4, 8]) -> Packed:
    """Quantize weight [N, K] (K a multiple of 32): int4 min/max per group, int8 absmax per group; the scales are
    rounded to float16 first and the codes chosen against the rounded ones."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    if bits == 8:
        d = (w.abs().amax(dim=-1) / 127).to(torch.float16)
        safe = d.float().clamp(min=1e-30)[..., None]
        codes = (w / safe).round_().clamp_(-127, 127).to(torch.int8).reshape(n, k)
        return Packed(8, codes.contiguous(), d.contiguous(), None)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    m = lo.to(torch.float16)
    d = ((hi - m.float()) / 15).to(torch.float16)
    safe = d.float().clamp(min=1e-30)[..., None]
    q = ((w - m.float()[..., None]) / safe).round_().clamp_(0, 15).to(torch.uint8)  # [n, groups, 32]
    codes = q[..., :16] | (q[..., 16:] << 4)
    return Packed(4, codes.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous())


def unpack(p: Packed) -> torch.Tensor:
    """What a Packed weight stands for, float32 [N, K] (for tests, quality checks and large steps)."""
    n, k = p.shape
    d = p.d.float()[..., None]
    if p.bits == 8:
        return (p.codes.reshape(n, k // GROUP, GROUP).float() * d).reshape(n, k)
    assert p.m is not None
    c = p.codes.reshape(n, k // GROUP, 16)
    q = torch.cat([c & 0x0F, c >> 4], dim=-1).float()
    return (q * d + p.m.float()[..., None]).reshape(n, k)


def _plain(t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return t is not None and t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous() and not t.is_cuda


def matmul(
    x: torch.Tensor,
    p: Packed,
    bias: torch.Tensor | None = None,
    prologue: Prologue = None,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """f(x) @ W^T (+ bias) for x [M, K] (float32 or bfloat16; [M, 2K] for silu_gate), in x's dtype.

    f: None (x), "rms_norm" (x * rsqrt(mean(x^2) + eps) * norm; norm float32 [K]) or "silu_gate"
    (silu(x[:, :K]) * x[:, K:]). With `out` ([M, N], x's dtype, contiguous) the result is added into it (a
    residual) and `out` returned. bias: float32 [N] or None.
    """
    if _lib is None:
        raise RuntimeError("the quant_matmul kernel is not built here (no C++ compiler?); check available()")
    n, k = p.shape
    width = 2 * k if prologue == "silu_gate" else k
    if x.dim() != 2 or x.shape[1] != width or x.dtype not in (torch.float32, torch.bfloat16) or x.is_cuda:
        raise ValueError(f"x must be a CPU float32 or bfloat16 [M, {width}], got {x.dtype} {list(x.shape)} {x.device}")
    x = x.contiguous()
    rows = x.shape[0]
    # The kernel reads and writes raw memory: every shape is checked here, never assumed.
    if prologue == "rms_norm" and not _plain(norm, torch.float32, (k,)):
        raise ValueError(f"rms_norm needs norm: a contiguous CPU float32 [{k}]")
    if bias is not None and not _plain(bias, torch.float32, (n,)):
        raise ValueError(f"bias must be a contiguous CPU float32 [{n}]")
    accumulate = out is not None
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype)
    elif not _plain(out, x.dtype, (rows, n)):
        raise ValueError(f"out must be a contiguous CPU {x.dtype} [{rows}, {n}]")
    bf16 = int(x.dtype == torch.bfloat16)
    args = _Args(rows, n, k, p.bits, bf16, bf16, _PROLOGUE[prologue], int(accumulate), eps)
    _lib.quant_matmul(
        ctypes.byref(args),
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_void_p(None if norm is None else norm.data_ptr()),
        ctypes.c_void_p(p.codes.data_ptr()),
        ctypes.c_void_p(p.d.data_ptr()),
        ctypes.c_void_p(None if p.m is None else p.m.data_ptr()),
        ctypes.c_void_p(None if bias is None else bias.data_ptr()),
        ctypes.c_void_p(out.data_ptr()),
    )
    return out
