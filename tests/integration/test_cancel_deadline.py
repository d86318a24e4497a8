"""Cancellation and deadlines on a real deployment (issue 30; the session's tiny-model
pipeline of conftest.py): a stream its client drops is stopped in the workers and releases
everything; a request's own deadline (``X-Request-Timeout``) it cannot meet is refused up front (503
``deadline_unreachable``) once admission knows the stages' rates, or ends it with a 504
``deadline_exceeded`` and stops its work there too."""

from __future__ import annotations

import time

import pytest

from tests.integration.test_pipeline import chat_body
from tests.pipeline_fixture import heartbeats, metric_value

pytestmark = pytest.mark.timeout(300)


def worker_state(pipeline) -> tuple[float, int, int]:
    """(cancelled work counted by prefill and decode, requests they hold, KV blocks they hold)."""
    cancelled = held = blocks = 0
    for hb in heartbeats(pipeline.settings).values():
        if hb.stage in ("prefill", "decode") and hb.metrics_port:
            cancelled += metric_value(hb.metrics_port, "pd_cancelled_total", f'stage="{hb.stage}"')
            blocks += int(metric_value(hb.metrics_port, f"pd_{hb.stage}_kv_blocks_used"))
            held += hb.num_running
    return cancelled, held, int(blocks)


def settled(pipeline, cancelled_before: float, timeout_s: float = 30.0) -> tuple[float, int, int]:
    """The worker state once the cancel was counted and nothing is held (or the last reading)."""
    end = time.monotonic() + timeout_s
    while True:
        state = worker_state(pipeline)
        if (state[0] > cancelled_before and state[1] == 0 and state[2] == 0) or time.monotonic() > end:
            return state
        time.sleep(0.5)


def test_a_stream_its_client_drops_is_stopped_and_released(client, pipeline):
    before, _, _ = worker_state(pipeline)
    body = chat_body("Tell me a very long story about rivers", max_tokens=700, ignore_eos=True, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # the first text: the request streams; the client leaves
    cancelled, held, blocks = settled(pipeline, before)
    assert cancelled > before, "no stage counted the cancelled request's work"
    assert held == 0 and blocks == 0, (held, blocks)
    # and the deployment serves the next request as usual
    ok = client.post("/v1/chat/completions", json=chat_body("Hello there", max_tokens=4)).json()
    assert ok["choices"][0]["finish_reason"] in ("stop", "length")


def test_request_timeout_header_ends_it_with_deadline_exceeded_everywhere(client, pipeline):
    """A 0.3 s deadline for 700 tokens cannot be met. Once the gateway knows the stages' rates
    (any earlier request in the shared deployment measured them) admission refuses it up front:
    503 ``deadline_unreachable`` with Retry-After and nothing computed. Before that, it is
    admitted and the deadline ends it: 504 ``deadline_exceeded``, its work stopped in the stages.
    Either way it ends within the deadline's order of time, not the 700 tokens', and nothing is
    held afterwards."""
    before, _, _ = worker_state(pipeline)
    started = time.monotonic()
    resp = client.post("/v1/chat/completions", json=chat_body("Count to a thousand", max_tokens=700, ignore_eos=True),
                       headers={"X-Request-Timeout": "0.3"})
    elapsed = time.monotonic() - started
    assert elapsed < 20, elapsed  # the deadline, not the 700 tokens
    error = resp.json()["error"]
    if resp.status_code == 503:
        assert error["type"] == "overloaded" and error["code"] == "deadline_unreachable", resp.text
        assert float(resp.headers["Retry-After"]) >= 1
        cancelled, held, blocks = worker_state(pipeline)
        assert cancelled == before and held == 0 and blocks == 0, (cancelled, before, held, blocks)
    else:
        assert resp.status_code == 504, resp.text
        assert error["code"] == "deadline_exceeded"
        cancelled, held, blocks = settled(pipeline, before)
        assert cancelled > before, "no stage stopped the expired request's work"
        assert held == 0 and blocks == 0, (held, blocks)
