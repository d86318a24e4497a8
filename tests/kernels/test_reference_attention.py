"""The reference paged attention against dense causal attention."""

from __future__ import annotations

import pytest
import torch

from kernels import attention as ref


def make_cache(num_blocks=32, bs=4, kvh=2, d=8, dtype=torch.float32):
    return torch.zeros(num_blocks, bs, kvh, d, dtype=dtype), torch.zeros(num_blocks, bs, kvh, d, dtype=dtype)


@pytest.mark.parametrize("n,heads,kvh", [(1, 4, 2), (7, 4, 4), (13, 6, 2), (16, 4, 1)])
def test_prefill_over_scattered_blocks_matches_dense(n, heads, kvh):
    torch.manual_seed(n)
    d, bs = 8, 4
    kc, vc = make_cache(kvh=kvh, d=d)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    table = torch.randperm(32)[: -(-n // bs)]
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)])
    ref.write_kv(k, v, kc, vc, slots)
    out = ref.paged_prefill_attention(q, kc, vc, table, n, d ** -0.5)
    torch.testing.assert_close(out, ref.dense_causal_attention(q, k, v, d ** -0.5), rtol=1e-5, atol=1e-5)


def test_prefill_chunk_after_cached_prefix_matches_dense():
    torch.manual_seed(1)
    n, split, heads, kvh, d, bs = 19, 11, 4, 2, 8, 4
    kc, vc = make_cache(kvh=kvh, d=d)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    table = torch.tensor([9, 3, 17, 0, 25])
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)])
    ref.write_kv(k, v, kc, vc, slots)
    tail = ref.paged_prefill_attention(q[split:], kc, vc, table, n, d ** -0.5)
    torch.testing.assert_close(tail, ref.dense_causal_attention(q, k, v, d ** -0.5)[split:], rtol=1e-5, atol=1e-5)


def test_decode_batch_with_different_lengths_matches_dense():
    torch.manual_seed(2)
    heads, kvh, d, bs = 4, 2, 8, 4
    kc, vc = make_cache(num_blocks=64, kvh=kvh, d=d)
    lengths = [1, 5, 12, 9]
    tables, qs, expected = [], [], []
    free = iter(torch.randperm(64).tolist())
    for n in lengths:
        q, k, v = torch.randn(n, heads, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
        table = [next(free) for _ in range(-(-n // bs))]
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)])
        ref.write_kv(k, v, kc, vc, slots)
        tables.append(table)
        qs.append(q[-1])
        expected.append(ref.dense_causal_attention(q, k, v, d ** -0.5)[-1])
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = ref.paged_decode_attention(torch.stack(qs), kc, vc, bt, torch.tensor(lengths), d ** -0.5)
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-5, atol=1e-5)


def test_write_kv_puts_tokens_in_their_slots():
    kc, vc = make_cache(num_blocks=4, bs=2, kvh=1, d=2)
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    ref.write_kv(k, -k, kc, vc, torch.tensor([5, 0, 3]))
    flat = kc.view(-1, 1, 2)
    assert flat[5].tolist() == [[0, 1]] and flat[0].tolist() == [[2, 3]] and flat[3].tolist() == [[4, 5]]
    assert vc.view(-1, 1, 2)[3].tolist() == [[-4, -5]]


def _cpu_kernel():
    """The C++ kernels; skipped only where there is no C++ compiler (a build error fails)."""
    import os
    import shutil

    from kernels import cpu

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this machine")
    cpu.load()
    return cpu


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(4, 2, 8), (9, 3, 64), (8, 8, 32)])
def test_cpu_kernel_matches_reference_decode(kv_dtype, heads, kvh, d):
    cpu = _cpu_kernel()
    torch.manual_seed(3)
    bs = 16
    kc = torch.randn(50, bs, kvh, d).to(kv_dtype)
    vc = torch.randn(50, bs, kvh, d).to(kv_dtype)
    lengths = torch.tensor([1, 17, 33, 100, 160])
    perm = torch.randperm(50)
    tables = torch.stack([perm[i * 10:(i + 1) * 10] for i in range(5)])  # scattered blocks
    q = torch.randn(5, heads, d)
    want = ref.paged_decode_attention(q, kc, vc, tables, lengths, d ** -0.5)
    got = cpu.paged_decode_attention(q, kc, vc, tables, lengths, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 64])
