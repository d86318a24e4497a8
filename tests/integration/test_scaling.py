"""Horizontal scaling: two replicas of prefill, decode and postfilter share the work queues
(durable consumers) and split the token streams, and 20 concurrent requests are each correct."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from tests.integration.test_pipeline import reference_text
from tests.pipeline_fixture import deployment, heartbeats, metric_value

pytestmark = pytest.mark.timeout(400)

TOPICS = ["fox", "capital", "numbers", "emoji", "code", "weather", "music", "rivers", "stars", "trees"]


def test_two_replicas_serve_20_concurrent_requests(tmp_path, tiny_model_dir, tiny_model, nats_url):
    ns = f"t{uuid.uuid4().hex[:10]}"
    replicas = {"tokenizer": 2, "prefill": 2, "decode": 2, "postfilter": 2}
    prompts = [f"Tell me about {TOPICS[i % 10]} number {i}" for i in range(20)]
    expected = {p: reference_text(tiny_model, p, 16)[0] for p in prompts}
    with deployment(tmp_path, str(tiny_model_dir), ns, replicas=replicas, block_size=4, max_num_seqs=4) as dep:
        live = heartbeats(dep.settings)
        for stage, n in replicas.items():
            assert sum(h.stage == stage for h in live.values()) == n

        async def one(client: httpx.AsyncClient, prompt: str, stream: bool) -> str:
            body = {"model": "tiny-llama", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                    "temperature": 0, "stream": stream}
            if not stream:
                resp = await client.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
                return resp.json()["choices"][0]["message"]["content"]
            text = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        import json

                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        text.append(delta.get("content", ""))
            return "".join(text)

        async def run_all() -> list[str]:
            async with httpx.AsyncClient(base_url=dep.url, timeout=120) as client:
                return await asyncio.gather(*(one(client, p, i % 2 == 0) for i, p in enumerate(prompts)))

        results = asyncio.run(run_all())
        for p, got in zip(prompts, results):
            assert got == expected[p], p
        # every replica took part
        for stage, metric in (("prefill", "pd_prefill_tasks_total"), ("decode", "pd_decode_tasks_total"),
                              ("tokenizer", "pd_tokenizer_tasks_total"),
                              ("postfilter", "pd_postfilter_process_seconds_count")):
            counts = [metric_value(h.metrics_port, metric) for h in live.values() if h.stage == stage]
            assert len(counts) == 2 and all(c > 0 for c in counts), (stage, counts)
