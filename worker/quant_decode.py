"""The decode fast path of quantized weights on the CPU: every decoder layer of a step in one C++ call
(worker/kernels/decode_step.cpp).

Why: at batch 1 a decode step of SmolLM2 moves ~95 MB of int4/int8 weights (~2 ms at this machine's memory
bandwidth), but through torch it runs ~25 ops a layer, 750 a step, each costing microseconds of dispatch: the
ops, not the weights, set the pace (docs/architecture.md, "CPU decode of quantized weights"). Here each layer
is the RMSNorm fused into the q/k/v matmul, RoPE and the cache write, decode attention (paged_attention.cpp),
the output matmul adding into the residual, the RMSNorm fused into gate/up, and the SiLU gating fused into down
adding into the residual; the residual stream stays float32 throughout.

When: a step whose every sequence decodes one token, no more tokens than the quantized linears' `max_tokens`
(above it `auto` weights run dense), a KV cache in the model's dtype (bfloat16 or float32) read by the CPU
kernels, and every linear of the model quantized (worker/quant_linear.py). Anything else runs the model's own
forward, which computes the same thing op by op, up to rounding: here the residual stays float32 and the norms
are fused, so an int8 activation can land one step apart (tests compare the two).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from worker.attention import AttentionMetadata
from worker.kernels import decode_step as kernel
from worker.kernels.quant_matmul import Packed
from worker.kv_cache import PlainStore


def _linears(layer: Any) -> tuple[Any, ...]:
    """A decoder layer's linears, in the order decode_step.cpp's Layer holds them."""
    return layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down


def _weight(linear: Any) -> tuple[kernel.Weight, list[torch.Tensor]]:
    p: Packed = linear.packed
    bias = linear.bias32
    keep = [t for t in (p.codes, p.d, p.m, bias) if t is not None]
    ptr = [None if t is None else t.data_ptr() for t in (p.codes, p.d, p.m, bias)]
    return kernel.Weight(*ptr), keep


class DecodeStep:
    """The decode fast path of one model over one KV cache; `takes` says whether a step can use it."""

    def __init__(self, model: Any, cache: Any) -> None:
        cfg = model.config
        self.model, self.cache = model, cache
        self.max_tokens = model.layers[0].attn.qkv.max_tokens
        self.bits = model.layers[0].attn.qkv.packed.bits
        self._keep: list[torch.Tensor] = []
        weights = []
        for layer in model.layers:
            ws = []
            for lin in _linears(layer):
                w, keep = _weight(lin)
                ws.append(w)
                self._keep += keep
            # float32 copies, taken once: weights are loaded once per process
            norms = [n.weight.detach().float().contiguous() for n in (layer.attn_norm, layer.mlp_norm)]
            self._keep += norms
            weights.append((ws, norms))
        self._weights = weights
        self._layers_for: object = None  # the cache.layers list the C structs point into
        self._model = kernel.Model(
            cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cache.block_size, self.bits, int(cache.dtype == torch.bfloat16),
            cfg.rms_norm_eps, None,
        )  # fmt: skip

    @staticmethod
    def build(model: Any, cache: Any) -> DecodeStep | None:
        """The fast path for this model and cache, or None where it cannot run (see the module docstring)."""
        if not kernel.available() or cache.dtype not in (torch.bfloat16, torch.float32) or cache.kv_dtype == "int8":
            return None
        linears = [lin for layer in model.layers for lin in _linears(layer)]
        if any(getattr(lin, "packed", None) is None for lin in linears):
            return None  # a linear left dense
        bits = {lin.packed.bits for lin in linears}
        return DecodeStep(model, cache) if len(bits) == 1 else None

    def takes(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        d = self.cache.layers[0][0]
        return (
            meta.prefill is None
            and meta.decode is not None
            and meta.tail_rows is None
            and num_tokens <= self.max_tokens
            and type(d) is PlainStore  # the stores' own write() is not called here
            and d.kernel
        )

    def _bind(self) -> None:
        """Point the layers' structs at the cache's current stores (they change when an auto cache converts)."""
        if self._layers_for is self.cache.layers:
            return
        arr = (kernel.Layer * len(self._weights))()
        for i, ((ws, norms), (k, v)) in enumerate(zip(self._weights, self.cache.layers, strict=True)):
            arr[i] = kernel.Layer(*ws, norms[0].data_ptr(), norms[1].data_ptr(), k.data.data_ptr(), v.data.data_ptr())
        self._arr = arr
        self._model.layer = ctypes.cast(arr, ctypes.POINTER(kernel.Layer))
        self._layers_for = self.cache.layers

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, in the model's dtype (as Transformer.forward)."""
        assert meta.decode is not None
        self._bind()
        model = self.model
        x = model.embed(tokens).float()
        cos, sin = model.rope(positions, torch.float32)
        d = meta.decode
        m = x.shape[0]
        # The kernel writes and reads the cache at these rows unchecked: out of range is an error here, as
        # index_copy_ makes it on the forward's path.
        store = self.cache.layers[0][0].data
        if int(meta.slots.max()) >= store.shape[0] * store.shape[1] or int(d.blocks.max()) >= store.shape[0]:
            raise IndexError(f"a slot or block beyond the KV cache's {store.shape[0]} blocks")
        step = kernel.Step(
            m, d.blocks.numel() // m, d.window or 0,
            cos.data_ptr(), sin.data_ptr(), meta.slots.data_ptr(), d.blocks.data_ptr(), d.lengths.data_ptr(),
        )  # fmt: skip
        kernel.run(self._model, step, x.data_ptr())
        return model.norm(x.to(model.embed.weight.dtype))
