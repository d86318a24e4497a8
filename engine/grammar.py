"""Constrained decoding in the engine: a grammar matcher per sequence and a token mask per
sampling step, with llguidance (https://github.com/guidance-ai/llguidance; the engine vLLM
and SGLang use as their ``guidance`` backend).

A request's ``SamplingParams.grammar`` is an llguidance grammar (JSON text, made and checked
at the gateway by :mod:`shared.structured`). Here:

* :class:`GrammarBackend` owns the llguidance tokenizer of the served model (built once from
  the model folder's Hugging Face tokenizer, ~1 s) and a cache of compiled grammars: the first
  sequence with a grammar compiles it into a matcher, every later one starts from a
  ``deep_copy`` of that (microseconds).
* Each sequence holds its own ``LLMatcher``; :meth:`GrammarBackend.matcher_for` replays the
  output tokens a resumed sequence already has (a failover to another decode worker, or the
  hand-off from prefill), so its state is exactly what it was on the worker before.
* :meth:`GrammarBackend.start_masks` computes the allowed-token bitmasks of every
  constrained row of a step in one llguidance call (its executor spreads the rows over
  threads, without the GIL), in a background thread *while the forward pass runs*; the sampler
  waits for the result (:class:`MaskJob`) and sets every disallowed logit to -inf.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import torch

from shared.errors import InvalidRequest
from shared.logging import get_logger

#: Rows from which one parallel executor call beats a call per row (a per-step mask costs
#: ~10-50 us a row for a JSON schema on a 49k vocabulary).
PARALLEL_MIN_ROWS = 8
#: Compiled grammars kept per worker (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256
#: Byte value → its 8 bits, least significant first (allowed), and as a 0 / -inf bias.
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
_BYTE_BIAS = torch.where(_BYTE_BITS, 0.0, float("-inf"))


class MaskJob:
    """The masks of one step's constrained rows, being computed in the background.

    ``rows`` are indices into the step's sampled rows; :meth:`allowed` waits for the result.
    """

    def __init__(self, rows: list[int], future: Future, vocab_size: int):
        self.rows = rows
        self._future = future
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """``[len(rows), vocab_size]`` bool: True where the grammar allows the token."""
        return unpack_bitmask(self._future.result(), self._vocab_size)

    def apply(self, logits: torch.Tensor) -> None:
        """Wait for the masks and set the disallowed logits of ``logits: [batch, vocab]`` to
        -inf, in place."""
        apply_bitmask(logits, self.rows, self._future.result())


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's ``[rows, ceil(vocab/32)]`` int32 bitmask (bit ``j`` of word ``w`` is
    token ``32 w + j``) as a ``[rows, vocab_size]`` bool tensor (True: allowed)."""
    return _byte_lookup(bitmask, _BYTE_BITS)[:, :vocab_size]


