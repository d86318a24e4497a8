"""Batch-invariant numerics through the real pipeline (separate processes over NATS) in the
default dtype (PD_DTYPE=auto: bfloat16 on a CPU with native bf16): one started system with a
prefill and two decode workers serves the issue's cases, each compared with the same request
run undisturbed and alone:

* the seeded example ("Once upon a time", temperature 0.8, seed 42) alone, again (prefix hit),
  and beside five unseeded copies;
* a temperature-0 chat request sent twice (the second finds its prompt in the prefix cache),
  streamed and not;
* a seeded stream whose decode worker is SIGKILLed mid-stream and resumed by the other one;
* disaggregated (prefilled by the prefill worker) vs aggregated (the tokenizer restarted with
  PD_ROUTING=aggregated: the decode worker prefills the prompts itself).
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services import launcher
from tests.pipeline_fixture import DecodeKiller, deployment, heartbeats, metric_value

pytestmark = pytest.mark.timeout(300)

SEEDED = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8, "seed": 42}
CHAT = {"model": "tiny-llama", "temperature": 0, "max_tokens": 12,
        "messages": [{"role": "user", "content": "Paris is the capital of France. What is the capital of Germany?"}]}
#: long enough that the kill lands mid-stream; ignore_eos keeps it that long
LONG = {"model": "tiny-llama", "prompt": "Hello world! How are you today?", "max_tokens": 300, "temperature": 0.8,
        "seed": 7, "ignore_eos": True}


def complete(client: httpx.Client, body: dict) -> str:
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def chat(client: httpx.Client, body: dict, stream: bool) -> str:
    if not stream:
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"]
    text = ""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
    return text


def stream_completion(client: httpx.Client, body: dict, on_chunk=None) -> str:
    """The streamed text; ``on_chunk(n)`` after the n-th text chunk."""
    text, n = "", 0
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            piece = event["choices"][0]["text"]
            if piece:
                text += piece
                n += 1
                if on_chunk:
                    on_chunk(n)
    return text


def routes_of(heartbeat, target: str) -> float:
    return metric_value(heartbeat.metrics_port, "pd_router_decisions_total", f'target="{target}"')


def routes(dep, target: str) -> float:
    """The live tokenizer's routing decisions to ``target`` (local or remote)."""
    live = [h for h in heartbeats(dep.settings).values() if h.stage == "tokenizer"]
    assert len(live) == 1
    return routes_of(live[0], target)


def test_same_request_same_tokens_through_the_pipeline(tmp_path, tiny_model_dir, nats_url):
    ns = f"t{uuid.uuid4().hex[:10]}"
    with deployment(tmp_path, str(tiny_model_dir), ns, replicas={"decode": 2}, dtype="auto", block_size=4,
                    routing="disaggregated", ack_wait_s=2.0, stall_timeout_s=30.0) as dep:
        same_request_same_tokens(dep, "tiny-llama")


def same_request_same_tokens(dep, model: str) -> None:
    """The module's cases on a started deployment (one prefill and two decode workers,
    disaggregated) serving ``model``."""
    seeded_body, chat_body, long_body = ({**body, "model": model} for body in (SEEDED, CHAT, LONG))
    with httpx.Client(base_url=dep.url, timeout=300) as client:
        assert dep.settings.batch_invariant
        # --- the seeded example: alone (twice: the second hits the prefix cache), then in a crowd
        seeded = complete(client, seeded_body)
        assert seeded and complete(client, seeded_body) == seeded
        unseeded = {k: v for k, v in seeded_body.items() if k != "seed"}
        with ThreadPoolExecutor(6) as pool:
            crowd = [pool.submit(complete, client, seeded_body if i == 2 else unseeded) for i in range(6)]
            texts = [f.result() for f in crowd]
        assert texts[2] == seeded
        assert len(set(texts)) > 1  # the neighbours did sample differently
        # --- temperature 0, streamed and not, the prompt from the prefix cache after the first
        greedy = chat(client, chat_body, stream=False)
        assert [chat(client, chat_body, stream=s) for s in (True, False, True)] == [greedy] * 3
        # --- the undisturbed long stream, then the same with its decode worker killed mid-stream
        undisturbed = stream_completion(client, long_body)
        killer = DecodeKiller(dep, at=5)
        assert sorted(killer.decoders) == ["decode-0", "decode-1"]
        resumed = stream_completion(client, long_body, on_chunk=killer)
        assert killer.killed and killer.killed[0].popen.wait(10) == -signal.SIGKILL
        assert resumed == undisturbed
        # --- aggregated: the tokenizer restarted with PD_ROUTING=aggregated sends every prompt to
        # a decode worker, which prefills it itself (the prefill worker stays up, unused)
        assert routes(dep, "remote") > 0 and routes(dep, "local") == 0
        i = next(k for k, p in enumerate(dep.procs) if p.name == "tokenizer-0")
        dep.procs[i].popen.terminate()
        dep.procs[i].popen.wait(30)
        dep.settings = dep.settings.replace(routing="aggregated")
        dep.procs[i] = launcher.spawn(dep, "tokenizer-0")
        deadline = time.monotonic() + 120
        while not any(h.stage == "tokenizer" and h.ready and h.instance_id.startswith("tokenizer-0-")
                      and routes_of(h, "local") == 0 for h in heartbeats(dep.settings).values()):
            assert time.monotonic() < deadline and dep.procs[i].popen.poll() is None, "tokenizer did not restart"
        assert complete(client, seeded_body) == seeded
        assert chat(client, chat_body, stream=True) == greedy
        assert routes(dep, "local") == 2 and routes(dep, "remote") == 0
