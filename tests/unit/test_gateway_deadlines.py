"""The gateway's side of cancellation and deadlines, against the fake pipeline of
test_gateway.py: a client that leaves before the headers is noticed at once (not at the next
once-a-second check), a request's own deadline (``X-Request-Timeout``) bounds its wait for
tokens and ends it with ``deadline_exceeded`` — a 504 before streaming, a terminal event after."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.unit.test_gateway import BODY, client_for, make, texts

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(coro)


def test_client_gone_before_headers_aborts_at_once(tiny_model_dir):
    """The prompt is never accepted (a deep tokenizer queue): the stream has sent no headers
    when the client leaves. The Abort goes out well inside the run's one-second tick."""
    app, fake = make(tiny_model_dir, lambda task: None, stall_timeout_s=30.0)
    body = json.dumps({**BODY, "stream": True}).encode()

    async def go():
        gone = asyncio.Event()
        sent: list[dict] = []
        stage = {"body_sent": False}

        async def receive():
            if not stage["body_sent"]:
                stage["body_sent"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                                  (b"host", b"gw")],
                 "client": ("127.0.0.1", 1), "server": ("gw", 80), "state": {}}
        app_task = asyncio.create_task(app(scope, receive, send))
        for _ in range(500):
            if fake.submitted:
                break
            await asyncio.sleep(0.01)
        assert fake.submitted, "the request was never submitted"
        # waiting for Accepted, no headers yet; just past the run's first one-second tick, so a
        # poll at each tick would notice the disconnect only ~0.9 s after it
        await asyncio.sleep(1.1)
        assert not any(m["type"] == "http.response.start" and m["status"] == 200 for m in sent)
        gone.set()
        left_at = time.monotonic()
        for _ in range(500):
            if fake.aborted:
                break
            await asyncio.sleep(0.005)
        abort_after = time.monotonic() - left_at
        await asyncio.wait_for(app_task, 10)
        return abort_after

    abort_after = run(go())
    rid = fake.submitted[0].meta.request_id
    assert fake.aborted == [(rid, "client_disconnected")]
    # the watch sees the disconnect itself, not at the next tick
    assert abort_after < 0.5, abort_after


def test_request_timeout_header_bounds_the_wait_with_deadline_exceeded(tiny_model_dir):
    app, fake = make(tiny_model_dir, lambda task: None, stall_timeout_s=30.0, request_timeout_s=300.0)

    async def go():
        async with client_for(app) as c:
            started = time.time()
            resp = await c.post("/v1/chat/completions", json=BODY, headers={"X-Request-Timeout": "1.5"})
            elapsed = time.time() - started
            for _ in range(500):  # the abort is sent by a task of its own
                if fake.aborted:
                    break
                await asyncio.sleep(0.01)
            return resp, started, elapsed

    resp, started, elapsed = run(go())
    assert resp.status_code == 504, resp.text
    err = resp.json()["error"]
    assert err["code"] == "deadline_exceeded" and "deadline" in err["message"]
    # the task carried the request's own deadline, not the 300 s default
    assert abs(fake.submitted[0].meta.deadline_at - (started + 1.5)) < 1.0
    assert 1.4 < elapsed < 30.0
    assert fake.aborted and fake.aborted[0][1] == "deadline"


def test_request_timeout_header_over_the_maximum_or_garbled_is_a_400(tiny_model_dir):
    app, fake = make(tiny_model_dir, lambda task: texts(task.meta.request_id, ["x"]), max_request_timeout_s=60.0)

    async def go():
        async with client_for(app) as c:
            over = await c.post("/v1/chat/completions", json=BODY, headers={"X-Request-Timeout": "61"})
            garbled = await c.post("/v1/chat/completions", json=BODY, headers={"X-Request-Timeout": "soon"})
            negative = await c.post("/v1/chat/completions", json=BODY, headers={"X-Request-Timeout": "-1"})
            fine = await c.post("/v1/chat/completions", json=BODY, headers={"X-Request-Timeout": "60"})
            return over, garbled, negative, fine

    over, garbled, negative, fine = run(go())
    for resp in (over, garbled, negative):
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "X-Request-Timeout"
    assert "maximum of 60s" in over.json()["error"]["message"]
    assert fine.status_code == 200, fine.text
    assert len(fake.submitted) == 1  # refused before anything was queued


def test_deadline_mid_stream_is_a_terminal_deadline_exceeded_event(tiny_model_dir):
    def script(task):
        return texts(task.meta.request_id, ["a", "b", "c"], finish=None)[:2]  # one chunk, then silence

    app, fake = make(tiny_model_dir, script, stall_timeout_s=30.0)

    async def go():
        async with client_for(app) as c:
            resp = await c.post("/v1/chat/completions", json={**BODY, "stream": True},
                                headers={"X-Request-Timeout": "1.5"})
            return resp.status_code, resp.content

    status, raw = run(go())
    assert status == 200
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2][len(b"data: "):])["error"]
    assert err["code"] == "deadline_exceeded", err
    assert b'"content":"a"' in raw  # the text before it was delivered
