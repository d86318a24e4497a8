"""Paged KV block bookkeeping: free list, reference counts and the prefix cache.

Each block of the KV pool is in one of three states:

* in use: ``ref_cnt > 0``, listed in the block tables of ``ref_cnt`` sequences;
* cached and free: ``ref_cnt == 0`` but still holding a full block whose hash is in
  ``cached_blocks``; a later prompt with the same prefix takes it back at no cost;
* free: ``ref_cnt == 0``, no hash.

Free blocks (cached or not) wait in ``free_queue`` in eviction order: allocation takes the
head, so the least recently freed cached block is evicted first; a sequence's blocks are
freed tail first, so a prefix outlives its suffixes. This is the design of vLLM's v1
KV cache manager (``vllm/v1/core/block_pool.py``); an ``OrderedDict`` gives the O(1)
remove-from-middle that a cache hit on a free block needs.

Methods come in check-then-act pairs (``can_allocate`` → ``allocate``); an act whose check
would fail raises :class:`NoFreeBlocks`, a bug in the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.sequence import Sequence
from shared.hashing import num_reusable_blocks


class NoFreeBlocks(RuntimeError):
    """An allocation was attempted without checking ``can_allocate`` first."""


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockManager:
    """Owns the ``num_blocks`` blocks of one worker's KV pool.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep full blocks findable by hash after their sequences end.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[bytes, KVBlock] = {}

    # --- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (free, including evictable cached ones)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash) if self.enable_prefix_caching else None

    def get_computed_blocks(self, seq: Sequence) -> list[KVBlock]:
        """The longest run of ``seq``'s leading full blocks that are in the prefix cache.

        At least one token is always left to compute, so a fully cached prompt still gets
        the logits of its last token: the run stops before the block holding the last token.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = num_reusable_blocks(seq.num_tokens, self.block_size)
        hits = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, computed: list[KVBlock]) -> int:
        have = len(seq.block_table) + len(computed)
        need = -(-(seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens) // self.block_size)
        return max(0, need - have)

    # --- check / act --------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: list[KVBlock] = ()) -> bool:
        """Whether ``seq`` can take blocks for ``num_new_tokens`` more tokens after its
        computed ones (and after the cache hits ``computed``, which it would take too)."""
        if not computed:  # the common case (every decode step): no list, no generator
            return self._num_new_blocks(seq, num_new_tokens, ()) <= self.num_free_blocks
        reclaim = sum(1 for b in computed if b.ref_cnt == 0)  # hits that sit in the free queue
        return self._num_new_blocks(seq, num_new_tokens, list(computed)) + reclaim <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, computed: list[KVBlock] = ()) -> None:
        """Give ``seq`` the cache hits ``computed`` (counted as computed tokens) and enough
        fresh blocks for ``num_new_tokens`` more tokens.

        Raises:
            NoFreeBlocks: ``can_allocate`` would have said no.
        """
        if not self.can_allocate(seq, num_new_tokens, computed):
            raise NoFreeBlocks(f"{seq.request_id}: {num_new_tokens} tokens do not fit")
        if computed:
            assert seq.num_computed_tokens == len(seq.block_table) * self.block_size
            for block in computed:
                self._touch(block)
                seq.block_table.append(block.block_id)
            seq.num_computed_tokens += len(computed) * self.block_size
        for _ in range(self._num_new_blocks(seq, num_new_tokens, [])):
            seq.block_table.append(self._pop_free().block_id)

    def can_append_slot(self, seq: Sequence) -> bool:
        """Whether one more token fits (a decode step)."""
        return self.can_allocate(seq, 1)

    def append_slot(self, seq: Sequence) -> None:
        self.allocate(seq, 1)

    def allocate_block(self) -> KVBlock:
        """One fresh block, for KV loaded from outside (the KV store).

        Raises:
            NoFreeBlocks: none is free.
        """
        if not self.free_queue:
            raise NoFreeBlocks("no free KV block")
        return self._pop_free()

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full, computed blocks in the prefix cache under their hashes.

        A block whose hash already names another block (the same prefix computed twice at
        once) stays private to ``seq``.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes), len(seq.block_table))
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            block_hash = seq.block_hashes[i]
            if block_hash in self.cached_blocks:
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def register_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Name ``block`` (just filled from outside) by ``block_hash`` in the prefix cache."""
        if self.enable_prefix_caching and block_hash not in self.cached_blocks and block.block_hash is None:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def import_blocks(self, block_hashes: Seq[bytes], keep: Seq[bytes] = (),
                      fill: Callable[[int, int], None] | None = None) -> int:
        """Name fresh blocks by ``block_hashes`` (blocks computed elsewhere, read from the KV
        store) as free cached blocks that the next prompt with that prefix will hit. Hashes
        cached here already are skipped; stops early when no block is free. ``fill(block_id,
        i)`` writes the ``i``-th block's data into the pool before it is named (the engine's
        copy; the simulator has none). Returns how many were imported.

        ``keep``: hashes of the blocks before these in the same prompt that this cache holds
        (its local leading hits). They, and every block of the import, are held until the
        import ends, so that taking a free block cannot evict a block the prompt is about to
        hit (the free queue is least recently used first); then they go back last block first,
        so that eviction takes suffixes before their prefixes (as :meth:`free` does). An
        exception from ``fill`` ends the import (the block it was filling goes back unnamed).
        """
        held: list[KVBlock] = []
        imported = 0
        try:
            for block_hash in keep:
                block = self.lookup(block_hash)
                if block is not None:
                    self.hold(block)
                    held.append(block)
            for i, block_hash in enumerate(block_hashes):
                block = self.lookup(block_hash)
                if block is not None:
                    self.hold(block)
                    held.append(block)
                    continue
                if self.num_free_blocks == 0:
                    break
                block = self.allocate_block()
                held.append(block)
                if fill is not None:
                    fill(block.block_id, i)
                self.register_block(block, block_hash)
                imported += 1
        finally:
            for block in reversed(held):
                self.release(block)
        return imported

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its blocks go to the free queue, last block first, so
        that eviction takes suffixes before the prefixes they depend on."""
        for block_id in reversed(seq.block_table):
            self.release(self.blocks[block_id])
        seq.block_table.clear()

    def truncate(self, seq: Sequence, num_blocks: int) -> int:
        """Give back ``seq``'s blocks past its first ``num_blocks`` (last first): the rollback of
        rejected speculative tokens, whose blocks were fresh and never named in the prefix cache.
        Returns how many were released."""
        released = 0
        while len(seq.block_table) > num_blocks:
            block = self.blocks[seq.block_table.pop()]
            assert block.block_hash is None, f"block {block.block_id} of rejected drafts is in the prefix cache"
            self.release(block)
            released += 1
        return released

    def release(self, block: KVBlock) -> None:
        """Drop one reference to ``block``."""
        assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None or not self.enable_prefix_caching:
                self._forget_hash(block)
            self.free_queue[block.block_id] = block

    def hold(self, block: KVBlock) -> None:
        """Take one more reference to ``block`` (a cache hit used outside a sequence)."""
        self._touch(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash of free blocks; returns how many were forgotten."""
        n = 0
        for block in self.free_queue.values():
            if block.block_hash is not None:
                self._forget_hash(block)
                n += 1
        return n

    # --- internals ----------------------------------------------------------------------
    def _touch(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> KVBlock:
        _, block = self.free_queue.popitem(last=False)
        self._forget_hash(block)
        block.ref_cnt = 1
        return block

    def _forget_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
