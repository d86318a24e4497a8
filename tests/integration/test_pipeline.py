"""The whole pipeline on a tiny model: five OS processes over real NATS, KV through the
shared-memory store, HTTP and SSE at the gateway."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import torch

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    "Hello there",
    "What is the capital of France?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 and a much longer prompt that spans several KV blocks",
    "café naïve résumé",
]


def greedy_reference(tiny_model, ids: list[int], max_tokens: int) -> tuple[str, list[int], int]:
    """(text, token ids, prompt tokens) of transformers' greedy generate after prompt ``ids``."""
    _, ref, tok = tiny_model
    eos = ref.generation_config.eos_token_id
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    gen = out[0, len(ids):].tolist()
    return tok.decode(gen, skip_special_tokens=True), gen, len(ids)


def reference_text(tiny_model, content: str, max_tokens: int) -> tuple[str, list[int], int]:
    """:func:`greedy_reference` for a chat prompt (the chat template applied)."""
    tok = tiny_model[2]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return greedy_reference(tiny_model, tok.encode(text, add_special_tokens=False), max_tokens)


def chat_body(content: str, **kw) -> dict:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": content}], "temperature": 0}
    body.update(kw)
    return body


def read_sse(resp: httpx.Response) -> list[str]:
    """The data payloads of an SSE response, checking the framing byte by byte."""
    raw = b"".join(resp.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    payloads = []
    for event in events[:-1]:
        if event.startswith(b":"):
            continue  # keep-alive comment
        assert event.startswith(b"data: "), event[:80]
        assert b"\n" not in event, "one data line per event"
        payloads.append(event[len(b"data: "):].decode())
    return payloads


def stream_chat(client, body) -> tuple[str, str, list[dict]]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        payloads = read_sse(resp)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["id"] == chunks[0]["id"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks]
    assert all(f is None for f in finish[:-1]) and finish[-1] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return text, finish[-1], chunks


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-llama"
    assert client.get("/health").status_code == 200
    ready = client.get("/health/ready").json()
    assert ready["status"] == "ready" and all(ready["workers"][s] == 1 for s in ("tokenizer", "prefill", "decode", "postfilter"))


@pytest.mark.parametrize("content", PROMPTS)
def test_greedy_stream_equals_generate_and_non_stream(client, tiny_model, content):
    expected, gen_ids, num_prompt = reference_text(tiny_model, content, 24)
    streamed, finish, _ = stream_chat(client, chat_body(content, max_tokens=24))
    assert streamed == expected
    resp = client.post("/v1/chat/completions", json=chat_body(content, max_tokens=24))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected, "refusal": None}
    assert body["choices"][0]["finish_reason"] == finish
    assert body["usage"]["prompt_tokens"] == num_prompt
    assert body["usage"]["completion_tokens"] == len(gen_ids)
    assert body["usage"]["total_tokens"] == num_prompt + len(gen_ids)


def test_completions_endpoint(client, tiny_model):
    _, ref, tok = tiny_model
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, eos_token_id=ref.generation_config.eos_token_id,
                           pad_token_id=ref.generation_config.eos_token_id)
    expected = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    body = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 10,
                                                "temperature": 0}).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected
    assert body["usage"]["prompt_tokens"] == len(ids)
    with client.stream("POST", "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 10,
                                                        "temperature": 0, "stream": True}) as resp:
        payloads = read_sse(resp)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected


def test_stop_string_never_leaks(client, tiny_model):
    expected, _, _ = reference_text(tiny_model, PROMPTS[1], 24)
    # a stop string from the middle of the known output: two characters that span tokens or not
    cut = len(expected) // 2
    stop = expected[cut : cut + 2]
    assert stop.strip(), expected
    first = expected.find(stop)
    streamed, finish, _ = stream_chat(client, chat_body(PROMPTS[1], max_tokens=24, stop=[stop, "\x00never"]))
    assert finish == "stop"
    assert streamed == expected[:first]
    body = client.post("/v1/chat/completions", json=chat_body(PROMPTS[1], max_tokens=24, stop=stop)).json()
    assert body["choices"][0]["message"]["content"] == expected[:first]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_sampling_with_seed_is_reproducible(client):
    body = chat_body(PROMPTS[0], max_tokens=16, temperature=1.0, top_p=0.9, seed=42)
    a = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    b = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    streamed, _, _ = stream_chat(client, body)
    assert a == b == streamed
    c = client.post("/v1/chat/completions", json={**body, "seed": 43}).json()["choices"][0]["message"]["content"]
    assert c != a


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


