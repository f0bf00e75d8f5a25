"""The paged KV cache: per layer, K and V tensors of [num_blocks, block_size, kv_heads, head_dim].

Which block belongs to which sequence is decided by the control plane; the worker only holds the tensors
and copies blocks when asked (copy-on-write of a shared, partially filled block).
"""

from __future__ import annotations

import torch

from worker.config import WorkerSettings
from worker.model import ModelConfig

CPU_DEFAULT_BUDGET_BYTES = 256 * 2**20


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many whole blocks fit in `budget_bytes`."""
    return budget_bytes // block_bytes(config, block_size, dtype)


def budget_bytes(settings: WorkerSettings, device: torch.device) -> int:
    """The cache budget: kv_cache_mb when set; else a fraction of free CUDA memory (call after loading the
    weights, so they are not counted as free), or 256 MiB on CPU."""
    if settings.kv_cache_mb > 0:
        return settings.kv_cache_mb * 2**20
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * settings.kv_cache_fraction)
    return CPU_DEFAULT_BUDGET_BYTES


class KVCache:
    """Zero-filled K/V tensors (zeros, not garbage: a NaN under a masked-out slot would still poison SDPA)."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"KV cache needs at least one block, got {num_blocks} (raise kv_cache_mb?)")
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src to block dst for each (src, dst) pair, in every layer."""
        if not pairs:
            return
        device = self.layers[0][0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]
