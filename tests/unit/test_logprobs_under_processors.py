"""Reported logprobs under everything that changes sampling (README, "Evaluating with
lm-evaluation-harness"): with ``logit_bias``, presence/frequency/repetition penalties and a
grammar, each sampled token's logprob and its top alternatives are still the model's own
distribution (log-softmax of the raw logits), checked against transformers' forward pass over
the same tokens. Each case also checks that the processing did change what was sampled, so the
raw values are not the processed ones by accident."""

from __future__ import annotations

import pytest
import torch

from shared.messages import SamplingParams
from shared.structured import schema_grammar
from tests.unit.test_engine_vs_transformers import make_engine, prompts_of
from tests.unit.test_grammar import SCHEMA

#: float32 on both sides; the engine's attention sums in another order than transformers' eager
TOLERANCE = 1e-4
MAX_TOKENS = 12


def raw_logprobs(ref, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), vocab]``: log-softmax of the raw logits that predicted each output token."""
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)], dim=-1)


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_model_dir):
    eng = make_engine(tiny_model[0], num_kv_blocks=512)
    eng.grammar.folder = tiny_model_dir
    return eng


def cases(vocab: int, prompt: list[int]) -> dict[str, SamplingParams]:
    base = dict(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True)
    return {
        "logit_bias": SamplingParams(**base, logit_bias={prompt[0]: 6.0, (prompt[0] + 7) % vocab: 6.0}),
        "penalties": SamplingParams(**base, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.8),
        "grammar": SamplingParams(**{**base, "ignore_eos": False, "max_tokens": 60},
                                  grammar=schema_grammar(SCHEMA, "response_format")),
    }


@pytest.mark.parametrize("case", ["logit_bias", "penalties", "grammar"])
def test_logprobs_are_the_raw_distribution_whatever_changed_the_sampling(engine, tiny_model, case):
    model, ref, tok = tiny_model
    prompt = prompts_of([9], model.config.vocab_size, seed=11)[0] if case != "grammar" else tok.encode("Hello world")
    plain = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    seq = engine.generate([prompt], cases(model.config.vocab_size, prompt)[case])[0]
    output = list(seq.output_token_ids)
    assert output[:MAX_TOKENS] != list(plain.output_token_ids)[:len(output)], case  # the processing mattered
    expected = raw_logprobs(ref, prompt, output)
    assert len(seq.output_logprobs) == len(output)
    flipped = 0
    for i, (token, entry, row) in enumerate(zip(output, seq.output_logprobs, expected)):
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < TOLERANCE, (case, i, entry.logprob, row[token].item())
        vals, ids = torch.topk(row, 2)
        assert [t for t, _ in entry.top] == ids.tolist(), (case, i)
        assert torch.allclose(torch.tensor([v for _, v in entry.top]), vals, atol=TOLERANCE)
        flipped += token != ids[0].item()
    # somewhere the processed choice was not the raw argmax: its logprob is below the top one
    assert flipped > 0, case
