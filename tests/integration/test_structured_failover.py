"""Constrained decoding across a decode failover: a decode worker is killed while JSON-schema
streams run; the surviving worker resumes them (replaying the grammar state from the tokens
already produced), and every answer is the same valid JSON an undisturbed run gives."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid

import httpx
import jsonschema
import pytest

from tests.pipeline_fixture import deployment

pytestmark = pytest.mark.timeout(400)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["words"], "properties": {
    "words": {"type": "array", "minItems": 30, "maxItems": 30, "items": {"type": "string", "maxLength": 5}}}}


def _body(i: int, stream: bool) -> dict:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": f"List {i} things"}], "max_tokens": 400,
            "temperature": 0.8, "seed": i, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}


def test_json_streams_survive_a_decode_worker_kill(tmp_path, tiny_model_dir, nats_url):
    ns = f"t{uuid.uuid4().hex[:10]}"
    # room for 3 sequences per decode worker: the 6 streams are split 3 and 3, so the killed
    # worker surely held some
    with deployment(tmp_path, str(tiny_model_dir), ns, replicas={"decode": 2}, block_size=4, ack_wait_s=3.0,
                    stall_timeout_s=30.0, max_num_seqs=3) as dep:
        n = 6
        with httpx.Client(base_url=dep.url, timeout=120) as client:
            expected = [client.post("/v1/chat/completions", json=_body(i, False)).json()["choices"][0]["message"]["content"]
                        for i in range(n)]
        for text in expected:
            jsonschema.validate(json.loads(text), SCHEMA)
        decoders = [p for p in dep.procs if p.name.startswith("decode")]
        assert len(decoders) == 2
        started = asyncio.Event()
        progress = [0] * n

        async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
            pieces, finish = [], None
            async with client.stream("POST", "/v1/chat/completions", json=_body(i, True)) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    choice = event["choices"][0]
                    pieces.append(choice["delta"].get("content") or "")
                    finish = choice["finish_reason"] or finish
                    progress[i] += 1
                    if all(p >= 5 for p in progress):
                        started.set()
            return "".join(pieces), finish

        async def kill_mid_stream() -> None:
            await asyncio.wait_for(started.wait(), 120)
            os.kill(decoders[0].popen.pid, signal.SIGKILL)

        async def run() -> list:
            async with httpx.AsyncClient(base_url=dep.url, timeout=180) as client:
                results = await asyncio.gather(kill_mid_stream(), *(one(client, i) for i in range(n)))
                return results[1:]

        results = asyncio.run(run())
        assert decoders[0].popen.poll() is not None  # it was killed while the streams ran
        # (the survivor continues each taken-over stream after the tokens the postfilter already has,
        # or, when that query times out, regenerates it from the first token: both replay the grammar)
        for (text, finish), want in zip(results, expected):
            assert finish == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
            assert text == want  # seeded: the resumed stream continues exactly
