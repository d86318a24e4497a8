"""A fused decode step for Llama models whose projections are GGUF blocks (``PD_WEIGHTS``).

For a decode-only step of at most :data:`MAX_ROWS` tokens, each decoder layer runs as two C++
calls (``kernels/cpu/fused_decode.cpp``) around the existing paged attention kernel:

* ``attn_in``: RMSNorm, one matmul over the stacked Q/K/V blocks, RoPE, KV cache write;
* ``attn_out``: o_proj + residual, RMSNorm, stacked gate/up matmul, SiLU * up, down + residual.

instead of transformers' layers op by op (about a dozen tensor ops and module calls per
layer, each a dispatch from Python). The embedding lookup, the rotary cos/sin (the model's own
``rotary_emb``, so its RoPE scaling applies), the final norm and the LM head stay as they are.

The stacked Q/K/V and gate/up blocks are built once; the original layers' buffers become views
of them, so the weights are held once. Prefill runs the unfused layers, except in the
batch-invariant mode (``PD_BATCH_INVARIANT``), where every step runs here
(:meth:`FusedDecode.step_logits`): one per-row path for decoded and prefilled tokens alike.

Rows are independent: a token's hidden state, logits and KV entries are bit-identical whether
it is alone in the step or in a batch (see the kernel's header comment and
``tests/unit/test_fused_decode.py``). Against the unfused quantized path the matmuls are the
same kernel; the RMSNorm, RoPE and SiLU differ in float32 rounding only. A bfloat16 model on a
CPU with AVX512-BF16 multiplies with bf16 dot products instead (:class:`FusedDecode`'s ``bf16``):
matmul inputs and weights rounded to bf16, float32 sums (the unfused bf16 model rounds every
activation to bf16 anyway; the error is about the same, ``tests/unit/test_fused_decode.py``).
With ``PD_BLOCK_DOT=int8`` (``auto`` on AVX2-only CPUs) each matmul's input rows are quantized
per 32 to int8 and multiplied with integer dot products (:class:`FusedDecode`'s ``int8``;
llama.cpp's scheme), the same arithmetic as the model's BlockLinear layers then use.

Eligible: ``model_type`` llama (or mistral without a sliding window), SiLU MLP, no
projection biases, every projection a :class:`~engine.model.quant.BlockLinear` with Q/K/V of one
bit width and gate/up of one bit width, a CPU, a float32 or bfloat16 KV cache, and the
extension built. Anything else returns ``None`` from :func:`build` and the step runs unfused.
"""

from __future__ import annotations

import torch

from engine.model.quant import BlockLinear
from shared.logging import get_logger

log = get_logger(__name__)

#: Token rows up to which a decode step runs fused (the block kernel's range, engine.model.quant).
MAX_ROWS = 64
#: Token rows per call of :meth:`FusedDecode.step_logits` on AMX tiles (``amx``): the kernel
#: widens each weight block once per 256 rows of a call (kernels/cpu/quant_block.h,
#: block_rows_amx), so prefill chunks go in calls of up to this many rows instead of 64.
AMX_STEP_ROWS = 512


def _stack(ext, layers: list[BlockLinear], bf16: bool = False, int8: bool = False, amx: bool = False):
    """One ``Blocks`` over ``layers`` stacked along the output rows; each layer's buffers become
    views of the stacked tensors (so the weights are held once). ``bf16``: bf16 dot products;
    ``int8``: int8 activations, integer dot products; ``amx``: bf16 roundings on AMX tiles."""
    codes = torch.cat([m.codes for m in layers])
    scale = torch.cat([m.scale for m in layers])
    minimum = torch.cat([m.minimum for m in layers]) if layers[0].bits == 4 else torch.empty(0, dtype=torch.float16)
    start = 0
    for m in layers:
        end = start + m.out_features
        m.codes, m.scale = codes[start:end], scale[start:end]
        if m.bits == 4:
            m.minimum = minimum[start:end]
        start = end
    return ext.Blocks(codes, scale, minimum, layers[0].bits, bf16, int8, amx)


