"""The paged KV cache: per layer, a K store and a V store of [num_blocks, block_size, kv_heads, head_dim].

Which block belongs to which sequence is decided by the control plane; the worker only holds the tensors,
copies blocks when asked (copy-on-write of a shared, partially filled block) and, with `auto`, converts the
whole cache to int8 when asked. What each kv_cache_dtype stores (docs/kv_cache.md):

- model: K/V in the model's dtype.
- int8: int8 K/V (rotated) plus a one-byte scale per (token, KV head, 32 channels) (worker/kv_quant.py),
  quantized as attention writes them and dequantized as it gathers a step's blocks.
- auto: one arena per layer, sized in int8 blocks ("units"). It starts in the model's dtype, where block b
  (a multiple of `units`, the dtype's size in bytes) spans units b .. b + units - 1; `to_int8` converts
  every block in place (b keeps its id, the other units become blocks of their own) and the cache stays
  int8 until `reset`.

Full-precision tails (int8, and auto once converted): a sequence may also hold TAIL_BLOCKS int8 blocks whose
bytes are read as bfloat16 rows, block_size of them, one per offset in a block. Every K/V written goes to its
int8 block as always and, when it lies in the sequence's last block, what int8 lost of it (x - dequantized x)
goes to the tail row of its offset; attention adds that back for the last block's positions, which it so reads
at about float32 precision. The newest positions are where int8 keys cost most greedy agreement
(docs/kv_cache.md); the int8 blocks stay complete, so prefix sharing, copies and the block manager need to
know nothing of tails.
"""

from __future__ import annotations

from typing import Literal

import torch

from worker.config import WorkerSettings
from worker.kernels import paged_attention
from worker.kv_quant import SCALE_DTYPE, dequantize, groups, quantize, rotation
from worker.model import ModelConfig

CPU_DEFAULT_BUDGET_BYTES = 256 * 2**20
KVDtype = Literal["model", "int8", "auto"]
CONVERT_CHUNK = 256  # blocks converted at a time by to_int8 (bounds its temporary memory)
TAIL_DTYPE = torch.bfloat16
TAIL_BLOCKS = 2  # int8 blocks one tail takes: block_size bfloat16 rows in the bytes of 2 x block_size int8 rows


def tail_blocks(kv_dtype: KVDtype, block_size: int) -> int:
    """Int8 blocks a sequence's full-precision tail takes (0: this cache keeps no tails)."""
    return TAIL_BLOCKS if kv_dtype != "model" and block_size % TAIL_BLOCKS == 0 else 0


def units_per_block(dtype: torch.dtype) -> int:
    """Int8 blocks one model-dtype block takes: its element size in bytes (2 for 16-bit dtypes, 4 for float32)."""
    return torch.empty((), dtype=dtype).element_size()


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: KVDtype = "model") -> int:
    """Bytes one block takes across all layers, K and V (with int8 or auto: one int8 block, scales included)."""
    vectors = 2 * config.num_layers * block_size * config.num_kv_heads
    if kv_dtype == "model":
        return vectors * config.head_dim * units_per_block(dtype)
    return vectors * (config.head_dim + groups(config.head_dim) * units_per_block(SCALE_DTYPE))


def blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int, kv_dtype: KVDtype = "model"
) -> int:
    """How many whole blocks fit in `budget_bytes` (with auto: int8 blocks, a multiple of units_per_block)."""
    n = budget_bytes // block_bytes(config, block_size, dtype, kv_dtype)
    return n - n % units_per_block(dtype) if kv_dtype == "auto" else n


def budget_bytes(settings: WorkerSettings, device: torch.device) -> int:
    """The cache budget: kv_cache_mb when set; else a fraction of free CUDA memory (call after loading the
    weights, so they are not counted as free), or 256 MiB on CPU."""
    if settings.kv_cache_mb > 0:
        return settings.kv_cache_mb * 2**20
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * settings.kv_cache_fraction)
    return CPU_DEFAULT_BUDGET_BYTES


class PlainStore:
    """K or V of one layer in the model's dtype."""

    rotation = None  # stored as they come
    scales = None
    tail = None  # exact already

    def __init__(self, data: torch.Tensor, kernels: bool) -> None:
        self.data = data  # [blocks, block_size, kv_heads, head_dim]
        self._rows = data.view(-1, *data.shape[2:])
        self.kernel = kernels and paged_attention.supports(data)

    def write(self, slots: torch.Tensor, x: torch.Tensor, tail_rows: torch.Tensor | None = None) -> None:
        """x: [T, kv_heads, head_dim] into rows `slots` (block * block_size + offset); `tail_rows` is ignored (a
        model-dtype store loses nothing)."""
        self._rows.index_copy_(0, slots, x)

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        """The blocks' K or V, [len(blocks), block_size, kv_heads, head_dim] in the model's dtype."""
        return self.data.index_select(0, blocks)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data[dst] = self.data[src]


