"""Seeing inside the hop: a request's timeline (phases between marks checked against the client's own clock),
one OpenTelemetry trace across all five services, and request ids on every log line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

CRITICAL_PATH = ["gateway", "queue.tokenizer", "tokenize", "queue.prefill", "prefill", "kv_put", "queue.decode",
                 "kv_get", "decode", "postfilter", "respond"]


@pytest.fixture(scope="module")
def traced(pipeline):
    """The shared tiny-model pipeline (conftest.py), which traces to files and logs at DEBUG."""
    assert pipeline.settings.tracing.startswith("file:") and pipeline.settings.log_level == "DEBUG"
    return pipeline, Path(pipeline.settings.tracing.removeprefix("file:"))


def test_timeline_phases_agree_with_the_clients_own_clock(traced):
    """The phases telescope between the same two marks, so their sum equals e2e by construction;
    what can be wrong is the marks. Check them against what the client measures itself: the
    marks are in time order, the phases up to the first token fit inside the client's own TTFT,
    and the whole timeline inside the client's wall time."""
    dep, _ = traced
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Tell me about rivers and the sea"}],
            "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=dep.url, timeout=60) as client:
        started = time.perf_counter()
        resp = client.post("/v1/chat/completions", json=body)
        wall_ms = (time.perf_counter() - started) * 1e3
        assert resp.status_code == 200
        header = dict(part.split("=") for part in resp.headers["x-pd-timeline"].split(";"))
        assert list(header)[:-1] == CRITICAL_PATH
        timeline = client.get(f"/debug/timeline/{resp.json()['id']}").json()
        choice = timeline["choices"][0]
        assert [p["phase"] for p in choice["phases"]] == CRITICAL_PATH
        assert timeline["e2e_ms"] <= wall_ms
        # phases() clamps a negative gap to 0: check the raw marks are in order instead
        at = [m["at"] for m in choice["marks"] if m["mark"] != "gateway.first_flush"]
        assert at == sorted(at), choice["marks"]
        # streamed: the client's own time to its first content chunk bounds the server's view
        rid, client_ttft_ms = None, None
        started = time.perf_counter()  # before the request is sent (entering stream() sends it)
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    rid = chunk["id"]
                    if client_ttft_ms is None and chunk["choices"][0]["delta"].get("content"):
                        client_ttft_ms = (time.perf_counter() - started) * 1e3
            client_wall_ms = (time.perf_counter() - started) * 1e3
        streamed = client.get(f"/debug/timeline/{rid}").json()
        phases = streamed["choices"][0]["phases"]
        to_first_token = sum(p["ms"] for p in phases[:CRITICAL_PATH.index("prefill") + 1])
        # (the server's ttft_ms is its first SSE flush, the role chunk, so it is not ordered
        # against the first token; both are inside the client's time to its first content)
        assert 0 < to_first_token <= client_ttft_ms
        assert 0 < streamed["ttft_ms"] <= client_ttft_ms
        assert streamed["ttft_ms"] < streamed["e2e_ms"] <= client_wall_ms
        assert client.get("/debug/timeline/chatcmpl-nope").status_code == 404


def test_one_trace_spans_all_five_services(traced):
    dep, spans_dir = traced
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "trace me through all five services"}],
            "max_tokens": 6,
            "temperature": 0}
    with httpx.Client(base_url=dep.url, timeout=60) as client:
        rid = client.post("/v1/chat/completions", json=body).json()["id"]
    time.sleep(1.0)
    spans = [json.loads(line) for f in spans_dir.glob("*.jsonl") for line in f.read_text().splitlines()]
    mine = [s for s in spans if s["attributes"].get("request_id", "").startswith(rid)]
    services = {s["service"] for s in mine}
    assert services == {"pdserve-gateway", "pdserve-tokenizer", "pdserve-prefill", "pdserve-decode",
                        "pdserve-postfilter"}, services
    assert len({s["trace_id"] for s in mine}) == 1  # a decode.kv_prefetch span too, where the read ran ahead
    trace_id = mine[0]["trace_id"]
    in_trace = [s for s in spans if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in in_trace}
    roots = [s for s in in_trace if s["parent_id"] is None]
    # the root is the HTTP server span (FastAPI's own, where it is instrumented) or ours
    assert len(roots) == 1 and roots[0]["name"] in ("gateway", "POST /v1/chat/completions")
    assert all(s["parent_id"] in ids for s in in_trace if s["parent_id"])
    names = {s["name"] for s in in_trace}
    assert {"prefill.kv_put", "decode.kv_get"} <= names
    # the prompt (over the pipeline's 16-token chunk cap) had full blocks staged while it was prefilled
    assert "prefill.kv_put_early" in names
    (put,) = [s for s in in_trace if s["name"] == "prefill.kv_put"]
    assert int(put["attributes"]["early_blocks"]) > 0


def test_log_lines_of_a_request_carry_its_id(traced):
    dep, _ = traced
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "log me"}], "max_tokens": 4}
    with httpx.Client(base_url=dep.url, timeout=60) as client:
        rid = client.post("/v1/chat/completions", json=body).json()["id"]
    time.sleep(0.5)
    done = []
    for proc in dep.procs:
        for line in proc.log_path.read_text().splitlines():
            if line.startswith("{") and '"task_done"' in line:
                done.append(json.loads(line))
    mine = [d for d in done if d["request_id"].startswith(rid)]
    assert {d["service"] for d in mine} == {"tokenizer", "prefill", "decode"}
    assert all("request_id" in d for d in done)


def test_gateway_metrics_over_http_count_each_request(traced):
    """The README's ``GET /metrics`` on the gateway's own port, through the real HTTP server:
    Prometheus text, and one more completed chat request moves its counters by one (and its
    TTFT and end-to-end histograms by one observation each)."""
    from prometheus_client.parser import text_string_to_metric_families

    dep, _ = traced

    def scrape(client) -> dict[tuple[str, tuple], float]:
        resp = client.get("/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain"), resp.headers
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(resp.text) for s in family.samples}

    ok = ("pd_gateway_requests_total", (("endpoint", "chat"), ("outcome", "ok")))
    ttft, e2e = ("pd_gateway_ttft_seconds_count", ()), ("pd_gateway_e2e_seconds_count", ())
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Count me"}], "max_tokens": 4,
            "temperature": 0}
    with httpx.Client(base_url=dep.url, timeout=60) as client:
        before = scrape(client)
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        after = scrape(client)
    assert after[ok] == before.get(ok, 0.0) + 1
    assert after[ttft] == before.get(ttft, 0.0) + 1 and after[e2e] == before.get(e2e, 0.0) + 1
