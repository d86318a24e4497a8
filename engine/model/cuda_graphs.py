"""The decode step replayed from CUDA graphs, one per batch-size bucket.

At batch 1 a decode step launches a few hundred small kernels (30 layers × norms,
projections, RoPE, attention, MLP); on a GPU their launch overhead, not the work, sets the
step time. A CUDA graph records the launches once and replays them with one call (vLLM and
SGLang do this for decode; see vLLM's ``CUDAGraphRunner``).

A graph replays fixed addresses and shapes, so:

* the step's inputs and attention metadata (token ids, positions, slot mapping, block tables,
  context lengths) live in static buffers sized for the largest bucket, and every step copies
  its values into them;
* a batch of ``n`` sequences runs the graph of the smallest bucket ``>= n``; the padded rows
  get slot ``-1`` (the Triton ``write_kv`` writes nothing there), context length 1 and block
  0, and their logits are dropped;
* block tables are as wide as the longest possible sequence (``max_model_len``), so the
  decode kernel's launch (its split plan depends on that width) is the same at every step;
* a batch larger than the largest bucket, or any step with a prefill, runs eagerly.

Capturing needs CUDA; :class:`DecodeGraphs` takes the capture function as an argument, so the
bucketing, padding and copying run (and are tested) on CPU with a stand-in capture.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

#: A capture function: given a step function, record it and return ``(replay, output)``:
#: calling ``replay()`` re-runs what was recorded, writing into ``output``.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def cuda_capture(device: torch.device, warmup_runs: int = 2) -> Capture:
    """The real capture: warm the step up on a side stream (lazy initialisation and Triton
    compilation must not happen inside a capture), then record it into a ``torch.cuda.CUDAGraph``.
    All graphs share one memory pool (captured largest first, so smaller ones fit in it)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup_runs):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()
        return graph.replay, out

    return capture


class DecodeGraphs:
    """Static decode buffers and one recorded step per batch-size bucket.

    Args:
        forward: ``forward(input_ids [n], positions [n], meta) -> logits [n, vocab]``, the
            model's decode step (``meta`` an ``AttentionMetadata`` over the static buffers).
        make_meta: ``make_meta(slot_mapping, block_tables, context_lens) -> AttentionMetadata``
            for a decode-only step.
        batch_sizes: the buckets.
        max_blocks_per_seq: width of the block tables (``ceil(max_model_len / block_size)``).
        device: of the buffers.
        capture: how to record a step (:func:`cuda_capture` on a GPU).

    Raises:
        ValueError: no bucket.
    """

    def __init__(self, forward: Callable, make_meta: Callable, batch_sizes: Sequence[int], max_blocks_per_seq: int,
                 device: torch.device, capture: Capture):
        self.sizes = sorted({int(s) for s in batch_sizes if s > 0})
        if not self.sizes:
            raise ValueError("CUDA graphs need at least one batch size")
        self.forward, self.make_meta, self.capture = forward, make_meta, capture
        self.max_blocks = max_blocks_per_seq
        largest = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(largest, **long)
        self.positions = torch.zeros(largest, **long)
        self.slot_mapping = torch.full((largest,), -1, **long)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, **long)
        self.context_lens = torch.ones(largest, **long)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.num_replays = 0
        self.num_eager = 0

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` sequences; None past the largest."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture_all(self) -> None:
        """Record every bucket's step, largest first."""
        for size in reversed(self.sizes):
            meta = self.make_meta(self.slot_mapping[:size], self.block_tables[:size], self.context_lens[:size])
            ids, pos = self.input_ids[:size], self.positions[:size]
            self.graphs[size] = self.capture(lambda ids=ids, pos=pos, meta=meta: self.forward(ids, pos, meta))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor | None:
        """Replay the step for a decode-only batch; None when it must run eagerly (no bucket
        holds it, or its block tables are wider than the static ones).

        Args:
            input_ids, positions, slot_mapping, context_lens: ``[n]``.
            block_tables: ``[n, width]``.

        Returns:
            ``[n, vocab]`` logits, a view of the graph's output (valid until the next replay).
        """
        n, width = block_tables.shape
        size = self.bucket(n)
        if size is None or width > self.max_blocks or size not in self.graphs:
            self.num_eager += 1
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self.block_tables[:n, width:].zero_()
        self.context_lens[:n].copy_(context_lens, non_blocking=True)
        if size > n:  # padding rows: write nothing, read one token of block 0
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.block_tables[n:size].zero_()
            self.context_lens[n:size].fill_(1)
        replay, logits = self.graphs[size]
        replay()
        self.num_replays += 1
        return logits[:n]
