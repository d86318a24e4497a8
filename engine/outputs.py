"""What an engine step hands back: per-sequence step outputs, a prompt's KV copied out of the
pool, and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence
from shared.messages import TokenLogprob


@dataclass(slots=True)
class PromptKV:
    """A prompt's KV copied out of the pool: full blocks by hash, and the partial tail.

    ``blocks[i]`` is the block of ``block_hashes[first_block + i]``: the first ``first_block``
    full blocks were handed out earlier, while the prompt was still being prefilled
    (``LLMEngine.on_prompt_blocks``), and are not copied again.
    """

    block_hashes: list[bytes]
    blocks: list[memoryview]
    tail: memoryview | None
    num_tail_tokens: int
    num_tokens: int
    first_block: int = 0


@dataclass(slots=True)
class StepOutput:
    """What one step did for one sequence that sampled a token.

    A snapshot taken on the engine thread: ``index`` (output position of the first new
    token), ``finish_reason`` and ``finished`` describe this step even if the consumer reads
    them after the engine has moved on. ``seq`` is the live sequence (its counters move).
    """

    seq: Sequence
    new_token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    index: int
    finished: bool
    finish_reason: str | None = None
    prompt_kv: PromptKV | None = None
    #: on a sequence's first output, when it asked for them: prompt tokens 1.. (prompt_logprobs.py)
    prompt_logprobs: list[TokenLogprob] | None = None
    #: why the sequence failed (finish_reason "error"): the worker fails the request with it
    error: str | None = None

    @property
    def request_id(self) -> str:
        return self.seq.request_id


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0
    num_loaded_tokens: int = 0
    step_seconds: float = 0.0
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    #: speculative decoding (engine/speculative.py): verification items, drafts, accepted drafts
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
