"""Weight-only quantized linears (`--weights`), quantized at load from the dense weights (docs/architecture.md,
worker section).

At a decode step of a few sequences a CPU matmul is bound by reading its weights and by each op's fixed cost,
so reading int4 or int8 weights through worker/kernels/quant_matmul.cpp is faster; at large batches the dense
bf16/fp32 kernels win again (measured in docs/architecture.md). The modes:

- dense: the checkpoint's weights in the model's dtype (exactly the transformers reference in float32).
- int8: groups of 32 input channels, symmetric, a float16 scale each (llama.cpp's Q8_0).
- int4: groups of 32, asymmetric (float16 scale and minimum; llama.cpp's Q4_1, the format of SmolLM2's GGUF
  file).
- auto: int4 and the dense weights both kept; a step of at most AUTO_MAX_TOKENS tokens (QUANT_MAX_TOKENS for
  a float32 model) runs int4, a larger one dense. Costs the int4 copy's memory (about 30 % more than bfloat16
  alone, 15 % more than float32).

The kernel quantizes each step's activations to int8 per group of 32 as llama.cpp does. A step of more than
QUANT_MAX_TOKENS tokens (a prefill) under int8 or int4 dequantizes each weight and runs the dense matmul: there
the matmul's arithmetic, not its weights' bytes, sets the pace. The LM head is int8 under int4 and auto: with a
4-bit head SmolLM2's perplexity rose 3.9 % over dense bfloat16, with an int8 one 0.32 % (bench/perplexity.py).
Only the decoder's linears and the LM head are quantized; the embedding stays dense (a lookup reads a few
rows). A linear whose input size is not a multiple of 32 stays dense.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels import quant_matmul

log = logging.getLogger(__name__)

WeightsMode = Literal["auto", "dense", "int8", "int4"]
WEIGHTS_MODES: tuple[WeightsMode, ...] = ("auto", "dense", "int8", "int4")
# The largest step (in tokens) that runs the quantized kernel. int8/int4: the kernel beats dequantizing every
# weight for the step up to about here. auto: int4 beats its dense copy up to about here in bfloat16; in
# float32, whose dense matmuls are slower, up to QUANT_MAX_TOKENS (all measured, docs/architecture.md).
QUANT_MAX_TOKENS = 128
AUTO_MAX_TOKENS = 16


class QuantLinear(nn.Module):
    """y = x W^T + b with W int8 or int4 (quant_matmul.Packed); steps over `max_tokens` rows run dense, on the
    kept dense W (`keep_dense`) or on W dequantized for the step."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bits: Literal[4, 8],
        keep_dense: bool = False,
        max_tokens: int = QUANT_MAX_TOKENS,
    ) -> None:
        super().__init__()
        self.packed = quant_matmul.pack(weight, bits)
        self.max_tokens = max_tokens
        self.dense = weight if keep_dense else None
        self.bias = bias
        self.bias32 = None if bias is None else bias.detach().float().contiguous()  # what the kernel adds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_tokens:
            w = self.dense if self.dense is not None else quant_matmul.unpack(self.packed).to(x.dtype)
            return F.linear(x, w, self.bias)
        if x.dtype in (torch.float32, torch.bfloat16):
            return quant_matmul.matmul(x, self.packed, self.bias32)
        return quant_matmul.matmul(x.float(), self.packed, self.bias32).to(x.dtype)

    def extra_repr(self) -> str:
        n, k = self.packed.shape
        dense = f", dense above {self.max_tokens} tokens" if self.dense is not None else ""
        return f"int{self.packed.bits}, in={k}, out={n}{dense}"


def quantize_weights(model: Any, mode: WeightsMode, max_tokens: int | None = None) -> None:
    """Swap a worker.model.Transformer's linears (and LM head) for QuantLinear in place; `dense` leaves it as
    is. CPU only. Without the kernel (no C++ compiler) the weights stay dense, with a warning."""
    if mode == "dense":
        return
    if mode not in WEIGHTS_MODES:
        raise ValueError(f"unknown weights mode {mode!r}; one of {', '.join(WEIGHTS_MODES)}")
    if not quant_matmul.available():
        log.warning("--weights %s: the quantized kernel is not built here (no C++ compiler?); weights stay dense", mode)
        return
    bits: Literal[4, 8] = 8 if mode == "int8" else 4
    keep = mode == "auto"
    if max_tokens is None:
        dtype = model.embed.weight.dtype
        max_tokens = AUTO_MAX_TOKENS if keep and dtype != torch.float32 else QUANT_MAX_TOKENS

    def swap(lin: nn.Linear) -> nn.Module:
        if not quant_matmul.supports(lin.weight):
            return lin
        bias = None if lin.bias is None else lin.bias.detach()
        return QuantLinear(lin.weight.detach(), bias, bits, keep, max_tokens)

    for layer in model.layers:
        layer.attn.qkv, layer.attn.o = swap(layer.attn.qkv), swap(layer.attn.o)
        layer.mlp.gate_up, layer.mlp.down = swap(layer.mlp.gate_up), swap(layer.mlp.down)
    head: nn.Module = model.embed if model.lm_head is None else model.lm_head
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    if quant_matmul.supports(weight):
        # The LM head stays int8 under int4 (see the module docstring).
        model.head = QuantLinear(weight.detach(), None, 8, keep, max_tokens)
        model.lm_head = None  # tied or not, the head is model.head now (its dense weight kept by auto)
