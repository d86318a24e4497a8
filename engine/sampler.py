"""Choosing the next token of each sequence from its logits.

Order of operations per row (the order vLLM and Hugging Face apply them in):
logit_bias → repetition penalty (prompt and output tokens; divides positive logits, multiplies
negative ones: Keskar et al., 2019, CTRL) → presence and frequency penalties (output tokens;
OpenAI's definition) → greedy argmax when temperature is 0, else temperature → top-k →
top-p (nucleus, Holtzman et al., 2019) → min-p (Nguyen et al., 2024) → a random draw.

Randomness is per row and stateless: the draw for output token ``i`` of a request is a pure
function of ``(seed, i)`` and that row's probabilities. So a seeded request gives the same tokens whatever else
is in the batch, and a request moved to another worker mid-stream (or split between a
prefill and a decode worker) draws exactly what it would have drawn on one.
The draw is inverse-CDF sampling with one uniform per row: the uniform is a pure function of
``(seed, i)`` (:func:`step_seed`'s top 24 bits), and the token is the first whose cumulative
probability exceeds it (``cumsum`` + ``searchsorted``, float32, as FlashInfer's sampling
kernels do). Temperature, softmax and the search run once over all sampled rows on the
logits' device; only the token ids reach the host. It replaced a race ``argmax(p / E)`` with
``E ~ Exp(1)`` drawn per row from a seeded CPU generator, which cost ~1.5 ms per 49k-token row
on one core here (``Tensor.exponential_``) and, on a GPU, a copy to the host per row: a decode
step of 32 rows spent ~50 ms sampling on this CPU, and the H200 profile's step at batch 256
526 ms. Now 0.3-0.5 ms a row on the CPU and ~0.03 ms on the GPU (``docs/decisions.md``).

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
            ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long, device=logits.device)
            vals = torch.tensor([p.logit_bias[t] for t in p.logit_bias if 0 <= t < vocab], dtype=logits.dtype,
                                device=logits.device)
            logits[i].index_add_(0, ids, vals)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(list({*row.prompt_token_ids, *row.output_token_ids}), dtype=torch.long,
                                device=logits.device)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            ids = torch.tensor([t for t in row.output_token_ids if 0 <= t < vocab], dtype=torch.long,
                               device=logits.device)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device).index_add_(
                0, ids, torch.ones(ids.shape, dtype=logits.dtype, device=logits.device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _has_filters(p: SamplingParams) -> bool:
    return (p.top_k is not None and p.top_k > 0) or p.top_p < 1.0 or p.min_p > 0.0


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-probable prefix of ``probs: [vocab]`` whose mass reaches
    ``top_p`` (always at least one token); zero the rest.

    The nucleus is looked for among the top ``k`` tokens first (k = 64, 512, 4096, then all):
    once their mass reaches ``top_p``, every token after them is dropped, so sorting the rest
    is not needed. A full sort of a 49k-token row costs ~4 ms on one CPU core; ``topk(64)``
    ~0.1 ms. Which ``k`` is used depends on the row alone, so the result is batch-invariant."""
    vocab = probs.shape[0]
    k = 64
    while True:
        k = min(k, vocab)
        top, order = torch.topk(probs, k) if k < vocab else torch.sort(probs, descending=True)
        cum = torch.cumsum(top, dim=-1)
        if k == vocab or bool(cum[-1] >= top_p):  # the same float32 sums the rule below reads
            break
        k *= 8
    keep = (cum - top) < top_p
    keep[0] = True  # a top_p that rounds to 0 in float32 still keeps the best token
    out = torch.zeros_like(probs)
    out[order[keep]] = top[keep]
    return out


def _filter_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Top-k, top-p and min-p on one row ``[vocab]`` of logits already divided by the
    temperature; returns probabilities."""
    if p.top_k is not None and 0 < p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        probs = _top_p(probs, p.top_p)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def _uniform(seed: int, index: int) -> float:
    """The uniform in [0, 1) for output token ``index`` of a request seeded with ``seed``: the
    top 24 bits of :func:`step_seed` (a float32 holds them exactly)."""
    return (step_seed(seed, index) >> 39) / float(1 << 24)


def _draw(logits: torch.Tensor, rows: Seq[SamplingRow], index: list[int]) -> list[int]:
    """Inverse-CDF draws for ``rows`` (rows ``index`` of ``logits: [batch, vocab]``, float32):
    one token each, on the logits' device; only the token ids come back to the host.

    Temperature and softmax run once over all drawn rows; rows with top-k/top-p/min-p are
    filtered one by one. A row's result depends on that row alone (softmax and cumsum reduce
    along it), so a seeded request draws the same token in any batch."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=logits.device)
    picked = logits if len(index) == logits.shape[0] else logits[index]
    scaled = picked / temps[:, None]
    probs = torch.softmax(scaled, dim=-1)
    for k, r in enumerate(rows):
        if _has_filters(r.params):
            probs[k] = _filter_row(scaled[k], r.params)
    # a zero-probability token must get an empty interval: cumsum's value there equals the one
    # before it on a CPU (rows are summed in order) but a GPU's scan may round it another way;
    # the running maximum over the nonzero positions makes it exact on any device
    cum = torch.cumsum(probs, dim=-1)
    cum = torch.cummax(torch.where(probs > 0, cum, torch.zeros_like(cum)), dim=-1).values
    total = cum[:, -1:]
    u = torch.tensor([[_uniform(r.params.seed or 0, r.index)] for r in rows], dtype=torch.float32,
                     device=logits.device)
    # the first token whose cumulative mass exceeds u * total: zero-probability tokens have empty
    # intervals and are never picked; the bound keeps a rounded-up u * total below the total
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    picks = torch.searchsorted(cum, x, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    # no finite positive mass (a +inf logit, every logit -inf, NaN): the row's argmax, as greedy
    bad = ~(torch.isfinite(total) & (total > 0)).squeeze(1)
    if bool(bad.any()):
        picks = torch.where(bad, scaled.argmax(dim=-1), picks)
    return picks.tolist()


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
    drawn = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if drawn:
        for i, token in zip(drawn, _draw(logits, [rows[i] for i in drawn], drawn)):
            token_ids[i] = token

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
