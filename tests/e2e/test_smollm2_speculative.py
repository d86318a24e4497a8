"""Speculative decoding end to end with the real default model (SmolLM2-135M-Instruct from its GGUF,
PD_DTYPE=auto, real NATS, one prefill and two decode workers, speculation on as by default): every
request is sent with speculation and with ``"speculative": false`` (the per-request opt-out),
and the two answers — tokens as text, logprobs and top_logprobs — must be identical:

* a copy-heavy edit request (loadtest/bench_spec.py's workload), greedy, streamed and not, with
  logprobs; the decode workers' metrics must show accepted drafts (the path really ran);
* a seeded (temperature 0.8) copy-heavy request with n=2 and a stop string;
* a JSON-schema request (response_format);
* the copy-heavy stream with its decode worker SIGKILLed mid-stream (resumed on the other one);
* disaggregated (the default) and aggregated routing (the tokenizer restarted with it).
"""

from __future__ import annotations

import json
import signal
import time
import uuid

import httpx
import pytest

from loadtest.bench_spec import COPY_HEAVY
from services import launcher
from tests.integration.test_batch_invariance_pipeline import routes, routes_of
from tests.pipeline_fixture import DecodeKiller, deployment, heartbeats, metric_value

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

MODEL = "SmolLM2-135M-Instruct"
EDIT = {"model": MODEL, "temperature": 0, "max_tokens": 120, "logprobs": True, "top_logprobs": 3,
        "messages": [{"role": "user", "content": f"{COPY_HEAVY[0][0]}\n\n{COPY_HEAVY[0][1]}"}]}
SEEDED = {**EDIT, "temperature": 0.8, "seed": 11, "n": 2, "stop": ["withdraw"], "max_tokens": 150}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["owner", "balance"],
          "properties": {"owner": {"type": "string", "maxLength": 20}, "balance": {"type": "number"}}}
JSON_BODY = {"model": MODEL, "temperature": 0, "max_tokens": 60,
             "messages": [{"role": "user", "content": "Give the owner and balance of: Account(owner='Ann', balance=12.5)"}],
             "response_format": {"type": "json_schema", "json_schema": {"name": "acct", "schema": SCHEMA}}}
LONG = {"model": MODEL, "prompt": f"{COPY_HEAVY[1][0]}\n\n{COPY_HEAVY[1][1]}\n\n{COPY_HEAVY[1][1]}", "max_tokens": 200,
        "temperature": 0.8, "seed": 5, "ignore_eos": True, "logprobs": 2}


def answer(client: httpx.Client, body: dict) -> list:
    """(text, logprobs) of each choice, non-streamed."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    out = []
    for c in resp.json()["choices"]:
        text = c["message"]["content"] if "message" in c else c["text"]
        out.append((text, c.get("logprobs"), c["finish_reason"]))
    return out


def streamed(client: httpx.Client, body: dict, on_chunk=None) -> tuple[str, list]:
    """(text, logprob entries) of a streamed single-choice request; ``on_chunk(n)`` after chunk n."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    text, logprobs, n = "", [], 0
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            piece = choice["delta"].get("content", "") if "delta" in choice else choice.get("text", "")
            lp = choice.get("logprobs")
            if lp:
                logprobs.extend(lp.get("content") or lp.get("token_logprobs") or [])
            if piece:
                text += piece
                n += 1
                if on_chunk:
                    on_chunk(n)
    return text, logprobs


def spec_counts(dep) -> tuple[float, float]:
    """(drafted, accepted) summed over the live decode workers."""
    live = [h for h in heartbeats(dep.settings).values() if h.stage == "decode"]
    return (sum(metric_value(h.metrics_port, "pd_decode_spec_draft_tokens_total") for h in live),
            sum(metric_value(h.metrics_port, "pd_decode_spec_accepted_tokens_total") for h in live))


def same_with_and_without(client, body) -> None:
    off = answer(client, {**body, "speculative": False})
    assert answer(client, body) == off
    if body.get("n", 1) == 1:
        assert streamed(client, body) == streamed(client, {**body, "speculative": False})


def test_smollm2_speculation_never_changes_the_answer(tmp_path, nats_url):
    from engine.model.loader import ensure_model
    from shared.config import Settings

    folder = ensure_model(Settings.from_env({}))
    ns = f"e2e{uuid.uuid4().hex[:8]}"
    with deployment(tmp_path, "", ns, replicas={"decode": 2}, dtype="auto", weights="auto",
                    routing="disaggregated", cache_dir=str(folder.parent.parent), kv_cache_memory_bytes=256 << 20,
                    ack_wait_s=2.0, stall_timeout_s=60.0, ready_timeout_s=900) as dep:
        assert dep.settings.speculative_method == "ngram"
        with httpx.Client(base_url=dep.url, timeout=600) as client:
            same_with_and_without(client, EDIT)
            drafted, accepted = spec_counts(dep)
            assert accepted > 20 and drafted >= accepted, (drafted, accepted)
            same_with_and_without(client, SEEDED)
            json_answer = answer(client, JSON_BODY)
            assert answer(client, {**JSON_BODY, "speculative": False}) == json_answer
            json.loads(json_answer[0][0])
            # --- a decode worker killed mid-stream: resumed on the other, the same answer
            undisturbed = streamed(client, {**LONG, "speculative": False})
            killer = DecodeKiller(dep, at=3)
            assert streamed(client, LONG, on_chunk=killer) == undisturbed
            assert killer.killed and killer.killed[0].popen.wait(10) == -signal.SIGKILL
            # --- aggregated routing: the decode worker prefills the prompt itself
            assert routes(dep, "remote") > 0
            i = next(k for k, p in enumerate(dep.procs) if p.name == "tokenizer-0")
            dep.procs[i].popen.terminate()
            dep.procs[i].popen.wait(30)
            dep.settings = dep.settings.replace(routing="aggregated")
            dep.procs[i] = launcher.spawn(dep, "tokenizer-0")
            deadline = time.monotonic() + 180
            while not any(h.stage == "tokenizer" and h.ready and h.instance_id.startswith("tokenizer-0-")
                          and routes_of(h, "local") == 0 for h in heartbeats(dep.settings).values()):
                assert time.monotonic() < deadline and dep.procs[i].popen.poll() is None, "tokenizer did not restart"
            same_with_and_without(client, EDIT)
            assert routes(dep, "local") > 0
