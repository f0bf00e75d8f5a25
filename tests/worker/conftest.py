"""Worker test fixtures. Helpers live in sibling modules (hf_models.py); tests reach them through fixtures.

hf_models is imported lazily: it pulls in `transformers`, which tests that do not compare against it skip.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="session")
def hf() -> ModuleType:
    """The hf_models helpers: ARCH_CONFIGS, save_checkpoint, Seq, Driver, check_against_hf."""
    import hf_models  # this folder is on sys.path (rootdir-based discovery)

    return hf_models


@pytest.fixture(scope="session")
def hf_checkpoint(
    hf: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """`hf_checkpoint(arch, shard=False)` -> (checkpoint dir, the HF model), written once per session."""
    made: dict[tuple[str, bool], tuple[Path, torch.nn.Module]] = {}

    def get(arch: str, shard: bool = False) -> tuple[Path, torch.nn.Module]:
        if (arch, shard) not in made:
            path = tmp_path_factory.mktemp(arch)
            made[arch, shard] = (path, hf.save_checkpoint(arch, path, shard=shard))
        return made[arch, shard]

    return get
