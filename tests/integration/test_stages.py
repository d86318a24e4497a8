"""A deployment with the example stages plugged in: a pre-processing service that adds
retrieved context to prompts, and a streaming filter that redacts digits and e-mails."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.pipeline_fixture import deployment, heartbeats

pytestmark = pytest.mark.timeout(300)


def test_example_stages_are_wired_by_configuration(tmp_path, tiny_model_dir, nats_url):
    ns = f"t{uuid.uuid4().hex[:10]}"
    with deployment(tmp_path, str(tiny_model_dir), ns, pre_stages="services.plugins.examples:AddContext",
                    text_filters="services.plugins.examples:RedactPatterns") as dep, \
            httpx.Client(base_url=dep.url, timeout=60) as client:
        assert any(h.stage == "stage-addcontext" for h in heartbeats(dep.settings).values())
        question = [{"role": "user", "content": "Where is Paris?"}]
        plain = client.post("/tokenize", json={"model": "tiny-llama", "messages": question}).json()["count"]
        body = client.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": question,
                                                          "max_tokens": 2}).json()
        assert body["usage"]["prompt_tokens"] > plain + 10  # the context was added before tokenizing
        timeline = client.get(f"/debug/timeline/{body['id']}").json()
        assert "stage-addcontext" in [p["phase"] for p in timeline["choices"][0]["phases"]]
        # force a run of digits: the filter shows it redacted, streamed or not
        one = client.post("/tokenize", json={"model": "tiny-llama", "prompt": "1", "add_special_tokens": False}).json()
        assert len(one["tokens"]) == 1
        digits = {"model": "tiny-llama", "messages": [{"role": "user", "content": "count"}], "max_tokens": 8,
                  "ignore_eos": True, "temperature": 0, "logit_bias": {str(one["tokens"][0]): 100}}
        assert client.post("/v1/chat/completions", json=digits).json()["choices"][0]["message"]["content"] == "[redacted]"
        text = []
        with client.stream("POST", "/v1/chat/completions", json={**digits, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        assert "".join(text) == "[redacted]"
