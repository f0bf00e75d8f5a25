"""A loaded model as the worker serves it, and the one way every loader builds its Transformer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from worker.model import ModelConfig, Transformer, rope_inv_freq


class ModelLoadError(ValueError):
    """A model that cannot be loaded, said in one line naming the file and the problem (shown without a
    traceback by the CLI)."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    name: str
    architecture: str
    tokenizer_json: bytes
    eos_token_ids: list[int]
    bos_token_id: int | None  # None when the model has none
    # Jinja chat template ("" when the model has none) and the special token strings it may use
    # (bos_token, eos_token, unk_token, pad_token), as transformers' apply_chat_template passes them.
    chat_template: str = ""
    special_tokens: dict[str, str] = field(default_factory=dict)


INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_")


@contextmanager
def _no_init() -> Iterator[None]:
    """Skip nn.Linear / nn.Embedding's random init: the weights are replaced anyway, and init on the meta device
    goes through torch._refs, whose first use imports ~800 modules (about a second of every start)."""
    saved = {name: getattr(torch.nn.init, name) for name in INIT_FUNCTIONS}
    try:
        for name in INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def meta_transformer(config: ModelConfig) -> Transformer:
    """A Transformer whose parameters are shapes only (on the meta device)."""
    with torch.device("meta"), _no_init():
        return Transformer(config)


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    """A Transformer holding exactly the given tensors (built on the meta device: no throwaway init)."""
    model = meta_transformer(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(config).to(device)  # a non-persistent buffer: not in `state`
    return model.eval().requires_grad_(False)
