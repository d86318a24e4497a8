"""The fused decode step (engine/model/fused_decode.py): same logits as the unfused quantized layers,
each token's result independent of the rest of the batch, and the unfused fallback."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import kernels
from engine.config import EngineConfig
from engine.engine import LLMEngine, eos_ids_of
from engine.kv_cache import PagedKVCache
from engine.model import fused_decode
from engine.model.weights import quantize_float
from engine.model_runner import AttentionMetadata
from shared.messages import SamplingParams

#: the scalar model of the AVX512-BF16 loops: a test build of its own (a minute or more to compile on
#: 2 cores, again whenever kernels/cpu changes), so `make test-fast` leaves it out
EMULATED = pytest.param("bf16-emulated", marks=pytest.mark.slow)
pytestmark = pytest.mark.skipif(not fused_decode.kernel_available(), reason="no AVX2/FMA CPU")

BLOCK = 4


def quantized(model, qtype: str):
    clone = copy.deepcopy(model)
    quantize_float(clone, qtype)
    return clone


def decode_meta(cache: PagedKVCache, lens: list[int], rows: list[int], attention) -> AttentionMetadata:
    """Decode metadata for sequences ``rows`` of a pool where sequence ``i`` owns blocks
    ``[i * 16, i * 16 + 16)`` and has ``lens[i]`` tokens (its new one last)."""
    tables = [[i * 16 + b for b in range(-(-lens[i] // BLOCK))] for i in rows]
    width = max(len(t) for t in tables)
    slots = [t[(lens[i] - 1) // BLOCK] * BLOCK + (lens[i] - 1) % BLOCK for t, i in zip(tables, rows)]
    return AttentionMetadata(
        kv_cache=cache, slot_mapping=torch.tensor(slots), num_decode_tokens=len(rows),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor([lens[i] for i in rows]), attention=attention)


def random_decode_step(cfg, kv_dtype):
    """A KV cache of random contents and eight decode tokens over it: (cache, context lengths,
    token ids, positions), the same for a given config and dtype."""
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 8 * 16, BLOCK, kv_dtype,
                         torch.device("cpu"), "tiny")
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)))
    rng = random.Random(0)
    lens = [rng.randrange(2, 60) for _ in range(8)]
    ids = torch.tensor([rng.randrange(3, cfg.vocab_size) for _ in range(8)])
    return cache, lens, ids, torch.tensor(lens) - 1


@pytest.mark.parametrize("qtype,kv_dtype,dot", [("Q4_1", torch.float32, "float32"), ("Q8_0", torch.float32, "float32"),
                                                ("Q4_1", torch.bfloat16, "float32"), ("Q4_1", torch.float32, "int8"),
                                                ("Q8_0", torch.float32, "int8")])
def test_fused_step_matches_unfused_and_each_row_is_independent(tiny_model, qtype, kv_dtype, dot):
    """int8: the unfused layers use the same int8-activation kernel (set_block_dot), so the two
    differ where a float32 rounding of RMSNorm, RoPE or SiLU moves an activation across an int8
    rounding boundary: a looser tolerance, the same argmax."""
    from engine.model.quant import set_block_dot

    model = quantized(tiny_model[0], qtype)
    set_block_dot(model, dot)
    cfg = model.config
    fused = fused_decode.build(model, kv_dtype, torch.device("cpu"), dot)
    assert fused is not None and fused.int8 == (dot == "int8")
    cache, lens, ids, pos = random_decode_step(cfg, kv_dtype)
    attention = kernels.select("cpu", "cpu", str(kv_dtype).removeprefix("torch."))
    everyone = list(range(8))

    with torch.inference_mode():
        meta = decode_meta(cache, lens, everyone, attention)
        unfused = model(input_ids=ids[None], position_ids=pos[None], use_cache=False, pd_attn=meta).logits[0].float()
        batch = fused.logits(ids, pos, meta, torch.arange(8))
        kv_after_batch = cache.kv.clone()
        tol = 1e-4 if kv_dtype == torch.float32 and dot == "float32" else 3e-2
        torch.testing.assert_close(batch, unfused, rtol=tol, atol=tol)
        assert torch.equal(batch.argmax(-1), unfused.argmax(-1))
        for row in (0, 3, 7):  # alone: bit-identical logits and KV entries
            alone = fused.logits(ids[row:row + 1], pos[row:row + 1], decode_meta(cache, lens, [row], attention),
                                 torch.arange(1))
            assert torch.equal(alone[0], batch[row]), row
        assert torch.equal(cache.kv, kv_after_batch)


def engine_of(model, fused: bool, batch_invariant: bool = False) -> LLMEngine:
    engine = LLMEngine(model, EngineConfig(model_id="tiny", block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=64,
                                           num_kv_blocks=256, attention_backend="cpu", batch_invariant=batch_invariant),
                       eos_token_ids=eos_ids_of(model))
    if not fused:
        engine.runner.fused = None
    return engine


def generate(engine: LLMEngine, vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 9, 17, 30)]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    return [list(s.output_token_ids) for s in seqs]


def test_engine_greedy_tokens_identical_fused_and_unfused(tiny_model):
    base = quantized(tiny_model[0], "Q4_1")
    fused_engine = engine_of(copy.deepcopy(base), fused=True)
    assert fused_engine.runner.fused is not None
    calls = []
    run = fused_engine.runner.fused.logits
    fused_engine.runner.fused.logits = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    vocab = base.config.vocab_size
    assert generate(fused_engine, vocab) == generate(engine_of(copy.deepcopy(base), fused=False), vocab)
    assert calls and max(calls) == 5  # decode steps ran fused, the five sequences together


def test_falls_back_to_unfused_when_the_kernel_cannot_build(tiny_model, monkeypatch):
    from kernels.cpu import quant

    def broken():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(quant, "load_fused", broken)
    base = quantized(tiny_model[0], "Q8_0")
    engine = engine_of(copy.deepcopy(base), fused=True)
    assert engine.runner.fused is None
    assert fused_decode.build(copy.deepcopy(tiny_model[0]), torch.float32, torch.device("cpu")) is None  # float weights
    vocab = base.config.vocab_size
    monkeypatch.undo()
    assert generate(engine, vocab) == generate(engine_of(copy.deepcopy(base), fused=False), vocab)


def test_batch_invariant_mode_runs_every_step_fused(tiny_model):
    """In the batch-invariant mode prefill chunks run through the fused per-row path too (so a
    token's KV is the same decoded or re-prefilled), in calls of at most MAX_ROWS tokens; the
    tokens equal the unfused invariant path's in float32 (same kernels, float32 rounding only)."""
    base = quantized(tiny_model[0], "Q4_1")
    engine = engine_of(copy.deepcopy(base), fused=True, batch_invariant=True)
    assert engine.runner.fused_all and not engine_of(copy.deepcopy(base), fused=True).runner.fused_all
    rows = []
    hidden_rows = engine.runner.fused.hidden_rows
    engine.runner.fused.hidden_rows = lambda ids, *a: rows.append(ids.shape[0]) or hidden_rows(ids, *a)
    vocab = base.config.vocab_size
    fused_tokens = generate(engine, vocab)
    assert max(rows) == 62 and 5 in rows  # the five prompts (62 tokens) in one call, then decodes
    unfused = engine_of(copy.deepcopy(base), fused=False, batch_invariant=True)
    unfused.runner.fused_all = False
    assert fused_tokens == generate(unfused, vocab)


def test_a_quantized_head_gives_float32_logits_in_a_bfloat16_model(tiny_model):
    """bfloat16 logits round to 1/8 near 20 and tie greedy choices; the quantized head takes
    float32 input once an engine is built, whatever the mode (the fused step fed it float32 already)."""
    from engine.model_runner import float_logits_from_quantized_head

    model = copy.deepcopy(tiny_model[0]).to(torch.bfloat16)
    quantize_float(model, "Q4_1")  # as the engine does: quantized after the cast (scales stay the file's float16)
    x = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    assert model.lm_head(x).dtype == torch.bfloat16
    float_logits_from_quantized_head(model)
    logits = model.lm_head(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, model.lm_head(x.float()))


@pytest.mark.timeout(900)  # the emulated build compiles an extension of its own
@pytest.mark.parametrize("path", ["bf16", EMULATED])
def test_bf16_dot_products_in_a_bfloat16_model_keep_rows_independent(tiny_model, path):
    """A bfloat16 model's fused step multiplies with bf16 dot products (x and weights rounded
    to bf16, float32 sums; a float32 model keeps the float32 loops): each token's logits and KV
    entries are still bit-identical alone or in the batch, and close to the unfused bf16 model's
    (which rounds every activation to bf16). Runs on an AVX512-BF16 CPU, and emulated on any."""
    from kernels.cpu import quant

    ext = quant.load_fused(emulate_bf16=path == "bf16-emulated")
    if not ext.has_bf16:
        pytest.skip("this CPU has no AVX512-BF16 (the emulated build covers the same loops)")
    assert not fused_decode.FusedDecode(quantized(tiny_model[0], "Q4_1"), ext).bf16  # float32 model
    model = copy.deepcopy(tiny_model[0]).to(torch.bfloat16)
    quantize_float(model, "Q4_1")  # as the engine does: quantized after the cast
    fused = fused_decode.FusedDecode(model, ext)
    assert fused.bf16 and not fused_decode.FusedDecode(model, ext, bf16=False).bf16
    cfg = model.config
    cache, lens, ids, pos = random_decode_step(cfg, torch.bfloat16)
    attention = kernels.select("cpu", "cpu", "bfloat16")
    with torch.inference_mode():
        meta = decode_meta(cache, lens, list(range(8)), attention)
        unfused = model(input_ids=ids[None], position_ids=pos[None], use_cache=False, pd_attn=meta).logits[0].float()
        float_dot = fused_decode.FusedDecode(model, ext, bf16=False).logits(ids, pos, meta, torch.arange(8))
        batch = fused.logits(ids, pos, meta, torch.arange(8))
        kv_after_batch = cache.kv.clone()
        assert not torch.equal(batch, float_dot)  # the bf16 loops ran
        # against the float32 loops on the same weights, about as far off as the bf16 model itself
        err = ((batch - float_dot).norm() / float_dot.norm()).item()
        bf16_model_err = ((unfused - float_dot).norm() / float_dot.norm()).item()
        print(f"relative error: bf16 dot products {err:.2e}, unfused bf16 model {bf16_model_err:.2e}")
        assert 0 < err <= 1.5 * bf16_model_err  # measured: 1.46e-2 vs 1.44e-2 (emulated build)
        for row in (0, 3, 7):
            alone = fused.logits(ids[row:row + 1], pos[row:row + 1], decode_meta(cache, lens, [row], attention),
                                 torch.arange(1))
            assert torch.equal(alone[0], batch[row]), row
        assert torch.equal(cache.kv, kv_after_batch)


def test_amx_tiles_in_a_bfloat16_model_keep_rows_independent(tiny_model):
    """With PD_BLOCK_DOT=amx a bfloat16 model's fused step multiplies on AMX tiles (bf16's
    roundings, the tiles' summation order), decode's single rows included: each token's logits
    and KV entries are bit-identical alone or in the batch, and as close to the float32 loops
    as the bf16 dot products are. AMX CPUs only (no build emulates the tiles' order)."""
    from kernels.cpu import quant

    ext = quant.load_fused()
    if not ext.has_amx:
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 tiles")
    model = copy.deepcopy(tiny_model[0]).to(torch.bfloat16)
    quantize_float(model, "Q4_1")
    fused = fused_decode.FusedDecode(model, ext, amx=True)
    assert fused.amx and not fused.bf16 and not fused.int8
    cache, lens, ids, pos = random_decode_step(model.config, torch.bfloat16)
    attention = kernels.select("cpu", "cpu", "bfloat16")
    with torch.inference_mode():
        meta = decode_meta(cache, lens, list(range(8)), attention)
        float_dot = fused_decode.FusedDecode(model, ext, bf16=False).logits(ids, pos, meta, torch.arange(8))
        bf16_dot = fused_decode.FusedDecode(model, ext).logits(ids, pos, meta, torch.arange(8))
        batch = fused.logits(ids, pos, meta, torch.arange(8))
        kv_after_batch = cache.kv.clone()
        assert not torch.equal(batch, bf16_dot)  # the tiles ran, in their own order
        err = ((batch - float_dot).norm() / float_dot.norm()).item()
        bf16_err = ((bf16_dot - float_dot).norm() / float_dot.norm()).item()
        print(f"relative error against the float32 loops: amx {err:.2e}, bf16 dot products {bf16_err:.2e}")
        assert 0 < err <= 1.5 * bf16_err
        for row in (0, 3, 7):
            alone = fused.logits(ids[row:row + 1], pos[row:row + 1], decode_meta(cache, lens, [row], attention),
                                 torch.arange(1))
            assert torch.equal(alone[0], batch[row]), row
        assert torch.equal(cache.kv, kv_after_batch)
