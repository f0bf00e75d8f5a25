"""Every decoder layer of a decode step in one C++ call (decode_step.cpp): its argument structs and the call.
worker/quant_decode.py says when and why it runs, and builds the structs from a model and its KV cache."""

from __future__ import annotations

import ctypes

from worker.kernels.build import load

_lib = load("decode_step")


class Weight(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("codes", "d", "mins", "bias")]


class Layer(ctypes.Structure):
    _fields_ = [
        *((name, Weight) for name in ("qkv", "o", "gate_up", "down")),
        *((name, ctypes.c_void_p) for name in ("attn_norm", "mlp_norm", "k_cache", "v_cache")),
        *((name, ctypes.c_void_p) for name in ("k_codes", "v_codes", "k_tail", "v_tail")),
    ]


class Int8Cache(ctypes.Structure):
    _fields_ = [
        ("groups", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in ("rotation", "scales")),
        *((name, ctypes.c_float) for name in ("offset", "steps", "qmax")),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_int64)
            for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size", "bits")
        ),
        *((name, ctypes.c_int64) for name in ("cache_bf16", "cache_int8")),
        ("eps", ctypes.c_float),
        ("layer", ctypes.POINTER(Layer)),
        ("int8", Int8Cache),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("m", "max_blocks", "window")),
        *((name, ctypes.c_void_p) for name in ("cos", "sin", "slots", "tables", "lengths")),
        *((name, ctypes.c_void_p) for name in ("tail_rows", "tail_lo", "tail_index")),
    ]


def available() -> bool:
    """Whether the kernel is built here (a C++ compiler was found)."""
    return _lib is not None


def run(model: Model, step: Step, x: int) -> None:
    """The layers of `model` over the step, on x (the address of [m, hidden] float32 embeddings; the last
    layer's output, before the final norm, replaces them)."""
    if _lib is None:
        raise RuntimeError("the decode_step kernel is not built here (no C++ compiler?); check available()")
    _lib.decode_step(ctypes.byref(model), ctypes.byref(step), ctypes.c_void_p(x))
