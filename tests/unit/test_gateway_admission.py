"""Gateway admission against a fake pipeline: API keys, the in-flight and backlog limits, and
the per-key token rate limit with its reservations (in process; the shared Redis limits have
tests of their own in test_shared_limits.py and test_tenant_gateway.py)."""

from __future__ import annotations

import asyncio
import time

from services.gateway.openai_models import TokenizeRequest
from services.gateway.tenancy.keys import hash_key
from tests.unit.test_gateway import BODY, client_for, make, run, texts


def test_api_keys(tiny_model_dir):
    app, fake = make(tiny_model_dir, lambda task: texts(task.meta.request_id, ["ok"]), api_keys="k1,k2")

    async def go():
        async with client_for(app) as c:
            none = await c.post("/v1/chat/completions", json=BODY)
            wrong = await c.post("/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer nope"})
            ok1 = await c.post("/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer k1"})
            ok2 = await c.post("/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer k2"})
            models = await c.get("/v1/models")
            return none, wrong, ok1, ok2, models

    none, wrong, ok1, ok2, models = run(go())
    assert none.status_code == wrong.status_code == models.status_code == 401
    assert none.json()["error"]["type"] == "authentication_error"
    assert ok1.status_code == ok2.status_code == 200
    salts = {t.meta.cache_salt for t in fake.submitted}
    assert len(salts) == 2  # each key has its own prefix cache


def test_inflight_limit_and_backlog_give_429_with_retry_after(tiny_model_dir):
    app, fake = make(tiny_model_dir, lambda task: texts(task.meta.request_id, ["slow"], gap=0.5),
                     max_inflight_requests=1)

    async def go():
        async with client_for(app) as c:
            first = asyncio.create_task(c.post("/v1/chat/completions", json=BODY))
            await asyncio.sleep(0.1)
            second = await c.post("/v1/chat/completions", json=BODY)
            fake.queued = 10_000
            await first
            third = await c.post("/v1/chat/completions", json=BODY)
            return (await first), second, third

    first, second, third = run(go())
    assert first.status_code == 200
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert third.status_code == 429 and "queued" in third.json()["error"]["message"]


def test_token_rate_limit_per_key(tiny_model_dir):
    app, _ = make(tiny_model_dir, lambda task: texts(task.meta.request_id, ["a", "b", "c"]), api_keys="k1,k2",
                  rate_limit_tokens_per_minute=6)

    async def go():
        async with client_for(app) as c:
            h1, h2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
            a = await c.post("/v1/chat/completions", json=BODY, headers=h1)  # spends 5 + 3 = 8 > 6
            b = await c.post("/v1/chat/completions", json=BODY, headers=h1)
            other = await c.post("/v1/chat/completions", json=BODY, headers=h2)
            return a, b, other

    a, b, other = run(go())
    assert a.status_code == 200
    assert b.status_code == 429 and b.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(b.headers["retry-after"]) >= 1
    assert other.status_code == 200



def test_rate_limit_reserves_max_tokens_so_a_burst_cannot_overspend(tiny_model_dir):
    probe, _ = make(tiny_model_dir, lambda task: None)
    chat = probe.state.gateway.tokenize(TokenizeRequest(model="tiny-llama", messages=BODY["messages"]))
    size = chat["count"] + 30  # a request reserves its prompt and its max_tokens
    limit = 3 * size + size // 2
    app, fake = make(tiny_model_dir, lambda task: texts(task.meta.request_id, ["a", "b"], gap=0.3), api_keys="k1",
                     rate_limit_tokens_per_minute=limit)

    async def go():
        async with client_for(app) as c:
            h = {"Authorization": "Bearer k1"}
            burst = [c.post("/v1/chat/completions", json={**BODY, "max_tokens": 30}, headers=h) for _ in range(6)]
            return await asyncio.gather(*burst), await app.state.gateway.admission.drain()

    started = time.monotonic()
    codes = sorted(r.status_code for r in run(go())[0])
    elapsed = time.monotonic() - started
    # the bucket holds three reservations, not six
    assert codes == [200, 200, 200, 429, 429, 429]
    # what was not used went back: 3 × (5 prompt + 2 completion) spent, plus the refill of the
    # time it took (limit per minute), bounded by measuring that time
    bucket = app.state.gateway.admission.limits.local.bucket(f"key-{hash_key('k1')[:8]}", "tokens", limit, 60.0)
    spent = limit - 3 * 7
    assert spent - 1e-6 <= bucket.level <= min(limit, spent + elapsed * limit / 60) + 1e-6, (bucket.level, elapsed)
