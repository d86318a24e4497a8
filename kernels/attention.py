"""Reference attention over a paged KV cache, in plain PyTorch (the executable spec).

The KV cache of one layer is two tensors ``k_cache, v_cache: [num_blocks, block_size,
num_kv_heads, head_dim]``. A sequence's tokens live in the blocks listed by its block table:
token ``t`` is at block ``block_table[t // block_size]``, offset ``t % block_size``; its
*slot* is ``block_id * block_size + offset``. Queries may have more heads than keys
(grouped-query attention): query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Accelerated kernels (``kernels/``) keep these signatures and are tested against these
functions, which are themselves tested against dense causal attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new tokens' keys and values in their slots.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens]`` int64, slot of each token.
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``context_len`` keys and values, each ``[context_len, num_kv_heads,
    head_dim]``, from the blocks in ``block_table`` (``[num_blocks_of_seq]`` int64)."""
    block_size = k_cache.shape[1]
    num_blocks = -(-context_len // block_size)
    ids = block_table[:num_blocks]
    k = k_cache.index_select(0, ids).flatten(0, 1)[:context_len]
    v = v_cache.index_select(0, ids).flatten(0, 1)[:context_len]
    return k, v


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's newest tokens over its whole cached context.

    The ``n`` queries are positions ``context_len - n .. context_len - 1``; query ``i`` sees
    keys ``0 .. context_len - n + i``. Their keys and values must already be written.

    Args:
        query: ``[n, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: ``[>= ceil(context_len / block_size)]`` int64.
        context_len: tokens in the context, the queries included (>= n).
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[n, num_heads, head_dim]``.
    """
    n = query.shape[0]
    k, v = gather_kv(k_cache, v_cache, block_table, context_len)
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    k = k.transpose(0, 1).unsqueeze(0).to(query.dtype)  # [1, KVH, L, D]
    v = v.transpose(0, 1).unsqueeze(0).to(query.dtype)
    if n == context_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(context_len - n, context_len, device=query.device)
        k_pos = torch.arange(context_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [n, L]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over each sequence's cached context.

    Args:
        query: ``[batch, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[batch, max_blocks]`` int64; entries past a sequence's last block
            may hold any valid block id (they are masked).
        context_lens: ``[batch]`` int64, tokens in each context, the new one included.
        scale: softmax scale.

    Returns:
        ``[batch, num_heads, head_dim]``.
    """
    batch = query.shape[0]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    max_len = block_tables.shape[1] * k_cache.shape[1]
    k = k_cache[block_tables].view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[block_tables].view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(max_len, device=query.device)[None, :] < context_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [B, H, 1, D]
        k.to(query.dtype),
        v.to(query.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def dense_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Textbook causal attention, the ground truth for tests.

    Args:
        query: ``[n, num_heads, head_dim]``; key, value: ``[n, num_kv_heads, head_dim]``.

    Returns:
        ``[n, num_heads, head_dim]``.
    """
    n, num_heads, _ = query.shape
    group = num_heads // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k.float()) * scale
    causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(query.dtype)
