"""``echo`` + ``logprobs`` on /v1/completions through the tiny-model pipeline: the prompt's
logprobs (computed in prefill) against transformers' own forward pass on the same float32
weights, in the OpenAI completions shape; ``max_tokens: 0``; token-id prompts in a batch (what
lm-evaluation-harness sends); a warm prefix cache; streaming."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.test_pipeline import error_of, read_sse

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-llama"
#: float32 on both sides; paged attention and the eager reference sum in different orders
TOLERANCE = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."


def reference(tiny_model, ids: list[int]) -> tuple[list[float], list[int]]:
    """(log P(ids[i] | ids[:i]) for i >= 1, the argmax token after each prefix)."""
    _, ref, _ = tiny_model
    with torch.inference_mode():
        logprobs = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), logprobs.argmax(-1).tolist()


def check_prompt_part(lp: dict, tiny_model, ids: list[int], k: int = 1) -> None:
    _, _, tok = tiny_model
    expected, _ = reference(tiny_model, ids)
    n = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][:n] == [tok.decode([t]) for t in ids]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:n]), torch.tensor(expected), atol=TOLERANCE)
    assert lp["text_offset"][:n] == [len("".join(lp["tokens"][:i])) for i in range(n)]
    for value, top in zip(lp["token_logprobs"][1:n], lp["top_logprobs"][1:n]):
        assert (len(top) >= 1 and max(top.values()) >= value - TOLERANCE) if k else top == {}


def test_echo_logprobs_match_transformers(client, tiny_model):
    _, _, tok = tiny_model
    ids = tok.encode(PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    first = client.post("/v1/completions", json=body).json()
    choice = first["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
    check_prompt_part(lp, tiny_model, ids)
    _, greedy = reference(tiny_model, ids)
    assert lp["tokens"][-1] == tok.decode([greedy[-1]])
    # the same prompt again: its blocks are in the prefix cache now, which must not be used
    again = client.post("/v1/completions", json=body).json()
    assert again["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]


def test_max_tokens_zero_and_token_id_batches(client, tiny_model):
    _, _, tok = tiny_model
    prompts = [tok.encode("Hello world! How are you today?"), tok.encode("def add(a, b):\n    return a + b")]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}
    resp = client.post("/v1/completions", json=body).json()
    choices = sorted(resp["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices):
        assert choice["text"] == tok.decode(ids)
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        # two alternatives, unless both render as the same text (partial UTF-8 bytes: one dict key)
        assert all(1 <= len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
        check_prompt_part(choice["logprobs"], tiny_model, ids, k=2)
    assert resp["usage"]["completion_tokens"] == 0
    assert resp["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    error_of(client.post("/v1/completions", json={**body, "echo": False}), 400)
    # echo without logprobs: the prompt alone too, nothing generated
    plain = client.post("/v1/completions", json={k: v for k, v in body.items() if k != "logprobs"}).json()
    assert [c["text"] for c in sorted(plain["choices"], key=lambda c: c["index"])] == [tok.decode(p) for p in prompts]
    assert plain["usage"]["completion_tokens"] == 0


def test_echo_logprobs_streamed(client, tiny_model):
    _, _, tok = tiny_model
    ids = tok.encode(PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as resp:
        chunks = [json.loads(p) for p in read_sse(resp)[:-1]]
    with_logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    check_prompt_part(with_logprobs[0], tiny_model, ids, k=0)
    outputs = sum(len(lp["tokens"]) for lp in with_logprobs) - len(ids)
    assert outputs == 4
    whole = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
