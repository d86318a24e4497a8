"""Speculative decoding that never changes the answer: drafting, acceptance, and when not to.

A decoding sequence normally computes one token per engine step. With speculation, a step
runs its last token *and* ``d`` draft tokens as rows of one chunk (the engine's per-row,
batch-invariant path, :mod:`engine.model.batch_invariant`), and the sampler picks the target's
token at each of the ``d + 1`` positions exactly as it would have without drafts: the logits of
a row are bit-identical to those of the same token decoded alone, the history the penalties
and grammar mask see is the drafts before it, and the random draw of output position ``i`` is
seeded from ``(seed, i)`` (:func:`engine.sampler.step_seed`). Position ``i``'s pick is
therefore the token the sequence would have produced there *if* drafts ``0 .. i-1`` were the
tokens it produced; the engine keeps the longest prefix of drafts that equal the picks plus
the pick after them (:func:`num_accepted`): between 1 and ``d + 1`` tokens a step, always the
tokens (and logprobs) of plain decoding, for greedy and seeded sampling alike. This is exact
*verification by the target's own sampler* rather than the rejection sampling of Leviathan et
al. (2023) / Chen et al. (2023), which keeps the distribution but not the tokens.

Drafting is model-free prompt lookup (:class:`NgramProposer`): the last ``n`` tokens are
looked up earlier in the sequence (prompt and output) and the tokens that followed the most
recent match are the draft. The idea is Saxena's "Prompt Lookup Decoding" (2023,
https://github.com/apoorvumang/prompt-lookup-decoding), which vLLM serves as its n-gram
proposer (``vllm/v1/spec_decode/ngram_proposer.py``: the longest suffix match between a
minimum and maximum n); this module is written from those descriptions. It pays on outputs
that copy their input: editing or summarising a given text, code edits, RAG answers.

Or a draft model (:class:`DraftModelProposer`, ``method="draft"``): any local Hugging Face model
folder whose vocabulary is the target's (a smaller model of the same family: SmolLM2-135M for
SmolLM2-1.7B, Qwen2.5-0.5B for Qwen2.5-7B) drafts greedily, one token per forward, with a KV
cache of its own per sequence that is cut back to what verification kept (the draft-model
speculative decoding of Leviathan et al., 2023, with the exact verification above in place of
their rejection sampling). It pays where the draft model is much cheaper per token than the
target and agrees with it often; on the default 135M model there is no smaller sibling, so
prompt lookup is the default.

When not to (:class:`Speculator`; the measurements behind the defaults are in
docs/decisions.md): a verified row is not free on a CPU (each costs about a quarter of a one-row
step's fixed cost here), so every step decides how many drafts each decoding sequence gets by
expected tokens per unit of step time. A step of ``R`` rows costs ``1 + row_cost * R`` (in units
of its fixed cost); the ``k``-th draft of a sequence is accepted with probability ``p ** k``,
``p`` being the sequence's recent per-token acceptance (a truncated-geometric estimate,
:meth:`Speculator.acceptance`); drafts are added, most likely first, while each one's expected
token per ``row_cost`` beats the step's expected tokens per cost so far (:meth:`Speculator.plan`,
the greedy that maximizes the ratio). One stream drafts whenever ``p`` passes about 0.2; at 32
sequences only drafts above about 0.9 earn their row; a sequence whose drafts keep failing stops
drafting and, as its history fades while it decodes without drafts, tries again.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from engine.sequence import Sequence

METHODS = ("off", "ngram", "draft")
#: Weight kept of a sequence's acceptance history at each verification (about the last five count).
HISTORY_DECAY = 0.8
#: Weight kept at each step a decoding sequence makes no draft: a failing history fades, so the
#: sequence tries again after some tens of tokens (as the prior pulls its estimate back up).
IDLE_DECAY = 0.95
#: The estimate's prior, worth one trial: p = 2/3 before any verification (prompt lookup's acceptance
#: on the copy-heavy and the open-ended workloads of `pdserve bench spec`, 63-67 %). Worth no more, so
#: that a few rejections bring p below what one stream's step needs (about 0.2; with the decay, the
#: history holds at most ~5 trials).
PRIOR_HITS, PRIOR_MISSES = 2.0 / 3.0, 1.0 / 3.0


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How an engine speculates (``PD_SPECULATIVE_*`` settings).

    Attributes:
        method: ``off``, ``ngram`` (prompt lookup) or ``draft`` (a draft model).
        num_tokens: most draft tokens per sequence per step.
        ngram_min, ngram_max: n-gram sizes looked up, longest first.
        max_batch: most decoding sequences in a step for which drafts are made (0: no limit; the
            expected-gain rule of :meth:`Speculator.plan` decides below it).
        row_cost: the time one more row adds to a decode step, as a fraction of the step's fixed
            cost (``pdserve bench spec --crossover`` measures it: 0.16-0.32 on a 2-vCPU Zen 4).
        draft_model: the draft model's local folder (``method="draft"`` only).
    """

    method: str = "off"
    num_tokens: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 0
    row_cost: float = 0.25
    draft_model: str = ""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, not {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs a draft model folder (PD_SPECULATIVE_DRAFT_MODEL)")
        if self.num_tokens < 1 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("speculative num_tokens must be >= 1 and 1 <= ngram_min <= ngram_max")
        if not self.row_cost > 0:
            raise ValueError("speculative row_cost must be > 0")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


class NgramProposer:
    """Prompt-lookup drafts: the continuation of the most recent earlier occurrence of the
    sequence's last ``n`` tokens, for ``n`` from ``ngram_max`` down to ``ngram_min``.

    Args:
        ngram_min, ngram_max: the n-gram sizes tried (longest first).
    """

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: Seq[int], num_draft: int) -> list[int]:
        """Up to ``num_draft`` draft tokens to follow ``token_ids`` (possibly none).

        Cost: one vectorized comparison of ``len(token_ids) x n`` per n tried (~0.1 ms at
        2,000 tokens on these CPUs)."""
        total = len(token_ids)
        if num_draft <= 0 or total < self.ngram_min + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.ngram_max, total - 1), self.ngram_min - 1, -1):
            pattern = arr[total - n:]
            # windows starting at s cover s .. s+n-1; s <= total-n-1 leaves at least one token after
            windows = np.lib.stride_tricks.sliding_window_view(arr[: total - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start: start + num_draft].tolist()
        return []


class DraftModelProposer:
    """Greedy drafts from a smaller model that shares the target's tokenizer.

    Each sequence (by request id) keeps a KV cache of the draft model (``transformers``'
    ``DynamicCache``) and the tokens it covers. A call cuts the cache back to the longest prefix
    it shares with the sequence's tokens now (what verification rejected goes; a preempted or
    resumed sequence keeps it), runs the new tokens through the draft model in one forward, then
    drafts one token per forward. The first call for a sequence runs its whole prompt through
    the draft model (a prefill of the draft's size on the decode worker).

    Args:
        folder: a local Hugging Face model folder (``config.json`` and weights).
        vocab_size: the target's vocabulary size; the draft's must equal it (the same token ids).
        dtype: the draft model's dtype (the engine's).

    Raises:
        ValueError: not a model folder, or a vocabulary of another size.
    """

    def __init__(self, folder: str, vocab_size: int, dtype=None):
        from pathlib import Path

        import torch
        from transformers import AutoModelForCausalLM

        path = Path(folder).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"speculative draft model {folder!r} is not a local model folder (no config.json)")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()
        if self.model.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary has {self.model.config.vocab_size} tokens, the "
                             f"target's {vocab_size}: a draft model must share the target's tokenizer")
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        #: request id → (the draft model's cache, the tokens whose KV it holds)
        self.caches: dict[str, tuple[object, list[int]]] = {}

    def propose(self, key: str, token_ids: Seq[int], num_draft: int) -> list[int]:
        """Up to ``num_draft`` greedy draft tokens to follow ``token_ids`` (none past the draft
        model's context)."""
        import torch
        from transformers import DynamicCache

        total = len(token_ids)
        num_draft = min(num_draft, self.max_len - total)
        if num_draft <= 0 or total == 0:
            return []
        cache, seen = self.caches.get(key) or (DynamicCache(), [])
        keep = 0
        limit = min(len(seen), total - 1)  # at least one token is fed: its logits give the first draft
        while keep < limit and seen[keep] == token_ids[keep]:
            keep += 1
        if keep < len(seen):
            if keep == 0:
                cache = DynamicCache()
            else:  # transformers 5 crops by a negative count: the tokens to remove
                cache.crop(keep - len(seen))
            del seen[keep:]
        drafts: list[int] = []
        with torch.inference_mode():
            feed = list(token_ids[keep:])
            while True:
                out = self.model(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True)
                seen.extend(feed)
                drafts.append(int(out.logits[0, -1].argmax()))
                if len(drafts) == num_draft:
                    break
                feed = drafts[-1:]
        self.caches[key] = (cache, seen)
        return drafts

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the caches of every sequence not in ``keep`` (finished, aborted, preempted)."""
        alive = set(keep)
        for k in [k for k in self.caches if k not in alive]:
            del self.caches[k]


def num_accepted(draft_token_ids: Seq[int], picked_token_ids: Seq[int]) -> int:
    """How many leading drafts equal the target's picks at their positions (``picked[i]`` is the
    token sampled at the position of ``draft[i]``; ``len(picked) == len(draft) + 1``). The step
    emits ``picked[: accepted + 1]``."""
    n = 0
    for draft, picked in zip(draft_token_ids, picked_token_ids):
        if draft != picked:
            break
        n += 1
    return n


class Speculator:
    """Makes the drafts of a step's decoding sequences and keeps each one's acceptance.

    Args:
        config: the settings.
        max_model_len: the engine's context length (drafts never pass it).
        vocab_size, dtype: the target's (a draft model is checked against them and run in it).

    Raises:
        ValueError: a draft model that cannot draft for this target (:class:`DraftModelProposer`).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int, vocab_size: int = 0, dtype=None):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        self.draft_model = (DraftModelProposer(config.draft_model, vocab_size, dtype)
                            if config.method == "draft" else None)

    def propose(self, running: Iterable[Sequence]) -> int:
        """Set ``draft_token_ids`` of every sequence in ``running`` (empty for those not drafting
        this step); returns the number of sequences with drafts.

        Prompt lookup runs first (it is cheap), for the sequences whose first draft could pay at
        all, so that :meth:`plan` weighs only drafts that exist (none past ``max_tokens`` or the
        context, none the grammar forbids, none where the lookup found nothing); a draft model runs
        after the plan, for the lengths it chose."""
        running = list(running)
        decoding = [s for s in running if _is_decoding(s)]
        for seq in running:
            seq.draft_token_ids = []
        if self.draft_model is not None:
            self.draft_model.forget(s.request_id for s in running)
        if self.config.max_batch and len(decoding) > self.config.max_batch:
            return 0
        need = self.first_draft_needs(len(decoding))
        drafts: list[list[int] | None] = []  # looked up (ngram), or None: the draft model's, after the plan
        caps: list[int] = []
        for seq in decoding:
            room = min(self.config.num_tokens,
                       seq.sampling.max_tokens - seq.num_output_tokens - 1,  # the pick after them
                       self.max_model_len - seq.num_tokens)  # positions of the drafts' KV
            if not seq.sampling.speculative or room <= 0 or self.acceptance(seq) <= need:
                drafts.append([])  # not even its likeliest draft could pay (or none may be made)
                caps.append(0)
            elif self.draft_model is None:
                draft = self._allowed(seq, self.proposer.propose(seq.token_ids, room))
                drafts.append(draft)
                caps.append(len(draft))
            else:
                drafts.append(None)
                caps.append(room)
        count = 0
        for seq, want, draft in zip(decoding, self.plan(decoding, caps), drafts):
            if want > 0 and draft is None:
                draft = self._allowed(seq, self.draft_model.propose(seq.request_id, seq.token_ids, want))
            draft = (draft or [])[:want]
            if draft:
                seq.draft_token_ids = draft
                count += 1
            elif seq.sampling.speculative:  # no draft this step: its history fades towards the prior
                seq.spec_hits *= IDLE_DECAY
                seq.spec_misses *= IDLE_DECAY
        return count

    @staticmethod
    def _allowed(seq: Sequence, draft: list[int]) -> list[int]:
        """``draft`` cut before the first token its grammar forbids (it would be rejected anyway)."""
        if draft and seq.matcher is not None:
            return draft[: seq.matcher.validate_tokens(draft)]
        return draft

    def release(self, request_id: str) -> None:
        """A sequence finished or was aborted: its draft model cache (if any) goes now."""
        if self.draft_model is not None:
            self.draft_model.caches.pop(request_id, None)

    @staticmethod
    def acceptance(seq: Sequence) -> float:
        """``p``: the chance that a sequence's next draft token is accepted given the one before it
        was. Each verification with ``d`` drafts and ``a`` accepted is a draw of a geometric run cut
        at ``d``: ``a`` successes, and one failure when ``a < d``; the estimate is successes over
        trials, with :data:`PRIOR_HITS` / :data:`PRIOR_MISSES` added and older verifications weighed
        down by :data:`HISTORY_DECAY` each."""
        return (seq.spec_hits + PRIOR_HITS) / (seq.spec_hits + seq.spec_misses + PRIOR_HITS + PRIOR_MISSES)

    def first_draft_needs(self, num_decoding: int) -> float:
        """The acceptance a sequence's first draft needs to pay in a step of ``num_decoding``
        decoding sequences and no drafts yet: its expected token per ``row_cost`` must beat the plain
        step's tokens per cost, ``p / c > n / (1 + c n)``, i.e. ``p > c n / (1 + c n)``."""
        c = self.config.row_cost
        return c * num_decoding / (1.0 + c * num_decoding)

    def plan(self, decoding: Seq[Sequence], caps: Seq[int] | None = None) -> list[int]:
        """Drafts to ask for, per sequence of this step's decoding ones (0: none); ``caps[i]``, when
        given, is the most sequence ``i`` can have (the drafts that exist for it).

        A step of ``R`` rows costs ``1 + c R`` (``c`` = ``row_cost``, in units of the step's fixed
        cost); a sequence's ``k``-th draft adds ``p ** k`` expected tokens (:meth:`acceptance`).
        Starting from the plain step (one row and one token per sequence), drafts are added in
        order of their expected tokens, most first, while each one's ``p ** k / c`` exceeds the
        step's expected tokens per cost so far: each added draft raises the ratio, the first that
        would not ends the plan, so the plan maximizes expected tokens per unit of step time over
        every choice of lengths (a sequence's drafts come in order, as ``p ** k`` falls with
        ``k``). Sequences opted out (``"speculative": false``) get none."""
        c = self.config.row_cost
        tokens, cost = float(len(decoding)), 1.0 + c * len(decoding)
        lengths = [0] * len(decoding)
        accept = [self.acceptance(seq) if seq.sampling.speculative else 0.0 for seq in decoding]
        if not accept or max(accept) <= self.first_draft_needs(len(decoding)):
            return lengths  # not even the likeliest first draft pays (a large batch): no sorting
        candidates = []
        for i, p in enumerate(accept):
            if p == 0.0:
                continue
            gain = 1.0
            for k in range(1, min(self.config.num_tokens, caps[i] if caps is not None else self.config.num_tokens) + 1):
                gain *= p
                candidates.append((-gain, k, i))
        candidates.sort()
        for neg_gain, k, i in candidates:
            gain = -neg_gain
            if gain * cost <= c * tokens:
                break
            if lengths[i] == k - 1:
                lengths[i] = k
                tokens += gain
                cost += c
        return lengths

    def record(self, seq: Sequence, num_drafted: int, num_accepted_tokens: int) -> None:
        """Count one verification of ``seq`` (``num_drafted`` drafts, the first
        ``num_accepted_tokens`` accepted) in its acceptance history (:meth:`acceptance`)."""
        seq.spec_hits = HISTORY_DECAY * seq.spec_hits + num_accepted_tokens
        seq.spec_misses = HISTORY_DECAY * seq.spec_misses + (num_accepted_tokens < num_drafted)
        seq.num_draft_tokens += num_drafted
        seq.num_accepted_tokens += num_accepted_tokens


def _is_decoding(seq: Sequence) -> bool:
    """Past its prompt with all but its last token computed (a plain decode step next)."""
    return seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
