"""Attention through the paged KV cache.

Each step first writes its new K/V into cache slots (slot = block_table[pos // bs] * bs + pos % bs), then each
sequence's new queries attend causally over its whole cached context, read through its block table.
Single-token sequences (decodes) are attended in one batched gather + masked SDPA call; longer ones (prefill
chunks) one sequence at a time. Reads gather whole blocks (contiguous rows, far cheaper than gathering slot
by slot) and mask what lies past each sequence. Index tensors are built once per step (`build_metadata`) and
reused by every layer. The stores (worker/kv_cache.py) hide the cache's dtype: an int8 store quantizes what is
written and dequantizes the blocks it gathers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from worker.batch import PackedBatch, SeqSlice
from worker.kv_quant import rotate


class KVStore(Protocol):
    """K or V of one layer in the paged cache (the stores of worker/kv_cache.py)."""

    @property
    def rotation(self) -> torch.Tensor | None:
        """The [D, D] rotation the store keeps its vectors in (queries and outputs must match), or None."""

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x: [T, KV, D] into rows `slots` (block * block_size + offset)."""

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        """The blocks' vectors, [len(blocks), block_size, KV, D], in the model's dtype."""


@dataclass(slots=True)
class DecodeGroup:
    """All single-token sequences of a step, padded to the longest block table B."""

    rows: torch.Tensor  # [D] their rows in the packed batch
    blocks: torch.Tensor  # [D * B] their block tables, flattened (padding: block 0, masked out)
    mask: torch.Tensor  # [D, 1, 1, B * block_size] 0 where the query may attend, -inf elsewhere


@dataclass(slots=True)
class Prefill:
    """One sequence with several new tokens."""

    first_row: int
    num_tokens: int
    blocks: torch.Tensor  # [B] the blocks holding positions 0..start + num_tokens - 1
    mask: torch.Tensor  # [1, 1, num_tokens, B * block_size]


@dataclass(slots=True)
class AttentionMetadata:
    slots: torch.Tensor  # [T] where each new token's K/V goes
    decode: DecodeGroup | None
    prefills: list[Prefill]


def _mask(q_pos: torch.Tensor, length: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[len(q_pos), length] causal mask, limited to the last `window` positions when set (as transformers).

    Additive (0 or -inf, in the queries' dtype): CPU SDPA runs it about a third faster than a boolean mask.
    """
    k_pos = torch.arange(length)[None, :]
    allowed = k_pos <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos > q_pos[:, None] - window
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def build_metadata(
    batch: PackedBatch,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    block_div: int = 1,
) -> AttentionMetadata:
    """Slot indices and masks of one step, computed on the CPU and moved to `device` once. Block ids are
    divided by `block_div` to index the stores (an auto cache still in the model's dtype)."""
    offsets = torch.arange(block_size)
    new_slots: list[int] = []
    prefills: list[Prefill] = []
    dec_rows: list[int] = []
    dec_seqs: list[SeqSlice] = []
    row = 0
    for s in batch.seqs:
        end = s.start + s.num_tokens
        if s.num_tokens < 1 or s.start < 0 or len(s.block_table) * block_size < end:
            raise ValueError(
                f"seq {s.seq_id}: start={s.start} num_tokens={s.num_tokens} needs {end} positions, "
                f"its {len(s.block_table)} blocks of {block_size} hold {len(s.block_table) * block_size}"
            )
        if s.num_tokens == 1:
            dec_rows.append(row)
            dec_seqs.append(s)
            new_slots.append(s.block_table[s.start // block_size] // block_div * block_size + s.start % block_size)
        else:
            table = torch.tensor(s.block_table[: -(-end // block_size)]) // block_div
            slots = (table[:, None] * block_size + offsets).flatten()
            mask = _mask(torch.arange(s.start, end), len(slots), sliding_window, dtype)
            prefills.append(Prefill(row, s.num_tokens, table.to(device), mask[None, None].to(device)))
            new_slots += slots[s.start : end].tolist()
        row += s.num_tokens
    if row != batch.num_tokens or batch.positions.shape != batch.token_ids.shape:
        raise ValueError(
            f"batch has {batch.num_tokens} token ids and {batch.positions.numel()} positions, seqs say {row}"
        )

    decode = None
    if dec_seqs:
        used = [s.block_table[: s.start // block_size + 1] for s in dec_seqs]
        nblocks = max(len(u) for u in used)
        tables = torch.tensor([u + [0] * (nblocks - len(u)) for u in used], dtype=torch.int64) // block_div
        mask = _mask(torch.tensor([s.start for s in dec_seqs]), nblocks * block_size, sliding_window, dtype)
        rows = torch.tensor(dec_rows).to(device)
        decode = DecodeGroup(rows, tables.flatten().to(device), mask[:, None, None].to(device))
    return AttentionMetadata(torch.tensor(new_slots, dtype=torch.int64).to(device), decode, prefills)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVStore,
    v_cache: KVStore,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; caches: stores of [blocks, block_size, KV, D]. Returns [T, H * D]."""
    k_cache.write(meta.slots, k)
    v_cache.write(meta.slots, v)
    rotation = k_cache.rotation
    if rotation is None:
        return _over_cache(q, k.shape[1], k_cache, v_cache, meta)
    # Int8 stores hold K and V rotated (worker/kv_quant.py): q·k = (qR)·(kR), and attention over rotated
    # values gives rotated outputs, so rotating the queries and the outputs is all it takes.
    out = _over_cache(rotate(q, rotation), k.shape[1], k_cache, v_cache, meta)
    return rotate(out.view(q.shape), rotation.T).view(out.shape)


def _over_cache(
    q: torch.Tensor, kv_heads: int, k_cache: KVStore, v_cache: KVStore, meta: AttentionMetadata
) -> torch.Tensor:
    """Each sequence's queries over its cached K/V (this step's included); [T, H * D]."""
    t, heads, dim = q.shape
    group = heads // kv_heads
    out = q.new_empty(t, heads, dim)
    if meta.decode is not None:
        d = meta.decode
        # One query per sequence: lay the `group` query heads that share a KV head along the query axis, so
        # keys need no repeat: q [D, KV, group, dim] against keys [D, KV, L, dim].
        qd = (q if not meta.prefills else q[d.rows]).view(-1, kv_heads, group, dim)
        num = qd.shape[0]
        keys = k_cache.read(d.blocks).view(num, -1, kv_heads, dim).transpose(1, 2)
        values = v_cache.read(d.blocks).view(num, -1, kv_heads, dim).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, keys, values, attn_mask=d.mask).reshape(-1, heads, dim)
        if not meta.prefills:
            return od.reshape(t, heads * dim)
        out[d.rows] = od
    for p in meta.prefills:
        # Repeat each KV head for its query heads (as transformers' repeat_kv): [1, H, L, dim].
        length = p.mask.shape[-1]
        keys = k_cache.read(p.blocks).view(length, kv_heads, 1, dim).expand(-1, -1, group, -1)
        values = v_cache.read(p.blocks).view(length, kv_heads, 1, dim).expand(-1, -1, group, -1)
        keys, values = keys.reshape(length, heads, dim), values.reshape(length, heads, dim)
        rows = slice(p.first_row, p.first_row + p.num_tokens)
        qp = q[rows].transpose(0, 1)[None]
        op = F.scaled_dot_product_attention(qp, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], p.mask)
        out[rows] = op[0].transpose(0, 1)
    return out.reshape(t, heads * dim)
