"""A request inside the engine: its tokens and how far its KV cache has caught up.

State is counters, not phases: ``num_computed_tokens`` is how many of ``token_ids`` have
their KV in the cache, and scheduling makes it catch up with ``num_tokens``. A prompt being
prefilled, a prompt prefilled in chunks, a sequence decoding and one resumed after preemption
are the same thing with different counters (the way vLLM's v1 scheduler sees requests).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shared.hashing import ROOT_HASH, hash_block
from shared.messages import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens (prompt then output) and its KV bookkeeping.

    Attributes:
        request_id: unique id.
        token_ids: prompt tokens followed by output tokens.
        num_prompt_tokens: length of the prompt part of ``token_ids``.
        sampling: how to pick tokens; ``sampling.max_tokens`` counts output tokens.
        block_size: tokens per KV block.
        hash_extra: extra bytes in every block hash (model, block size, cache salt).
        num_computed_tokens: tokens whose KV is in the cache.
        num_cached_tokens: prompt tokens found in a prefix cache at admission (not computed).
        num_prefill_chunks: engine steps that computed part of its prompt (what an abort wasted).
        num_exported_blocks: full prompt blocks already copied out while the prompt was still
            being prefilled (``LLMEngine.on_prompt_blocks``); the final export starts after them.
        block_table: KV block ids, in token order.
        block_hashes: hashes of the full blocks of ``token_ids`` so far.
        eos_token_ids: tokens that end the sequence unless ``sampling.ignore_eos``.
        max_model_len: context cap; reaching it ends the sequence ("length").
        stop_after_prefill: prefill workers stop a sequence once its first token is sampled.
        matcher: its grammar's matcher when ``sampling.grammar`` is set, else None.
        draft_token_ids: this step's speculative drafts (engine/speculative.py; not in
            ``token_ids``: they become tokens only when verified).
        num_draft_tokens, num_accepted_tokens: drafts verified so far, and how many were kept.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_size: int
    hash_extra: bytes = b""
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    stop_after_prefill: bool = False
    arrival_at: float = field(default_factory=time.monotonic)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_prefill_chunks: int = 0
    num_exported_blocks: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    matcher: Any = None  # the llguidance matcher of a constrained sequence (engine/grammar.py)
    #: with ``sampling.prompt_logprobs``: entry i is prompt token i + 1's (engine/prompt_logprobs.py)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: engine steps that gave this sequence output tokens here, and those tokens
    num_output_steps: int = 0
    num_step_tokens: int = 0
    #: the decayed acceptance history of engine.speculative.Speculator (accepted drafts; verifications
    #: that rejected one)
    spec_hits: float = 0.0
    spec_misses: float = 0.0

    def __post_init__(self) -> None:
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether this sequence asked for prompt logprobs and has not produced output yet
        (then every prompt position needs its logits: no prefix-cache hits)."""
        return self.sampling.prompt_logprobs is not None and self.num_tokens == self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_blocks_needed(self) -> int:
        """Blocks to hold the KV of all tokens that have KV or will get it this step."""
        return -(-self.num_tokens // self.block_size)

    def update_block_hashes(self) -> None:
        """Extend ``block_hashes`` over blocks that have become full."""
        num_full = self.num_tokens // self.block_size
        while len(self.block_hashes) < num_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            block = self.token_ids[i * self.block_size : (i + 1) * self.block_size]
            self.block_hashes.append(hash_block(parent, block, self.hash_extra))

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.update_block_hashes()

    def check_finished(self) -> str | None:
        """The finish reason after the last appended token, or None to go on."""
        last = self.token_ids[-1]
        if not self.sampling.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in self.sampling.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= self.sampling.max_tokens or self.num_tokens >= self.max_model_len:
            return "length"
        return None
