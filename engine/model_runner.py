"""Running one engine step: prepare inputs → forward → sample.

The model is a transformers causal LM loaded with ``attn_implementation="pdserve_paged"``:
its own layers (projections, RoPE, MLPs, norms) run unchanged and call
:func:`paged_attention_forward` for attention, which writes the step's keys and values into
the paged KV cache and attends over the cache. All sequences of a step are packed into one
row of ``num_tokens`` tokens (no padding); decode tokens come first, then prefill chunks.
Any architecture whose transformers implementation goes through the attention interface
(Llama, Mistral, Qwen2/3, Gemma, Phi-3, ...) works the same way.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

import kernels
from engine.kv_cache import PagedKVCache
from engine.model import fused_decode
from engine.model.quant import effective_block_dot, set_block_dot
from engine.prompt_logprobs import PromptLogprobRows
from engine.sampler import SamplingRow, sample
from engine.scheduler import ScheduledSeq
from shared.messages import TokenLogprob

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass(slots=True)
class PrefillSegment:
    """One sequence's chunk of queries in the packed row."""

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass(slots=True)
class AttentionMetadata:
    """What paged attention needs for one step (passed to every layer as ``pd_attn``).

    ``slot_mapping[t]`` is the cache slot of packed token ``t``. The first
    ``num_decode_tokens`` tokens are one query each of the decode sequences, described by
    ``decode_block_tables: [num_decode, max_blocks]`` and ``decode_context_lens:
    [num_decode]``; the rest are the ``prefills`` segments, in order.
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    prefills: list[PrefillSegment] = field(default_factory=list)
    attention: object = None  # kernels module


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function over pdserve's paged KV cache.

    Args:
        query: ``[1, num_heads, num_tokens, head_dim]`` (RoPE applied).
        key, value: ``[1, num_kv_heads, num_tokens, head_dim]``.
        kwargs: must hold ``pd_attn`` (:class:`AttentionMetadata`).

    Returns:
        ``([1, num_tokens, num_heads, head_dim], None)``.
    """
    meta: AttentionMetadata = kwargs["pd_attn"]
    attn = meta.attention
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    k_cache, v_cache = meta.kv_cache.layer(module.layer_idx)
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, KVH, D]
    v = value[0].transpose(0, 1)
    attn.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = attn.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )
    for seg in meta.prefills:
        s, e = seg.query_start, seg.query_start + seg.query_len
        if seg.query_len == seg.context_len and not getattr(attn, "always_paged", False):
            # no cached prefix: attend over this chunk's own keys, no gather needed
            out[s:e] = _causal_self_attention(q[s:e], k[s:e], v[s:e], scale)
        else:
            out[s:e] = attn.paged_prefill_attention(q[s:e], k_cache, v_cache, seg.block_table, seg.context_len, scale)
    return out.unsqueeze(0), None


