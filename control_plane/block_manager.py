"""Paged KV blocks of one worker and their prefix index (docs/architecture.md, "Scheduling").

Blocks hold `block_size` token positions. A block is used (refcount > 0: listed in that many block tables),
cached (refcount 0 but its chained hash is in the index, kept in LRU order) or free. A fresh block comes
from the free list first, then by evicting the least recently freed cached block.

Only FULL blocks are indexed, and only once the step that computed them has completed (`publish`, called
by the scheduler's `complete`): otherwise a new request could map KV that is not yet written.

Each pool is charged the distinct blocks its sequences hold (a block shared by two pools is charged to
both), so per-pool quotas are hard limits on memory, not on request counts.

A worker whose KV cache is `auto` (docs/kv_cache.md) has `units` int8-sized blocks; until `to_int8` its blocks
are model-dtype blocks of `per_block` units each, with ids the multiples of `per_block`. `to_int8` makes every
unit a block: a block in use or cached keeps its id (the worker converts it in place) and the other units
join the free list. Block counts (used, free, per pool) are in blocks of the current kind.

On an int8 cache each running sequence also holds `tail` fresh blocks for its full-precision tail
(docs/kv_cache.md): allocated with its table, charged to its pool, freed with it, never indexed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from control_plane.sequence import Sequence


def hash_block(parent: int | None, tokens: list[int], salt: str) -> int:
    """Stable chained hash of one full block: (parent hash, token ids, tenant salt).

    Python's hash() is randomized per process; blake2b makes hashes comparable across runs and replicas.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(salt.encode())
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True)
class Block:
    id: int
    ref: int = 0
    hash: int | None = None  # published: present in the index


