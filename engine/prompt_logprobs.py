"""Prompt logprobs: the log-probability of every prompt token given the tokens before it,
computed from the prefill's own logits (what ``echo`` + ``logprobs`` on ``/v1/completions``
returns, and what lm-evaluation-harness sums for its log-likelihood tasks).

The logits at prompt position ``p`` predict token ``p + 1``, so a prefill chunk covering
positions ``[start, start + n)`` yields the logprobs of tokens ``start + 1 .. start + n``
(the last prompt position predicts the first output token: that row is the sampler's). The
first prompt token has no logprob (nothing precedes it; OpenAI returns ``null`` for it).

Only a sequence that has produced no output yet gets them (a resumed or preempted sequence
with output recomputes its prompt without them), and such a sequence skips the prefix cache
(see ``Scheduler.schedule`` and ``LLMEngine.admit_with_kv``): cached positions have no logits.

Values are ``log_softmax`` of the raw logits in float32 (no temperature, penalties or
logit bias), as vLLM's ``prompt_logprobs`` and transformers' scoring compute them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.messages import TokenLogprob

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq

#: Logits rows turned into logprobs at a time (bounds the float32 copy: rows × vocab × 4 bytes).
ROWS_PER_PIECE = 256


@dataclass(slots=True)
class _Part:
    seq: object
    start: int  # the chunk's first position (its logits row predicts token start + 1)
    rows: list[int]  # packed-row indices whose logits are needed


@dataclass(slots=True)
class PromptLogprobRows:
    """The packed rows whose logits a step must keep for prompt logprobs.

    Built from a step's batch in packed order (:meth:`plan`); the runner asks the model for
    ``rows`` on top of the sampling rows and hands their logits back to :meth:`apply`.
    """

    parts: list[_Part]

    @classmethod
    def plan(cls, batch: Seq[ScheduledSeq]) -> PromptLogprobRows:
        parts = []
        query_start = 0
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            if seq.wants_prompt_logprobs:
                # rows predicting prompt tokens start+1 .. min(start+n, num_prompt-1)
                last = min(start + n, seq.num_prompt_tokens - 1)
                rows = [query_start + j for j in range(last - start)]
                parts.append(_Part(seq, start, rows))
            query_start += n
        return cls(parts)

    @property
    def rows(self) -> list[int]:
        """Packed-row indices, all parts concatenated."""
        return [r for p in self.parts for r in p.rows]

    def apply(self, logits: torch.Tensor) -> None:
        """Store each part's prompt logprobs on its sequence (``seq.prompt_logprobs``).

        Args:
            logits: ``[len(self.rows), vocab]``, the model's logits of :attr:`rows`, in order.
        """
        offset = 0
        for part in self.parts:
            seq, n = part.seq, len(part.rows)
            targets = seq.token_ids[part.start + 1 : part.start + 1 + n]
            entries = token_logprobs(logits[offset : offset + n], targets, seq.sampling.prompt_logprobs)
            # entry i is token i + 1's: a recompute from ``start`` replaces what follows it
            del seq.prompt_logprobs[part.start:]
            seq.prompt_logprobs.extend(entries)
            offset += n


def token_logprobs(logits: torch.Tensor, targets: Seq[int], k: int) -> list[TokenLogprob]:
    """Each row's log-probability of its target token and its ``k`` most likely tokens.

    Args:
        logits: ``[num_rows, vocab]``, any float dtype (computed in float32).
        targets: one token id per row.
        k: alternatives per row (0: none).

    Returns:
        One :class:`TokenLogprob` per row.
    """
    out: list[TokenLogprob] = []
    target = torch.tensor(list(targets), dtype=torch.long, device=logits.device)
    for s in range(0, logits.shape[0], ROWS_PER_PIECE):
        piece = torch.log_softmax(logits[s : s + ROWS_PER_PIECE].float(), dim=-1)
        chosen = piece.gather(1, target[s : s + ROWS_PER_PIECE, None])[:, 0].tolist()
        if k > 0:
            vals, ids = torch.topk(piece, k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        else:
            tops = [[] for _ in chosen]
        out.extend(TokenLogprob(token_id=int(t), logprob=c, top=top)
                   for t, c, top in zip(targets[s : s + ROWS_PER_PIECE], chosen, tops))
    return out
