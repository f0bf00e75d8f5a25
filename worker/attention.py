"""Attention through the paged KV cache.

Each step first writes its new K/V into cache slots (slot = block_table[pos // bs] * bs + pos % bs), then each
sequence's new queries attend causally over its whole cached context, read through its block table.
Single-token sequences (decodes) are attended together; longer ones (prefill chunks) in one padded SDPA call:
no loop over sequences in a layer. On the CPU, decodes run in worker/kernels/paged_attention.cpp, which reads
each cached row where it lies; elsewhere (CUDA, `cpu_kernels=false`, a float16 cache) and for prefill chunks,
reads gather whole blocks (contiguous rows, far cheaper than gathering slot by slot) into one masked SDPA call.
Index tensors are built once per step (`build_metadata`) and reused by every layer. The stores
(worker/kv_cache.py) hide the cache's dtype: an int8 store quantizes what is written and dequantizes the blocks
it gathers (the kernel reads int8 and applies the scales itself). A sequence with a full-precision tail (an
int8 cache's, worker/kv_cache.py) has the positions of its last block corrected by its tail rows, by the
kernel and by both torch paths alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from worker import kv_tails
from worker.batch import PackedBatch, SeqSlice
from worker.kernels import paged_attention
from worker.kv_quant import rotate
from worker.kv_tails import RowMap


class KVStore(Protocol):
    """K or V of one layer in the paged cache (the stores of worker/kv_cache.py)."""

    data: torch.Tensor  # [blocks, block_size, KV, D], in the model's dtype or int8
    scales: torch.Tensor | None  # int8: scale codes [blocks, block_size, KV, groups]
    tail: torch.Tensor | None  # int8: the same bytes as bfloat16 tail rows [rows, KV, D] (residuals)
    kernel: bool  # decode attention reads it with worker/kernels/paged_attention.py

    @property
    def rotation(self) -> torch.Tensor | None:
        """The [D, D] rotation the store keeps its vectors in (queries and outputs must match), or None."""

    def write(self, slots: torch.Tensor, x: torch.Tensor, tail_rows: torch.Tensor | None = None) -> None:
        """x: [T, KV, D] into rows `slots` (block * block_size + offset); where it keeps tails, what it lost of
        x[i] into tail row tail_rows[i] where that is >= 0."""

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        """The blocks' vectors, [len(blocks), block_size, KV, D], in the model's dtype."""


@dataclass(slots=True)
class DecodeGroup:
    """All single-token sequences of a step, padded to the longest block table B."""

    rows: torch.Tensor  # [D] their rows in the packed batch
    blocks: torch.Tensor  # [D * B] their block tables, flattened (padding: block 0, masked out)
    # [D, 1, 1, B * block_size] 0 where the query may attend, -inf elsewhere (None when the kernel reads)
    mask: torch.Tensor | None
    lengths: torch.Tensor  # [D] int64, positions cached per sequence (this step's included): for the kernel
    window: int | None  # the sliding window, if any
    # With tails: for the kernel, the first position corrected by a tail ([D] int64; `lengths` where none)
    # and each sequence's tail row per block offset ([D * block_size] int64) ...
    tail_index: tuple[torch.Tensor, torch.Tensor] | None = None
    # ... and for the torch path, which tail rows are added to which of the gathered [D * B * block_size].
    tail_reads: RowMap | None = None


@dataclass(slots=True)
class PrefillGroup:
    """All sequences of a step with several new tokens, padded to the longest chunk Q and block table B."""

    rows: torch.Tensor  # [P * Q] their rows in the packed batch (padding: a real row, its result dropped)
    real: torch.Tensor  # [R] which of the P * Q padded rows are real ...
    dest: torch.Tensor  # [R] ... and their rows in the packed batch
    blocks: torch.Tensor  # [P * B] their block tables, flattened (padding: block 0, masked out)
    mask: torch.Tensor  # [P, 1, Q, B * block_size]; a padding query sees key 0 only (no all -inf row)
    tail_reads: RowMap | None = None  # tail rows added to rows of the gathered [P * B * block_size]


@dataclass(slots=True)
class AttentionMetadata:
    slots: torch.Tensor  # [T] where each new token's K/V goes
    decode: DecodeGroup | None
    prefill: PrefillGroup | None
    tail_rows: torch.Tensor | None = None  # [T] int64: each new token's tail row, -1 where none (None: no tails)


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
    decode_kernel: bool = False,
) -> AttentionMetadata:
    """Slot indices and masks of one step, computed on the CPU and moved to `device` once. Block ids are
    divided by `block_div` to index the stores (an auto cache still in the model's dtype). With
    `decode_kernel` (the stores' `kernel`), what only the torch decode path reads is not built."""
    offsets = torch.arange(block_size)
    new_slots: list[int] = []
    has_tails = any(s.tail for s in batch.seqs)
    write_rows: list[int] = []  # with tails: each new token's tail row, -1 where none
    pre_seqs: list[tuple[int, SeqSlice]] = []
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
            pre_seqs.append((row, s))
            table = torch.tensor(s.block_table[: -(-end // block_size)]) // block_div
            new_slots += (table[:, None] * block_size + offsets).flatten()[s.start : end].tolist()
        if has_tails:
            write_rows += kv_tails.writes(s, block_size)
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
        mask = None
        if not decode_kernel:
            mask = _mask(torch.tensor([s.start for s in dec_seqs]), nblocks * block_size, sliding_window, dtype)
            mask = mask[:, None, None].to(device)
        rows = torch.tensor(dec_rows).to(device)
        lengths = torch.tensor([s.start + 1 for s in dec_seqs], dtype=torch.int64).to(device)
        decode = DecodeGroup(rows, tables.flatten().to(device), mask, lengths, sliding_window)
        if any(s.tail for s in dec_seqs):
            if decode_kernel:
                lo = [kv_tails.lo(s, block_size) if s.tail else s.start + 1 for s in dec_seqs]
                tails = [r for s in dec_seqs for r in (kv_tails.rows(s, block_size) if s.tail else [0] * block_size)]
                decode.tail_index = (torch.tensor(lo).to(device), torch.tensor(tails).to(device))
            else:
                decode.tail_reads = kv_tails.reads(dec_seqs, nblocks * block_size, block_size, device)
    prefill = _prefill_group(pre_seqs, block_size, sliding_window, device, dtype, block_div) if pre_seqs else None
    writes = torch.tensor(write_rows, dtype=torch.int64).to(device) if has_tails else None
    return AttentionMetadata(torch.tensor(new_slots, dtype=torch.int64).to(device), decode, prefill, writes)


def _prefill_group(
    seqs: list[tuple[int, SeqSlice]],
    block_size: int,
    window: int | None,
    device: torch.device,
    dtype: torch.dtype,
    block_div: int,
) -> PrefillGroup:
    """The padded index tensors and masks of a step's prefill chunks ((first packed row, slice) each)."""
    q_max = max(s.num_tokens for _, s in seqs)
    used = [s.block_table[: -(-(s.start + s.num_tokens) // block_size)] for _, s in seqs]
    b_max = max(len(u) for u in used)
    length = b_max * block_size
    rows = torch.empty(len(seqs), q_max, dtype=torch.int64)
    mask = torch.zeros(len(seqs), 1, q_max, length, dtype=dtype)
    real: list[int] = []
    dest: list[int] = []
    for i, (first, s) in enumerate(seqs):
        n = s.num_tokens
        rows[i] = first
        rows[i, :n] = torch.arange(first, first + n)
        mask[i, 0, :n] = _mask(torch.arange(s.start, s.start + n), length, window, dtype)
        mask[i, 0, n:, 1:] = float("-inf")
        real += range(i * q_max, i * q_max + n)
        dest += range(first, first + n)
    tables = torch.tensor([u + [0] * (b_max - len(u)) for u in used], dtype=torch.int64) // block_div
    return PrefillGroup(
        rows.flatten().to(device),
        torch.tensor(real).to(device),
        torch.tensor(dest).to(device),
        tables.flatten().to(device),
        mask.to(device),
        kv_tails.reads([s for _, s in seqs], length, block_size, device),
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: KVStore,
    v_cache: KVStore,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; caches: stores of [blocks, block_size, KV, D]. Returns [T, H * D]."""
    k_cache.write(meta.slots, k, meta.tail_rows)
    v_cache.write(meta.slots, v, meta.tail_rows)
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
        qd = q if meta.prefill is None else q.index_select(0, d.rows)
        if k_cache.kernel:
            tails = None
            if d.tail_index is not None and k_cache.tail is not None and v_cache.tail is not None:
                tails = paged_attention.Tails(k_cache.tail, v_cache.tail, *d.tail_index)
            od = paged_attention.decode(
                qd, k_cache.data, v_cache.data, d.blocks, d.lengths, d.window, k_cache.scales, v_cache.scales, tails
            )
        else:
            qd = qd.reshape(-1, kv_heads, group, dim)
            num = qd.shape[0]
            keys = _read(k_cache, d.blocks, d.tail_reads).view(num, -1, kv_heads, dim).transpose(1, 2)
            values = _read(v_cache, d.blocks, d.tail_reads).view(num, -1, kv_heads, dim).transpose(1, 2)
            assert d.mask is not None, "build_metadata was told the decode kernel reads"
            od = F.scaled_dot_product_attention(qd, keys, values, attn_mask=d.mask).reshape(-1, heads, dim)
        if meta.prefill is None:
            return od.reshape(t, heads * dim)
        out.index_copy_(0, d.rows, od)
    p = meta.prefill
    if p is not None:
        # Padded to [P, Q] queries over [P, L] keys; each KV head repeated for its query heads (as
        # transformers' repeat_kv): [P, H, L, dim].
        num, q_max, length = p.mask.shape[0], p.mask.shape[2], p.mask.shape[3]
        qp = q.index_select(0, p.rows).view(num, q_max, heads, dim).transpose(1, 2)
        keys = _read(k_cache, p.blocks, p.tail_reads).view(num, length, kv_heads, 1, dim).expand(-1, -1, -1, group, -1)
        values = _read(v_cache, p.blocks, p.tail_reads).view(num, length, kv_heads, 1, dim)
        values = values.expand(-1, -1, -1, group, -1)
        keys = keys.reshape(num, length, heads, dim).transpose(1, 2)
        values = values.reshape(num, length, heads, dim).transpose(1, 2)
        op = F.scaled_dot_product_attention(qp, keys, values, p.mask).transpose(1, 2).reshape(-1, heads, dim)
        out.index_copy_(0, p.dest, op.index_select(0, p.real))
    return out.reshape(t, heads * dim)


def _read(store: KVStore, blocks: torch.Tensor, tails: RowMap | None) -> torch.Tensor:
    """The blocks gathered ([n, block_size, KV, D]), tail rows `tails.src` added to the gathered rows `tails.dst`
    where the store keeps tails."""
    x = store.read(blocks)
    if tails is not None and store.tail is not None:
        x.view(-1, *x.shape[2:]).index_add_(0, tails.dst, store.tail.index_select(0, tails.src).to(x.dtype))
    return x
