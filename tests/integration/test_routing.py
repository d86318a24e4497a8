"""Where prompts are prefilled: aggregated serving (decode workers prefill their own prompts,
no prefill worker at all) and conditional routing (short prompts locally, long ones on a
prefill worker) — both still token-identical to transformers' greedy output."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.integration.test_pipeline import chat_body, reference_text
from tests.pipeline_fixture import deployment, heartbeats, log_tail, metric_value

pytestmark = pytest.mark.timeout(400)

SHORT = "Hello there"
LONG = "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 " * 6


@pytest.mark.parametrize("routing", ["aggregated", "conditional"])
def test_serving_needs_no_prefill_worker(tmp_path, tiny_model_dir, tiny_model, nats_url, routing):
    """Aggregated serving, and conditional routing with every prefill worker gone (the router
    then prefills on the decode worker; the gateway used to answer 503 "no live worker")."""
    ns = f"t{uuid.uuid4().hex[:10]}"
    with deployment(tmp_path, str(tiny_model_dir), ns, replicas={"prefill": 0}, routing=routing,
                    block_size=4, router_local_max_tokens=4) as dep, httpx.Client(base_url=dep.url, timeout=60) as client:
        assert not any(h.stage == "prefill" for h in heartbeats(dep.settings).values())
        assert client.get("/health/ready").status_code == 200
        for content in (SHORT, LONG):
            expected, _, n_prompt = reference_text(tiny_model, content, 12)
            body = client.post("/v1/chat/completions", json=chat_body(content, max_tokens=12)).json()
            assert body["choices"][0]["message"]["content"] == expected
            assert body["usage"]["prompt_tokens"] == n_prompt
        # a repeated prompt hits the decode worker's own prefix cache
        again = client.post("/v1/chat/completions", json=chat_body(LONG, max_tokens=12)).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_conditional_routing_sends_short_prompts_local_and_long_ones_remote(tmp_path, tiny_model_dir, tiny_model,
                                                                             nats_url):
    ns = f"t{uuid.uuid4().hex[:10]}"
    n_short, n_long = (reference_text(tiny_model, c, 1)[2] for c in (SHORT, LONG))
    assert n_short < n_long
    limit = (n_short + n_long) // 2
    with deployment(tmp_path, str(tiny_model_dir), ns, routing="conditional", router_local_max_tokens=limit,
                    block_size=4) as dep, httpx.Client(base_url=dep.url, timeout=60) as client:
        for content in (SHORT, LONG, SHORT):
            expected, _, _ = reference_text(tiny_model, content, 12)
            body = client.post("/v1/chat/completions", json=chat_body(content, max_tokens=12)).json()
            assert body["choices"][0]["message"]["content"] == expected
        live = heartbeats(dep.settings)
        tok = next(h for h in live.values() if h.stage == "tokenizer")
        # in order: the first short prompt meets workers that have measured no rate yet (rates
        # are measured on steps of 32 tokens or more), so both sides cost the default rate and
        # the hop overhead makes local cheaper: local, whatever this machine's speed; the long
        # prompt is over the local limit: remote. The second short prompt goes local when its
        # estimated cost is not higher, which depends on the rates measured here since
        # (tests/unit/test_router.py checks that rule with given rates).
        routes = [json.loads(line) for line in log_tail(dep, "tokenizer", chars=1 << 22).splitlines()
                  if '"event": "route"' in line]
        assert [r["target"] for r in routes[:2]] == ["local", "remote"], routes
        assert "longer than the local limit" in routes[1]["reason"], routes[1]
        assert len(routes) == 3, routes
        local = metric_value(tok.metrics_port, "pd_router_decisions_total", 'target="local"')
        remote = metric_value(tok.metrics_port, "pd_router_decisions_total", 'target="remote"')
        assert (local, remote) == (sum(r["target"] == "local" for r in routes), sum(r["target"] == "remote" for r in routes))
        assert local >= 1 and remote >= 1
        prefill = next(h for h in live.values() if h.stage == "prefill")
        # one task per remote decision (a JetStream redelivery while it runs counts as "duplicate")
        assert metric_value(prefill.metrics_port, "pd_prefill_tasks_total", 'outcome="ok"') == remote