class Int8Store:
    """K or V of one layer in int8, rotated by `rotation`, with scales per (token, KV head, channel group); reads
    dequantize to `dtype` (still rotated: attention rotates its queries and outputs to match)."""

    def __init__(
        self, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rotation: torch.Tensor, kernels: bool
    ) -> None:
        self.data, self.scales, self.dtype = data, scales, dtype  # [blocks, bs, kv, dim] int8; [blocks, bs, kv, g]
        self.rotation = rotation  # [dim, dim] float32
        self._rows = data.view(-1, *data.shape[2:])
        self._scale_rows = scales.view(-1, *scales.shape[2:])
        self.kernel = kernels and paged_attention.supports(data)
        # The same bytes as bfloat16 tail rows [blocks * block_size / TAIL_BLOCKS, kv_heads, head_dim]: row
        # b * block_size / TAIL_BLOCKS + i lies in block b (only blocks a sequence holds as its tail are read so).
        blocks, block_size, kv_heads, dim = data.shape
        self.tail = None
        if tail_blocks("int8", block_size):
            self.tail = data.view(blocks, -1).view(TAIL_DTYPE).view(-1, kv_heads, dim)

    def write(self, slots: torch.Tensor, x: torch.Tensor, tail_rows: torch.Tensor | None = None) -> None:
        # What int8 loses of a vector in a sequence's last block (at most half a step) goes to its tail row in
        # bfloat16, which keeps it to ~2**-9 of that.
        y = x.float() @ self.rotation
        tail = None if tail_rows is None else self.tail
        if self.kernel:
            paged_attention.quantize_write(y, slots, self._rows, self._scale_rows, tail_rows, tail)
            return
        q, scale = quantize(y)
        self._rows.index_copy_(0, slots, q)
        self._scale_rows.index_copy_(0, slots, scale)
        if tail is not None and tail_rows is not None:
            src = (tail_rows >= 0).nonzero().squeeze(1)
            residual = y.index_select(0, src) - dequantize(q.index_select(0, src), scale.index_select(0, src), y.dtype)
            tail.index_copy_(0, tail_rows.index_select(0, src), residual.to(TAIL_DTYPE))

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        # Dequantized as gathered: the int8 path makes the one working copy of the step's blocks that the
        # model-dtype path's gather makes anyway, never a dequantized copy of the cache.
        return dequantize(self.data.index_select(0, blocks), self.scales.index_select(0, blocks), self.dtype)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data[dst] = self.data[src]
        self.scales[dst] = self.scales[src]


Store = PlainStore | Int8Store


class KVCache:
    """Zero-filled K/V stores (zeros, not garbage: a NaN under a masked-out slot would still poison SDPA)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: KVDtype = "model",
        kernels: bool = True,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"KV cache needs at least one block, got {num_blocks} (raise kv_cache_mb?)")
        self.kv_dtype, self.dtype = kv_dtype, dtype
        self.kernels = kernels  # worker/kernels where they support the stores (else torch ops)
        self.units = units_per_block(dtype) if kv_dtype == "auto" else 1
        if num_blocks % self.units:
            raise ValueError(f"an auto KV cache needs a multiple of {self.units} blocks, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (block_size, config.num_kv_heads, config.head_dim)
        # One tensor per layer and K/V holds the data; with auto, its model-dtype and int8 views share it.
        data_dtype = torch.int8 if kv_dtype == "int8" else dtype
        blocks = num_blocks // self.units if kv_dtype == "auto" else num_blocks
        tensors = 2 * config.num_layers  # K and V of each layer
        self._data = [torch.zeros(blocks, *shape, dtype=data_dtype, device=device) for _ in range(tensors)]
        self._scales = []
        if kv_dtype != "model":
            scale_shape = (num_blocks, *shape[:2], groups(config.head_dim))
            self._scales = [torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device) for _ in self._data]
        self.rotation = rotation(config.head_dim).to(device)
        self.tail_blocks = tail_blocks(kv_dtype, block_size)
        self.int8 = kv_dtype == "int8"
        self.layers = self._stores()

    @property
    def block_div(self) -> int:
        """What divides a block id to index the stores: `units` while an auto cache is in the model's dtype."""
        return 1 if self.int8 else self.units

    @property
    def can_switch(self) -> bool:
        """An auto cache still in the model's dtype."""
        return self.kv_dtype == "auto" and not self.int8

    def _stores(self) -> list[tuple[Store, Store]]:
        stores: list[Store]
        if self.int8:
            shape = (self.num_blocks, *self._data[0].shape[1:])
            views = [d.view(torch.int8).view(shape) for d in self._data]
            stores = [
                Int8Store(v, s, self.dtype, self.rotation, self.kernels)
                for v, s in zip(views, self._scales, strict=True)
            ]
        else:
            stores = [PlainStore(d, self.kernels) for d in self._data]
        return list(zip(stores[0::2], stores[1::2], strict=True))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src to block dst for each (src, dst) pair, in every layer."""
        if not pairs:
            return
        device, div = self._data[0].device, self.block_div
        src = torch.tensor([s // div for s, _ in pairs], device=device)
        dst = torch.tensor([d // div for _, d in pairs], device=device)
        for k, v in self.layers:
            k.copy(src, dst)
            v.copy(src, dst)

    def to_int8(self) -> None:
        """Convert an auto cache from the model's dtype to int8 in place: block b's K/V move to unit b."""
        if not self.can_switch:
            raise RuntimeError(f"only an auto cache in the model's dtype converts (this one: {self.kv_dtype})")
        for data, scales in zip(self._data, self._scales, strict=True):
            units = data.view(torch.int8).view(self.num_blocks, *data.shape[1:])
            for lo in range(0, data.shape[0], CONVERT_CHUNK):
                hi = min(lo + CONVERT_CHUNK, data.shape[0])
                # quantize() returns new tensors, so blocks lo..hi are read in full before their first units
                # (which lie inside them) are overwritten; blocks past hi are not touched.
                q, scale = quantize(data[lo:hi].float() @ self.rotation)
                units[lo * self.units : hi * self.units : self.units] = q
                scales[lo * self.units : hi * self.units : self.units] = scale
        self.int8 = True
        self.layers = self._stores()

    def reset(self) -> None:
        """Back to the initial dtype (a new session: the contents are meaningless from here on)."""
        if self.kv_dtype == "auto" and self.int8:
            for d in self._data:
                d.zero_()  # int8 bytes read as floats could be NaNs
            self.int8 = False
            self.layers = self._stores()