def test_cpu_small_batch_linear_matches_torch(rows):
    cpu = _cpu_kernel()
    torch.manual_seed(rows)
    w, b, x = torch.randn(300, 96), torch.randn(300), torch.randn(rows, 96)
    ext = cpu.load()
    torch.testing.assert_close(ext.linear_small_batch(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ext.linear_small_batch(x, w, torch.empty(0)), x @ w.T, rtol=1e-5, atol=1e-4)


def test_accelerated_linears_route_small_batches_only():
    cpu = _cpu_kernel()
    lin = torch.nn.Linear(32, 8)
    ref_out = lin(torch.ones(40, 32))
    assert cpu.accelerate_linears(torch.nn.Sequential(lin)) == 1
    torch.testing.assert_close(lin(torch.ones(2, 5, 32)), torch.nn.functional.linear(torch.ones(2, 5, 32), lin.weight, lin.bias))
    torch.testing.assert_close(lin(torch.ones(40, 32)), ref_out)  # 40 rows: torch's own matmul


def test_bf16_weights_stream_at_one_row_and_match_torch(monkeypatch):
    cpu = _cpu_kernel()
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 24).to(torch.bfloat16)
    x1 = torch.randn(1, 64, dtype=torch.bfloat16)
    x3 = torch.randn(3, 64, dtype=torch.bfloat16)
    want1 = (x1.float() @ lin.weight.float().t() + lin.bias.float()).to(torch.bfloat16)
    want3 = torch.nn.functional.linear(x3, lin.weight, lin.bias)
    calls = []
    ext = cpu.load()

    class Spy:
        def __getattr__(self, name):
            fn = getattr(ext, name)
            return lambda *a: calls.append(name) or fn(*a)

    monkeypatch.setattr(cpu, "load", lambda: Spy())
    assert cpu.accelerate_linears(torch.nn.Sequential(lin)) == 1
    got1, got3 = lin(x1), lin(x3)
    assert got1.dtype == torch.bfloat16 and calls == ["linear_small_batch"]  # one row: the kernel
    torch.testing.assert_close(got1, want1, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got3, want3)  # three rows: torch's bf16 matmul, untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,cached,heads,kvh", [(5, 11, 4, 2), (16, 48, 9, 3), (1, 30, 6, 6), (13, 0, 4, 1)])
def test_cpu_prefill_over_cached_prefix_matches_dense(dtype, n, cached, heads, kvh):
    """Split (prefix + causal chunk, merged by log-sum-exp) against dense causal attention."""
    from kernels import cpu

    torch.manual_seed(n + cached)
    d, bs, total = 16, 4, n + cached
    kc, vc = make_cache(num_blocks=32, bs=bs, kvh=kvh, d=d, dtype=dtype)
    q, k, v = (torch.randn(total, h, d).to(dtype) for h in (heads, kvh, kvh))
    table = torch.randperm(32)[: -(-total // bs)]
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(total)])
    ref.write_kv(k, v, kc, vc, slots)
    got = cpu.paged_prefill_attention(q[cached:], kc, vc, table, total, d ** -0.5)
    want = ref.dense_causal_attention(q.float(), k.float(), v.float(), d ** -0.5)[cached:]
    assert got.dtype == dtype and got.shape == (n, heads, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_rms_norms_are_routed_only_where_the_kernel_agrees():
    """Llama's RMSNorm goes to the one-pass kernel with the same output; a norm with another
    formula (Gemma's 1 + weight) keeps its own forward."""
    cpu = _cpu_kernel()
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    llama, gemma = LlamaRMSNorm(48, eps=1e-5), GemmaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        llama.weight.copy_(torch.randn(48))
        gemma.weight.copy_(torch.randn(48))
    x = torch.randn(2, 7, 48)
    want_llama, want_gemma = llama(x), gemma(x)
    assert cpu.accelerate_norms(torch.nn.Sequential(llama, gemma)) == 1
    torch.testing.assert_close(llama(x), want_llama, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemma(x), want_gemma)
    torch.testing.assert_close(llama(x.double()), want_llama.double(), rtol=1e-5, atol=1e-5)


def test_cpu_prefill_with_a_strided_query_matches_reference():
    """torch's CPU flash op assumes a unit last-dimension stride; the kernel must not pass it
    a strided query."""
    from kernels import cpu

    torch.manual_seed(5)
    total, n, heads, kvh, d, bs = 40, 9, 8, 2, 64, 4
    kc, vc = make_cache(num_blocks=16, bs=bs, kvh=kvh, d=d)
    k, v = torch.randn(total, kvh, d), torch.randn(total, kvh, d)
    table = torch.randperm(16)[: total // bs]
    ref.write_kv(k, v, kc, vc, torch.tensor([table[t // bs] * bs + t % bs for t in range(total)]))
    q = torch.randn(n, heads, 2 * d)[:, :, ::2]
    want = ref.paged_prefill_attention(q.contiguous(), kc, vc, table, total, d ** -0.5)
    torch.testing.assert_close(cpu.paged_prefill_attention(q, kc, vc, table, total, d ** -0.5), want,
                               rtol=1e-5, atol=1e-5)


def test_cpu_decode_with_wide_groups_and_heads_matches_reference():
    cpu = _cpu_kernel()
    torch.manual_seed(6)
    for heads, kvh, d in [(32, 1, 64), (17, 1, 40), (2, 1, 264)]:
        kc, vc = torch.randn(8, 4, kvh, d), torch.randn(8, 4, kvh, d)
        tables, lens, q = torch.tensor([[3, 1, 7], [0, 2, 5]]), torch.tensor([9, 12]), torch.randn(2, heads, d)
        torch.testing.assert_close(cpu.paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5),
                                   ref.paged_decode_attention(q, kc, vc, tables, lens, d ** -0.5), rtol=1e-5, atol=1e-5)


def test_routed_bf16_linear_sees_in_place_bias_updates():
    cpu = _cpu_kernel()
    lin = torch.nn.Linear(16, 8).to(torch.bfloat16)
    cpu.accelerate_linears(torch.nn.Sequential(lin))
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    before = lin(x)
    with torch.no_grad():
        lin.bias.add_(1.0)
    torch.testing.assert_close(lin(x).float(), before.float() + 1.0, rtol=2e-2, atol=2e-2)
