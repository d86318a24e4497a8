"""Issue 19 on real NATS: a work item published while the broker restarts is queued once the
broker is back (same Nats-Msg-Id: once), a stream found missing is declared again and reported
on ``<ns>.control.stream_lost``, and a three-node cluster keeps its replicated queues through
the death of its meta leader."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from loadtest.infra import NatsServer
from shared.config import Settings
from shared.messages import Progress, RequestMeta, SamplingParams, TokenizeTask
from shared.nats_bus import NatsBus, subscribe_messages

pytestmark = pytest.mark.timeout(120)


def task(rid: str) -> TokenizeTask:
    meta = RequestMeta(request_id=rid, reply_to="x", model="m", created_at=time.time(), deadline_at=time.time() + 60)
    return TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=1), prompt="p")


def test_a_publish_during_a_broker_restart_is_queued_once(tmp_path, namespace):
    server = NatsServer(tmp_path / "nats")
    server.start()
    settings = Settings.from_env({}, nats_url=server.url, namespace=namespace)
    queue = settings.protocol().tokenize

    async def go():
        bus = await NatsBus.connect(settings, "test-publisher")
        await bus.ensure_queues([queue])
        server.stop()
        restart = threading.Timer(2.0, server.start)
        restart.start()
        started = time.monotonic()
        await bus.publish_work(queue, task("r1"), "r1")  # would fail at once without the retry
        waited = time.monotonic() - started
        await bus.publish_work(queue, task("r1"), "r1")  # a retry of the same hand-off
        got = await bus.pull(queue, 10, timeout_s=2.0)
        restart.join()
        await bus.close()
        return waited, len(got)

    try:
        waited, n = asyncio.run(go())
    finally:
        server.stop()
    assert waited >= 1.5  # it did wait for the restart
    assert n == 1


def test_a_stream_found_missing_is_declared_again_and_reported_lost(nats_url, namespace):
    settings = Settings.from_env({}, nats_url=nats_url, namespace=namespace)
    protocol = settings.protocol()
    queue = protocol.prefill

    async def go():
        bus = await NatsBus.connect(settings, "test-worker")
        await bus.ensure_queues([queue])
        assert await bus.pull(queue, 1, timeout_s=0.2) == []
        reports: list = []

        async def on_lost(message) -> None:
            reports.append(message)

        await subscribe_messages(bus.nc, protocol.stream_lost, on_lost)
        await bus.js.delete_stream(queue.stream)  # the broker lost it
        end = time.monotonic() + 20
        while not reports and time.monotonic() < end:  # an idle worker's fetches notice it
            await bus.pull(queue, 1, timeout_s=0.5)
        await bus.nc.flush()
        await asyncio.sleep(0.2)
        info = await bus.js.stream_info(queue.stream)
        await bus.js.delete_stream(queue.stream)
        await bus.close()
        return reports, info

    reports, info = asyncio.run(go())
    assert info.config.name == queue.stream
    assert [(type(m), m.stage) for m in reports] == [(Progress, "prefill")]


def test_a_cluster_keeps_its_replicated_queue_through_the_meta_leader_death(tmp_path, namespace):
    from loadtest.chaos_cluster import ChaosCluster

    cluster = ChaosCluster(tmp_path / "cluster")
    cluster.start()
    settings = Settings.from_env({}, nats_url=cluster.url, namespace=namespace, nats_replicas=3)
    queue = settings.protocol().decode

    async def go(rids):
        bus = await NatsBus.connect(settings, "test-cluster")
        await bus.ensure_queues([queue])
        for rid in rids:
            await bus.publish_work(queue, task(rid), rid)
        await bus.close()

    async def drain():
        bus = await NatsBus.connect(settings, "test-cluster-consumer")
        got = []
        end = time.monotonic() + 30
        while len(got) < 10 and time.monotonic() < end:
            for d in await bus.pull(queue, 10, timeout_s=1.0):
                got.append(d)
                await d.ack()
        await bus.close()
        return got

    try:
        asyncio.run(go([f"a{i}" for i in range(5)]))
        leader = cluster.meta_leader()
        assert leader is not None
        cluster.kill(leader)
        asyncio.run(go([f"b{i}" for i in range(5)]))  # while the leader is dead
        got = asyncio.run(drain())
        cluster.start_node(leader)
        cluster.wait_healthy(leader, 30)
    finally:
        cluster.stop()
    assert len(got) == 10
