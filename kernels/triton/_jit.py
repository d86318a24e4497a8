"""The Triton kernels themselves (``@triton.jit``); the launch code is in ``kernels/triton``.

Every kernel reads the paged KV cache ``[num_blocks, block_size, num_kv_heads, head_dim]``
in place through the block table: a tile of ``BLOCK_N`` consecutive token positions maps to
``block_table[pos // BLOCK_SIZE]``, offset ``pos % BLOCK_SIZE``, so the tile size does not
depend on the cache's block size (as in vLLM's Triton "unified attention" kernel). Softmax
is the online (streaming) softmax of FlashAttention (Dao et al., 2022) in base 2: the scale
is multiplied by log2(e) once and ``exp2`` replaces ``exp``.

Grouped-query attention: one program serves all ``GROUP`` query heads that share a KV head,
so that KV head's keys and values are read once per tile for the whole group (the rows of the
``tl.dot`` are the group's heads, padded to ``BLOCK_G``).

The head dimension must be contiguous (stride 1) in every tensor. ``UPCAST`` makes the dot
products float32 whatever the input dtype: Triton's interpreter cannot multiply bfloat16
(measured: garbage results), so the launcher sets it for bfloat16 on CPU tensors only.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: The largest finite float8 e4m3 value; values are clamped to it before the cast.
FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _load_kv_tile(cache_ptr, block_table_ptr, pos, pos_mask, d, d_mask, kvh, stride_b, stride_t, stride_h, scale,
                  BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` keys or values at token positions ``pos`` of one sequence."""
    block_ids = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    offs = block_ids * stride_b + (pos % BLOCK_SIZE).to(tl.int64) * stride_t + kvh * stride_h
    tile = tl.load(cache_ptr + offs[:, None] + d[None, :], mask=pos_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:
        tile = tile.to(tl.float32) * scale
    return tile.to(OUT_DTYPE)


@triton.jit
def decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, k_scale, v_scale,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    num_splits, tiles_per_split,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One (sequence, KV head, split) program of paged decode attention.

    Grid ``(batch, num_kv_heads, num_splits)``. Split ``s`` covers tiles ``[s *
    tiles_per_split, (s + 1) * tiles_per_split)`` of the context. With ``SPLIT`` it writes
    its normalised partial output ``part_out[b, h, s, :]`` (fp32) and log2-sum-exp
    ``part_lse[b, h, s]`` for :func:`decode_reduce_kernel`; without, the final output.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b).to(tl.int32)
    first = s * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(ctx, BLOCK_N))
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    qd_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
    dtype = tl.float32 if UPCAST else q.dtype
    q = (q.to(tl.float32) * qk_scale).to(dtype)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(first, last):
        pos = tile * BLOCK_N + n
        pos_mask = pos < ctx
        k = _load_kv_tile(k_cache_ptr, table, pos, pos_mask, d, d_mask, kvh, stride_kb, stride_kt, stride_kh, k_scale,
                          BLOCK_SIZE, KV_FP8, dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(v_cache_ptr, table, pos, pos_mask, d, d_mask, kvh, stride_vb, stride_vt, stride_vh, v_scale,
                          BLOCK_SIZE, KV_FP8, dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + s  # index into [B, H, S]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=qd_mask)
        # an empty split (past the context's end) has m_i = -inf, so lse = -inf: weight 0
        tl.store(part_lse_ptr + row, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=g_mask)
    else:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=qd_mask)


@triton.jit
def decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_heads, num_splits, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the splits of one (sequence, head): grid ``(batch, num_heads)``; each split's
    output is weighted by ``2 ** (lse_s - max lse)`` (empty splits have ``lse = -inf``)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    row = (b * num_heads + h) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, out_ptr,
    num_queries, context_len, qk_scale, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Causal attention of one sequence's newest ``num_queries`` tokens over its cached context.

    Grid ``(cdiv(num_queries * GROUP, BLOCK_M), num_kv_heads)``. Row ``r`` of a program is
    query token ``r // GROUP`` of head ``kv_head * GROUP + r % GROUP``, at position
    ``context_len - num_queries + r // GROUP``; it sees keys up to its own position.
    """
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = r // GROUP
    heads = kvh * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    r_mask = tok < num_queries
    d_mask = d < HEAD_DIM
    qd_mask = r_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
    dtype = tl.float32 if UPCAST else q.dtype
    q = (q.to(tl.float32) * qk_scale).to(dtype)
    prefix = context_len - num_queries
    q_pos = prefix + tok
    hi = tl.minimum(context_len, prefix + (pid * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        pos = start + n
        pos_mask = pos < context_len
        k = _load_kv_tile(k_cache_ptr, block_table_ptr, pos, pos_mask, d, d_mask, kvh, stride_kb, stride_kt,
                          stride_kh, k_scale, BLOCK_SIZE, KV_FP8, dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        visible = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(v_cache_ptr, block_table_ptr, pos, pos_mask, d, d_mask, kvh, stride_vb, stride_vt,
                          stride_vh, v_scale, BLOCK_SIZE, KV_FP8, dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qd_mask)


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_inv_scale, v_inv_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Store token ``program_id(0)``'s keys and values in its slot (``reshape_and_cache``).

    A negative slot (a padded row of a CUDA-graph batch) writes nothing. For a float8 cache
    the values are divided by the per-tensor scale (multiplied by ``*_inv_scale``) and
    clamped to the e4m3 range before the cast.
    """
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rows = (h < NUM_KV_HEADS) & ((tl.zeros([BLOCK_H], tl.int64) + slot) >= 0)
    mask = rows[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    if KV_FP8:
        k = tl.clamp(k.to(tl.float32) * k_inv_scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
        v = tl.clamp(v.to(tl.float32) * v_inv_scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kct + h[:, None] * stride_kch + d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vct + h[:, None] * stride_vch + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)
