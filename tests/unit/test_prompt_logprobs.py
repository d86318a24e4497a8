"""Prompt logprobs (engine/prompt_logprobs.py) against transformers' own forward pass on the
same float32 weights: whole and chunked prefill, a batch mixing requests with and without
them, and a prompt whose prefix is already in the prefix cache (which must not be used)."""

from __future__ import annotations

import pytest
import torch

from shared.messages import SamplingParams
from tests.unit.test_engine_vs_transformers import make_engine, prompts_of

#: float32 on both sides; the paged attention sums in another order than transformers' eager
TOLERANCE = 1e-4


def reference_logprobs(ref_model, prompt: list[int]) -> torch.Tensor:
    """log P(prompt[i] | prompt[:i]) for i >= 1, from one plain forward pass."""
    with torch.inference_mode():
        logits = ref_model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def run(engine, prompts, sampling):
    outs = {}
    seqs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sampling))]
    while engine.has_unfinished():
        for out in engine.step():
            if out.index == 0:
                outs[out.request_id] = out
    return seqs, outs


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_match_transformers(tiny_model, chunk):
    model, ref, _ = tiny_model
    overrides = {"max_prefill_chunk_tokens": chunk} if chunk else {}
    engine = make_engine(model, **overrides)
    prompts = prompts_of([1, 2, 9, 23], model.config.vocab_size, seed=3)
    want = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    sampling = [want, want, plain, want]
    _, outs = run(engine, prompts, sampling)
    assert outs["r2"].prompt_logprobs is None
    for i in (0, 1, 3):
        got = outs[f"r{i}"].prompt_logprobs
        assert [e.token_id for e in got] == prompts[i][1:]
        expected = reference_logprobs(ref, prompts[i])
        assert torch.allclose(torch.tensor([e.logprob for e in got]), expected, atol=TOLERANCE)
        for e, row in zip(got, torch.log_softmax(ref(torch.tensor([prompts[i]])).logits[0, :-1].float(), -1)):
            vals, ids = torch.topk(row.detach(), 2)
            assert [t for t, _ in e.top] == ids.tolist()
            assert torch.allclose(torch.tensor([v for _, v in e.top]), vals, atol=TOLERANCE)


def test_prefix_cache_is_skipped_for_prompt_logprobs(tiny_model):
    model, ref, _ = tiny_model
    engine = make_engine(model)  # block size 4, prefix caching on
    prompt = prompts_of([18], model.config.vocab_size, seed=4)[0]
    run(engine, [prompt], [SamplingParams(max_tokens=1, temperature=0.0)])
    seqs, outs = run(engine, [prompt], [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)])
    assert seqs[0].num_cached_tokens == 0
    got = torch.tensor([e.logprob for e in outs["r0"].prompt_logprobs])
    assert torch.allclose(got, reference_logprobs(ref, prompt), atol=TOLERANCE)
    # without prompt logprobs the same prompt does hit the cache
    seqs, _ = run(engine, [prompt], [SamplingParams(max_tokens=1, temperature=0.0)])
    assert seqs[0].num_cached_tokens == 16


def test_decode_prefilling_a_prompt_itself_skips_its_prefix_cache(tiny_model):
    """A decode worker admitting a request routed straight to it (no KV from prefill) with its
    prefix cached locally still computes every position."""
    model, ref, _ = tiny_model
    engine = make_engine(model)
    prompt = prompts_of([13], model.config.vocab_size, seed=5)[0]
    seqs, _ = run(engine, [prompt], [SamplingParams(max_tokens=1, temperature=0.0)])
    hashes = seqs[0].block_hashes[:3]
    seq = engine.admit_with_kv("d0", prompt, [], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                               hashes, [], None)
    assert seq.num_computed_tokens == 0
    outs = [o for o in engine.step() if o.request_id == "d0"]
    while not outs:
        outs = [o for o in engine.step() if o.request_id == "d0"]
    got = torch.tensor([e.logprob for e in outs[0].prompt_logprobs])
    assert torch.allclose(got, reference_logprobs(ref, prompt), atol=TOLERANCE)
