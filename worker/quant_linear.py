"""Weight-only quantized linears (`--weights`), quantized at load from the dense weights (docs/architecture.md,
worker section).

At a decode step of a few sequences a CPU matmul is bound by reading its weights, so reading int8 (a quarter
of float32's bytes) or int4 weights is faster; at large batches the dense bf16/fp32 kernels win again
(measured in docs/architecture.md). The modes:

- dense: the checkpoint's weights in the model's dtype (exactly the transformers reference in float32).
- int8: per output channel symmetric int8, run by torch._weight_int8pack_mm.
- int4: groups of INT4_GROUP input channels, asymmetric (scale and zero per group), run by
  torch._weight_int4pack_mm_for_cpu on the packed layout of torch._convert_weight_to_int4pack_for_cpu.
  A linear whose input size is not a multiple of INT4_GROUP (or output size of 16) gets int8 instead.
- auto: int4 and the dense weights both kept; a step of at most AUTO_MAX_TOKENS tokens runs int4, a larger
  one dense. Costs the int4 copy's memory (about 30 % more than bfloat16 alone, 15 % more than float32).

The LM head is int8 under int4 and auto: a 4-bit head cost 3.5 % perplexity on SmolLM2, an int8 one 0.1 %.

Only the decoder's linears and the LM head are quantized; the embedding stays dense (a lookup reads a few rows).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

WeightsMode = Literal["auto", "dense", "int8", "int4"]
WEIGHTS_MODES: tuple[WeightsMode, ...] = ("auto", "dense", "int8", "int4")
INT4_GROUP = 32
# The kernels run in bfloat16 whatever the model's dtype: their float32 paths are 7-20x slower here (measured,
# docs/architecture.md), so a float32 model's activations are rounded to bfloat16 for a quantized matmul.
KERNEL_DTYPE = torch.bfloat16
# The largest step (in tokens) that auto runs quantized: int4 beats dense bf16 up to about here (measured).
AUTO_MAX_TOKENS = 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> int8 [N, K] and float32 scales [N]: w ~ q * scale, per output channel."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
    return (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8), scales


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> int32 codes [N, K] in 0..15 and float32 scales_and_zeros [K / group, N, 2], in the
    convention of torch's int4 kernels: w ~ (q - 8) * scale + zero."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scales = ((hi - lo) / 15).clamp(min=1e-10)
    codes = ((w - lo) / scales).round_().clamp_(0, 15).to(torch.int32).reshape(n, k)
    zeros = lo + 8 * scales
    return codes, torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def dequantize_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """What quantize_int4's output stands for, as float32 [N, K] (for tests and quality checks)."""
    n, k = codes.shape
    sz = scales_and_zeros.transpose(0, 1)  # [N, K / group, 2]
    return ((codes.reshape(n, k // group, group).float() - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)


class QuantLinear(nn.Module):
    """y = x W^T + b with W int8 or int4; with `keep_dense`, steps over `max_tokens` rows use the dense W."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kind: Literal["int8", "int4"],
        keep_dense: bool = False,
        max_tokens: int = AUTO_MAX_TOKENS,
    ) -> None:
        super().__init__()
        if kind == "int4" and (weight.shape[1] % INT4_GROUP or weight.shape[0] % 16):
            kind = "int8"  # torch's int4 packing wants whole groups and rows in sixteens
        self.kind, self.max_tokens = kind, max_tokens
        self.dense = weight if keep_dense else None
        self.bias = bias
        if kind == "int8":
            q, scales = quantize_int8(weight)
            self.q, self.scales = q, scales.to(KERNEL_DTYPE)
        else:
            codes, sz = quantize_int4(weight)
            self.q, self.scales = torch._convert_weight_to_int4pack_for_cpu(codes, 1), sz.to(KERNEL_DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > self.max_tokens:
            return F.linear(x, self.dense, self.bias)
        xk = x.to(KERNEL_DTYPE).contiguous()
        if self.kind == "int8":
            y = torch._weight_int8pack_mm(xk, self.q, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xk, self.q, INT4_GROUP, self.scales)
        y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        dense = f", dense above {self.max_tokens} tokens" if self.dense is not None else ""
        return f"{self.kind}, out={self.q.shape[0]}{dense}"


def quantize_weights(model: Any, mode: WeightsMode, max_tokens: int = AUTO_MAX_TOKENS) -> None:
    """Swap a worker.model.Transformer's linears (and LM head) for QuantLinear in place; `dense` leaves it as
    is. CPU only: torch's int4 kernel here is the CPU one."""
    if mode == "dense":
        return
    if mode not in WEIGHTS_MODES:
        raise ValueError(f"unknown weights mode {mode!r}; one of {', '.join(WEIGHTS_MODES)}")
    kind: Literal["int8", "int4"] = "int8" if mode == "int8" else "int4"
    keep = mode == "auto"

    def swap(lin: nn.Linear) -> QuantLinear:
        return QuantLinear(lin.weight, lin.bias, kind, keep, max_tokens)

    for layer in model.layers:
        layer.attn.qkv, layer.attn.o = swap(layer.attn.qkv), swap(layer.attn.o)
        layer.mlp.gate_up, layer.mlp.down = swap(layer.mlp.gate_up), swap(layer.mlp.down)
    head: nn.Module = model.embed if model.lm_head is None else model.lm_head
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    # The LM head stays int8 under int4 (see the module docstring).
    model.head = QuantLinear(weight, None, "int8", keep, max_tokens)
    model.lm_head = None  # tied or not, the head is model.head now (its dense weight kept by auto)
