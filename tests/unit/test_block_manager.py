"""Exact block ids, ref counts and free-queue order, the way vLLM's prefix-caching tests
check them."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, NoFreeBlocks
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from shared.messages import SamplingParams

SP = SamplingParams(max_tokens=4, temperature=0.0)


def seq(rid: str, tokens: list[int], bs: int = 4) -> Sequence:
    return Sequence(request_id=rid, token_ids=list(tokens), num_prompt_tokens=len(tokens), sampling=SP,
                    block_size=bs, hash_extra=b"m")


def refcounts(bm: BlockManager) -> list[int]:
    return [b.ref_cnt for b in bm.blocks]


def test_allocate_takes_blocks_from_the_head_in_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    s = seq("a", range(10))
    assert bm.can_allocate(s, 10)
    bm.allocate(s, 10)
    assert s.block_table == [0, 1, 2]
    assert refcounts(bm) == [1, 1, 1, 0, 0, 0]
    assert list(bm.free_queue) == [3, 4, 5]


def test_free_returns_blocks_tail_first_and_keeps_full_ones_cached():
    bm = BlockManager(num_blocks=6, block_size=4)
    s = seq("a", range(10))
    bm.allocate(s, 10)
    s.num_computed_tokens = 10
    bm.cache_full_blocks(s)
    assert set(bm.cached_blocks) == set(s.block_hashes[:2]) and len(s.block_hashes) == 2
    bm.free(s)
    assert refcounts(bm) == [0] * 6
    # the partial block 2 goes first, then 1, then 0: suffixes are evicted before prefixes
    assert list(bm.free_queue) == [3, 4, 5, 2, 1, 0]
    assert bm.blocks[0].block_hash == s.block_hashes[0]
    assert bm.blocks[2].block_hash is None


def test_prefix_hit_reuses_blocks_and_shares_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", range(12))
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    b = seq("b", [*range(8), 100, 101, 102])
    hits = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert bm.can_allocate(b, 3, hits)
    bm.allocate(b, 3, hits)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert refcounts(bm)[:4] == [2, 2, 1, 1]


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", range(8))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    assert list(bm.free_queue) == [2, 3, 1, 0]
    b = seq("b", [*range(4), 9, 9])
    hits = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0]
    bm.allocate(b, 2, hits)
    assert b.block_table == [0, 2]
    assert list(bm.free_queue) == [3, 1]
    assert bm.blocks[1].block_hash == a.block_hashes[1]  # still cached, not yet evicted


def test_eviction_forgets_the_hash():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq("a", range(8))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    c = seq("c", range(50, 58))
    bm.allocate(c, 8)  # takes both cached blocks: their hashes are evicted
    assert bm.cached_blocks == {}
    assert bm.get_computed_blocks(seq("a2", range(8))) == []


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", range(8))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    hits = bm.get_computed_blocks(seq("b", range(8)))
    assert len(hits) == 1  # the block holding the last token is recomputed


def test_check_then_act():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq("a", range(12))
    assert not bm.can_allocate(s, 12)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(s, 12)
    assert refcounts(bm) == [0, 0]
    t = seq("t", range(4))
    bm.allocate(t, 4)
    t.num_computed_tokens = 4
    t.append_token(7)
    assert bm.can_append_slot(t)
    bm.append_slot(t)
    assert t.block_table == [0, 1]
    assert bm.num_free_blocks == 0


def test_scheduler_preempts_the_newest_and_requeues_it_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq("a", range(7)), seq("b", range(100, 107))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 7), ("b", 7)]
    for s in (a, b):
        s.num_computed_tokens = 7
        s.append_token(1)
    # both now need one more token; a fits in its block, b too
    out = sched.schedule()
    assert [x.num_new_tokens for x in out.scheduled] == [1, 1]
    for s in (a, b):
        s.num_computed_tokens += 1
        s.append_token(1)
    # 9 tokens each need a third block: only one is possible, so b (newest) is preempted
    out = sched.schedule()
    assert [x.seq.request_id for x in out.scheduled] == ["a"]
    assert out.preempted == [b]
    assert b.num_computed_tokens == 0 and b.block_table == [] and sched.waiting[0] is b
    assert sched.num_preemptions == 1


def test_chunked_prefill_splits_a_long_prompt_by_the_budget():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=10)
    s = seq("long", range(25))
    sched.add(s)
    chunks = []
    while s.num_computed_tokens < 25:
        out = sched.schedule()
        (item,) = out.scheduled
        chunks.append(item.num_new_tokens)
        s.num_computed_tokens += item.num_new_tokens
    assert chunks == [10, 10, 5]
    assert len(s.block_table) == 7