def _eligible(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run fused, or ``None``."""
    config = model.config
    if config.model_type not in ("llama", "mistral") or getattr(config, "sliding_window", None):
        return f"model_type {config.model_type}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(isinstance(p, BlockLinear) and p.bias is None for p in projections):
            return "a projection is not held as blocks (PD_WEIGHTS=float?) or has a bias"
        if len({p.bits for p in projections[:3]}) > 1 or mlp.gate_proj.bits != mlp.up_proj.bits:
            return "Q/K/V or gate/up mix bit widths"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not isinstance(getattr(norm, "variance_epsilon", None), float):
                return f"norm {type(norm).__name__}"
    return None


class FusedDecode:
    """The fused decode step of one model (see the module docstring).

    Args:
        model: a transformers Llama causal LM whose projections are BlockLinear.
        ext: the built extension (:func:`kernels.cpu.quant.load_fused`).
        bf16: multiply with bf16 dot products (the matmul inputs and weights rounded to bf16,
            float32 accumulation; quant_block.h). ``None``: when the model computes in
            bfloat16 (its embedding's dtype, ``PD_DTYPE``) and the build has them
            (``ext.has_bf16``: AVX512-BF16). Fixed per model, never per step or row count,
            so a token's bits do not depend on its batch.
        int8: quantize each matmul's input rows per 32 to int8 and take integer dot products
            (``PD_BLOCK_DOT=int8``, quant_block.h ``block_rows_q8``); excludes ``bf16``.
        amx: bf16's roundings with the dot products on AMX tiles (``PD_BLOCK_DOT=amx``,
            quant_block.h ``block_rows_amx``; ``ext.has_amx``), every row of every step, decode
            included; excludes ``bf16`` and ``int8``.
    """

    def __init__(self, model: torch.nn.Module, ext, bf16: bool | None = None, int8: bool = False,
                 amx: bool = False):
        config = model.config
        self.model = model
        self.ext = ext
        if bf16 is None:
            bf16 = model.model.embed_tokens.weight.dtype == torch.bfloat16
        #: True when the matmuls run on AMX tiles (asked for and available)
        self.amx = bool(amx) and bool(getattr(ext, "has_amx", False)) and not int8
        #: True when the matmuls use bf16 dot products (asked for and available)
        self.bf16 = bool(bf16) and bool(getattr(ext, "has_bf16", False)) and not int8 and not self.amx
        #: True when the matmuls quantize their inputs to int8 (integer dot products)
        self.int8 = bool(int8)
        #: token rows per call of step_logits (a row's bits do not depend on it)
        self.step_rows = AMX_STEP_ROWS if self.amx else MAX_ROWS
        self.layers = []
        self.scales = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _stack(ext, [attn.q_proj, attn.k_proj, attn.v_proj], self.bf16, self.int8, self.amx)
            gate_up = _stack(ext, [mlp.gate_proj, mlp.up_proj], self.bf16, self.int8, self.amx)
            o = _stack(ext, [attn.o_proj], self.bf16, self.int8, self.amx)
            down = _stack(ext, [mlp.down_proj], self.bf16, self.int8, self.amx)
            self.layers.append(ext.DecodeLayer(
                layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                layer.input_layernorm.variance_epsilon, qkv, o, gate_up, down,
                config.num_attention_heads, config.num_key_value_heads, attn.head_dim))
            self.scales.append(float(attn.scaling))
        self.norm_weight = model.model.norm.weight.detach().float()
        self.norm_eps = model.model.norm.variance_epsilon

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, meta) -> torch.Tensor:
        """The final hidden states (after the last norm) of a decode-only step: ids, pos
        ``[M]`` int64; ``meta`` an :class:`engine.model_runner.AttentionMetadata` with every
        token a decode query. Returns float32 ``[M, hidden]``; writes the KV cache."""
        return self.hidden_rows(ids, pos, meta.decode_block_tables, meta.decode_context_lens, meta.slot_mapping,
                                meta.kv_cache, meta.attention)

    def hidden_rows(self, ids: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                    slots: torch.Tensor, cache, attention, runs: list | None = None) -> torch.Tensor:
        """The final hidden states of ``M`` tokens (any number; decode steps pass at most
        :data:`MAX_ROWS`, :meth:`step_logits` at most :attr:`step_rows`), each one query over its own
        context in the KV cache.

        Args:
            ids, pos, slots: ``[M]`` int64 token ids, positions and KV cache slots.
            tables: ``[M, max_blocks]`` int64, the block table of each token's sequence.
            lens: ``[M]`` int64, each token's context length including itself (``pos + 1``).
            cache: the :class:`engine.kv_cache.PagedKVCache`; attention: the kernels module.
            runs: :func:`attention_runs` of these rows, or None (every row a decode query). A
                prefill run goes to ``attention.paged_prefill_attention`` (the batch-invariant
                mode's tiled kernel: the decode kernel's arithmetic per query, K/V read once
                per tile of queries); the rest to ``paged_decode_attention``.

        Returns:
            float32 ``[M, hidden]``. Writes the tokens' keys and values to their slots in every
            layer before that layer's attention, so tokens of one sequence in the same call
            see each other.
        """
        inner = self.model.model
        x = inner.embed_tokens(ids).float().contiguous()
        cos, sin = inner.rotary_emb(x.unsqueeze(0), pos.unsqueeze(0))
        cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = cache.layer(i)
            q = layer.attn_in(x, cos, sin, k_cache, v_cache, slots)
            if runs is None:
                out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, self.scales[i])
            else:
                out = torch.empty_like(q)
                for a, b, table, context_len in runs:
                    out[a:b] = (attention.paged_decode_attention(q[a:b], k_cache, v_cache, tables[a:b], lens[a:b],
                                                                 self.scales[i]) if table is None else
                                attention.paged_prefill_attention(q[a:b], k_cache, v_cache, table, context_len,
                                                                  self.scales[i]))
            layer.attn_out(x, out)
        return self.ext.rms_norm(x, self.norm_weight, self.norm_eps)

    def logits(self, ids: torch.Tensor, pos: torch.Tensor, meta, keep: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[len(keep), vocab]`` of the rows ``keep`` of a decode-only step."""
        return self._head(self.hidden(ids, pos, meta)[keep])

    def step_logits(self, ids: torch.Tensor, pos: torch.Tensor, meta, keep: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[len(keep), vocab]`` of the rows ``keep`` of any step: decode
        queries, prefill chunks (with or without a cached prefix) or both.

        Every token is one query over its own context (positions ``0..pos``), and the step runs
        as consecutive calls of at most :attr:`step_rows` tokens (:data:`MAX_ROWS`, or
        :data:`AMX_STEP_ROWS` on AMX tiles) in packed order (a sequence's
        earlier tokens are written to the KV cache before its later ones attend to them). Each
        token is thus computed by the same per-row code whether it is decoded, prefilled,
        re-prefilled after a worker's death or found beside any other tokens: the
        batch-invariant mode's one path (:mod:`engine.model.batch_invariant`). Writes the KV cache
        of every token, also when ``keep`` is empty.
        """
        tables, lens = token_tables(meta)
        # prefill runs to the tiled kernel only where it keeps the decode kernel's per-query
        # arithmetic (engine.model.batch_invariant.InvariantAttention); else one query per token
        tiled = getattr(meta.attention, "always_paged", False)
        n = self.step_rows
        hidden = [self.hidden_rows(ids[s:s + n], pos[s:s + n], tables[s:s + n], lens[s:s + n],
                                   meta.slot_mapping[s:s + n], meta.kv_cache, meta.attention,
                                   attention_runs(meta, s, min(s + n, ids.shape[0])) if tiled else None)
                  for s in range(0, ids.shape[0], n)]
        return self._head(torch.cat(hidden)[keep])

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head
        if not isinstance(head, BlockLinear):
            h = h.to(head.weight.dtype)
        return head(h).float()


def attention_runs(meta, start: int, stop: int) -> list[tuple[int, int, torch.Tensor | None, int]]:
    """The packed tokens ``start .. stop - 1`` of a step as runs, indices relative to ``start``:
    ``(a, b, None, 0)`` for decode queries, ``(a, b, block_table, context_len)`` for consecutive
    queries of one prefill chunk (the last ``b - a`` positions of a context of ``context_len``
    tokens, ``block_table`` the sequence's ``[max_blocks]`` int64 table)."""
    runs: list[tuple[int, int, torch.Tensor | None, int]] = []
    nd = min(meta.num_decode_tokens, stop)
    if nd > start:
        runs.append((0, nd - start, None, 0))
    for seg in meta.prefills:
        a, b = max(start, seg.query_start), min(stop, seg.query_start + seg.query_len)
        if a < b:  # query j of the chunk sees context_len - query_len + j + 1 tokens
            runs.append((a - start, b - start, seg.block_table,
                         seg.context_len - seg.query_len + (b - seg.query_start)))
    return runs


def token_tables(meta) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token block tables ``[T, max_blocks]`` and context lengths ``[T]`` (int64) of a
    step's packed tokens: a decode token's own row, and for the ``i``-th query of a prefill
    chunk its sequence's table and ``context_len - query_len + i + 1``."""
    tables, lens = [], []
    if meta.num_decode_tokens:
        tables.append(meta.decode_block_tables)
        lens.append(meta.decode_context_lens)
    for seg in meta.prefills:
        tables.append(seg.block_table.unsqueeze(0).expand(seg.query_len, -1))
        first = seg.context_len - seg.query_len + 1
        lens.append(torch.arange(first, first + seg.query_len, dtype=torch.long, device=seg.block_table.device))
    width = max(t.shape[1] for t in tables)
    tables = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables]
    return torch.cat(tables).contiguous(), torch.cat(lens)


def build(model: torch.nn.Module, kv_dtype: torch.dtype, device: torch.device,
          block_dot: str = "float32") -> FusedDecode | None:
    """The fused decode step for ``model``, or ``None`` when it is not eligible (the reason is
    logged) or the extension cannot be built (the step then runs unfused, correct but slower).
    ``block_dot`` (``PD_BLOCK_DOT``, resolved: :func:`engine.model.quant.resolve_block_dot`):
    ``float32``; ``int8`` (int8 activations, integer dot products); ``bf16`` (bf16 dot products
    when the model computes in bfloat16 and the CPU has them, else float32, logged); ``amx`` (bf16
    roundings on AMX tiles, where the extension has them, else float32, logged)."""
    bf16_dot = block_dot == "bf16"
    if device.type != "cpu" or kv_dtype not in (torch.float32, torch.bfloat16):
        return None
    if not any(isinstance(m, BlockLinear) for m in model.modules()):
        return None
    reason = _eligible(model)
    if reason is not None:
        log.info("fused_decode_off", reason=reason)
        return None
    try:
        from kernels.cpu import quant

        ext = quant.load_fused()
    except Exception as exc:  # a failed build must not stop serving
        log.warning("fused_decode_unavailable", error=str(exc))
        return None
    # bf16 None: where the model and CPU allow
    fused = FusedDecode(model, ext, bf16=None if bf16_dot else False, int8=block_dot == "int8",
                        amx=block_dot == "amx")
    if bf16_dot and not fused.bf16:
        log.warning("bf16_dot_unavailable", model_dtype=str(model.model.embed_tokens.weight.dtype),
                    cpu_has_it=getattr(ext, "has_bf16", False))
    if block_dot == "amx" and not fused.amx:
        log.warning("amx_dot_unavailable", cpu_has_it=getattr(ext, "has_amx", False))
    log.info("fused_decode_on", layers=len(fused.layers), isa=ext.isa, bf16_dot=fused.bf16, int8_dot=fused.int8,
             amx_dot=fused.amx)
    return fused


def applies(fused: FusedDecode | None, meta, num_tokens: int) -> bool:
    """True when ``fused`` can run this step: decode queries only, at most MAX_ROWS of them."""
    return (fused is not None and not meta.prefills and meta.num_decode_tokens == num_tokens
            and 0 < num_tokens <= MAX_ROWS)


def kernel_available() -> bool:
    """True on a CPU the fused kernel's instructions run on (AVX2 + FMA; AVX-512 when present)."""
    from kernels.cpu import quant

    return quant.available()
