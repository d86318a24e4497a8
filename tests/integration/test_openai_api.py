"""OpenAI API fidelity on the tiny-model pipeline: the official client (sync and async,
streamed and not), and every parameter either honoured or rejected with a 400."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.integration.test_pipeline import (
    chat_body,
    error_of,
    greedy_reference,
    read_sse,
    reference_text,
    stream_chat,
)

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def oai(pipeline):
    return openai.OpenAI(base_url=f"{pipeline.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aoai(pipeline):
    return openai.AsyncOpenAI(base_url=f"{pipeline.url}/v1", api_key="unused", max_retries=0)


def msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_official_client_sync_streamed_and_not(oai, tiny_model):
    expected, gen, n_prompt = reference_text(tiny_model, "Hello there", 12)
    resp = oai.chat.completions.create(model=MODEL, messages=msgs("Hello there"), max_tokens=12, temperature=0)
    assert resp.choices[0].message.content == expected
    assert resp.usage.prompt_tokens == n_prompt and resp.usage.completion_tokens == len(gen)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs("Hello there"), max_tokens=12,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    comp = oai.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0)
    want, want_ids, n_prompt = reference_completion(tiny_model, "The quick brown fox", 5)
    assert comp.object == "text_completion" and comp.choices[0].text == want
    assert comp.usage.prompt_tokens == n_prompt and comp.usage.completion_tokens == len(want_ids)


def reference_completion(tiny_model, prompt: str, max_tokens: int) -> tuple[str, list[int], int]:
    """:func:`greedy_reference` for a raw prompt, encoded as /v1/completions encodes it (with the
    tokenizer's special tokens)."""
    return greedy_reference(tiny_model, tiny_model[2].encode(prompt), max_tokens)


def test_official_client_async_streamed_and_not(aoai, tiny_model):
    expected, _, _ = reference_text(tiny_model, "What is the capital of France?", 10)

    async def run():
        whole = await aoai.chat.completions.create(model=MODEL, messages=msgs("What is the capital of France?"),
                                                   max_tokens=10, temperature=0)
        stream = await aoai.chat.completions.create(model=MODEL, messages=msgs("What is the capital of France?"),
                                                    max_tokens=10, temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(run())
    assert whole == streamed == expected


def test_client_errors_are_typed(oai):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=msgs("hi"), max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=msgs("hi"), max_tokens=2, temperature=9)
    assert info.value.body["param"] == "temperature"


def test_n_choices_have_indices_streamed_and_not(client):
    body = chat_body("Hello there", max_tokens=8, temperature=1.0, seed=7, n=3)
    whole = client.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in whole["choices"]]
    assert len(set(texts)) > 1  # seed + k per choice: different samples
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        chunks = [json.loads(p) for p in read_sse(resp)[:-1]]
    streamed = {0: "", 1: "", 2: ""}
    finished = set()
    for ch in chunks:
        for choice in ch["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert finished == {0, 1, 2}
    assert [streamed[i] for i in range(3)] == texts
    assert whole["usage"]["prompt_tokens"] == client.post("/v1/chat/completions", json={**body, "n": 1}).json()["usage"]["prompt_tokens"]


def test_include_usage_chunk_is_last_with_empty_choices(client):
    # ignore_eos: exactly six tokens, so the usage chunk's count is known
    body = chat_body("Hello there", max_tokens=6, stream=True, stream_options={"include_usage": True},
                     ignore_eos=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        payloads = read_sse(resp)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    error_of(client.post("/v1/chat/completions", json={**body, "stream": False}), 400)


def test_logprobs_chat_and_completions(client):
    # ignore_eos: the text ends at max_tokens, never at an EOS whose bytes the content leaves out
    body = client.post("/v1/chat/completions", json=chat_body("Hello there", max_tokens=6, logprobs=True,
                                                              top_logprobs=3, ignore_eos=True)).json()
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6  # greedy picks the top one
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    raw = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace")
    assert choice["finish_reason"] == "length"
    assert raw.replace("<|im_end|>", "") == choice["message"]["content"]
    comp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                "logprobs": 2}).json()
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0
    error_of(client.post("/v1/chat/completions", json=chat_body("hi", top_logprobs=2)), 400)


