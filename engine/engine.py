"""The engine: a scheduler, a KV pool and a model runner, stepped in a loop.

``step()`` reads as a sentence: schedule → execute → update. Prefill and decode workers run
the same engine: a prefill worker adds sequences with ``stop_after_prefill`` and exports
their prompt KV when the first token is sampled; a decode worker admits sequences whose
prompt KV it loads from the KV store (:meth:`LLMEngine.admit_with_kv`) and decodes them in
a continuous batch. An engine is single-threaded: one thread owns it (see
``services/common/engine_loop.py``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import msgspec
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.grammar import LazyGrammar, advance
from engine.kv_cache import PagedKVCache
from engine.model_runner import ATTN_IMPLEMENTATION, ModelRunner, register_attention
from engine.outputs import EngineStats, PromptKV, StepOutput
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import Speculator, num_accepted
from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.hashing import hash_extra
from shared.kv.layout import KVLayout
from shared.messages import SamplingParams


class LLMEngine:
    """Paged-KV, continuously batched inference over a transformers causal LM.

    Args:
        model: a causal LM loaded with ``attn_implementation=ATTN_IMPLEMENTATION``.
        config: sizes.
        eos_token_ids: tokens that end generation.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, eos_token_ids: Iterable[int] = ()):
        register_attention()
        mc = model.config
        self.config = config
        self.model = model
        num_layers = mc.num_hidden_layers
        num_kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.kv_dtype = config.kv_cache_dtype or self.dtype
        self.bytes_per_token = PagedKVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, self.kv_dtype)
        num_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory_bytes // (self.bytes_per_token * config.block_size))
        self.max_model_len = config.max_model_len or int(getattr(mc, "max_position_embeddings", 2048))
        self.kv_cache = PagedKVCache(num_layers, num_kv_heads, head_dim, num_blocks, config.block_size,
                                     self.kv_dtype, self.device, config.model_id, config.kv_pinned_buffer_bytes)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_chunk_tokens)
        self.runner = ModelRunner(model, self.kv_cache, config.attention_backend, config.batch_invariant,
                                  config.block_dot)
        if config.cuda_graphs and self.device.type == "cuda" and self.runner.attention.__name__ == "kernels.triton":
            self._enable_cuda_graphs()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sequences: dict[str, Sequence] = {}
        self.stats = EngineStats()
        #: when a list, :meth:`step` appends one :func:`step_record` per step (the step log)
        self.step_log: list | None = None
        #: when set, called on the engine thread after a step that completed full prompt blocks of
        #: a ``stop_after_prefill`` sequence whose prompt is not finished yet, with ``(request_id,
        #: first block index, their hashes, their buffers)``: a prefill worker stages them while
        #: the rest of the prompt is computed, and the final export skips them
        self.on_prompt_blocks = None
        self.grammar = LazyGrammar(self.runner, mc.vocab_size, self.eos_token_ids)  # constrained decoding
        #: drafts and verifies tokens (engine/speculative.py); None when off. Exactness needs the
        #: batch-invariant per-row path, so without it speculation stays off
        self.speculator = None
        if config.speculative.enabled:
            if self.runner.is_batch_invariant:
                self.speculator = Speculator(config.speculative, self.max_model_len, mc.vocab_size, self.dtype)
            else:
                from shared.logging import get_logger

                get_logger(__name__).warning("speculative_off", reason="needs PD_BATCH_INVARIANT on a CPU")

    def _enable_cuda_graphs(self) -> None:
        """Capture decode graphs for the configured batch sizes; a capture that fails (an
        operation of the model that cannot be captured) leaves decode eager, with a warning."""
        from shared.logging import get_logger

        sizes = [s for s in self.config.cuda_graph_batch_sizes if s <= self.config.max_num_seqs]
        if not sizes:
            return
        try:
            self.runner.enable_cuda_graphs(sizes, -(-self.max_model_len // self.config.block_size))
        except Exception as exc:
            self.runner.graphs = None
            get_logger(__name__).warning("cuda_graphs_disabled", error=f"{type(exc).__name__}: {str(exc)[:300]}")

    @classmethod
    def load(cls, folder, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> LLMEngine:
        """Load a Hugging Face model folder and build an engine around it."""
        from engine.model.loader import load_model

        register_attention()
        model = load_model(folder, dtype, device, ATTN_IMPLEMENTATION)
        if config.weights != "float":
            from engine.model.weights import apply_weights

            apply_weights(model, config.weights, folder, device)
        engine = cls(model, config, eos_token_ids=eos_ids_of(model))
        engine.grammar.prepare(folder)
        return engine


    # --- properties ---------------------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self.kv_cache.layout

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def hash_extra(self, cache_salt: str = "") -> bytes:
        return hash_extra(self.config.model_id, self.config.block_size, cache_salt)

    # --- adding and removing requests -----------------------------------------------------
    def _new_sequence(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams,
        output_token_ids: Seq[int],
        cache_salt: str,
        stop_after_prefill: bool,
        block_hashes: Seq[bytes] | None,
    ) -> Sequence:
        if request_id in self.sequences:
            raise InvalidRequest(f"request {request_id} is already in the engine")
        if not prompt_token_ids:
            raise InvalidRequest("the prompt has no tokens", param="prompt")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        total = len(prompt_token_ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt_token_ids)} in the prompt, {sampling.max_tokens} for the completion).",
                param="max_tokens",
            )
        if -(-total // self.config.block_size) > self.num_kv_blocks:
            raise ContextLengthExceeded(
                f"{total} tokens do not fit this worker's KV pool of {self.num_kv_blocks * self.config.block_size} tokens",
                param="max_tokens",
            )
        if not sampling.is_greedy and sampling.seed is None:
            sampling = msgspec.structs.replace(sampling, seed=random.getrandbits(63))
        seq = Sequence(
            request_id=request_id,
            token_ids=[*prompt_token_ids, *output_token_ids],
            num_prompt_tokens=len(prompt_token_ids),
            sampling=sampling,
            block_size=self.config.block_size,
            hash_extra=self.hash_extra(cache_salt),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            stop_after_prefill=stop_after_prefill,
            block_hashes=list(block_hashes) if block_hashes else [],
        )
        if sampling.grammar is not None:
            seq.matcher = self.grammar.get().matcher_for(sampling.grammar, output_token_ids)
        return seq

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams,
        *,
        output_token_ids: Seq[int] = (),
        cache_salt: str = "",
        stop_after_prefill: bool = False,
        block_hashes: Seq[bytes] | None = None,
    ) -> Sequence:
        """Queue a request. ``output_token_ids`` resumes one that already has output (its
        KV is recomputed). ``stop_after_prefill`` ends it once its first token is sampled,
        with its prompt KV exported in the step output.

        Raises:
            InvalidRequest: empty prompt, a token id outside the vocabulary, a duplicate id.
            ContextLengthExceeded: prompt + max_tokens exceeds the context or the KV pool.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, sampling, output_token_ids, cache_salt,
                                 stop_after_prefill, block_hashes)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def cached_block_hashes(self, block_hashes: Seq[bytes]) -> int:
        """How many leading hashes are in this worker's prefix cache (a hint: the answer may
        change before the engine thread acts on it)."""
        n = 0
        for h in block_hashes:
            if self.block_manager.lookup(h) is None:
                break
            n += 1
        return n

    def import_cached_blocks(self, block_hashes: Seq[bytes], blocks: Seq[bytes | memoryview],
                             keep: Seq[bytes] = ()) -> int:
        """Put blocks computed elsewhere (read from the KV store) into this worker's prefix
        cache, as free cached blocks that the next prompt with that prefix will hit. Blocks
        already cached here are skipped; stops early when no block is free. Returns how many
        were imported.

        ``keep``: the prompt's blocks before these that this worker's cache holds (its local
        leading hits), held with the import's own until it ends
        (:meth:`BlockManager.import_blocks`).

        Raises:
            ValueError: a block's size does not match this pool's layout.
        """
        return self.block_manager.import_blocks(
            block_hashes[: len(blocks)], keep, lambda block_id, i: self.kv_cache.import_block(block_id, blocks[i]))

    def admit_with_kv(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        output_token_ids: Seq[int],
        sampling: SamplingParams,
        block_hashes: Seq[bytes],
        blocks: Seq[bytes | memoryview | None],
        tail: bytes | memoryview | None,
        *,
        cache_salt: str = "",
    ) -> Sequence:
        """Admit a request whose prompt KV was computed elsewhere.

        Each full block is taken from this worker's prefix cache when it has it, else from
        ``blocks[i]`` (the bytes loaded from the KV store; None when missing there). The
        ``tail`` covers the prompt's last ``len(prompt) % block_size`` tokens. Whatever is
        missing is recomputed, from the first gap on.

        Raises:
            InvalidRequest, ContextLengthExceeded: as for :meth:`add_request`.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, sampling, output_token_ids, cache_salt,
                                 False, block_hashes)
        bm = self.block_manager
        bs = self.config.block_size
        num_prompt = len(prompt_token_ids)
        num_full = num_prompt // bs
        local = loaded = 0
        # a prompt decode prefills itself with prompt logprobs needs every position's logits
        if seq.wants_prompt_logprobs:
            num_full, tail = 0, None
        for i in range(num_full):
            h = seq.block_hashes[i]
            block = bm.lookup(h)
            if block is not None:
                bm.hold(block)
                local += 1
            elif i < len(blocks) and blocks[i] is not None and bm.num_free_blocks > 0:
                block = bm.allocate_block()
                self.kv_cache.import_block(block.block_id, blocks[i])
                bm.register_block(block, h)
                loaded += 1
            else:
                break
            seq.block_table.append(block.block_id)
        num_tail = num_prompt - num_full * bs
        computed = len(seq.block_table) * bs
        if computed == num_full * bs and num_tail and tail is not None and bm.num_free_blocks > 0:
            block = bm.allocate_block()
            self.kv_cache.import_block(block.block_id, tail, num_tail)
            seq.block_table.append(block.block_id)
            computed += num_tail
        seq.num_computed_tokens = min(computed, seq.num_tokens - 1)
        seq.num_cached_tokens = local * bs
        self.stats.num_cached_tokens += local * bs
        self.stats.num_loaded_tokens += computed - local * bs
        self.sequences[request_id] = seq
        self.scheduler.add_running(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; its blocks are freed. Returns its sequence (what it had
        computed: ``num_prefill_chunks``, ``num_computed_tokens``), None if unknown."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        if self.speculator is not None:
            self.speculator.release(request_id)
        return seq

    # --- the loop -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule → execute → update. Returns outputs of sequences that sampled a token."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        started = time.perf_counter()
        self.stats.last_step_tokens = plan.num_batched_tokens
        self.stats.last_step_seqs = len(plan.scheduled)
        shape = step_shape(plan.scheduled) if self.step_log is not None else None
        result = self.runner.execute(plan.scheduled)
        outputs = self._update(plan.scheduled, result)
        self.stats.num_steps += 1
        elapsed = time.perf_counter() - started
        self.stats.step_seconds += elapsed
        if shape is not None:
            self.step_log.append((started, elapsed, *shape))
        return outputs

    def _update(self, scheduled, result) -> list[StepOutput]:
        for item in scheduled:
            seq = item.seq
            if item.draft_token_ids:
                continue  # counted once its drafts are verified, below
            if is_decode(item):
                self.stats.num_decode_tokens += 1
            else:
                self.stats.num_prefill_tokens += item.num_new_tokens
                seq.num_prefill_chunks += 1
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if self.on_prompt_blocks is not None and seq.stop_after_prefill:
                self._export_finished_blocks(seq)
        outputs = []
        for item, picked, logprobs in zip(result.sampled, result.token_ids, result.logprobs):
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            num_drafts = item.num_draft_tokens
            accepted = num_accepted(item.draft_token_ids, picked) if num_drafts else 0
            index = seq.num_output_tokens
            new_ids, new_logprobs = [], []
            reason = error = None
            for token_id, logprob in zip(picked[: accepted + 1], logprobs[: accepted + 1]):
                seq.append_token(token_id)
                new_ids.append(token_id)
                new_logprobs.append(logprob)
                if logprob is not None:
                    seq.output_logprobs.append(logprob)
                reason = seq.check_finished()
                if seq.matcher is not None and reason is None:
                    done, error = advance(seq.matcher, token_id)
                    if done:  # the grammar is complete (only EOS could follow), or the matcher failed
                        reason = "error" if error else "stop"
                if reason is not None:
                    break
            if num_drafts:
                self._verified(item, accepted, len(new_ids))
            seq.num_output_steps += 1
            seq.num_step_tokens += len(new_ids)
            ends_here = reason is not None or seq.stop_after_prefill
            out = StepOutput(seq, new_ids, new_logprobs, index=index, finished=ends_here,
                             finish_reason=reason, error=error)
            if out.index == 0 and seq.sampling.prompt_logprobs is not None:
                out.prompt_logprobs = seq.prompt_logprobs
            if seq.stop_after_prefill and reason is None:
                out.prompt_kv = self.export_prompt_kv(seq)
            if ends_here:
                self._finish(seq, reason)
            outputs.append(out)
        return outputs

    def _verified(self, item, accepted: int, num_emitted: int) -> None:
        """Counters and KV of a sequence after its drafts were verified: the last token and the
        ``accepted`` drafts have KV now; the rejected drafts' slots are rolled back (blocks past
        what the computed tokens fill go back to the pool, and nothing past them is cached)."""
        seq = item.seq
        self.stats.num_decode_tokens += num_emitted
        self.stats.num_spec_steps += 1
        self.stats.num_draft_tokens += item.num_draft_tokens
        self.stats.num_accepted_tokens += accepted
        seq.num_computed_tokens = min(seq.num_computed_tokens + 1 + accepted, seq.num_tokens)
        self.block_manager.truncate(seq, -(-seq.num_computed_tokens // self.config.block_size))
        self.block_manager.cache_full_blocks(seq)
        self.speculator.record(seq, item.num_draft_tokens, accepted)

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        self.sequences.pop(seq.request_id, None)
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.release(seq.request_id)

    def _export_finished_blocks(self, seq: Sequence) -> None:
        """Hand the full prompt blocks this step finished to ``on_prompt_blocks`` while the
        prompt is still being prefilled (the last chunk's blocks go with the final export).

        Staging a long prompt's KV chunk by chunk overlaps the copy into the KV store with the
        rest of its prefill, so the hand-off after the first token moves only the last chunk:
        the overlap of KV transfer with prefill of Splitwise (Patel et al., ISCA 2024: layer by
        layer) and Mooncake (Qin et al., FAST 2025: chunk by chunk), here per prefill chunk.
        Nothing is handed out for a request its first token ends (``max_tokens`` ≤ 1)."""
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            return  # the prompt is done: its first token is sampled this step, export_prompt_kv follows
        if seq.sampling.max_tokens <= 1:
            return  # its first token ends it: there will be no hand-off to stage for
        bs = self.config.block_size
        done = seq.num_computed_tokens // bs
        first = seq.num_exported_blocks
        if done <= first:
            return
        buffers = self.kv_cache.export_blocks(seq.block_table[first:done])
        seq.num_exported_blocks = done
        self.on_prompt_blocks(seq.request_id, first, seq.block_hashes[first:done], buffers)

    def export_prompt_kv(self, seq: Sequence) -> PromptKV:
        """Copy the KV of ``seq``'s prompt out of the pool (call before its blocks are freed),
        from its first full block not yet handed to ``on_prompt_blocks`` on."""
        bs = self.config.block_size
        num_prompt = seq.num_prompt_tokens
        num_full = num_prompt // bs
        num_tail = num_prompt - num_full * bs
        first = min(seq.num_exported_blocks, num_full)
        ids = seq.block_table[first: num_full + (1 if num_tail else 0)]
        sizes = [bs] * (num_full - first) + ([num_tail] if num_tail else [])
        buffers = self.kv_cache.export_blocks(ids, sizes)
        return PromptKV(
            block_hashes=seq.block_hashes[:num_full],
            blocks=buffers[: num_full - first],
            tail=buffers[num_full - first] if num_tail else None,
            num_tail_tokens=num_tail,
            num_tokens=num_prompt,
            first_block=first,
        )

    # --- offline use ------------------------------------------------------------------------
    def generate(self, prompts: Seq[Seq[int]], sampling: SamplingParams | Seq[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion in one continuous batch; returns finished sequences in
        prompt order (their ``output_token_ids``). For tests, benchmarks and offline use."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        base = f"gen-{random.getrandbits(32):08x}"
        seqs = [self.add_request(f"{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        while self.has_unfinished():
            self.step()
        return seqs


def eos_ids_of(model: torch.nn.Module) -> set[int]:
    """End-of-sequence token ids from the model's generation config (an int or a list)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


def step_shape(scheduled) -> tuple[list[list[int]], int, int]:
    """What a step computes, in the simulator's cost terms (``sim/profile.py``):
    ``([[chunk tokens, context tokens before the chunk], ...], decode batch, decode context
    tokens)`` — a decode is a one-token item of a sequence past its prompt (as :meth:`LLMEngine._update`
    counts it, :func:`is_decode`). Read before the step runs."""
    prefill, batch, ctx = [], 0, 0
    for item in scheduled:
        if is_decode(item):
            batch += 1
            ctx += item.seq.num_computed_tokens
        else:
            prefill.append([item.num_new_tokens, item.seq.num_computed_tokens])
    return prefill, batch, ctx


def is_decode(item) -> bool:
    """A scheduled item is a decode: one token of a sequence past its prompt (read before the
    step runs)."""
    seq = item.seq
    return item.num_new_tokens == 1 and 0 < seq.num_computed_tokens and seq.num_computed_tokens >= seq.num_prompt_tokens
