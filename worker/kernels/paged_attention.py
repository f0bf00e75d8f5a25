"""Decode attention read straight from the paged KV cache, and int8 cache writes: CPU kernels
(paged_attention.cpp) behind worker/attention.py and worker/kv_cache.py.

Why: the torch path gathers each decoding sequence's blocks into a contiguous copy per layer before SDPA,
and for an int8 cache dequantizes that copy (two more passes over it), so an int8 cache decoded slower than
a bfloat16 one although it holds half the bytes. The kernel reads each cached row once where it lies, in
what the cache holds (int8 with its scales, bfloat16 or float32), and computes in float32. The int8 write
quantizes and scatters a step's K or V in one pass instead of the ~15 torch ops of kv_quant.quantize (whose
rounding it follows; both are tested against each other). Prefill chunks keep the torch path: their time is
in matmuls, not in reading the cache.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from worker.kernels.build import load
from worker.kv_quant import MAX_CODE, MIN_LOG2, QMAX, STEPS, decode_scale

_lib = load("paged_attention")
_DECODE = {torch.int8: "decode_int8", torch.bfloat16: "decode_bf16", torch.float32: "decode_f32"}
SCALES = decode_scale(torch.arange(MAX_CODE + 1))  # code -> float32 scale, exactly as kv_quant decodes it


class _Shape(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_int64)
            for name in ("seqs", "heads", "kv_heads", "dim", "groups", "block_size", "max_blocks", "window")
        ),
        ("softmax_scale", ctypes.c_float),
    ]


class _Tail(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("k", "v", "lo", "rows")]


@dataclass(slots=True)
class Tails:
    """An int8 cache's full-precision tails (worker/kv_cache.py) as one decode reads them: positions p >= lo[s] of
    sequence s add row rows[s, p % block_size] of k/v ([rows, KV, D] bfloat16: what int8 lost) to their blocks'."""

    k: torch.Tensor
    v: torch.Tensor
    lo: torch.Tensor  # [S] int64 (a sequence without a tail: its length)
    rows: torch.Tensor  # [S * block_size] int64


def supports(data: torch.Tensor) -> bool:
    """Whether the kernels can read a cache tensor like `data` (built, on the CPU, a dtype they know)."""
    return _lib is not None and data.device.type == "cpu" and data.dtype in _DECODE and data.is_contiguous()


def _loaded() -> ctypes.CDLL:
    if _lib is None:
        raise RuntimeError("the paged_attention kernels are not built here (no C++ compiler?); check supports()")
    return _lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decode(
    q: torch.Tensor,
    k_data: torch.Tensor,
    v_data: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    tails: Tails | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its cached positions [length - window, length).

    q: [S, H, D]; k_data, v_data: [blocks, block_size, KV, D] (int8 with k_scales/v_scales [blocks, block_size,
    KV, groups] codes and optionally tails, or bfloat16/float32); tables: [S * B] int64 block ids; lengths: [S]
    int64 positions cached (this step's included). Returns [S, H, D] in q's dtype.
    """
    seqs, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_data.shape
    shape = _Shape(
        seqs,
        heads,
        kv_heads,
        dim,
        1 if k_scales is None else k_scales.shape[-1],
        block_size,
        tables.numel() // max(seqs, 1),
        window or 0,
        1 / math.sqrt(dim),
    )
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    tail = None
    if tails is not None:
        assert k_data.dtype == torch.int8 and tails.k.dtype == tails.v.dtype == torch.bfloat16
        tail = _Tail(*(t.data_ptr() for t in (tails.k, tails.v, tails.lo, tails.rows)))
    getattr(_loaded(), _DECODE[k_data.dtype])(
        ctypes.c_void_p(qf.data_ptr()),
        ctypes.c_void_p(k_data.data_ptr()),
        ctypes.c_void_p(_ptr(k_scales)),
        ctypes.c_void_p(v_data.data_ptr()),
        ctypes.c_void_p(_ptr(v_scales)),
        ctypes.c_void_p(SCALES.data_ptr()),
        ctypes.c_void_p(tables.data_ptr()),
        ctypes.c_void_p(lengths.data_ptr()),
        ctypes.byref(shape),
        None if tail is None else ctypes.byref(tail),
        ctypes.c_void_p(out.data_ptr()),
    )
    return out.to(q.dtype)


def quantize_write(
    x: torch.Tensor,
    slots: torch.Tensor,
    data: torch.Tensor,
    codes: torch.Tensor,
    tail_rows: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
) -> None:
    """x [T, KV, D] (rotated, any float dtype) quantized into int8 rows `slots` of data [rows, KV, D] and their
    scale codes into codes [rows, KV, groups], as kv_quant.quantize would; where tail_rows [T] (int64) is >= 0,
    what that lost (x - dequantized) also goes to that row of tail [tail rows, KV, D] (bfloat16)."""
    xf = x.float().contiguous()
    rows, kv_heads, dim = xf.shape
    if tail is not None:
        assert tail_rows is not None and tail.dtype == torch.bfloat16 and tail_rows.numel() == rows
    _loaded().quantize_write(
        ctypes.c_void_p(xf.data_ptr()),
        ctypes.c_void_p(slots.data_ptr()),
        ctypes.c_int64(rows),
        ctypes.c_int64(kv_heads),
        ctypes.c_int64(dim),
        ctypes.c_int64(codes.shape[-1]),
        ctypes.c_void_p(SCALES.data_ptr()),
        ctypes.c_float(math.log2(QMAX) + MIN_LOG2),
        ctypes.c_float(STEPS),
        ctypes.c_float(QMAX),
        ctypes.c_void_p(data.data_ptr()),
        ctypes.c_void_p(codes.data_ptr()),
        ctypes.c_void_p(_ptr(tail_rows if tail is not None else None)),
        ctypes.c_void_p(_ptr(tail)),
    )
