"""Cases: the Triton kernels against the reference attention (``kernels.attention``).

Collected through ``test_triton_attention.py``. Without a GPU they run under Triton's
interpreter on CPU tensors (see ``triton_env``), so the shapes stay tiny; on a GPU the same
cases run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from kernels import attention as ref
from tests.kernels.triton_env import device, load_kernels

DEV = device()
tk = load_kernels()
HEAD_DIM = 16
NUM_BLOCKS = 40


def _cache(bs: int, kvh: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, bs, kvh, HEAD_DIM)
    return torch.randn(shape, generator=g).to(DEV, dtype), torch.randn(shape, generator=g).to(DEV, dtype)


def _tables(lengths, bs, seed=0):
    """Block tables of scattered, distinct blocks, padded with block 0 (masked)."""
    g = torch.Generator().manual_seed(seed)
    free = iter(torch.randperm(NUM_BLOCKS, generator=g).tolist())
    tables = [[next(free) for _ in range(-(-n // bs))] for n in lengths]
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEV)


# ragged: one token, a partial last block, exactly full blocks, several blocks
LENGTHS = {16: [1, 21, 32, 70], 32: [1, 45, 64, 100]}


@pytest.mark.parametrize("bs,group,num_splits", [(16, 1, 3), (16, 3, 1), (16, 8, 3), (32, 1, 1), (32, 3, 3),
                                                 (32, 8, 1)])
def test_decode_matches_reference(bs, group, num_splits):
    kvh = 2 if group < 8 else 1
    kc, vc = _cache(bs, kvh, seed=bs + group)
    lengths = LENGTHS[bs]
    tables = _tables(lengths, bs)
    q = torch.randn(len(lengths), kvh * group, HEAD_DIM, generator=torch.Generator().manual_seed(group)).to(DEV)
    lens = torch.tensor(lengths, device=DEV)
    expected = ref.paged_decode_attention(q, kc, vc, tables, lens, HEAD_DIM ** -0.5)
    out = tk.paged_decode_attention(q, kc, vc, tables, lens, HEAD_DIM ** -0.5, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_decode_splits_past_the_context_are_empty_and_ignored():
    """More splits than a short sequence has tiles: its later splits see no key at all."""
    kc, vc = _cache(16, 2)
    tables = _tables([5, 90], 16)
    q = torch.randn(2, 4, HEAD_DIM).to(DEV)
    lens = torch.tensor([5, 90], device=DEV)
    out = tk.paged_decode_attention(q, kc, vc, tables, lens, 0.3, num_splits=6, block_n=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref.paged_decode_attention(q, kc, vc, tables, lens, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_16bit_cache(dtype):
    kc, vc = _cache(16, 2, dtype)
    tables = _tables([33, 7], 16)
    q = torch.randn(2, 6, HEAD_DIM).to(DEV, dtype)
    lens = torch.tensor([33, 7], device=DEV)
    expected = ref.paged_decode_attention(q.float(), kc.float(), vc.float(), tables, lens, HEAD_DIM ** -0.5)
    out = tk.paged_decode_attention(q, kc, vc, tables, lens, HEAD_DIM ** -0.5, num_splits=2, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def _fp8_or_skip():
    if not tk.supports_fp8(DEV):
        pytest.skip("float8 e4m3 needs compute capability >= 8.9")


def test_decode_fp8_cache_with_per_tensor_scales():
    """A float8 cache holds value / scale; the kernel multiplies the scale back in."""
    _fp8_or_skip()
    k_scale, v_scale = 0.05, 0.02
    kc, vc = _cache(16, 2)
    kc8, vc8 = (kc / k_scale).to(torch.float8_e4m3fn), (vc / v_scale).to(torch.float8_e4m3fn)
    tables = _tables([40, 3], 16)
    q = torch.randn(2, 4, HEAD_DIM).to(DEV)
    lens = torch.tensor([40, 3], device=DEV)
    expected = ref.paged_decode_attention(q, kc8.float() * k_scale, vc8.float() * v_scale, tables, lens, 0.25)
    out = tk.paged_decode_attention(q, kc8, vc8, tables, lens, 0.25, k_scale=k_scale, v_scale=v_scale, num_splits=2,
                                    block_n=16)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # and float8 is close to the unquantized cache it came from (e4m3 has 3 mantissa bits)
    torch.testing.assert_close(out, ref.paged_decode_attention(q, kc, vc, tables, lens, 0.25), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("bs,group,num_queries,context_len", [
    (16, 1, 13, 50), (16, 3, 9, 9), (16, 8, 1, 37), (32, 1, 9, 9), (32, 3, 13, 50), (32, 8, 5, 70)])
def test_prefill_over_cached_prefix_matches_reference(bs, group, num_queries, context_len):
    kvh = 2 if group < 8 else 1
    kc, vc = _cache(bs, kvh, seed=group)
    table = _tables([context_len], bs, seed=bs)[0]
    q = torch.randn(num_queries, kvh * group, HEAD_DIM, generator=torch.Generator().manual_seed(bs)).to(DEV)
    expected = ref.paged_prefill_attention(q, kc, vc, table, context_len, HEAD_DIM ** -0.5)
    out = tk.paged_prefill_attention(q, kc, vc, table, context_len, HEAD_DIM ** -0.5, block_m=16, block_n=16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_prefill_bf16_and_bad_context():
    kc, vc = _cache(16, 2, torch.bfloat16)
    table = _tables([30], 16)[0]
    q = torch.randn(12, 4, HEAD_DIM).to(DEV, torch.bfloat16)
    expected = ref.paged_prefill_attention(q.float(), kc.float(), vc.float(), table, 30, 0.25)
    out = tk.paged_prefill_attention(q, kc, vc, table, 30, 0.25, block_m=16, block_n=16)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="context_len"):
        tk.paged_prefill_attention(q, kc, vc, table, 5, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    kc, vc = _cache(16, 3, dtype)
    k, v = torch.randn(6, 3, HEAD_DIM).to(DEV), torch.randn(6, 3, HEAD_DIM).to(DEV)
    slots = torch.tensor([5, -1, 16 * 7 + 15, 300, -1, 0], device=DEV)
    got_k, got_v = kc.clone(), vc.clone()
    tk.write_kv(k, v, got_k, got_v, slots)
    keep = slots >= 0
    want_k, want_v = kc.clone(), vc.clone()
    ref.write_kv(k[keep], v[keep], want_k, want_v, slots[keep])
    if dtype == torch.float32:
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    else:  # the interpreter rounds to bfloat16 toward zero, a GPU to nearest: within one ulp
        torch.testing.assert_close(got_k, want_k, rtol=2 ** -7, atol=0)
        torch.testing.assert_close(got_v, want_v, rtol=2 ** -7, atol=0)
    untouched = torch.ones(NUM_BLOCKS * 16, dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert torch.equal(got_k.view(-1, 3, HEAD_DIM)[untouched], kc.view(-1, 3, HEAD_DIM)[untouched])


def test_write_kv_fp8_stores_value_over_scale():
    _fp8_or_skip()
    kc = torch.zeros(4, 16, 2, HEAD_DIM, device=DEV, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    # values exactly representable after scaling: the interpreter's float32 -> e4m3 cast rounds
    # wrongly just below a power of two (0.4999 -> 0.25, measured), a GPU's does not
    k = (torch.randn(3, 2, HEAD_DIM) * 4).to(torch.float8_e4m3fn).float().to(DEV) * 0.5
    v = k * 4
    v[0, 0, 0] = 1e6  # beyond e4m3's range: clamped to 448, not NaN
    slots = torch.tensor([0, 17, 63], device=DEV)
    tk.write_kv(k, v, kc, vc, slots, k_scale=0.5, v_scale=2.0)
    flat_k, flat_v = kc.view(-1, 2, HEAD_DIM), vc.view(-1, 2, HEAD_DIM)
    assert torch.equal(flat_k[slots].float(), k / 0.5)
    assert flat_v[0, 0, 0].float().item() == 448.0
    assert torch.equal(flat_v[slots].float().flatten()[1:], (v / 2.0).flatten()[1:])
    assert not kc.view(-1, 2, HEAD_DIM)[1:17].float().any()  # other slots stay empty


def test_write_then_attend_equals_dense_causal_attention():
    """The whole path: keys written by the kernel, then prefill of a chunk over a prefix and a
    decode step, against textbook causal attention on the dense tensors."""
    bs, kvh, heads, n = 16, 2, 6, 29
    kc = torch.zeros(NUM_BLOCKS, bs, kvh, HEAD_DIM, device=DEV)
    vc = torch.zeros_like(kc)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, h, HEAD_DIM, generator=g).to(DEV) for h in (heads, kvh, kvh))
    table = _tables([n], bs)[0]
    slots = table[torch.arange(n, device=DEV) // bs] * bs + torch.arange(n, device=DEV) % bs
    tk.write_kv(k, v, kc, vc, slots)
    dense = ref.dense_causal_attention(q, k, v, 0.25)
    chunk = tk.paged_prefill_attention(q[20:28], kc, vc, table, 28, 0.25, block_m=16, block_n=16)
    torch.testing.assert_close(chunk, dense[20:28], rtol=1e-5, atol=1e-5)
    last = tk.paged_decode_attention(q[-1:], kc, vc, table[None], torch.tensor([n], device=DEV), 0.25, num_splits=2,
                                     block_n=16)
    torch.testing.assert_close(last[0], dense[-1], rtol=1e-5, atol=1e-5)


def test_decode_plan_depends_on_shapes_only():
    """Same shapes, same launch (what a captured CUDA graph replays); splits never exceed tiles."""
    cpu = torch.device("cpu")
    assert tk.decode_plan(4, 2, 2048, cpu) == (32, 1, 64)
    block_n, splits, per_split = tk.decode_plan(4, 2, 100, cpu, num_splits=50, block_n=16)
    assert (block_n, splits, per_split) == (16, 7, 1)
    block_n, splits, per_split = tk.decode_plan(1, 1, 1000, cpu, num_splits=3, block_n=32)
    assert splits * per_split >= -(-1000 // 32) > (splits - 1) * per_split