def _byte_lookup(bitmask: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # little-endian: byte k of word w holds tokens 32 w + 8 k .. 32 w + 8 k + 7
    as_bytes = bitmask.contiguous().view(torch.uint8).long()
    return torch.nn.functional.embedding(as_bytes, table).reshape(bitmask.shape[0], -1)


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Set the logits a bitmask disallows to -inf, in place: ``logits: [batch, vocab]``,
    ``bitmask[k]`` the mask of row ``rows[k]``. Columns past the mask's width (padding tokens)
    are disallowed. A row whose mask allows nothing (a matcher in an error state) is left
    alone rather than made NaN. One table lookup per mask byte gives an additive 0 / -inf
    bias (a bool ``masked_fill`` costs several times more on CPU: bench_grammar.py)."""
    if not rows:
        return
    vocab = logits.shape[1]
    device = logits.device
    table = _BYTE_BIAS if device.type == "cpu" else _BYTE_BIAS.to(device)  # only the packed mask travels
    bias = _byte_lookup(bitmask.to(device, non_blocking=True), table)
    width = min(bias.shape[1], vocab)
    bias = bias[:, :width]
    empty = ~(bitmask != 0).any(dim=1)
    if bool(empty.any()):
        bias[empty.to(device)] = 0.0
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits[:, :width] += bias
        logits[:, width:] = float("-inf")
        return
    idx = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    sub = logits[idx]
    sub[:, :width] += bias
    sub[:, width:] = float("-inf")
    logits[idx] = sub


class GrammarBackend:
    """The llguidance tokenizer of one model, its grammar cache, and the mask computation.

    Args:
        ll_tokenizer: an ``llguidance.LLTokenizer`` whose vocabulary is the logits' width.
        mask_threads: llguidance executor threads (None: its default, 80% of the CPUs).
    """

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, mask_threads: int | None = None):
        self.tokenizer = ll_tokenizer
        self.vocab_size = ll_tokenizer.vocab_size
        self.executor = llguidance.LLExecutor(num_threads=mask_threads)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    @classmethod
    def from_folder(cls, folder: str | Path, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> GrammarBackend:
        """From a Hugging Face model folder's (fast) tokenizer, with ``vocab_size`` tokens
        (the model's, which may exceed the tokenizer's) and the model's EOS tokens."""
        import llguidance.hf
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(folder))
        eos = sorted(eos_token_ids) or None
        return cls(llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos))

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for ``grammar`` at its start state (compiled once, then copied).

        Raises:
            InvalidRequest: the grammar does not compile (400 on ``response_format``).
        """
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
                return template.deep_copy()
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidRequest(f"invalid grammar: {template.get_error()}", param="response_format")
        with self._lock:
            self._compiled[grammar] = template
            self.num_compiled += 1
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def matcher_for(self, grammar: str, output_token_ids: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A matcher for a sequence that already produced ``output_token_ids`` (replayed).

        Raises:
            InvalidRequest: the grammar does not compile, or the tokens do not follow it.
        """
        matcher = self.compile(grammar)
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise InvalidRequest(f"the output so far does not follow the grammar: {matcher.get_error()}",
                                 param="response_format")
        return matcher

    def fill(self, matchers: Sequence[llguidance.LLMatcher]) -> torch.Tensor:
        """The bitmasks of ``matchers`` now, ``[len(matchers), ceil(vocab/32)]`` int32: one
        llguidance executor call (rows in parallel) for :data:`PARALLEL_MIN_ROWS` rows or more
        on a machine with more than 4 CPUs, else one call per row (cheaper there:
        ``loadtest/experiments/bench_grammar.py`` measures both)."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
        if len(matchers) >= PARALLEL_MIN_ROWS and (os.cpu_count() or 1) > 4:
            self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                                  words * 4, len(matchers))
        else:
            for i, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
        return bitmask

    def start_masks(self, matchers: Sequence[llguidance.LLMatcher | None]) -> MaskJob | None:
        """Start computing the masks of a step's sampled rows (None where unconstrained) in
        the background; None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        active = [matchers[i] for i in rows]
        return MaskJob(rows, self._pool.submit(self.fill, active), self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def advance(matcher: llguidance.LLMatcher, token_id: int) -> tuple[bool, str | None]:
    """Feed a sampled token to a sequence's matcher.

    Returns:
        ``(done, error)``: done when the grammar is complete (only EOS may follow) or the
        matcher failed; ``error`` is then the matcher's message (the sequence ends with an
        error rather than run on unconstrained or pass off a broken output as complete).
    """
    matcher.consume_token(token_id)
    if matcher.is_error():
        error = matcher.get_error()[:300]
        get_logger(__name__).error("grammar_matcher_failed", error=error)
        return True, error
    return matcher.is_stopped(), None


class LazyGrammar:
    """An engine's :class:`GrammarBackend`, built once from the model folder's tokenizer.

    Args:
        runner: the engine's ModelRunner (gets ``.grammar`` once built, to compute masks).
        vocab_size: the model's vocabulary (logits width).
        eos_token_ids: the model's EOS tokens (what a complete grammar allows).
    """

    def __init__(self, runner, vocab_size: int, eos_token_ids: Iterable[int]):
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.folder: str | Path | None = None
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def prepare(self, folder: str | Path) -> None:
        """Set the tokenizer folder and build the backend in a background thread (~1 s, off
        the first constrained request's path)."""
        self.folder = folder
        threading.Thread(target=self._warm, name="grammar-init", daemon=True).start()

    def _warm(self) -> None:
        try:
            self.get()
        except Exception as exc:  # a folder without a usable tokenizer: said once here, and
            # again to each constrained request, by get()
            get_logger(__name__).warning("grammar_unavailable", folder=str(self.folder), error=f"{type(exc).__name__}: {str(exc)[:200]}")

    def get(self) -> GrammarBackend:
        """The backend (built now if needed).

        Raises:
            InvalidRequest: no tokenizer folder was given.
        """
        with self._lock:
            if self._backend is None:
                if self.folder is None:
                    raise InvalidRequest("this worker has no tokenizer for constrained decoding",
                                         param="response_format")
                self._backend = GrammarBackend.from_folder(self.folder, self.vocab_size, self.eos_token_ids)
                self.runner.grammar = self._backend
        return self._backend

    async def precompile(self, grammar: str | None) -> None:
        """Compile ``grammar`` into the cache in a worker thread, so that the engine thread
        only copies it when the sequence is added (errors are left for that moment)."""
        if grammar is None:
            return
        try:
            await asyncio.to_thread(lambda: self.get().compile(grammar))
        except Exception:  # reported by add_request, where a request's errors belong
            return
