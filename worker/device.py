"""Where the model runs and in which dtype. `--dtype auto` is bfloat16 on CUDA and on CPUs that multiply
bfloat16 natively (x86 AVX512-BF16 or AMX, Arm BF16), float32 on other CPUs, where bfloat16 matmuls are
emulated and slower than float32."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# /proc/cpuinfo flags of native bfloat16 matrix instructions: x86 "flags", Arm "Features".
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
        return torch.bfloat16
    return torch.float32


def native_bf16(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo text lists a native bfloat16 matrix instruction set."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features") and NATIVE_BF16_FLAGS & set(value.split()):
            return True
    return False


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Probed once per process; False where /proc/cpuinfo is not readable (not Linux)."""
    try:
        return native_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False
