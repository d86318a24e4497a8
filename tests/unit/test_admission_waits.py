"""Admission by predicted wait (``services/gateway/tenancy/waits.py``): heartbeats we control
say how much prompt work is queued and how fast it drains; a request that would queue longer
than PD_MAX_QUEUE_TIME_S, or pass its deadline, gets 503 with Retry-After; one key cannot take
the whole backlog from another."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.tenancy.waits import QueueFull, WaitAdmission
from shared.config import Settings
from shared.messages import (
    Accepted,
    ChatMessage,
    Heartbeat,
    RequestMeta,
    SamplingParams,
    TextChunk,
    TokenizeTask,
    Usage,
)
from tests.unit.test_gateway import BODY, client_for, make, run, texts


def hb(stage: str, instance: str, **fields) -> Heartbeat:
    return Heartbeat(stage=stage, instance_id=instance, model="tiny-llama", sent_at=time.time(), **fields)


def task(rid: str, chars: int = 0, token_ids: list[int] | None = None, timeout_s: float = 600.0) -> TokenizeTask:
    now = time.time()
    meta = RequestMeta(request_id=rid, reply_to="inbox", model="m", created_at=now, deadline_at=now + timeout_s)
    if token_ids is not None:
        return TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=8), prompt_token_ids=token_ids)
    return TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=8), prompt="x" * chars)


def waits(**settings) -> WaitAdmission:
    return WaitAdmission(Settings.from_env({}, **settings))


def test_predicted_wait_is_the_backlog_at_the_measured_rate():
    w = waits(max_queue_time_s=10.0)
    beats = {"prefill": [hb("prefill", "p1", prefill_tokens_per_s=500.0, queued_prefill_tokens=3000),
                         hb("prefill", "p2", prefill_tokens_per_s=500.0, queued_prefill_tokens=1000)],
             "decode": [hb("decode", "d1", decode_step_s=0.02, num_running=1, capacity=8)]}
    p = w.predict(prompt_tokens=250, output_tokens=50, heartbeats=beats)
    assert p.backlog_tokens == 4000 and p.rate_tokens_per_s == 1000.0
    assert p.prefill_queue_s == pytest.approx(4.0)
    assert p.decode_slot_s == 0.0  # a decode slot is free
    assert p.prefill_s == pytest.approx(0.5)  # one worker's rate
    assert p.decode_s == pytest.approx(1.0)
    # every decode slot taken: it also waits for one to free
    full = dict(beats, decode=[hb("decode", "d1", decode_step_s=0.02, num_running=8, capacity=8)])
    assert w.predict(250, 50, full).decode_slot_s > 0
    # other gateways' admitted prompts count when they exceed what the workers have pulled
    peers = dict(beats, gateway=[hb("gateway", "g2", queued_prefill_tokens=9000),
                                 hb("gateway", "me", queued_prefill_tokens=5000)])
    assert w.predict(250, 50, peers, own_instance="me").backlog_tokens == 9000


def test_refuses_past_the_queue_limit_with_retry_after_and_admits_when_it_drains():
    w = waits(max_queue_time_s=10.0)
    busy = {"prefill": [hb("prefill", "p1", prefill_tokens_per_s=1000.0, queued_prefill_tokens=40_000)]}
    with pytest.raises(QueueFull) as info:
        w.check("k", [task("r1", chars=300)], 16, busy)
    exc = info.value
    assert exc.status == 503 and exc.type == "overloaded" and exc.code == "queue_time_exceeded"
    assert exc.retry_after_s == pytest.approx(30.0, abs=1.0)  # 40 s predicted - 10 s allowed
    idle = {"prefill": [hb("prefill", "p1", prefill_tokens_per_s=1000.0, queued_prefill_tokens=0)]}
    tokens, p = w.check("k", [task("r2", chars=300)], 16, idle)
    assert tokens > 0 and p.queue_s < 1.0


def test_refuses_what_would_pass_its_deadline():
    w = waits(max_queue_time_s=0.0)  # no queue limit: only the deadline
    beats = {"prefill": [hb("prefill", "p1", prefill_tokens_per_s=1000.0, queued_prefill_tokens=8000)]}
    with pytest.raises(QueueFull) as info:
        w.check("k", [task("r1", token_ids=list(range(100)), timeout_s=5.0)], 16, beats)
    assert info.value.code == "deadline_unreachable" and info.value.retry_after_s >= 3.0
    w.check("k", [task("r2", token_ids=list(range(100)), timeout_s=30.0)], 16, beats)


def test_one_key_cannot_starve_another():
    """Key a floods; the backlog is saturated; key b still gets in, and a is held to its share."""
    w = waits(max_queue_time_s=10.0)
    beats = {"prefill": [hb("prefill", "p1", prefill_tokens_per_s=100.0)]}  # capacity 1000 tokens
    ids = list(range(150))
    admitted_a = 0
    for i in range(20):
        try:
            tokens, _ = w.check("a", [task(f"a{i}", token_ids=ids)], 8, beats)
        except QueueFull as exc:
            assert exc.code == "queue_time_exceeded"
            break
        w.admitted(f"a{i}", "a", tokens, 8)
        admitted_a += 1
    assert admitted_a == 7  # alone, a may fill the backlog: the 7th waits behind 900 tokens, 9 s
    with pytest.raises(QueueFull):  # the queue is full for b too, but b is now waiting
        w.check("b", [task("b0", token_ids=ids)], 8, beats)
    for i in range(3):  # a's prompts drain
        w.first_token(f"a{i}")
    with pytest.raises(QueueFull) as info:  # a is over its share (1000 / 2 keys): the room is b's
        w.check("a", [task("a-more", token_ids=ids)], 8, beats)
    assert info.value.code == "fair_share_exceeded" and info.value.retry_after_s >= 1.0
    tokens, _ = w.check("b", [task("b1", token_ids=ids)], 8, beats)
    w.admitted("b1", "b", tokens, 8)
    assert w.backlog.per_key == {"a": 600, "b": 150}


def test_without_saturation_shares_do_not_apply():
    w = waits(max_queue_time_s=10.0)
    beats = {"prefill": [hb("prefill", "p1", prefill_tokens_per_s=1000.0)]}  # capacity 10000 tokens
    for i in range(3):
        tokens, _ = w.check("a", [task(f"a{i}", token_ids=list(range(1000)))], 8, beats)
        w.admitted(f"a{i}", "a", tokens, 8)
    w.refused_at["b"] = time.monotonic()  # b waiting, but the backlog is under half its capacity
    w.check("a", [task("a3", token_ids=list(range(1000)))], 8, beats)


def test_the_characters_per_token_ratio_is_learned_from_the_tokenizers_counts():
    w = waits()
    t = task("r", chars=4000)
    before = w.estimate_prompt_tokens(t)
    for _ in range(40):
        w.learn(4000, 1000, t)  # this text runs 4 characters a token
    assert before > 1300 and w.estimate_prompt_tokens(t) == pytest.approx(1000, rel=0.05)
    chat = TokenizeTask(meta=t.meta, sampling=t.sampling, messages=[ChatMessage(role="user", content="y" * 400)])
    assert w.estimate_prompt_tokens(chat) > 100  # its text and the template's tokens


def test_prompts_count_at_the_share_prefill_computes_learned_from_usage():
    """Requests sharing a long system prompt: 900 of each 1,000 prompt tokens come from the
    prefix cache. Counted at full length, five admitted prompts predict 5,000 tokens ahead
    (10 s at 500 tokens/s: refused at a 6 s limit); once the gateway has learned from its
    finished requests that prefill computes ~10 % of a prompt, they predict ~500 (admitted)."""
    quiet = {"prefill": [hb("prefill", "p1", prefill_tokens_per_s=500.0, queued_prefill_tokens=0)]}
    full = waits(max_queue_time_s=6.0)
    for i in range(5):
        full.admitted(f"r{i}", "k", 1000, 8)
    with pytest.raises(QueueFull):
        full.check("k", [task("new", token_ids=[1] * 1000)], 8, quiet)

    learned = waits(max_queue_time_s=6.0)
    for _ in range(60):
        learned.learn_cached(1000, 900)
    assert learned.computed_share == pytest.approx(0.1, abs=0.01)
    for i in range(5):
        learned.admitted(f"r{i}", "k", 1000, 8)
    assert learned.backlog.prompt_tokens == pytest.approx(500, rel=0.05)
    learned.check("k", [task("new", token_ids=[1] * 1000)], 8, quiet)  # admitted
    # token-weighted: one long prompt's hits count for more than a short one's misses
    mixed = waits()
    for _ in range(30):
        mixed.learn_cached(100, 0)
        mixed.learn_cached(10_000, 9_000)
    assert mixed.computed_share == pytest.approx(1100 / 10_100, rel=0.05)
    # a fully cached prompt still counts a little; nonsense usage neither raises nor passes 1
    cached = waits()
    cached.learn_cached(1000, 1000)
    assert cached.computed_share == 0.05
    cached.learn_cached(0, 0)
    cached.learn_cached(1000, -50)
    assert 0.05 <= cached.computed_share <= 1.0


def test_fair_share_compares_the_computed_parts():
    # two keys hold the backlog; key a's long prompt is mostly cached: its computed part fits
    # its share, so it is admitted (counting it whole would refuse it)
    w = waits(max_queue_time_s=6.0)
    for _ in range(60):
        w.learn_cached(1000, 900)
    w.admitted("a1", "a", 10_000, 8)
    w.admitted("b1", "b", 10_000, 8)
    quiet = {"prefill": [hb("prefill", "p1", prefill_tokens_per_s=500.0, queued_prefill_tokens=0)]}
    w.check("a", [task("a2", token_ids=[1] * 4000)], 8, quiet)  # 2,000 + 400 of a 3,000-token capacity


def test_the_gateway_learns_the_computed_share_from_its_answers_usage(tiny_model_dir):
    def script(t):
        rid = t.meta.request_id
        return [(0.0, Accepted(request_id=rid, num_prompt_tokens=400, max_tokens=8)),
                (0.0, TextChunk(request_id=rid, text="ok", text_offset=0, num_tokens=1, finish_reason="stop",
                                usage=Usage(400, 1, 384)))]

    app, _ = make(tiny_model_dir, script, max_queue_time_s=5.0)

    async def go():
        async with client_for(app) as c:
            for _ in range(3):
                assert (await c.post("/v1/chat/completions", json=BODY)).status_code == 200

    run(go())
    # each answer computed 16 of its 400 prompt tokens: 4 %, held at the 5 % floor
    assert app.state.gateway.admission.waits.computed_share == 0.05


def test_gateway_answers_503_with_retry_after_and_counts_the_decision(tiny_model_dir):
    app, fake = make(tiny_model_dir, lambda t: texts(t.meta.request_id, ["ok"]), max_queue_time_s=5.0)
    registry = fake.registry

    async def go():
        async with client_for(app) as c:
            registry.observe(hb("prefill", "p1", prefill_tokens_per_s=200.0, queued_prefill_tokens=10_000))
            refused = await c.post("/v1/chat/completions", json=BODY)
            registry.observe(hb("prefill", "p1", prefill_tokens_per_s=200.0, queued_prefill_tokens=0))
            ok = await c.post("/v1/chat/completions", json=BODY)
            metrics = (await c.get("/metrics")).text
            return refused, ok, metrics

    refused, ok, metrics = run(go())
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) >= 40  # 50 s predicted - 5 s allowed
    err = refused.json()["error"]
    assert err["type"] == "overloaded" and err["code"] == "queue_time_exceeded"
    assert "10000 prompt tokens" in err["message"]
    assert ok.status_code == 200
    assert app.state.gateway.admission.waits.backlog.prompt_tokens == 0  # done: out of the backlog
    assert _sample(metrics, 'pd_gateway_admission_total{decision="refused",reason="queue_time_exceeded"}') >= 1
    assert _sample(metrics, 'pd_gateway_admission_total{decision="admitted",reason="ok"}') >= 1
    assert _sample(metrics, "pd_gateway_predicted_wait_seconds_count") >= 2


def test_gateway_holds_a_flooding_key_to_its_share(tiny_model_dir):
    """Two keys over HTTP. Key a keeps six clients retrying at once; each of its requests holds
    its prompt in the backlog for 1 s (its first token). Key b retries every 0.2 s: once a's
    first prompts drain, a is over its share and b gets the room."""
    app, fake = make(tiny_model_dir, lambda t: texts(t.meta.request_id, ["x", "y"], gap=1.0),
                     api_keys="sk-a,sk-b", max_queue_time_s=5.0, stall_timeout_s=30.0)
    fake.registry.observe(hb("prefill", "p1", prefill_tokens_per_s=60.0))  # room for 300 prompt tokens
    body = dict(BODY, messages=[{"role": "user", "content": "word " * 40}])  # ~95 tokens estimated
    codes_a: list[str] = []

    async def go():
        async with client_for(app) as c:
            stop = asyncio.Event()

            async def flood():
                while not stop.is_set():
                    r = await c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-a"})
                    if r.status_code == 503:
                        codes_a.append(r.json()["error"]["code"])
                        await asyncio.sleep(0.02)

            floods = [asyncio.create_task(flood()) for _ in range(6)]
            await asyncio.sleep(0.3)
            b_status = []
            for _ in range(25):
                r = await c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-b"})
                b_status.append(r.status_code)
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and "retry-after" in r.headers
                await asyncio.sleep(0.2)
            stop.set()
            await asyncio.gather(*floods)
            return b_status

    b_status = run(go())
    assert b_status[-1] == 200, b_status
    assert b_status[0] == 503  # a had filled the backlog first
    assert "fair_share_exceeded" in codes_a  # a was held to its share while b waited


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or (line.startswith(name) and "{" not in name and line[len(name)] in " {"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
