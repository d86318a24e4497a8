"""The pinned staging pool and the staged KV export/import, on CPU (plain memory, no streams):
the slot bookkeeping and the block layout are the same code the GPU runs."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import PagedKVCache
from engine.kv_staging import KVStaging, PinnedBufferPool


class FakeFence:
    """Stands in for a CUDA event: done when the test says so; synchronize() marks it done."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_pool_is_one_allocation_cut_into_slots():
    pool = PinnedBufferPool(1000, 300, pin=False)
    assert pool.num_slots == 3 and pool.memory.numel() == 900 and not pool.memory.is_pinned()
    slots = [pool.acquire() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    views = [pool.view(s, torch.float32, (75,)) for s in slots]
    for i, v in enumerate(views):
        v.fill_(i)
    assert [v[0].item() for v in views] == [0, 1, 2]  # slots do not overlap
    with pytest.raises(RuntimeError, match="held"):
        pool.acquire()
    with pytest.raises(ValueError, match="do not fit"):
        pool.view(0, torch.float32, (76,))
    with pytest.raises(ValueError):
        PinnedBufferPool(100, 300, pin=False)


def test_fenced_slot_is_reused_only_after_its_copy():
    pool = PinnedBufferPool(200, 100, pin=False)
    a, b = pool.acquire(), pool.acquire()
    fa, fb = FakeFence(), FakeFence()
    pool.release(a, fa)
    pool.release(b, fb)
    assert pool.num_free == 0 and pool.num_fenced == 2
    fb.done = True  # the younger copy finished first: still reclaimed in order, oldest waited for
    got = pool.acquire()
    assert got == a and fa.waited == 1
    fa2 = FakeFence()
    fa2.done = True
    pool.release(got, fa2)
    first, second = pool.acquire(), pool.acquire()
    assert {first, second} == {a, b} and fb.waited == 0  # finished fences need no wait


def _cache(num_blocks=10, bs=4, dtype=torch.float32):
    cache = PagedKVCache(num_layers=2, num_kv_heads=3, head_dim=8, num_blocks=num_blocks, block_size=bs, dtype=dtype,
                         device=torch.device("cpu"), model_id="t")
    cache.kv.copy_(torch.randn(cache.kv.shape).to(dtype))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_export_equals_plain_export_across_slots(dtype):
    cache = _cache(dtype=dtype)
    block_bytes = cache.kv[:, :, 0].numel() * cache.kv.element_size()
    ids, sizes = [7, 2, 9, 0, 5], [4, 4, 4, 4, 3]
    plain = [bytes(b) for b in cache.export_blocks(ids, sizes)]
    # two slots of two blocks: five blocks need three copies, the third waits for a slot
    cache.staging = KVStaging(cache.kv, 4 * block_bytes, max_blocks_per_slot=2)
    assert cache.staging.blocks_per_slot == 2 and cache.staging.pool.num_slots == 2
    staged = [bytes(b) for b in cache.export_blocks(ids, sizes)]
    assert staged == plain
    assert cache.staging.pool.num_free == 2  # every slot back after the export


def test_staged_import_round_trip_with_a_tail():
    src = _cache()
    full, tail = src.export_blocks([3, 6], [4, 2])
    dst = _cache()
    dst.kv.zero_()
    block_bytes = dst.kv[:, :, 0].numel() * dst.kv.element_size()
    dst.staging = KVStaging(dst.kv, 3 * block_bytes)
    dst.import_block(1, full)
    dst.import_block(8, tail, num_tokens=2)
    assert torch.equal(dst.kv[:, :, 1], src.kv[:, :, 3])
    assert torch.equal(dst.kv[:, :, 8, :2], src.kv[:, :, 6, :2])
    assert not dst.kv[:, :, 8, 2:].any()
    with pytest.raises(ValueError, match="layout needs"):
        dst.import_block(0, bytes(full)[:-4])
    # more imports than slots: slots come back (no fence on CPU) and are reused
    for i in range(5):
        dst.import_block(i, full)
    assert dst.staging.pool.num_free == dst.staging.pool.num_slots


def test_pool_smaller_than_a_block_is_refused():
    cache = _cache()
    with pytest.raises(ValueError, match="cannot hold"):
        KVStaging(cache.kv, 10)
