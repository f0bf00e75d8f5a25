"""Block manager: stable chained hashes, publish-after-compute, LRU of cached blocks, COW lookups."""

from __future__ import annotations

from control_plane.block_manager import BlockManager, hash_block
from control_plane.sequence import Sequence


def seq(seq_id: int, tokens: list[int], tenant: str = "t", pool: str = "interactive") -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tenant, pool, tokens, max_tokens=4)


def admit(bm: BlockManager, s: Sequence, publish: bool = True) -> list[tuple[int, int]]:
    """Allocate like the scheduler does, then (optionally) publish as if the step completed."""
    hit = bm.match(s.tokens(), s.tenant)
    copies = bm.allocate(s, hit, -(-s.num_tokens // bm.block_size))
    if publish:
        for i, h in enumerate(bm.hash_blocks(s.tokens(), s.tenant)):
            bm.publish(s.block_table[i], h)
    return copies


def test_hash_is_stable_chained_and_salted() -> None:
    a = hash_block(None, [1, 2, 3, 4], "t")
    assert a == hash_block(None, [1, 2, 3, 4], "t")  # no per-process randomness
    assert a != hash_block(None, [1, 2, 3, 4], "u")  # tenants never share KV
    assert hash_block(a, [5, 6, 7, 8], "t") != hash_block(None, [5, 6, 7, 8], "t")  # chained
    bm = BlockManager(8, 4)
    first = hash_block(None, [0, 1, 2, 3], "t")
    assert bm.hash_blocks(list(range(10)), "t") == [first, hash_block(first, [4, 5, 6, 7], "t")]
    assert bm.hash_blocks(list(range(10)), "t", start=1, parent=first) == [hash_block(first, [4, 5, 6, 7], "t")]


def test_only_published_full_blocks_are_hit() -> None:
    bm = BlockManager(16, 4)
    a = seq(1, list(range(10)))
    admit(bm, a, publish=False)
    assert bm.match(list(range(12)), "t").tokens == 0  # KV not written yet: no hit
    for i, h in enumerate(bm.hash_blocks(a.tokens(), "t")):
        bm.publish(a.block_table[i], h)
    hit = bm.match(list(range(12)), "t")
    assert hit.tokens == 8 and hit.blocks == a.block_table[:2] and not hit.copy
    assert bm.match(list(range(12)), "other").tokens == 0


def test_match_is_read_only_and_stats_count_admissions() -> None:
    bm = BlockManager(16, 4)
    admit(bm, seq(1, list(range(9))))
    before = ([b.ref for b in bm.blocks], dict(bm.lru), bm.queries, bm.hits)
    bm.match(list(range(9)), "t")
    assert ([b.ref for b in bm.blocks], dict(bm.lru), bm.queries, bm.hits) == before
    admit(bm, seq(2, list(range(9))))
    assert (bm.queries, bm.hits) == (18, 8)
    assert bm.blocks[bm.index[bm.hash_blocks(list(range(4)), "t")[0]]].ref == 2


def test_hit_never_covers_last_token_and_copies_a_shared_last_block() -> None:
    bm = BlockManager(16, 4)
    a = seq(1, list(range(8)))
    admit(bm, a)
    hit = bm.match(list(range(8)), "t")
    assert hit.tokens == 7 and hit.copy  # block 1 is held by `a`: must be copied before writing token 7
    b = seq(2, list(range(8)))
    copies = bm.allocate(b, hit, 2)
    assert copies == [(a.block_table[1], b.block_table[1])]
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert bm.blocks[a.block_table[0]].ref == 2 and bm.blocks[a.block_table[1]].ref == 1


def test_unreferenced_last_block_is_rewritten_in_place() -> None:
    bm = BlockManager(16, 4)
    a = seq(1, list(range(8)))
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    hit = bm.match(list(range(8)), "t")
    assert hit.tokens == 7 and not hit.copy and hit.blocks == table


def test_free_keeps_cached_blocks_and_evicts_lru_tails_first() -> None:
    bm = BlockManager(4, 2)
    a = seq(1, [1, 2, 3, 4, 5])
    admit(bm, a)  # 3 blocks: two full (published), one partial
    head, mid, _tail = a.block_table
    bm.free(a)
    assert (bm.num_used, bm.num_cached, bm.num_free) == (0, 2, 2)
    assert list(bm.lru) == [mid, head]  # freed tail first: the chain's tail is evicted first
    b = seq(2, [9, 9, 9, 9, 9, 9, 9])  # needs 4 fresh blocks: both free ones, then evicts mid, then head
    admit(bm, b, publish=False)
    assert sorted(b.block_table) == [0, 1, 2, 3] and not bm.index  # mid and head were evicted
    assert bm.match([1, 2, 3, 4, 5], "t").tokens == 0


def test_pool_charges_count_distinct_blocks() -> None:
    bm = BlockManager(16, 4)
    a, b = seq(1, list(range(9))), seq(2, list(range(9)))
    admit(bm, a)
    hit = bm.match(b.tokens(), "t")
    assert bm.cost(hit, 3, "interactive") == (1, 1)  # two shared blocks are charged already
    assert bm.cost(hit, 3, "batch") == (3, 1)
    admit(bm, b)
    assert bm.used_by("interactive") == 4
    bm.free(a)
    bm.free(b)
    assert bm.used_by("interactive") == 0 and bm.num_used == 0


def test_auto_cache_hands_out_model_blocks_then_every_unit_after_to_int8() -> None:
    bm = BlockManager(18, 4, per_block=4)  # 4 model-dtype blocks of 4 units; units 16 and 17 wait for int8
    assert (bm.num_blocks, bm.num_free, bm.can_switch) == (4, 4, True)
    a = seq(1, list(range(9)))
    admit(bm, a)
    assert all(b % 4 == 0 for b in a.block_table) and (bm.num_used, bm.num_free) == (3, 1)
    bm.to_int8()
    assert not bm.can_switch and (bm.num_blocks, bm.num_used, bm.num_free) == (18, 3, 15)
    b = seq(2, [7] * 12)
    admit(bm, b)
    assert not set(a.block_table) & set(b.block_table) and bm.used_by("interactive") == 6
    bm.free(a)
    bm.free(b)
    assert bm.num_available == 18
    bm.reset()  # a new worker session starts in the model's dtype again
    assert (bm.num_blocks, bm.num_free, list(bm.free_ids)) == (4, 4, [0, 4, 8, 12])


def test_prefix_hits_and_copy_on_write_on_converted_blocks() -> None:
    bm = BlockManager(16, 4, per_block=2)
    a = seq(1, list(range(8)))
    admit(bm, a)  # two full model-dtype blocks, published
    bm.to_int8()  # converted in place: same ids, still indexed
    hit = bm.match(list(range(8)), "t")
    assert hit.blocks == a.block_table and hit.copy  # the last token is recomputed into a copy
    b = seq(2, list(range(8)))
    copies = bm.allocate(b, hit, 2)
    assert b.block_table[0] == a.block_table[0] and copies == [(a.block_table[1], b.block_table[1])]
    assert bm.blocks[a.block_table[0]].ref == 2 and bm.blocks[a.block_table[1]].ref == 1
