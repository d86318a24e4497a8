"""Which sequences run in the next engine step, and with how many tokens each.

One step has a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running sequences go first, in arrival order: a decoding sequence needs one
token, a sequence in the middle of a chunked prefill needs the rest of its prompt, cut to the
budget. Then waiting sequences are admitted in arrival order, each after its prefix-cache
hits are counted as computed, while budget, sequence slots and KV blocks last; a long prompt
is admitted with a first chunk (chunked prefill) and continues in later steps.

When a running sequence needs a block and none is free, the most recently arrived running
sequence is preempted by recompute: its blocks are freed (full ones stay in the prefix cache,
so recompute is often cheap) and it goes back to the front of the queue with its tokens —
prompt and output — to be prefilled again. This is vLLM v1's policy
(``vllm/v1/core/sched/scheduler.py``).

A decoding sequence with speculative drafts (``seq.draft_token_ids``, engine/speculative.py)
is scheduled with its last token and the drafts as one chunk; when the budget or the pool has
no room for the drafts they are dropped (a plain decode step) before anyone is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: ``num_new_tokens`` tokens from ``num_computed_tokens`` on,
    of which the last ``len(draft_token_ids)`` are speculative drafts (past ``token_ids``)."""

    seq: Sequence
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's tokens (so a token is sampled)."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids) == self.seq.num_tokens

    def input_token_ids(self) -> list[int]:
        """The ``num_new_tokens`` token ids this step computes."""
        start = self.seq.num_computed_tokens
        source = self.seq.token_ids if not self.draft_token_ids else self.seq.token_ids + self.draft_token_ids
        return source[start: start + self.num_new_tokens]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption.

    Args:
        block_manager: the worker's KV pool bookkeeping.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one step.
        max_prefill_chunk_tokens: most tokens of one sequence in one step (0 = the budget), so
            one long prompt cannot hold a whole step.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk_tokens: int = 0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_chunk = max_prefill_chunk_tokens or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Add a sequence whose blocks are already allocated (KV loaded from the store)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running sequences: decode steps and continuing chunked prefills
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.max_chunk)
            if n <= 0:
                i += 1
                continue
            drafts = seq.draft_token_ids
            if drafts and n == 1:
                drafts = drafts[: max(0, budget - 1)]
                if drafts and not bm.can_allocate(seq, 1 + len(drafts)):
                    drafts = []  # no room for them: decode plainly rather than preempt anyone
                n += len(drafts)
            else:
                drafts = []
            while not bm.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself; nothing after it is left either
            bm.allocate(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n, drafts))
            budget -= n
            i += 1

        # 2. waiting sequences, unless this step had to preempt
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            # prompt logprobs need the logits of every prompt position: no prefix-cache hits
            use_cache = seq.num_computed_tokens == 0 and not seq.wants_prompt_logprobs
            computed = bm.get_computed_blocks(seq) if use_cache else []
            num_computed = seq.num_computed_tokens + len(computed) * bm.block_size
            n = min(seq.num_tokens - num_computed, budget, self.max_chunk)
            if not bm.can_allocate(seq, n, computed):
                break
            self.waiting.popleft()
            if seq.num_computed_tokens == 0:
                seq.num_cached_tokens = len(computed) * bm.block_size
            bm.allocate(seq, n, computed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str | None) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