def test_completions_prompt_forms_echo_and_indices(client, tiny_model):
    _, _, tok = tiny_model
    ids = tok.encode("The quick brown fox")
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    by_text = client.post("/v1/completions", json={**base, "prompt": "The quick brown fox"}).json()
    by_ids = client.post("/v1/completions", json={**base, "prompt": ids}).json()
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    multi = client.post("/v1/completions", json={**base, "prompt": ["Hello", "The quick brown fox"], "n": 2}).json()
    assert [c["index"] for c in multi["choices"]] == [0, 1, 2, 3]
    assert multi["choices"][2]["text"] == by_text["choices"][0]["text"]  # greedy: both choices of a prompt agree
    echo = client.post("/v1/completions", json={**base, "prompt": "The quick brown fox", "echo": True}).json()
    assert echo["choices"][0]["text"] == "The quick brown fox" + by_text["choices"][0]["text"]
    echo_ids = client.post("/v1/completions", json={**base, "prompt": ids, "echo": True}).json()
    assert echo_ids["choices"][0]["text"] == echo["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**base, "prompt": "The quick brown fox", "echo": True,
                                                        "stream": True}) as resp:
        chunks = [json.loads(p) for p in read_sse(resp)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == echo["choices"][0]["text"]
    # max_tokens 0 is for echo only (prompt logprobs: tests/integration/test_prompt_logprobs_api.py)
    error_of(client.post("/v1/completions", json={**base, "prompt": "x", "max_tokens": 0}), 400)
    error_of(client.post("/v1/completions", json={**base, "prompt": [10**7]}), 400)
    assert error_of(client.post("/v1/completions", json={**base, "prompt": "x", "n": 2, "best_of": 1}),
                    400)["param"] == "best_of"


def test_penalties_bias_and_max_completion_tokens_change_the_output(client):
    base = chat_body("Numbers: 0 1 2 3", max_tokens=16, ignore_eos=True)
    plain = client.post("/v1/chat/completions", json=base).json()
    assert plain["usage"]["completion_tokens"] == 16
    lp = client.post("/v1/chat/completions", json={**base, "logprobs": True}).json()
    first = lp["choices"][0]["logprobs"]["content"][0]["bytes"]
    penal = client.post("/v1/chat/completions", json={**base, "frequency_penalty": 2.0, "presence_penalty": 2.0}).json()
    rep = client.post("/v1/chat/completions", json={**base, "repetition_penalty": 5.0}).json()
    assert penal["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]
    assert rep["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]
    # a +100 bias on one token makes it the only output
    token_id = client.post("/tokenize", json={"model": MODEL, "prompt": "fox", "add_special_tokens": False}).json()["tokens"][0]
    biased = client.post("/v1/chat/completions", json={**base, "logit_bias": {str(token_id): 100}, "max_tokens": 5}).json()
    assert biased["choices"][0]["message"]["content"] == client.post(
        "/detokenize", json={"model": MODEL, "tokens": [token_id] * 5}).json()["prompt"]
    short = client.post("/v1/chat/completions", json={**{k: v for k, v in base.items() if k != "max_tokens"},
                                                      "max_completion_tokens": 3}).json()
    assert short["usage"]["completion_tokens"] == 3 and short["choices"][0]["finish_reason"] == "length"
    # asking for logprobs does not change the output, and every token has its entry (also those
    # whose bytes end an incomplete UTF-8 sequence and show no text yet)
    assert lp["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert len(lp["choices"][0]["logprobs"]["content"]) == plain["usage"]["completion_tokens"]
    assert first  # the first entry carries its token's bytes


def test_stop_token_ids_end_the_text_without_appearing_in_it(client):
    token_id = client.post("/tokenize", json={"model": MODEL, "prompt": "fox", "add_special_tokens": False}).json()["tokens"][0]
    word = client.post("/detokenize", json={"model": MODEL, "tokens": [token_id]}).json()["prompt"]
    # a +100 bias makes the token the only output; as a stop token it ends the text at once
    body = {**chat_body("Numbers: 0 1 2 3", max_tokens=5, ignore_eos=True), "logit_bias": {str(token_id): 100},
            "stop_token_ids": [token_id]}
    hidden = client.post("/v1/chat/completions", json=body).json()
    assert hidden["choices"][0]["message"]["content"] == ""
    assert hidden["choices"][0]["finish_reason"] == "stop" and hidden["usage"]["completion_tokens"] == 1
    shown = client.post("/v1/chat/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert shown["choices"][0]["message"]["content"] == word
    streamed, finish, _ = stream_chat(client, {**body, "stream": True})
    assert (streamed, finish) == ("", "stop")


def test_top_k_one_is_greedy_and_seed_is_batch_invariant(client, pipeline):
    greedy = client.post("/v1/chat/completions", json=chat_body("Hello there", max_tokens=10)).json()
    topk = client.post("/v1/chat/completions", json={**chat_body("Hello there", max_tokens=10), "temperature": 1.0,
                                                     "top_k": 1}).json()
    assert topk["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    seeded = {**chat_body("Tell me about rivers", max_tokens=12), "temperature": 1.0, "seed": 99}
    alone = client.post("/v1/chat/completions", json=seeded).json()["choices"][0]["message"]["content"]

    async def crowd():
        async with httpx.AsyncClient(base_url=pipeline.url, timeout=120) as c:
            others = [c.post("/v1/chat/completions", json={**chat_body(f"noise {i} " * (i + 1), max_tokens=12),
                                                           "temperature": 1.0}) for i in range(5)]
            results = await asyncio.gather(c.post("/v1/chat/completions", json=seeded), *others)
            return results[0].json()["choices"][0]["message"]["content"]

    assert asyncio.run(crowd()) == alone


def test_tokenize_and_detokenize(client):
    tok = client.post("/tokenize", json={"model": MODEL, "prompt": "café 😀", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 1024
    assert client.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()["prompt"] == "café 😀"
    chat = client.post("/tokenize", json={"model": MODEL, "messages": msgs("Hello there")}).json()
    usage = client.post("/v1/chat/completions", json=chat_body("Hello there", max_tokens=1)).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    error_of(client.post("/tokenize", json={"model": MODEL}), 400)
    error_of(client.post("/detokenize", json={"model": MODEL, "tokens": [-1]}), 400)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"store": True}, "store"),
    ({"n": 0}, "n"),
    ({"n": 100}, "n"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": "x"}, "seed"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),  # a tool message needs tool_call_id
    ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
])
def test_unsupported_or_invalid_parameters_are_400(client, extra, param):
    err = error_of(client.post("/v1/chat/completions", json={**chat_body("hi", max_tokens=2), **extra}), 400)
    assert err["param"] == param


def test_accepted_spellings_of_off(client):
    ok = {"response_format": {"type": "text"}, "tool_choice": "none", "store": False, "service_tier": "auto",
          "top_k": -1, "user": "someone",
          "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                       {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]}
    resp = client.post("/v1/chat/completions", json={**chat_body("x", max_tokens=2), **ok})
    assert resp.status_code == 200, resp.text
