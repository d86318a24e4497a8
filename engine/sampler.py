"""Choosing the next token of each sequence from its logits.

Order of operations per row (the order vLLM and Hugging Face apply them in):
logit_bias → repetition penalty (prompt and output tokens; divides positive logits, multiplies
negative ones: Keskar et al., 2019, CTRL) → presence and frequency penalties (output tokens;
OpenAI's definition) → greedy argmax when temperature is 0, else temperature → top-k →
top-p (nucleus, Holtzman et al., 2019) → min-p (Nguyen et al., 2024) → a random draw.

Randomness is per row and stateless: the draw for output token ``i`` of a request uses a
generator seeded from ``(seed, i)``. So a seeded request gives the same tokens whatever else
is in the batch, and a request moved to another worker mid-stream (or split between a
prefill and a decode worker) draws exactly what it would have drawn on one.
The draw is the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` picks index ``j``
with probability ``p_j``, one vectorized op per row.

Log-probabilities, when asked for, are of the model's raw distribution (log-softmax of the
logits before any processing, grammar masks included), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from shared.messages import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, index: int) -> int:
    """A 63-bit seed for output token ``index`` of a request seeded with ``seed``
    (SplitMix64's finalizer; Steele, Lea & Flood, 2014)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs of one sequence: its params, token history and output index."""

    params: SamplingParams
    prompt_token_ids: Seq[int]
    output_token_ids: Seq[int]

    @property
    def index(self) -> int:
        return len(self.output_token_ids)


def _needs_processing(p: SamplingParams) -> bool:
    return bool(
        p.logit_bias
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
    )


def apply_penalties(logits: torch.Tensor, rows: Seq[SamplingRow]) -> torch.Tensor:
    """Logit bias and the three penalties, in place on ``logits: [batch, vocab]`` float32."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not _needs_processing(p):
            continue
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
            vals = torch.tensor([p.logit_bias[t] for t in p.logit_bias if 0 <= t < vocab], dtype=logits.dtype)
            logits[i].index_add_(0, ids, vals)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(list({*row.prompt_token_ids, *row.output_token_ids}), dtype=torch.long)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(list(row.output_token_ids), dtype=torch.long), minlength=vocab)[:vocab]
            logits[i] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row ``[vocab]``; returns probabilities."""
    logits = logits / p.temperature
    if p.top_k is not None and 0 < p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop_sorted = (cum - sorted_probs) >= p.top_p
        drop_sorted[0] = False  # a top_p that rounds to 0 in float32 still keeps the best token
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def sample(logits: torch.Tensor, rows: Seq[SamplingRow], masks=None) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row.

    Args:
        logits: ``[batch, vocab]``, any float dtype (computed in float32).
        rows: one per logits row.
        masks: the grammar masks of constrained rows (``engine.grammar.MaskJob``), applied
            first (disallowed tokens get -inf, so no later step can bring them back).

    Returns:
        ``(token_ids, logprobs)``: a token per row, and per row a TokenLogprob when that
        row asked for logprobs (else None).
    """
    logits = logits.float()
    raw_logprobs = None
    if any(r.params.logprobs is not None for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    owned = masks is not None  # logits is a copy of our own from here on
    if owned:
        logits = logits.clone()
        masks.apply(logits)
    if any(_needs_processing(r.params) for r in rows):
        logits = apply_penalties(logits if owned else logits.clone(), rows)

    token_ids = logits.argmax(dim=-1).tolist()  # greedy rows are done; others are redrawn
    for i, row in enumerate(rows):
        p = row.params
        if p.is_greedy:
            continue
        probs = _filter_row(logits[i], p)
        gen = torch.Generator(device="cpu").manual_seed(step_seed(p.seed or 0, row.index))
        noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=gen)
        token_ids[i] = int(torch.argmax(probs.cpu() / noise))

    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    if raw_logprobs is not None:
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None:
                continue
            chosen = float(raw_logprobs[i, token_ids[i]])
            top: list[tuple[int, float]] = []
            if k > 0:
                vals, ids = torch.topk(raw_logprobs[i], k)
                top = [(int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist())]
            logprobs[i] = TokenLogprob(token_id=token_ids[i], logprob=chosen, top=top)
    return token_ids, logprobs
