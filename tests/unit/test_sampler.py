"""Sampling semantics: greedy, filters, penalties, logprobs and per-token seeding."""

from __future__ import annotations

import math

import torch

from engine.sampler import SamplingRow, apply_penalties, sample, step_seed
from shared.messages import SamplingParams


def row(**kw) -> SamplingRow:
    out = kw.pop("output", [])
    prompt = kw.pop("prompt", [])
    return SamplingRow(SamplingParams(max_tokens=5, **kw), prompt, out)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    ids, lps = sample(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert ids == [1, 0] and lps == [None, None]


def test_top_k_one_and_tiny_top_p_are_greedy_whatever_the_seed():
    logits = torch.randn(1, 50)
    best = int(logits.argmax())
    for seed in range(20):
        assert sample(logits, [row(temperature=1.0, top_k=1, seed=seed)])[0] == [best]
        assert sample(logits, [row(temperature=1.0, top_p=1e-6, seed=seed)])[0] == [best]


def test_extreme_temperature_and_top_p_stay_greedy_not_garbage():
    """A temperature that overflows the division, or a top_p that is 0 in float32, must not
    turn every token into id 0."""
    logits = torch.randn(2, 50) * 10
    best = logits.argmax(dim=-1).tolist()
    for seed in range(5):
        assert sample(logits, [row(temperature=1e-40, seed=seed), row(temperature=5e-324, seed=seed)])[0] == best
        assert sample(logits, [row(temperature=1.0, top_p=1e-300, seed=seed)] * 2)[0] == best


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.35, 0.05]]))
    seen = {sample(logits, [row(temperature=1.0, min_p=0.2, seed=s)])[0][0] for s in range(200)}
    assert seen == {0, 1}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    counts = torch.zeros(3)
    for s in range(3000):
        counts[sample(torch.log(probs)[None], [row(temperature=1.0, seed=s)])[0][0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.04)


def test_seed_depends_on_seed_and_index_only():
    logits = torch.randn(1, 100)
    a = sample(logits, [row(temperature=1.0, seed=7, output=[1, 2])])[0]
    b = sample(torch.cat([torch.randn(2, 100), logits]), [row(temperature=0.5, seed=1), row(temperature=0.0),
                                                           row(temperature=1.0, seed=7, output=[9, 9])])[0][2]
    assert a == [b]
    assert len({step_seed(7, 2), step_seed(7, 3), step_seed(8, 2), step_seed(8, 3)}) == 4


def test_penalties_and_logit_bias():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    out = apply_penalties(logits.clone(), [row(repetition_penalty=2.0, prompt=[0, 1])])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.0]]
    out = apply_penalties(logits.clone(), [row(presence_penalty=0.5, frequency_penalty=0.25, output=[2, 2, 3])])
    assert out.tolist() == [[2.0, -2.0, 1.0 - 0.5 - 0.5, 0.0 - 0.5 - 0.25]]
    out = apply_penalties(logits.clone(), [row(logit_bias={3: 100.0})])
    assert out[0, 3] == 100.0
    assert sample(logits, [row(temperature=0.0, logit_bias={3: 100.0})])[0] == [3]


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    (tok,), (lp,) = sample(logits, [row(temperature=0.0, logprobs=2)])
    ref = torch.log_softmax(logits, -1)[0]
    assert tok == 2 and math.isclose(lp.logprob, float(ref[2]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [2, 1]
