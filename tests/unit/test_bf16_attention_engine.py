"""The bf16 attention kernels inside the engine (head_dim 64, the width they take): a request's
tokens and logits bytes stay those of the request alone, beside others, chunked and after a prefix
hit, with bf16 dot products (PD_BLOCK_DOT=bf16, natively or through the emulating test builds) and
on AMX tiles (PD_BLOCK_DOT=amx).

A module of its own: test_batch_invariance's module-scoped ``bf16_model`` fixture keeps its last
case's patches (the emulated builds) until its module ends, which here would route the native and
AMX cases through the emulated block kernels (and skip the AMX one)."""

from __future__ import annotations

import pytest
import torch

from engine.model.quant import amx_dot_available, bf16_dot_available
from shared.messages import SamplingParams
from tests.unit.test_batch_invariance import (
    BLOCK_DOT,
    GREEDY,
    _attention_build,
    assert_chunked_and_prefix_hit_equal_whole,
    make_engine,
    prompts,
    run,
    use_emulated_bf16_builds,
)


@pytest.fixture(scope="module", params=["native", "amx", pytest.param("emulated", marks=[pytest.mark.slow,
                                                                                         pytest.mark.timeout(1800)])])
def wide_bf16_model(request, tmp_path_factory):
    """A tiny model with head_dim 64 (the bf16 attention kernels take 64 and 128), Q4_1 blocks in
    bfloat16 with bf16 dot products (PD_BLOCK_DOT=bf16): natively on AVX512-BF16, or through the
    test builds that emulate the instructions (block kernels and attention); or on AMX tiles
    (PD_BLOCK_DOT=amx, AMX CPUs only), whose attention takes the bf16 dot products too."""
    from transformers import AutoModelForCausalLM

    from engine.model.weights import quantize_float
    from engine.model_runner import ATTN_IMPLEMENTATION, register_attention
    from tests.tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("models") / "wide-llama", hidden=128, heads=2, kv_heads=1)
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                 attn_implementation=ATTN_IMPLEMENTATION).eval()
    assert quantize_float(model, "Q4_1")["int4"] > 0
    saved = BLOCK_DOT["dot"]
    BLOCK_DOT["dot"] = "amx" if request.param == "amx" else "bf16"
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "emulated":
            use_emulated_bf16_builds(mp, attention=True)
        elif not bf16_dot_available(torch.bfloat16) or not _attention_build("native").has_bf16:
            pytest.skip("this CPU has no AVX512-BF16 (the 'emulated' case runs the same path)")
        elif request.param == "amx" and not amx_dot_available(torch.bfloat16):
            pytest.skip("this CPU (or its kernel) gives no AMX-BF16 tiles")
        try:
            yield model
        finally:
            BLOCK_DOT["dot"] = saved


def test_bf16_attention_in_the_engine_alone_beside_chunked_and_after_a_prefix_hit(wide_bf16_model, monkeypatch):
    """The engine with bf16 dot products in its linears takes them for attention too, and a
    request's tokens and logits bytes stay those of the request alone: beside decodes and long
    prefills, prefilled in chunks that cut tiles, blocks and 128-key spans, after a prefix hit."""
    model = wide_bf16_model
    vocab = model.config.vocab_size
    engine = make_engine(model)
    if BLOCK_DOT["dot"] == "amx":  # the same roundings on AMX tiles, where the block kernels use them
        assert engine.runner.attention.amx and engine.runner.attention.__name__.endswith("+amx")
    else:
        assert engine.runner.attention.bf16 and engine.runner.attention.__name__.endswith("+bf16")
    target, prompt = prompts([13, 300], vocab, seed=21)
    alone = run(engine, [(0, "g", target, GREEDY)], monkeypatch)["g"]
    others = prompts([3, 8, 40], vocab, seed=22)
    reqs = [(0, "g", target, GREEDY), (2, "long", prompt, GREEDY)]
    reqs += [(i, f"d{i}", p, SamplingParams(max_tokens=5, temperature=0.0)) for i, p in enumerate(others)]
    assert run(make_engine(model), reqs, monkeypatch)["g"] == alone
    assert_chunked_and_prefix_hit_equal_whole(model, prompt, (65, 129), 150, monkeypatch)