def test_bad_input_gets_openai_errors_and_server_keeps_serving(client):
    err = error_of(client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    err = error_of(client.post("/v1/chat/completions", content=b"\xff\xfe", headers={"content-type": "application/json"}), 400)
    assert "UTF-8" in err["message"]
    err = error_of(client.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": []}), 400)
    assert err["param"] == "messages"
    err = error_of(client.post("/v1/chat/completions", json={"model": "tiny-llama"}), 400)
    assert err["param"] == "messages"
    err = error_of(client.post("/v1/chat/completions", json=chat_body("hi", model="gpt-17")), 404)
    assert err["code"] == "model_not_found"
    for bad in (0, -5):
        err = error_of(client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=bad)), 400)
        assert err["param"] == "max_tokens"
    err = error_of(client.post("/v1/chat/completions", json=chat_body("hi", temperature=7)), 400)
    assert err["param"] == "temperature"
    # prompt longer than the context (the tiny model has 1024 positions)
    long_prompt = "word " * 1500
    err = error_of(client.post("/v1/chat/completions", json=chat_body(long_prompt, max_tokens=10)), 400)
    assert err["code"] == "context_length_exceeded"
    err = error_of(client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=5000)), 400)
    assert err["code"] == "context_length_exceeded" and "5000" in err["message"] and "1024" in err["message"]
    # the same errors before streaming, as real statuses
    resp = client.post("/v1/chat/completions", json=chat_body(long_prompt, max_tokens=10, stream=True))
    assert error_of(resp, 400)["code"] == "context_length_exceeded"
    err = error_of(client.post("/v1/chat/completions", json=chat_body("hi", tools=[{"type": "function"}])), 400)
    assert err["param"] == "tools[0].function"  # a tool without its function
    err = error_of(client.post("/v1/chat/completions", json=chat_body("hi", frobnicate=1)), 400)
    assert err["param"] == "frobnicate"
    error_of(client.get("/v1/nothing-here"), 404)
    error_of(client.post("/v1/chat/completions", content=b"x" * (5 << 20), headers={"content-type": "application/json"}), 413)
    # still serving
    assert client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=3)).status_code == 200


def test_kv_handoff_leaves_no_request_scoped_kv(client, pipeline):
    from shared.config import Settings
    from shared.kv import TAIL, open_store

    body = client.post("/v1/chat/completions", json=chat_body(PROMPTS[2], max_tokens=8)).json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    env = {"PD_NAMESPACE": pipeline.settings.namespace}
    store = open_store(Settings.from_env(env))
    # full prompt blocks stay as the shared prefix cache; no tail remains once decode admitted
    assert store.list_keys("blk")
    deadline = time.monotonic() + 5
    while store.list_keys(TAIL) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.list_keys(TAIL) == []
    # a second identical request reuses the prefix: reported as cached tokens
    again = client.post("/v1/chat/completions", json=chat_body(PROMPTS[2], max_tokens=8)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"] == body["choices"][0]["message"]


def test_stuck_stage_gives_error_within_deadline(client, pipeline):
    decode = next(p for p in pipeline.procs if p.name.startswith("decode"))
    os.kill(decode.popen.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        # a stalled stream ends with the stall's timeout (504) or, once decode's heartbeats are
        # missed for PD_STAGE_DOWN_GRACE_S, the stage's absence (503); each with its own code
        codes = {504: "timeout", 503: "service_unavailable"}
        with client.stream("POST", "/v1/chat/completions", json=chat_body(PROMPTS[0], max_tokens=20, stream=True)) as resp:
            if resp.status_code == 200:
                payloads = read_sse(resp)
                assert payloads[-1] == "[DONE]", payloads
                err = json.loads(payloads[-2])["error"]
                assert err["code"] in codes.values(), err
            else:
                resp.read()
                assert resp.status_code in codes, resp.text
                assert error_of(resp, resp.status_code)["code"] == codes[resp.status_code]
        elapsed = time.monotonic() - started
        # ended by the stall timeout (20 s) or the stage-down grace (10 s after decode's
        # heartbeats stop), not by a later deadline (first token: 120 s, request: 600 s); the
        # upper bound is generous for a loaded machine and still catches a hang
        settings = pipeline.settings
        assert min(settings.stall_timeout_s, settings.stage_down_grace_s) <= elapsed < settings.first_token_timeout_s
    finally:
        os.kill(decode.popen.pid, signal.SIGCONT)
    # once the worker is back, serving resumes
    deadline = time.monotonic() + 20
    while client.get("/health/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    resp = client.post("/v1/chat/completions", json=chat_body(PROMPTS[0], max_tokens=4))
    assert resp.status_code == 200, resp.text