def _causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [n, H, D], k/v: [n, KVH, D] -> [n, H, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def register_attention() -> None:
    """Register :func:`paged_attention_forward` with transformers (idempotent), and a mask
    function that builds no mask: paged attention masks from its metadata."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, lambda *args, **kwargs: None)


@dataclass(slots=True)
class StepResult:
    """Sampled tokens of the sequences that reached the end of their tokens this step.

    ``token_ids[k]`` and ``logprobs[k]`` belong to ``sampled[k]``: one pick, or for an item with
    ``d`` speculative drafts the ``d + 1`` picks at its last token and at each draft (pick ``i``
    as if drafts ``0 .. i-1`` were its output: engine/speculative.py).
    """

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]
    sampled: list[ScheduledSeq]


def float_logits_from_quantized_head(model: torch.nn.Module) -> None:
    """Make a quantized LM head (``engine.model.quant.BlockLinear``) take float32 input, so the logits
    come out in float32 (its kernel accumulates in float32 anyway; the fused decode step already
    feeds it float32). bfloat16 logits are rounded to 1/8 near 20: greedy choices tie, and the
    README's example ("What is the capital of France?") answered "L'Étoile, la Marseillaise"
    instead of "The capital of France is Paris".
    """
    from engine.model.quant import BlockLinear

    head = getattr(model, "lm_head", None)
    if isinstance(head, BlockLinear) and not getattr(head, "float_logits", False):
        head.register_forward_pre_hook(lambda module, args: (args[0].float(), *args[1:]))
        head.float_logits = True


class ModelRunner:
    """Owns the model and the KV pool; runs scheduled batches.

    Args:
        model: a transformers causal LM loaded with ``attn_implementation=ATTN_IMPLEMENTATION``.
        kv_cache: the paged KV pool.
        attention_backend: see :func:`kernels.select`.
        batch_invariant: see :mod:`engine.model.batch_invariant` (``PD_BATCH_INVARIANT``).
        block_dot: the block kernels' arithmetic (``PD_BLOCK_DOT``: auto, float32, int8, bf16),
            see :func:`engine.model.quant.resolve_block_dot` and :func:`engine.model.fused_decode.build`.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, attention_backend: str = "auto",
                 batch_invariant: bool = False, block_dot: str = "float32"):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        kv_dtype = str(kv_cache.dtype).removeprefix("torch.")
        self.attention = kernels.select(self.device.type, attention_backend, kv_dtype)
        # None: steps run unfused. With it, decode-only steps run fused; in the batch-invariant mode
        # every step does (prefill too), so a token's KV and logits come from one per-row path
        # whether it was decoded, prefilled or re-prefilled (a resumed stream, a recompute)
        #: the block kernels' arithmetic, resolved (engine.model.quant.BLOCK_DOTS); the same for the fused
        #: step and every BlockLinear (the LM head, unfused steps), so all paths agree
        self.block_dot = effective_block_dot(block_dot, model.get_input_embeddings().weight.dtype, self.device.type)
        set_block_dot(model, self.block_dot)
        self.fused = fused_decode.build(model, kv_cache.dtype, self.device, self.block_dot)
        self.fused_all = batch_invariant and self.fused is not None
        float_logits_from_quantized_head(model)
        if getattr(self.attention, "accelerate_model", None) is not None:
            self.attention.accelerate_model(model)
        #: whether a token's logits and KV are the same in any step (what speculation relies on)
        self.is_batch_invariant = False
        if batch_invariant:
            from engine.model.batch_invariant import apply

            self.is_batch_invariant = apply(self)
        self.graphs = None  # engine.model.cuda_graphs.DecodeGraphs once enable_cuda_graphs ran
        self.grammar = None  # engine.grammar.GrammarBackend once a constrained request came

    def enable_cuda_graphs(self, batch_sizes: Seq[int], max_blocks_per_seq: int, capture=None) -> None:
        """Capture decode steps as CUDA graphs, one per batch size (see ``engine.model.cuda_graphs``).

        Needs an attention backend whose ``write_kv`` skips negative slots (Triton's).
        ``capture`` defaults to the real CUDA capture; tests pass a stand-in.
        """
        from engine.model.cuda_graphs import DecodeGraphs, cuda_capture

        def make_meta(slot_mapping, block_tables, context_lens):
            return AttentionMetadata(kv_cache=self.kv_cache, slot_mapping=slot_mapping,
                                     num_decode_tokens=slot_mapping.shape[0], decode_block_tables=block_tables,
                                     decode_context_lens=context_lens, attention=self.attention)

        self.graphs = DecodeGraphs(self._decode_forward, make_meta, batch_sizes, max_blocks_per_seq, self.device,
                                   capture or cuda_capture(self.device))
        with torch.inference_mode():
            self.graphs.capture_all()

    def _decode_forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = self.model(input_ids=ids.unsqueeze(0), position_ids=pos.unsqueeze(0), use_cache=False,
                         logits_to_keep=0, pd_attn=meta)
        return out.logits[0]

    def _prepare(self, batch: Seq[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[list[int]]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        logits_index: list[int] = []
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            input_ids.extend(item.input_token_ids() if item.draft_token_ids else seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1 and start > 0:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                prefills.append(PrefillSegment(
                    query_start=len(input_ids) - n,
                    query_len=n,
                    context_len=start + n,
                    block_table=torch.tensor(table, dtype=torch.long, device=self.device),
                ))
            # a speculative item samples at its last token and at every draft
            logits_index.append(list(range(len(input_ids) - 1 - item.num_draft_tokens, len(input_ids))))
        dev = self.device
        decode_block_tables = decode_context_lens = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=dev)
            decode_context_lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=len(decode_tables),
            decode_block_tables=decode_block_tables,
            decode_context_lens=decode_context_lens,
            prefills=prefills,
            attention=self.attention,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta, logits_index

    @torch.inference_mode()
    def execute(self, batch: Seq[ScheduledSeq]) -> StepResult:
        """Run one step over ``batch`` and sample for the sequences that reach their end.

        Decode items (one token on top of a computed context) are packed before prefill
        chunks; ``StepResult.sampled`` is in that packed order.
        """
        batch = sorted(batch, key=lambda it: not (it.num_new_tokens == 1 and it.seq.num_computed_tokens > 0))
        ids, pos, meta, logits_index = self._prepare(batch)
        sampled = [item for item in batch if item.samples]
        prompt_rows = PromptLogprobRows.plan(batch) if meta.prefills else PromptLogprobRows([])
        extra = prompt_rows.rows
        keep_rows = [r for i, item in enumerate(batch) if item.samples for r in logits_index[i]]
        keep = torch.tensor(keep_rows + extra, dtype=torch.long, device=self.device)
        rows, matchers = self._sampling_rows(sampled)
        # the grammar masks of constrained rows are computed in a thread while the forward runs
        masks = self.grammar.start_masks(matchers) if self.grammar and sampled else None
        logits = None
        if self.graphs is not None and not meta.prefills and sampled:
            logits = self.graphs.run(ids, pos, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)
            logits = logits[keep] if logits is not None else None
        if logits is None and self.fused_all:
            logits = self.fused.step_logits(ids, pos, meta, keep)
        elif logits is None and sampled and fused_decode.applies(self.fused, meta, ids.shape[0]):
            logits = self.fused.logits(ids, pos, meta, keep)
        elif logits is None:
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=pos.unsqueeze(0),
                use_cache=False,
                logits_to_keep=keep if keep.numel() else torch.tensor([0], device=self.device),
                pd_attn=meta,
            )
            logits = out.logits[0]  # [num_sampled_rows + len(extra), vocab] (one row when keep is empty)
        if extra:
            prompt_rows.apply(logits[len(keep_rows):])
        if not sampled:
            return StepResult([], [], [])
        logits = logits[: len(keep_rows)]
        token_ids, logprobs = sample(logits, rows, masks)
        per_item_ids, per_item_logprobs, at = [], [], 0
        for item in sampled:
            n = item.num_draft_tokens + 1
            per_item_ids.append(token_ids[at: at + n])
            per_item_logprobs.append(logprobs[at: at + n])
            at += n
        return StepResult(per_item_ids, per_item_logprobs, sampled)

    @staticmethod
    def _sampling_rows(sampled: Seq[ScheduledSeq]) -> tuple[list[SamplingRow], list]:
        """One sampling row per sampled position, and its grammar matcher (None: unconstrained).
        Row ``i`` of an item with drafts sees drafts ``0 .. i-1`` as output (its penalties'
        history and its seeded draw's index), and a copy of the matcher advanced over them
        (the drafts were checked against the grammar when proposed)."""
        rows: list[SamplingRow] = []
        matchers: list = []
        for it in sampled:
            seq = it.seq
            rows.append(SamplingRow(seq.sampling, seq.prompt_token_ids, seq.output_token_ids))
            matchers.append(seq.matcher)
            if not it.draft_token_ids:
                continue
            output = seq.output_token_ids
            matcher = seq.matcher.deep_copy() if seq.matcher is not None else None
            for i, draft in enumerate(it.draft_token_ids):
                output = [*output, draft]
                rows.append(SamplingRow(seq.sampling, seq.prompt_token_ids, output))
                if matcher is not None:
                    matcher.consume_token(draft)
                    matchers.append(matcher)
                    if i + 1 < it.num_draft_tokens:
                        matcher = matcher.deep_copy()
                else:
                    matchers.append(None)
        return rows, matchers
