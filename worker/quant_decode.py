"""The decode fast path of quantized weights on the CPU: every decoder layer of a step in one C++ call
(worker/kernels/decode_step.cpp).

Why: at batch 1 a decode step of SmolLM2 moves ~95 MB of int4/int8 weights (~2 ms at this machine's memory
bandwidth), but through torch it runs ~25 ops a layer, 750 a step, each costing microseconds of dispatch: the
ops, not the weights, set the pace (docs/architecture.md, "CPU decode of quantized weights"). Here each layer
is the RMSNorm fused into the q/k/v matmul, RoPE and the cache write, decode attention (paged_attention.cpp),
the output matmul adding into the residual, the RMSNorm fused into gate/up, and the SiLU gating fused into down
adding into the residual; the residual stream stays float32 throughout.

When: a step whose every sequence decodes one token, no more tokens than the quantized linears' `max_tokens`
(above it `auto` weights run dense), a KV cache read by the CPU kernels (bfloat16, float32, or int8 with its
rotation and full-precision tails, worker/kv_cache.py), and every linear of the model quantized
(worker/quant_linear.py). Anything else runs the model's own
forward, which computes the same thing op by op, up to rounding: here the residual stays float32 and the norms
are fused, so an int8 activation can land one step apart (tests compare the two).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from worker.attention import AttentionMetadata
from worker.kernels import decode_step as kernel
from worker.kernels import paged_attention
from worker.kernels.quant_matmul import Packed
from worker.kv_cache import Int8Store, PlainStore
from worker.kv_quant import MIN_LOG2, QMAX, STEPS, groups


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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
        rotation = cache.rotation.float().contiguous()  # QR's factor may come column-major
        self._keep.append(rotation)
        int8 = kernel.Int8Cache(
            groups(cfg.head_dim), rotation.data_ptr(), paged_attention.SCALES.data_ptr(),
            math.log2(QMAX) + MIN_LOG2, STEPS, QMAX,
        )  # fmt: skip
        self._model = kernel.Model(
            cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cache.block_size, self.bits, int(cache.dtype == torch.bfloat16), 0,
            cfg.rms_norm_eps, None, int8,
        )  # fmt: skip

    @staticmethod
    def build(model: Any, cache: Any) -> DecodeStep | None:
        """The fast path for this model and cache, or None where it cannot run (see the module docstring)."""
        if not kernel.available() or cache.dtype not in (torch.bfloat16, torch.float32):
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
            and num_tokens <= self.max_tokens
            and type(d) in (PlainStore, Int8Store)  # what the kernel writes as they do (their write() is not called)
            and d.kernel
        )

    def _bind(self) -> None:
        """Point the layers' structs at the cache's current stores (they change when an auto cache converts)."""
        if self._layers_for is self.cache.layers:
            return
        arr = (kernel.Layer * len(self._weights))()
        for i, ((ws, norms), (k, v)) in enumerate(zip(self._weights, self.cache.layers, strict=True)):
            stores = [t.data_ptr() for t in (k.data, v.data)]
            int8 = [_ptr(k.scales), _ptr(v.scales), _ptr(k.tail), _ptr(v.tail)]
            arr[i] = kernel.Layer(*ws, norms[0].data_ptr(), norms[1].data_ptr(), *stores, *int8)
        self._arr = arr
        self._model.layer = ctypes.cast(arr, ctypes.POINTER(kernel.Layer))
        self._model.cache_int8 = int(self.cache.layers[0][0].data.dtype == torch.int8)
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
        lo, rows = d.tail_index if d.tail_index is not None else (None, None)
        step = kernel.Step(
            m, d.blocks.numel() // m, d.window or 0,
            cos.data_ptr(), sin.data_ptr(), meta.slots.data_ptr(), d.blocks.data_ptr(), d.lengths.data_ptr(),
            _ptr(meta.tail_rows), _ptr(lo), _ptr(rows),
        )  # fmt: skip
        kernel.run(self._model, step, x.data_ptr())
        return model.norm(x.to(model.embed.weight.dtype))
