"""Cases: the engine with the Triton kernels as its attention gives transformers' greedy tokens,
eagerly and with decode replayed from (stand-in) CUDA graphs whose padded rows rely on the
Triton KV write skipping slot -1. Collected through ``test_triton_engine.py``; CPU only (under
the interpreter): on a GPU, ``pdserve bench gpu`` checks the default model the same way."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine, eos_ids_of
from shared.messages import SamplingParams
from tests.kernels.triton_env import device, load_kernels
from tests.unit.test_cuda_graphs import RecordingCapture
from tests.unit.test_engine_vs_transformers import reference

DEV = device()
tk = load_kernels()
pytestmark = pytest.mark.skipif(DEV.type == "cuda", reason="CPU model; the GPU runs bench gpu's greedy check")


def _engine(model):
    # chunks of 8 tokens: later chunks are prefills over a cached prefix; block size 4 makes a
    # kernel tile span several blocks
    cfg = EngineConfig(model_id="tiny", block_size=4, max_num_seqs=4, max_num_batched_tokens=8, num_kv_blocks=64,
                       attention_backend="reference", max_model_len=48, max_prefill_chunk_tokens=8)
    engine = LLMEngine(model, cfg, eos_token_ids=eos_ids_of(model))
    engine.runner.attention = tk
    return engine


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_on_triton_kernels_matches_generate(tiny_model, graphs):
    model, ref, _ = tiny_model
    prompts = [[3, 5, 7], list(range(3, 22)), [9] * 6]
    engine = _engine(model)
    if graphs:
        engine.runner.enable_cuda_graphs([1, 2], 12, capture=RecordingCapture())
    seqs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    eos = eos_ids_of(model)
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_token_ids == reference(ref, prompt, 6, eos)
    if graphs:
        assert engine.runner.graphs.num_replays > 0
