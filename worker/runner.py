"""The model runner: one forward pass over a packed batch, through the paged KV cache.

It executes what the engine decided (which tokens, which blocks); it decides nothing itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from worker.attention import build_metadata
from worker.batch import PackedBatch
from worker.config import WorkerSettings
from worker.device import resolve_device, resolve_dtype
from worker.kv_cache import KVCache, KVDtype, blocks_for_budget, budget_bytes
from worker.loaded import LoadedModel
from worker.loading import load_model
from worker.model import Transformer
from worker.quant_decode import DecodeStep


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: KVDtype = "model",
        kernels: bool = True,
    ) -> None:
        if not isinstance(loaded.model, Transformer):
            raise TypeError(f"expected a worker.model.Transformer, got {type(loaded.model).__name__}")
        self.loaded, self.model = loaded, loaded.model
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device, self.dtype = device, dtype
        self.max_context = loaded.config.max_position_embeddings
        self.cache = KVCache(loaded.config, num_blocks, block_size, device, dtype, kv_dtype, kernels)
        # Decode steps of quantized weights: every layer in one C++ call (None where it cannot run).
        self.decode_step = DecodeStep.build(self.model, self.cache) if kernels else None

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> ModelRunner:
        """Resolve device and dtype, load the model, then size the cache from what memory is left."""
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        cache_dir = Path(settings.cache_dir).expanduser() if settings.cache_dir else None
        loaded = load_model(settings.model, device, dtype, settings.builtin_seed, cache_dir, weights=settings.weights)
        budget = budget_bytes(settings, device)
        kv = settings.kv_cache_dtype
        num_blocks = blocks_for_budget(loaded.config, settings.block_size, dtype, budget, kv)
        return cls(loaded, num_blocks, settings.block_size, device, dtype, kv, settings.cpu_kernels)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, all_logits: bool = False) -> torch.Tensor:
        """Float32 logits of each sequence's last new token ([num_seqs, vocab], in `batch.seqs` order), or of
        every new token ([T, vocab]) when `all_logits`."""
        window = self.loaded.config.sliding_window
        cache = self.cache
        kernel = cache.layers[0][0].kernel
        meta = build_metadata(batch, self.block_size, window, self.device, self.dtype, cache.block_div, kernel)
        model = self.model
        tokens = batch.token_ids.to(self.device, non_blocking=True)
        positions = batch.positions.to(self.device, non_blocking=True)
        if self.decode_step is not None and self.decode_step.takes(batch.num_tokens, meta):
            hidden = self.decode_step(tokens, positions, meta)
        else:
            hidden = model(tokens, positions, self.cache.layers, meta)
        if not all_logits:
            last, ends = 0, []
            for s in batch.seqs:
                last += s.num_tokens
                ends.append(last - 1)
            if len(ends) < hidden.shape[0]:
                hidden = hidden[torch.tensor(ends, device=self.device)]
        return model.logits(hidden).float()

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's K/V into block dst, for each (src, dst)."""
        self.cache.copy_blocks(pairs)

    @torch.inference_mode()
    def kv_to_int8(self) -> None:
        """Convert an auto cache to int8 in place (every block keeps its id)."""
        self.cache.to_int8()