@dataclass(slots=True)
class Hit:
    """A prefix-cache lookup: cached `blocks` (with their `hashes`) cover `tokens` computed tokens.

    A hit never covers the last token: when every block of the tokens is cached, `tokens` is one short
    and the last block must be written again; `copy` says another sequence holds it (copy-on-write).
    """

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    tokens: int = 0
    copy: bool = False

    @property
    def attach(self) -> list[int]:
        """Blocks mapped into the new table as they are (a copied block is replaced by its copy)."""
        return self.blocks[:-1] if self.copy else self.blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, per_block: int = 1) -> None:
        """`num_blocks` ids; with `per_block` > 1 (an auto cache), that many form one block until `to_int8`."""
        self.units = num_blocks
        self.per_block = per_block
        self.block_size = block_size
        self.reset()

    def reset(self) -> None:
        """Forget everything (the worker's cache is gone; an auto cache is back in the model's dtype)."""
        self.stride = self.per_block  # ids one block spans: per_block until to_int8, then 1
        self.num_blocks = self.units // self.stride
        self.blocks = [Block(i) for i in range(self.units)]
        self.free_ids: deque[int] = deque(range(0, self.num_blocks * self.stride, self.stride))
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently freed first
        self.index: dict[int, int] = {}  # hash -> block id
        self.charges: dict[str, dict[int, int]] = {}  # pool -> block id -> sequences of the pool holding it
        self.queries = 0  # prompt tokens looked up at admission
        self.hits = 0  # of which were served from the cache

    # -- stats
    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_cached(self) -> int:
        return len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids) - len(self.lru)

    @property
    def num_available(self) -> int:
        """Blocks a fresh allocation can take (free, or cached and evictable)."""
        return len(self.free_ids) + len(self.lru)

    def used_by(self, pool: str) -> int:
        return len(self.charges.get(pool, {}))

    # -- lookups (read-only)
    def hash_blocks(self, tokens: list[int], salt: str, start: int = 0, parent: int | None = None) -> list[int]:
        """Chained hashes of the full blocks of `tokens` from block index `start` (parent: block start-1)."""
        bs, out = self.block_size, []
        for i in range(start, len(tokens) // bs):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], salt)
            out.append(parent)
        return out

    def match(self, tokens: list[int], salt: str) -> Hit:
        """Longest cached prefix of `tokens` in whole blocks, never covering the last token. No side effects."""
        hit = Hit()
        parent: int | None = None
        bs = self.block_size
        for i in range(len(tokens) // bs):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], salt)
            b = self.index.get(parent)
            if b is None:
                break
            hit.blocks.append(b)
            hit.hashes.append(parent)
        hit.tokens = len(hit.blocks) * bs
        if hit.blocks and hit.tokens >= len(tokens):
            hit.tokens = len(tokens) - 1  # recompute the last token so that one can be sampled
            hit.copy = self.blocks[hit.blocks[-1]].ref > 0
        return hit

    def cost(self, hit: Hit, total: int, pool: str) -> tuple[int, int]:
        """(blocks newly charged to `pool`, blocks taken from the available supply) for a table of `total`."""
        charged = self.charges.get(pool, {})
        fresh = total - len(hit.attach)
        charge = fresh + sum(1 for b in hit.attach if b not in charged)
        supply = fresh + sum(1 for b in hit.attach if self.blocks[b].ref == 0)
        return charge, supply

    # -- mutations
    @property
    def can_switch(self) -> bool:
        """An auto cache still in the model's dtype: `to_int8` would multiply its capacity by `per_block`."""
        return self.stride > 1

    def to_int8(self) -> None:
        """Every unit becomes a block: blocks in use or cached keep their ids, the other units are free."""
        assert self.can_switch, "the cache is int8 already"
        whole = self.num_blocks * self.stride
        self.free_ids.extend(u for u in range(self.units) if u % self.stride or u >= whole)
        self.stride, self.num_blocks = 1, self.units

    def allocate(self, seq: Sequence, hit: Hit, total: int, tail: int = 0) -> list[tuple[int, int]]:
        """Give `seq` a table of `total` blocks starting with `hit`, and `tail` tail blocks; returns the (src, dst)
        copies to do first."""
        assert not seq.block_table and not seq.tail_blocks, f"seq {seq.seq_id} already holds blocks"
        for b in hit.attach:
            self._take(b, seq.pool)
        table = list(hit.attach)
        copies = []
        if hit.copy:
            dst = self._fresh(seq.pool)
            copies.append((hit.blocks[-1], dst))
            table.append(dst)
        while len(table) < total:
            table.append(self._fresh(seq.pool))
        seq.block_table = table
        seq.tail_blocks = [self._fresh(seq.pool) for _ in range(tail)]
        seq.hashes = list(hit.hashes)
        self.queries += seq.num_tokens
        self.hits += hit.tokens
        return copies

    def slots_needed(self, seq: Sequence, n: int) -> int:
        """Fresh blocks `seq` needs to write `n` more tokens after its scheduled ones (steps in flight included)."""
        return max(0, -(-(seq.num_scheduled + n) // self.block_size) - len(seq.block_table))

    def append(self, seq: Sequence) -> int:
        """Append one fresh block to `seq`'s table (a decode crossed a block boundary)."""
        b = self._fresh(seq.pool)
        seq.block_table.append(b)
        return b

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks. The table's last blocks go first so that LRU eviction takes chain ends before
        heads; its full-precision tail's blocks, never indexed, go to the free list."""
        for b in [*reversed(seq.block_table), *seq.tail_blocks]:
            self._uncharge(seq.pool, b)
            blk = self.blocks[b]
            blk.ref -= 1
            assert blk.ref >= 0, f"block {b} freed twice"
            if blk.ref == 0:
                if blk.hash is None:
                    self.free_ids.append(b)
                else:
                    self.lru[b] = None
        seq.block_table, seq.tail_blocks = [], []

    def publish(self, block: int, h: int) -> None:
        """Index a block whose KV is now computed. A duplicate hash keeps the block already indexed."""
        blk = self.blocks[block]
        if blk.hash is None and h not in self.index:
            blk.hash = h
            self.index[h] = block

    def _take(self, b: int, pool: str) -> None:
        blk = self.blocks[b]
        if blk.ref == 0:
            del self.lru[b]
        blk.ref += 1
        self._charge(pool, b)

    def _fresh(self, pool: str) -> int:
        if self.free_ids:
            b = self.free_ids.popleft()
        elif self.lru:
            b, _ = self.lru.popitem(last=False)
            blk = self.blocks[b]
            assert blk.hash is not None
            del self.index[blk.hash]
            blk.hash = None
        else:
            raise RuntimeError("no KV block available (the scheduler should have checked)")
        self.blocks[b].ref = 1
        self._charge(pool, b)
        return b

    def _charge(self, pool: str, b: int) -> None:
        charged = self.charges.setdefault(pool, {})
        charged[b] = charged.get(b, 0) + 1

    def _uncharge(self, pool: str, b: int) -> None:
        charged = self.charges[pool]
        charged[b] -= 1
        if charged[b] == 0:
            del charged[b]
