"""Every bus decoder fed random bytes, through the real workers: poison work items are
terminated (never redelivered), the request they belonged to (when it can still be read) gets
an error, every worker survives and reports the poison in its metrics."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest

from shared import nats_bus as bus
from shared.messages import ErrorEvent, decode
from shared.subjects import Protocol
from tests.pipeline_fixture import heartbeats, metric_value

pytestmark = pytest.mark.timeout(180)


def garbage(rng: random.Random, n: int) -> list[bytes]:
    out = [b"", b"\x00", b"\xc1", msgspec.msgpack.encode({"kind": "nope"}), msgspec.msgpack.encode([1, 2, 3])]
    out += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(n)]
    return out


def test_random_bytes_on_every_subject_are_survived(pipeline, client):
    settings = pipeline.settings
    proto = Protocol(settings.namespace)
    before = heartbeats(settings)
    rng = random.Random(7)
    reply_to = f"{settings.namespace}.test.poison.{time.monotonic_ns()}"

    async def attack() -> list:
        nc = await bus.connect(settings, "pdserve-test-fuzz", max_reconnect_attempts=0)
        js = nc.jetstream()
        errors: list = []

        async def on(msg) -> None:
            errors.append(decode(msg.data))

        await nc.subscribe(reply_to, cb=on)
        for queue in proto.work_queues:
            for i, payload in enumerate(garbage(rng, 15)):
                await js.publish(queue.subject, payload, headers={"Nats-Msg-Id": f"fuzz-{queue.stage}-{i}"})
            # decodable msgpack that is not a valid task, but names its request and reply subject
            broken = msgspec.msgpack.encode({"kind": "prefill", "meta": {"request_id": f"poison-{queue.stage}",
                                                                          "reply_to": reply_to}})
            await js.publish(queue.subject, broken)
        core = [proto.abort, proto.heartbeat_of("decode"), *(hb.inbox for hb in before.values() if hb.inbox)]
        for hb in before.values():
            if hb.stage == "decode":
                core.append(proto.decode_control(hb.instance_id))
        for subject in core:
            for payload in garbage(rng, 15):
                await nc.publish(subject, payload)
        await nc.flush()
        await asyncio.sleep(3.0)
        await nc.close()
        return errors

    errors = asyncio.run(attack())
    # the broken tasks' requests were told
    assert {e.request_id for e in errors if isinstance(e, ErrorEvent)} == {f"poison-{s}" for s in ("tokenizer", "prefill", "decode")}
    assert all(e.code == "poison_message" for e in errors)
    # every worker is still alive and counted its poison
    after = heartbeats(settings)
    assert {h.instance_id for h in before.values()} <= set(after)
    for hb in after.values():
        if hb.stage in ("tokenizer", "prefill", "decode"):
            assert metric_value(hb.metrics_port, f"pd_{hb.stage}_tasks_total", 'outcome="poison"') >= 20
    # nothing is redelivered: the work queues are empty again
    async def pending() -> int:
        nc = await bus.connect(settings, "pdserve-test-fuzz2", max_reconnect_attempts=0)
        js = nc.jetstream()
        total = 0
        for queue in proto.work_queues:
            info = await js.consumer_info(queue.stream, queue.durable)
            total += (info.num_pending or 0) + (info.num_ack_pending or 0)
        await nc.close()
        return total

    assert asyncio.run(pending()) == 0
    # and the pipeline still serves
    resp = client.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 3, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "still there?"}]})
    assert resp.status_code == 200
