"""Paged attention for CUDA GPUs in Triton, with the reference implementation's signatures.

* :func:`paged_decode_attention`: one query per sequence over its paged context, split-K
  ("flash-decoding", Dao et al. 2023; vLLM's paged attention v2): long contexts are cut into
  ``num_splits`` ranges computed by separate programs, then merged by their log-sum-exp in a
  second, small kernel. A program serves all query heads of one KV head (GQA), so each KV
  head's keys and values are read once per step.
* :func:`paged_prefill_attention`: a chunk of new tokens over a cached prefix plus itself,
  causal.
* :func:`write_kv`: the step's keys and values into their slots (vLLM's ``reshape_and_cache``);
  negative slots (padding) are skipped.

Caches may be float32, float16, bfloat16 or float8 e4m3 (``torch.float8_e4m3fn``, with one
scale per tensor: ``k_scale``/``v_scale``, stored value = real value / scale; needs a GPU of
compute capability 8.9 or newer, see :func:`supports_fp8`). Keys and values are converted to
the query's dtype inside the kernel; scores and the softmax accumulate in float32.

The kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this package's kernels are first imported), which is how
the tests check them against ``kernels.attention`` on machines without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from kernels.attention import dense_causal_attention, gather_kv

__all__ = ["available", "supports_fp8", "write_kv", "paged_decode_attention", "paged_prefill_attention",
           "gather_kv", "dense_causal_attention", "decode_plan"]

#: Tiles (of ``BLOCK_N`` tokens) a decode split covers at least: below that the merge costs
#: more than the parallelism gains.
MIN_TILES_PER_SPLIT = 4
#: Most decode splits of one sequence.
MAX_SPLITS = 32


def available() -> bool:
    """Triton is installed and a CUDA GPU is present."""
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def supports_fp8(device: torch.device) -> bool:
    """float8 e4m3 KV: the interpreter, or a GPU of compute capability >= 8.9 (Ada, Hopper)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _kernels():
    from kernels.triton import _jit

    return _jit


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def _upcast(query: torch.Tensor) -> bool:
    # the interpreter (CPU tensors) computes bfloat16 dot products wrongly: use float32 there
    return query.device.type != "cuda" and query.dtype == torch.bfloat16


def _precision(query: torch.Tensor) -> str | None:
    # fp32 products stay fp32 ("ieee", not tf32); 16-bit inputs keep Triton's default
    return "ieee" if query.dtype == torch.float32 or _upcast(query) else None


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _contiguous_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new tokens' keys and values in their slots (see :func:`kernels.attention.write_kv`).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens]`` integer slots; a negative slot writes nothing.
        k_scale, v_scale: float8 caches only: the stored value is ``x / scale``.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key, value = _contiguous_last(key), _contiguous_last(value)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _kernels().write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=_pow2(num_kv_heads, 1), BLOCK_D=_pow2(head_dim, 1),
        BLOCK_SIZE=block_size, KV_FP8=_is_fp8(k_cache),
    )


def decode_plan(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device,
                num_splits: int | None = None, block_n: int | None = None) -> tuple[int, int, int]:
    """``(block_n, num_splits, tiles_per_split)`` for a decode launch.

    It depends only on shapes (never on context lengths held on the device), so a CUDA
    graph captured for a batch shape replays the same launch. On CUDA, splits are added until
    the grid has about two programs per streaming multiprocessor, keeping at least
    :data:`MIN_TILES_PER_SPLIT` tiles per split.
    """
    block_n = block_n or (64 if device.type == "cuda" else 32)
    num_tiles = max(1, -(-max_tokens // block_n))
    if num_splits is None:
        want = 1
        if device.type == "cuda":
            want = -(-2 * _num_sms(device.index or 0) // max(1, batch * num_kv_heads))
        num_splits = min(want, MAX_SPLITS, -(-num_tiles // MIN_TILES_PER_SPLIT))
    num_splits = max(1, min(num_splits, num_tiles))
    tiles_per_split = -(-num_tiles // num_splits)
    return block_n, -(-num_tiles // tiles_per_split), tiles_per_split


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: float = 1.0, v_scale: float = 1.0, num_splits: int | None = None,
                           block_n: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context (see
    :func:`kernels.attention.paged_decode_attention`).

    Args:
        query: ``[batch, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[batch, max_blocks]`` integer block ids.
        context_lens: ``[batch]`` integer, tokens of each context (the new one included); a
            sequence of length 0 gets zeros.
        scale: softmax scale.
        k_scale, v_scale: float8 caches only (real value = stored × scale).
        num_splits, block_n: override :func:`decode_plan` (tests, tuning).

    Returns:
        ``[batch, num_heads, head_dim]`` in the query's dtype.
    """
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if batch == 0:
        return out
    query = _contiguous_last(query)
    block_n, splits, tiles_per_split = decode_plan(batch, num_kv_heads, block_tables.shape[1] * block_size,
                                                   query.device, num_splits, block_n)
    jit = _kernels()
    part_out = part_lse = out
    if splits > 1:
        part_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=query.device)
    jit.decode_kernel[(batch, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * 1.4426950408889634, k_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), splits, tiles_per_split,
        GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SPLIT=splits > 1, KV_FP8=_is_fp8(k_cache), DOT_PRECISION=_precision(query),
        UPCAST=_upcast(query),
    )
    if splits > 1:
        jit.decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, out, num_heads, splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim, 1), BLOCK_S=_pow2(splits, 1),
        )
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            k_scale: float = 1.0, v_scale: float = 1.0, block_m: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """Causal attention of one sequence's newest tokens over its whole cached context (see
    :func:`kernels.attention.paged_prefill_attention`).

    Args:
        query: ``[n, num_heads, head_dim]``, positions ``context_len - n .. context_len - 1``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, the queries'
            own keys and values already written.
        block_table: ``[>= ceil(context_len / block_size)]`` integer block ids.
        context_len: tokens in the context, the queries included (>= n).
        scale: softmax scale.
        k_scale, v_scale: float8 caches only.
        block_m, block_n: tile sizes (query rows × group heads, key tokens); tests, tuning.

    Returns:
        ``[n, num_heads, head_dim]`` in the query's dtype.

    Raises:
        ValueError: ``context_len`` is smaller than the number of queries.
    """
    n, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if context_len < n:
        raise ValueError(f"context_len {context_len} < {n} queries")
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if n == 0:
        return out
    query = _contiguous_last(query)
    cuda = query.device.type == "cuda"
    block_m = block_m or (64 if cuda else 32)
    block_n = block_n or (64 if cuda else 32)
    grid = (-(-n * group // block_m), num_kv_heads)
    _kernels().prefill_kernel[grid](
        query, k_cache, v_cache, block_table, out, n, context_len, scale * 1.4426950408889634, k_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim), BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, KV_FP8=_is_fp8(k_cache), DOT_PRECISION=_precision(query),
        UPCAST=_upcast(query),
    )
    return out
