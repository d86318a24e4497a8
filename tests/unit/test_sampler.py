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


def _top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus rule written the plain way: sort everything, keep the prefix whose mass
    before each token is under top_p."""
    sorted_probs, order = torch.sort(probs, descending=True)
    drop = (torch.cumsum(sorted_probs, -1) - sorted_probs) >= top_p
    drop[0] = False
    return probs.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), 0.0)


def test_top_p_through_topk_keeps_the_same_tokens_as_a_full_sort():
    """The nucleus is searched among the top 64 / 512 / 4096 tokens before sorting the whole
    row: peaked rows (found in the top 64), middling and flat ones (a full sort) must keep
    exactly the tokens the plain rule keeps."""
    from engine.sampler import _top_p

    gen = torch.Generator().manual_seed(3)
    for scale in (0.3, 2.0, 5.0, 12.0):
        for top_p in (0.05, 0.5, 0.9, 0.99):
            probs = torch.softmax(torch.randn(5000, generator=gen) * scale, -1)
            got, ref = _top_p(probs, top_p), _top_p_by_full_sort(probs, top_p)
            assert torch.equal(got > 0, ref > 0), (scale, top_p, int((got > 0).sum()), int((ref > 0).sum()))
            assert torch.equal(got[got > 0], probs[got > 0])


def test_a_seeded_filtered_row_draws_the_same_token_in_any_batch():
    """Rows with top-k, top-p and min-p go through the per-row filter, the others through the
    batched softmax: a seeded row's token must not depend on which other rows share its step."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen) * 3
    params = [dict(temperature=0.8, top_p=0.9, seed=1), dict(temperature=1.3, seed=2),
              dict(temperature=0.5, top_k=20, seed=3), dict(temperature=1.0, min_p=0.05, seed=4),
              dict(temperature=0.0), dict(temperature=0.7, top_k=50, top_p=0.8, seed=6)]
    together = sample(logits, [row(**p, output=[1] * i) for i, p in enumerate(params)])[0]
    alone = [sample(logits[i:i + 1], [row(**p, output=[1] * i)])[0][0] for i, p in enumerate(params)]
    assert together == alone
    # and a permuted batch gives each row its own token again
    perm = [3, 0, 5, 1, 4, 2]
    permuted = sample(logits[perm], [row(**params[i], output=[1] * i) for i in perm])[0]
    assert permuted == [together[i] for i in perm]


def test_sampling_with_top_p_follows_the_renormalised_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = torch.zeros(4)
    for s in range(3000):
        counts[sample(torch.log(probs)[None], [row(temperature=1.0, top_p=0.7, seed=s)])[0][0]] += 1
    # the nucleus of 0.7 is {0.5, 0.3} (the mass before 0.15 is 0.8 >= 0.7): renormalised 5/8, 3/8
    assert counts[2] == counts[3] == 0
    assert torch.allclose(counts[:2] / 3000, torch.tensor([0.625, 0.375]), atol=0.04)


def test_a_row_without_finite_mass_draws_its_argmax_not_the_last_token():
    """A +inf logit (a float16 overflow) or a row of -inf makes the probabilities NaN: the draw
    falls back to the row's argmax, as a greedy row would pick, not to the vocabulary's last id."""
    logits = torch.tensor([[0.0, float("inf"), 1.0], [float("-inf")] * 3, [0.0, 1.0, 2.0]])
    ids, _ = sample(logits, [row(temperature=1.0, seed=1)] * 3)
    assert ids[0] == 1 and ids[1] == 0 and ids[2] in (0, 1, 2)


def test_penalties_and_bias_run_on_the_logits_device():
    """The bias, repetition and presence tensors are made on the logits' device (a GPU's logits
    met CPU index tensors before); checked here with a device the CPU build has: meta."""
    logits = torch.empty(1, 8, device="meta")
    out = apply_penalties(logits, [row(logit_bias={3: 1.0}, repetition_penalty=1.5, presence_penalty=0.5,
                                       prompt=[1, 2], output=[2, 5])])
    assert out.device.type == "meta"
