"""Batch-invariant numerics (PD_BATCH_INVARIANT, engine.model.batch_invariant) on the tiny model in
bfloat16 (the default dtype on a CPU with native bf16): a request's tokens, and the logits they
were sampled from, are bit-identical whatever else is in the batch, with or without a prefix
hit, chunked or not, and when resumed from its tokens on another engine. The reference of each
case is the same request run alone on a fresh engine. With the mode off the logits differ
(the last test), so these tests measure the mode, not luck."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import pytest
import torch

import engine.model_runner as model_runner
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model import fused_decode
from engine.model.batch_invariant import invariant_linear
from engine.model.quant import BlockLinear, amx_dot_available, bf16_dot_available
from shared.messages import SamplingParams

SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=42)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


#: The block kernels' arithmetic (PD_BLOCK_DOT) of the engines make_engine builds, set by the
#: bf16_model fixture for its current case (module-scoped: pytest runs each case's tests together).
BLOCK_DOT = {"dot": "float32"}


#: the emulated case compiles two test builds of its own (minutes on 2 cores) and multiplies in scalar code
EMULATED = pytest.param("Q4_1 bf16-emulated", marks=[pytest.mark.slow, pytest.mark.timeout(1800)])


@pytest.fixture(scope="module", params=["float", "Q4_1", "Q4_1 int8", "Q4_1 bf16", "Q4_1 amx", EMULATED])
def bf16_model(request, tiny_model_dir):
    """The tiny model in bfloat16 with float weights (the mode's unfused path) and with GGUF-style
    Q4_1 blocks (the default model's storage: every step through the fused per-row path), with
    the float32 block loops, with int8 activations (PD_BLOCK_DOT=int8, opt-in) and
    with bf16 dot products (PD_BLOCK_DOT=bf16, auto for bfloat16 on AVX512-BF16 CPUs without AMX;
    skipped elsewhere), on AMX tiles (PD_BLOCK_DOT=amx, auto for bfloat16 on AMX CPUs; skipped
    elsewhere: no build emulates the tiles' order), and the same through the test builds that
    emulate the AVX512-BF16 instructions in scalar code (``PDQ_BF16_EMULATE``), so the engine's
    bf16 path runs on any CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.weights import quantize_float
    from engine.model_runner import ATTN_IMPLEMENTATION, register_attention

    register_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16,
                                                 attn_implementation=ATTN_IMPLEMENTATION).eval()
    if request.param != "float":
        assert quantize_float(model, request.param.split()[0])["int4"] > 0
    dot = request.param.split()[1] if " " in request.param else "float32"
    emulated = dot == "bf16-emulated"
    BLOCK_DOT["dot"] = "bf16" if emulated else dot
    with pytest.MonkeyPatch.context() as mp:
        if emulated:
            use_emulated_bf16_builds(mp)
            assert bf16_dot_available(torch.bfloat16)
        elif BLOCK_DOT["dot"] == "bf16" and not bf16_dot_available(torch.bfloat16):
            pytest.skip("this CPU has no AVX512-BF16 (the 'bf16-emulated' case runs the same path)")
        elif BLOCK_DOT["dot"] == "amx" and not amx_dot_available(torch.bfloat16):
            pytest.skip("this CPU (or its kernel) gives no AMX-BF16 tiles")
        yield model, AutoTokenizer.from_pretrained(tiny_model_dir)


def use_emulated_bf16_builds(mp: pytest.MonkeyPatch, attention: bool = False) -> None:
    """Route the engine's block kernels (and with ``attention``, the attention kernels) to the test
    builds that emulate the AVX512-BF16 instructions in scalar code; skips without AVX2/FMA."""
    import engine.model.batch_invariant as engine_invariant
    import engine.model.quant as engine_quant
    from kernels import cpu
    from kernels.cpu import quant

    if not quant.available():
        pytest.skip("no AVX2/FMA CPU for the block kernels")
    for module in (engine_quant, engine_invariant):  # both call the block kernel's build
        mp.setattr(module, "_kernel", lambda: quant.load(emulate_bf16=True))
    real_fused, real_attention = quant.load_fused, cpu.load
    mp.setattr(quant, "load_fused", lambda emulate_bf16=True: real_fused(emulate_bf16=True))
    if attention:
        mp.setattr(cpu, "load", lambda emulate_bf16=True: real_attention(emulate_bf16=True))


def make_engine(model, invariant=True, **overrides) -> LLMEngine:
    cfg = dict(model_id="tiny", block_size=4, max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=512,
               attention_backend="auto", batch_invariant=invariant, block_dot=BLOCK_DOT["dot"])
    cfg.update(overrides)
    engine = LLMEngine(copy.deepcopy(model), EngineConfig(**cfg), eos_token_ids=())
    quantized = any(isinstance(m, BlockLinear) for m in model.modules())
    if invariant and quantized and fused_decode.kernel_available():
        assert engine.runner.fused_all  # the case under test is the fused per-row path
        assert engine.runner.fused.int8 == (BLOCK_DOT["dot"] == "int8")
        assert engine.runner.fused.bf16 == (BLOCK_DOT["dot"] == "bf16")
        assert engine.runner.fused.amx == (BLOCK_DOT["dot"] == "amx")
    return engine


@dataclass
class Out:
    """A request's output tokens and the bytes of the logits row each was sampled from
    (compared), and the prompt tokens it found in the prefix cache (not compared)."""

    tokens: list[int]
    logits: list[bytes]
    cached: int = field(default=0, compare=False)


def run(engine: LLMEngine, requests, monkeypatch) -> dict[str, Out]:
    """Run ``requests``: ``(step, request_id, prompt, sampling[, output_token_ids])``, each added
    before engine step ``step``; returns each request's :class:`Out`."""
    captured: list[torch.Tensor] = []
    real_sample = model_runner.sample

    def sample(logits, rows, *args, **kwargs):
        captured.extend(logits.float().clone())
        return real_sample(logits, rows, *args, **kwargs)

    monkeypatch.setattr(model_runner, "sample", sample)
    execute = engine.runner.execute
    logits: dict[str, list[bytes]] = {}

    def traced(batch):
        captured.clear()
        result = execute(batch)
        for item, row in zip(result.sampled, captured, strict=True):
            logits.setdefault(item.seq.request_id, []).append(row.numpy().tobytes())
        return result

    engine.runner.execute = traced
    pending = sorted(requests, key=lambda r: r[0])
    seqs = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, sampling, *out = pending.pop(0)
            seqs[rid] = engine.add_request(rid, prompt, sampling, output_token_ids=out[0] if out else ())
        engine.step()
        step += 1
    engine.runner.execute = execute
    return {rid: Out(s.output_token_ids, logits.get(rid, []), s.num_cached_tokens) for rid, s in seqs.items()}


def prompts(lengths, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_linear_rows_do_not_depend_on_neighbours():
    """A row's result through invariant_linear is the same bits at any position, beside any
    rows, for any row count (bf16 and fp32: fp32 matmul here takes a GEMV path at one row)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(96, 64, generator=gen).to(dtype)
        b = torch.randn(96, generator=gen).to(dtype)
        x = torch.randn(1, 64, generator=gen).to(dtype)
        alone = invariant_linear(x, w, b)
        for m, pos in [(2, 1), (5, 3), (32, 31), (33, 32), (70, 40), (300, 7)]:
            batch = torch.randn(m, 64, generator=gen).to(dtype)
            batch[pos] = x[0]
            assert torch.equal(invariant_linear(batch, w, b)[pos], alone[0]), (dtype, m, pos)


def test_float32_linear_rows_do_not_depend_on_neighbours_and_match_torch():
    """float32 linears go through the block kernel's per-row loops (no padding): a row's bits
    at any position and row count, K and N not multiples of the tile, close to torch."""
    from engine.model.batch_invariant import float32_linear
    from engine.model.quant import _kernel

    ext = _kernel()
    if ext is None:
        pytest.skip("no C++ kernel build on this machine")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(99, 80, generator=gen)
    b = torch.randn(99, generator=gen)
    x = torch.randn(1, 80, generator=gen)
    alone = float32_linear(x, w, b, ext)
    torch.testing.assert_close(alone, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for m, pos in [(2, 1), (3, 2), (4, 0), (5, 4), (17, 9), (64, 63), (65, 64), (130, 100)]:
        batch = torch.randn(m, 80, generator=gen)
        batch[pos] = x[0]
        assert torch.equal(float32_linear(batch, w, b, ext)[pos], alone[0]), (m, pos)
    assert float32_linear(torch.empty(0, 80), w, b, ext).shape == (0, 99)


def test_seeded_request_alone_and_beside_unseeded_copies(bf16_model, monkeypatch):
    """The issue's example: "Once upon a time", 16 tokens at temperature 0.8, seed 42, alone
    three times (the second and third hit the prefix cache) and beside five unseeded copies."""
    model, tok = bf16_model
    prompt = tok("Once upon a time")["input_ids"]
    engine = make_engine(model)
    alone = [run(engine, [(0, f"a{i}", prompt, SEEDED)], monkeypatch)[f"a{i}"] for i in range(3)]
    assert alone[0] == alone[1] == alone[2]
    unseeded = SamplingParams(max_tokens=16, temperature=0.8)
    crowd = [(0, "s", prompt, SEEDED)] + [(i // 2, f"u{i}", prompt, unseeded) for i in range(5)]
    out = run(make_engine(model), crowd, monkeypatch)
    assert out["s"] == alone[0]
    # the copies drew their own (random) seeds: the test had neighbours that really differ
    assert len({tuple(out[f"u{i}"].tokens) for i in range(5)} | {tuple(out["s"].tokens)}) > 1


def test_greedy_with_and_without_a_prefix_hit(bf16_model, monkeypatch):
    model, _ = bf16_model
    vocab = model.config.vocab_size
    shared, tail_a, tail_b = prompts([37, 5, 9], vocab, seed=1)
    prompt = shared + tail_a
    fresh = run(make_engine(model), [(0, "p", prompt, GREEDY)], monkeypatch)["p"]
    engine = make_engine(model)
    run(engine, [(0, "other", shared + tail_b, GREEDY)], monkeypatch)
    hit = run(engine, [(0, "p", prompt, GREEDY)], monkeypatch)["p"]
    assert fresh.cached == 0 and hit.cached == 36  # the shared 37 tokens' 9 full blocks
    assert hit == fresh
    # the same prompt again: all its full blocks from the cache
    again = run(engine, [(0, "p2", prompt, GREEDY)], monkeypatch)["p2"]
    assert again.cached == 40
    assert again == fresh


def test_greedy_alone_and_beside_prefills_and_decodes(bf16_model, monkeypatch):
    """A greedy request alone, then beside 1, 4 and 9 other decodes joining at different steps
    and long prompts (150-200 tokens) prefilled in the same steps as its decode."""
    model, _ = bf16_model
    vocab = model.config.vocab_size
    target = prompts([13], vocab, seed=2)[0]
    alone = run(make_engine(model), [(0, "g", target, GREEDY)], monkeypatch)["g"]
    for count in (1, 4, 9):
        others = prompts([3 + 5 * i for i in range(count)], vocab, seed=10 + count)
        longs = prompts([150, 200], vocab, seed=20 + count)
        reqs = [(0, "g", target, GREEDY)]
        reqs += [(i % 4, f"d{i}", p, SamplingParams(max_tokens=4 + i, temperature=0.0)) for i, p in enumerate(others)]
        reqs += [(2, "long0", longs[0], GREEDY), (5, "long1", longs[1], GREEDY)]
        out = run(make_engine(model), reqs, monkeypatch)
        assert out["g"] == alone, count


def test_chunked_and_unchunked_prefill(bf16_model, monkeypatch):
    model, _ = bf16_model
    prompt = prompts([90], model.config.vocab_size, seed=3)[0]
    whole = run(make_engine(model), [(0, "c", prompt, GREEDY)], monkeypatch)["c"]
    chunked = run(make_engine(model, max_num_batched_tokens=16), [(0, "c", prompt, GREEDY)], monkeypatch)["c"]
    capped = run(make_engine(model, max_prefill_chunk_tokens=7), [(0, "c", prompt, GREEDY)], monkeypatch)["c"]
    assert chunked == whole
    assert capped == whole


def test_resumed_from_tokens_equals_undisturbed(bf16_model, monkeypatch):
    """What a decode worker does when it takes over a stream: the prompt and the tokens so far
    are recomputed as one prefill, then decoding goes on."""
    model, _ = bf16_model
    prompt = prompts([21], model.config.vocab_size, seed=4)[0]
    for sampling in (GREEDY, SEEDED):
        full = run(make_engine(model), [(0, "r", prompt, sampling)], monkeypatch)["r"]
        cut = 6
        resumed = run(make_engine(model), [(0, "r", prompt, sampling, full.tokens[:cut])], monkeypatch)["r"]
        assert resumed.tokens == full.tokens
        assert resumed.logits == full.logits[cut:]


def test_mode_off_changes_logits(bf16_model, monkeypatch):
    """Without the mode the cases above do change the logits (what makes them meaningful):
    alone vs beside neighbours, or chunked vs not."""
    model, _ = bf16_model
    vocab = model.config.vocab_size
    if any(isinstance(m, BlockLinear) for m in model.modules()):
        # quantized: the block kernel is per row already; what differs is a decoded token
        # (fused step, float32 throughout) against the same token re-prefilled (unfused layers)
        prompt = prompts([21], vocab, seed=4)[0]
        full = run(make_engine(model, invariant=False), [(0, "r", prompt, GREEDY)], monkeypatch)["r"]
        resumed = run(make_engine(model, invariant=False), [(0, "r", prompt, GREEDY, full.tokens[:6])],
                      monkeypatch)["r"]
        assert resumed.logits[0] != full.logits[6]
        return
    target = prompts([13], vocab, seed=2)[0]
    alone = run(make_engine(model, invariant=False), [(0, "g", target, GREEDY)], monkeypatch)["g"]
    others = [(0, f"d{i}", p, GREEDY) for i, p in enumerate(prompts([3, 8, 150], vocab, seed=5))]
    beside = run(make_engine(model, invariant=False), [(0, "g", target, GREEDY), *others], monkeypatch)["g"]
    prompt = prompts([90], vocab, seed=3)[0]
    whole = run(make_engine(model, invariant=False), [(0, "c", prompt, GREEDY)], monkeypatch)["c"]
    chunked = run(make_engine(model, invariant=False, max_num_batched_tokens=16), [(0, "c", prompt, GREEDY)],
                  monkeypatch)["c"]
    # which of the two torch's matmuls give away depends on the CPU and its kernels (on one
    # AVX512-BF16 EPYC the neighbours left the rows alone, chunking did not): at least one must
    assert beside.logits != alone.logits or chunked.logits != whole.logits


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_tiled_prefill_attention_equals_decode_queries(kv_dtype):
    """The tiled prefill kernel reduces each query exactly as one decode query over the same
    context: bit-identical for prompts with and without a cached prefix, at tile edges (1, 3, the
    default, 64), block edges and head layouts other than SmolLM2's."""
    from kernels import cpu

    try:
        ext = cpu.load()
    except RuntimeError as exc:
        pytest.skip(f"no C++ extension: {exc}")
    gen = torch.Generator().manual_seed(7)
    cases = [  # (context_len, queries, block_size, heads, kv heads, head_dim)
        (1, 1, 16, 9, 3, 64), (17, 5, 16, 9, 3, 64), (130, 130, 16, 9, 3, 64), (300, 37, 4, 9, 3, 64),
        (513, 512, 16, 9, 3, 64), (700, 65, 16, 4, 2, 128), (90, 90, 4, 4, 4, 48),
    ]
    for context_len, n, block_size, heads, kv_heads, head_dim in cases:
        blocks = -(-context_len // block_size)
        k = torch.randn(blocks + 2, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
        v = torch.randn(blocks + 2, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
        table = torch.randperm(blocks + 2, generator=gen)[:blocks]
        q = torch.randn(n, heads, head_dim, generator=gen)
        lens = torch.arange(context_len - n + 1, context_len + 1)
        decoded = ext.paged_decode_attention(q, k, v, table.unsqueeze(0).expand(n, -1).contiguous(), lens, 0.125)
        alone = torch.cat([ext.paged_decode_attention(q[i:i + 1], k, v, table.unsqueeze(0), lens[i:i + 1], 0.125)
                           for i in (0, n // 2, n - 1)])
        assert torch.equal(alone, decoded[[0, n // 2, n - 1]])
        for tile in (0, 1, 3, 64):
            tiled = ext.paged_prefill_attention_tiled(q, k, v, table, context_len, 0.125, tile)
            assert torch.equal(tiled, decoded), (context_len, n, block_size, heads, kv_heads, head_dim, tile)
        # against the float64 reference: the kernel computes attention, not just something stable
        kk = k[table].flatten(0, 1)[:context_len].double().repeat_interleave(heads // kv_heads, dim=1)
        vv = v[table].flatten(0, 1)[:context_len].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("nhd,thd->nht", q.double(), kk) * 0.125
        mask = torch.arange(context_len)[None, :] >= lens[:, None]
        scores.masked_fill_(mask[:, None, :], float("-inf"))
        ref = torch.einsum("nht,thd->nhd", scores.softmax(-1), vv)
        torch.testing.assert_close(decoded.double(), ref, rtol=1e-4, atol=1e-4)


def test_long_prompt_chunked_at_tile_and_block_edges(bf16_model, monkeypatch):
    """A prompt longer than a fused call (64 rows; on AMX tiles 512, where the block kernel
    takes its path for more than 64 rows: whole against chunks of 65 and 97 rows and against
    the rest under 64) and than the kernel's tiles, prefilled whole,
    in chunks that cut calls, tiles and blocks at odd places, and with a prefix hit: the same
    tokens and the same logits bytes."""
    model, _ = bf16_model
    prompt = prompts([150], model.config.vocab_size, seed=11)[0]
    assert_chunked_and_prefix_hit_equal_whole(model, prompt, (65, 97), 70, monkeypatch)


def assert_chunked_and_prefix_hit_equal_whole(model, prompt, chunks, warm, monkeypatch) -> None:
    """``prompt`` prefilled whole, capped at each of ``chunks`` tokens a chunk, and after a warm-up
    request of its first ``warm`` tokens (a prefix hit): the same tokens and logits bytes."""
    whole = run(make_engine(model), [(0, "l", prompt, GREEDY)], monkeypatch)["l"]
    for chunk in chunks:
        assert run(make_engine(model, max_prefill_chunk_tokens=chunk), [(0, "l", prompt, GREEDY)],
                   monkeypatch)["l"] == whole, chunk
    engine = make_engine(model, enable_prefix_caching=True)
    run(engine, [(0, "warm", prompt[:warm], GREEDY)], monkeypatch)
    hit = run(engine, [(0, "l", prompt, GREEDY)], monkeypatch)["l"]
    assert hit.cached > 0 and hit == whole


def test_any_thread_count_gives_the_same_bits(bf16_model, monkeypatch):
    """Prefill and decode workers change their torch threads between steps (services/common/core_share.py):
    a long prompt and a seeded one give the same tokens and logits bytes at one thread, at two, and
    with the count changing at every step (chunks of 64 and 97 tokens and decode steps computed at
    different counts)."""
    model, _ = bf16_model
    long_prompt, short = prompts([200, 30], model.config.vocab_size, seed=12)
    requests = [(0, "l", long_prompt, GREEDY), (1, "s", short, SEEDED)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(make_engine(model, max_prefill_chunk_tokens=64), requests, monkeypatch)
        torch.set_num_threads(2)
        two = run(make_engine(model, max_prefill_chunk_tokens=97), requests, monkeypatch)
        engine = make_engine(model, max_prefill_chunk_tokens=64)
        real_step, counts = engine.step, []

        def flipping_step():
            counts.append(1 + len(counts) % 2)
            torch.set_num_threads(counts[-1])
            return real_step()

        engine.step = flipping_step
        flipped = run(engine, requests, monkeypatch)
    finally:
        torch.set_num_threads(before)
    assert one == two == flipped
    assert set(counts) == {1, 2} and len(one["l"].tokens) == GREEDY.max_tokens


def _attention_build(kind: str):
    """The attention extension of ``kind``: ``native`` (skipped without AVX512-BF16), ``amx`` (the
    native build, skipped without AMX tiles) or ``emulated`` (the bf16 instructions modelled in
    scalar code; any AVX2 CPU)."""
    from kernels import cpu

    try:
        ext = cpu.load(emulate_bf16=kind == "emulated")
    except RuntimeError as exc:
        pytest.skip(f"no C++ extension: {exc}")
    if not ext.has_bf16:
        pytest.skip("this CPU has no AVX512-BF16 (the 'emulated' case runs the same path)")
    if kind == "amx" and not ext.has_amx:
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 tiles")
    return ext


def _arithmetic(kind: str) -> tuple[bool, bool]:
    """The kernels' (bf16, amx) arguments for ``kind``: bf16 dot products, or on AMX tiles."""
    return (False, True) if kind == "amx" else (True, False)


@pytest.mark.parametrize("kind", ["native", "amx", pytest.param("emulated", marks=pytest.mark.slow)])
def test_bf16_attention_prefill_tiles_equal_decode_queries(kind):
    """q.k and p.v as bf16 dot products (``bf16=True``, or on AMX tiles: ``amx=True``): every
    query bit-identical decoded alone, decoded in a batch and prefilled in tiles of any size, at
    block sizes that put pairs and 16-key chunks across blocks (1, 4, 5, 32) and span edges (128
    keys), for head_dim 64 and 128, with tiles of (query, head) rows that cut queries (9 heads,
    16 rows a tile) and the causal diagonal inside a 32-key chunk; within bf16 rounding of the
    float64 reference, and not the float32 kernel's bits (so the bf16 path ran)."""
    ext = _attention_build(kind)
    arith = _arithmetic(kind)
    gen = torch.Generator().manual_seed(5)
    cases = [  # (context_len, queries, block_size, heads, kv heads, head_dim)
        (1, 1, 16, 9, 3, 64), (2, 2, 4, 9, 3, 64), (17, 5, 16, 9, 3, 64), (130, 130, 16, 9, 3, 64),
        (257, 100, 5, 4, 2, 64), (300, 37, 4, 9, 3, 64), (129, 129, 32, 2, 1, 64), (700, 65, 16, 4, 2, 128),
        (160, 3, 1, 2, 2, 128), (333, 70, 16, 9, 3, 64), (96, 96, 16, 3, 1, 128),
    ]
    for context_len, n, block_size, heads, kv_heads, head_dim in cases:
        blocks = -(-context_len // block_size)
        k = torch.randn(blocks + 2, block_size, kv_heads, head_dim, generator=gen).bfloat16()
        v = torch.randn(blocks + 2, block_size, kv_heads, head_dim, generator=gen).bfloat16()
        table = torch.randperm(blocks + 2, generator=gen)[:blocks]
        q = torch.randn(n, heads, head_dim, generator=gen)
        lens = torch.arange(context_len - n + 1, context_len + 1)
        tables = table.unsqueeze(0).expand(n, -1).contiguous()
        case = (context_len, n, block_size, heads, kv_heads, head_dim)
        decoded = ext.paged_decode_attention(q, k, v, tables, lens, 0.125, *arith)
        alone = torch.cat([ext.paged_decode_attention(q[i:i + 1], k, v, table.unsqueeze(0), lens[i:i + 1], 0.125,
                                                      *arith)
                           for i in (0, n // 2, n - 1)])
        assert torch.equal(alone, decoded[[0, n // 2, n - 1]]), case
        for tile in (0, 1, 3, 64):
            tiled = ext.paged_prefill_attention_tiled(q, k, v, table, context_len, 0.125, tile, *arith)
            assert torch.equal(tiled, decoded), (*case, tile)
        kk = k[table].flatten(0, 1)[:context_len].double().repeat_interleave(heads // kv_heads, dim=1)
        vv = v[table].flatten(0, 1)[:context_len].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("nhd,thd->nht", q.double(), kk) * 0.125
        scores.masked_fill_((torch.arange(context_len)[None, :] >= lens[:, None])[:, None, :], float("-inf"))
        ref = torch.einsum("nht,thd->nhd", scores.softmax(-1), vv)
        torch.testing.assert_close(decoded.double(), ref, rtol=2e-2, atol=2e-2)
        assert ((decoded.double() - ref).norm() / ref.norm()).item() < 1e-2, case
        if context_len > 1:
            assert not torch.equal(decoded, ext.paged_decode_attention(q, k, v, tables, lens, 0.125)), case


@pytest.mark.slow
def test_bf16_attention_instructions_give_the_bits_of_their_scalar_model():
    """The native build (AVX512-BF16) and the emulated one (the instructions modelled in scalar
    code, quant_block.h) give the same bits for the same inputs: the emulated case's tests test
    the code the machine runs."""
    native, emulated = _attention_build("native"), _attention_build("emulated")
    gen = torch.Generator().manual_seed(9)
    for context_len, n, block_size, heads, kv_heads, head_dim in [(300, 40, 16, 9, 3, 64), (259, 259, 5, 4, 2, 128)]:
        blocks = -(-context_len // block_size)
        k = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
        v = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
        table = torch.randperm(blocks, generator=gen)
        q = torch.randn(n, heads, head_dim, generator=gen) * 4
        outs = [ext.paged_prefill_attention_tiled(q, k, v, table, context_len, 0.125, 0, True) for ext in (native, emulated)]
        assert torch.equal(*outs)
        # denormal keys (read as zero) and values whose products and sums fall below float32's
        # normal range (flushed): the instruction's edges, modelled in the emulated build
        k[0, :4] = (k[0, :4].float() * 1e-39).bfloat16()
        v[1:3] = (v[1:3].float() * 2.0 ** -120).bfloat16()
        outs = [ext.paged_prefill_attention_tiled(q * 8, k, v, table, context_len, 0.125, 0, True)
                for ext in (native, emulated)]
        assert torch.equal(*outs)


@pytest.mark.parametrize("kind", ["native", "amx", pytest.param("emulated", marks=pytest.mark.slow)])
def test_bf16_attention_non_finite_values_stay_where_they_belong(kind):
    """An Inf in a later token's V does not reach the earlier queries of a prefill tile (decode
    never reads it: the partner of a query's odd last key is read as zero), and an Inf key gives
    NaN where float32 does (a head scoring it +Inf) instead of being clamped into a finite answer."""
    ext = _attention_build(kind)
    arith = _arithmetic(kind)
    gen = torch.Generator().manual_seed(3)
    for context_len in (4, 7, 131):
        k = torch.randn(9, 16, 1, 64, generator=gen).bfloat16()
        v = torch.randn(9, 16, 1, 64, generator=gen).bfloat16()
        table = torch.arange(-(-context_len // 16))
        q = torch.randn(context_len, 2, 64, generator=gen)
        v[(context_len - 1) // 16, (context_len - 1) % 16] = float("inf")  # the last token's V
        lens = torch.arange(1, context_len + 1)
        decoded = ext.paged_decode_attention(q, k, v, table.unsqueeze(0).expand(context_len, -1).contiguous(), lens,
                                             0.125, *arith)
        assert torch.isfinite(decoded[:-1]).all()
        for tile in (0, 2, context_len):
            tiled = ext.paged_prefill_attention_tiled(q, k, v, table, context_len, 0.125, tile, *arith)
            assert torch.equal(tiled[:-1], decoded[:-1]), (context_len, tile)
    k, v = torch.randn(1, 16, 1, 64, generator=gen).bfloat16(), torch.randn(1, 16, 1, 64, generator=gen).bfloat16()
    k[0, 2, 0, 0] = float("inf")
    q, table = torch.randn(1, 2, 64, generator=gen), torch.zeros(1, 1, dtype=torch.long)
    q[0, 0, 0], q[0, 1, 0] = 1.0, -1.0  # head 0 scores the key +Inf (NaN after the max), head 1 -Inf (weight 0)
    bf16 = ext.paged_decode_attention(q, k, v, table, torch.tensor([5]), 0.125, *arith)
    f32 = ext.paged_decode_attention(q, k, v, table, torch.tensor([5]), 0.125)
    assert bf16[0, 0].isnan().all() and torch.isfinite(bf16[0, 1]).all()
    assert torch.equal(bf16.isnan(), f32.isnan())
    assert torch.isfinite(ext.paged_decode_attention(q, k, v, table, torch.tensor([2]), 0.125, *arith)).all()
