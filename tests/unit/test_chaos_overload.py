"""The overload scenario's client side (``loadtest/chaos_overload.py``, ``loadtest/chaos.py``
``one_request``): outcomes of admitted and refused streams against the gateway on a fake
pipeline, and the figures it reports."""

from __future__ import annotations

import time

from loadtest.chaos import one_request
from loadtest.chaos_overload import format_overload, long_prompts, percentile
from shared.messages import Heartbeat
from tests.unit.test_gateway import client_for, make, run, texts


def test_a_stream_reports_its_ttft_and_a_refusal_its_status_and_type(tiny_model_dir):
    app, fake = make(tiny_model_dir, lambda t: texts(t.meta.request_id, ["a", "b"], finish="length", gap=0.2),
                     max_queue_time_s=5.0)

    async def go():
        async with client_for(app) as c:
            ok = await one_request(c, "tiny-llama", "hello", 2, None, 30)
            fake.registry.observe(Heartbeat(stage="prefill", instance_id="p", model="m", sent_at=time.time(),
                                            prefill_tokens_per_s=100.0, queued_prefill_tokens=100_000))
            refused = await one_request(c, "tiny-llama", "hello", 2, None, 30)
            return ok, refused

    ok, refused = run(go())
    assert ok.status == "completed" and ok.text == "ab"
    assert 0.15 < ok.ttft_s < ok.seconds  # the first content came after one gap, before the end
    assert refused.status == "failed" and refused.http_status == 503 and refused.error_type == "overloaded"
    assert refused.ttft_s is None


def test_overload_figures():
    prompts = long_prompts(5, 50, seed=3)
    assert len(set(prompts)) == 5 and len({p.split(":")[0] for p in prompts}) == 5  # distinct from the first word
    assert all(len(p.split()) > 50 for p in prompts)
    assert percentile([], 0.99) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    figures = {"rate_rps": 1.2, "sustained_rps": 0.3, "duration_s": 20.0, "prompt_words": 1500,
                    "deadline_s": 120.0, "sent": 24, "completed": 10, "refused_503": 14, "typed_errors": 0,
                    "hung": 0, "late": 0, "broken": 0, "ttft_p50_s": 5.0, "ttft_p99_s": 30.0, "ttft_max_s": 31.0,
                    "errors": ["503 queue_time_exceeded"]}
    table = format_overload(figures, (0, 0, 0))
    assert "4.0x the sustained 0.300" in table and "0/0/0" in table and "30.00" in table
