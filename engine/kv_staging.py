"""Moving KV blocks between a GPU pool and host memory through pinned buffers allocated once.

Page-locked (pinned) host memory is what lets a device↔host copy run asynchronously at the
bus's full speed, but allocating it costs milliseconds (``cudaHostAlloc``), so it is taken
once per worker (:class:`PinnedBufferPool`, sized by ``PD_KV_PINNED_BUFFER_BYTES``) and cut
into equal slots reused across requests — as vLLM's and SGLang's KV offloading do.

:class:`KVStaging` does the copies on a side CUDA stream so they overlap the model's work:

* export (prefill → store): the side stream waits for the compute stream (the blocks are
  written), copies a slot's worth of blocks GPU → pinned slot with ``non_blocking=True`` and
  records an event; staging waits on that event only, then copies the bytes out of the slot.
* import (store → decode): the bytes go into a slot, the slot is copied host → GPU on the side
  stream, and the slot returns to the pool with the copy's event as its fence: it is reused
  only after the copy has read it. The compute stream waits for the side stream before the
  next step reads the blocks (:meth:`KVStaging.wait`).

On CPU (tests) the same code runs with plain memory, no streams and no events.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import deque
from collections.abc import Sequence

import torch


class PinnedBufferPool:
    """``num_slots`` equal host buffers of ``slot_bytes`` in one allocation.

    Args:
        total_bytes: memory of the pool; ``total_bytes // slot_bytes`` slots.
        slot_bytes: size of one slot.
        pin: page-lock the memory (default: when CUDA is available).

    Raises:
        ValueError: the pool cannot hold one slot.
    """

    def __init__(self, total_bytes: int, slot_bytes: int, pin: bool | None = None):
        if slot_bytes <= 0 or total_bytes < slot_bytes:
            raise ValueError(f"a pool of {total_bytes} bytes cannot hold a slot of {slot_bytes} bytes")
        pin = torch.cuda.is_available() if pin is None else pin
        self.slot_bytes = slot_bytes
        self.num_slots = total_bytes // slot_bytes
        self.memory = torch.empty(self.num_slots * slot_bytes, dtype=torch.uint8, pin_memory=pin)
        self._free: deque[int] = deque(range(self.num_slots))
        self._fenced: deque[tuple[int, object]] = deque()  # (slot, event) in release order
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Slots free now, not counting fenced ones whose copy has finished."""
        return len(self._free)

    @property
    def num_fenced(self) -> int:
        return len(self._fenced)

    def acquire(self) -> int:
        """A free slot. Reclaims fenced slots whose copies finished; if none is free, waits for
        the oldest fenced copy.

        Raises:
            RuntimeError: every slot is held (none released): the caller holds too many.
        """
        with self._lock:
            while self._fenced and self._fenced[0][1].query():
                self._free.append(self._fenced.popleft()[0])
            if not self._free and self._fenced:
                slot, fence = self._fenced.popleft()
                fence.synchronize()
                self._free.append(slot)
            if not self._free:
                raise RuntimeError(f"all {self.num_slots} pinned staging slots are held")
            return self._free.popleft()

    def release(self, slot: int, fence: object | None = None) -> None:
        """Give a slot back; with a ``fence`` (an event with ``query()``/``synchronize()``) it
        is reused only once the fence has completed."""
        with self._lock:
            if fence is None:
                self._free.append(slot)
            else:
                self._fenced.append((slot, fence))

    def view(self, slot: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The start of ``slot`` as a tensor of ``dtype`` and ``shape``.

        Raises:
            ValueError: the shape does not fit in a slot.
        """
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        start = slot * self.slot_bytes
        return self.memory[start:start + nbytes].view(dtype).view(tuple(shape))


class KVStaging:
    """Export and import of KV blocks of one paged pool through a :class:`PinnedBufferPool`.

    Args:
        kv: the pool tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        pool_bytes: pinned memory to allocate (``PD_KV_PINNED_BUFFER_BYTES``).
        max_blocks_per_slot: blocks one copy moves at most.

    Raises:
        ValueError: ``pool_bytes`` is smaller than one block.
    """

    def __init__(self, kv: torch.Tensor, pool_bytes: int, max_blocks_per_slot: int = 16):
        self.kv = kv
        self.block_shape = (kv.shape[0], 2, kv.shape[3], kv.shape[4], kv.shape[5])  # [L, 2, bs, KVH, D]
        block_bytes = kv[:, :, 0].numel() * kv.element_size()
        # at least two slots when the pool allows, so one copy can run while another is read
        self.blocks_per_slot = max(1, min(max_blocks_per_slot, pool_bytes // (2 * block_bytes)))
        cuda = kv.device.type == "cuda"
        self.pool = PinnedBufferPool(pool_bytes, self.blocks_per_slot * block_bytes, pin=cuda)
        self.stream = torch.cuda.Stream(kv.device) if cuda else None

    def _on_side_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _fence(self):
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy whole blocks to host memory: ``[n, num_layers, 2, block_size, num_kv_heads,
        head_dim]``, contiguous, in the pool's dtype (ordinary memory: the pinned slots are
        reused as soon as their bytes are copied out)."""
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.kv.dtype)
        launched: deque[tuple[int, int, int, object]] = deque()  # (slot, start, count, event)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.kv.device))  # the blocks are written
        for start in range(0, len(block_ids), self.blocks_per_slot):
            if self.pool.num_free == 0 and launched:
                self._land(launched.popleft(), out)
            ids = list(block_ids[start:start + self.blocks_per_slot])
            slot = self.pool.acquire()
            buf = self.pool.view(slot, self.kv.dtype, (len(ids), *self.block_shape))
            with self._on_side_stream():
                index = torch.tensor(ids, dtype=torch.long).to(self.kv.device, non_blocking=True)
                buf.copy_(self.kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5), non_blocking=True)
                launched.append((slot, start, len(ids), self._fence()))
        while launched:
            self._land(launched.popleft(), out)
        return out

    def _land(self, item: tuple[int, int, int, object], out: torch.Tensor) -> None:
        slot, start, count, event = item
        if event is not None:
            event.synchronize()  # this copy only; later ones keep running
        out[start:start + count].copy_(self.pool.view(slot, self.kv.dtype, (count, *self.block_shape)))
        self.pool.release(slot)

    def import_block(self, block_id: int, data: bytes | bytearray | memoryview, num_tokens: int) -> None:
        """Start copying one block's bytes (``[num_layers, 2, num_tokens, num_kv_heads,
        head_dim]`` in the pool dtype, size checked by the caller) into ``block_id``. Returns
        before the copy lands; call :meth:`wait` before the compute stream reads the block."""
        shape = (self.block_shape[0], 2, num_tokens, *self.block_shape[3:])
        slot = self.pool.acquire()
        buf = self.pool.view(slot, self.kv.dtype, shape)
        with warnings.catch_warnings():  # read-only bytes: only read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        buf.view(torch.uint8).view(-1).copy_(src)
        with self._on_side_stream():
            self.kv[:, :, block_id, :num_tokens].copy_(buf, non_blocking=True)
            fence = self._fence()
        self.pool.release(slot, fence)

    def wait(self) -> None:
        """Make the compute stream wait for the imports issued so far (no host wait)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.kv.device).wait_stream(self.stream)
