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
from shared.messages import RequestMeta, SamplingParams, TokenizeTask, WorkQueueLost
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
    assert [(type(m), m.stage, m.stream) for m in reports] == [(WorkQueueLost, "prefill", queue.stream)]


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


def test_a_gateway_on_a_node_cut_from_its_routes_keeps_its_redelivered_work(tmp_path, namespace):
    """A partition on real NATS (issue 19's lost partition request): the gateway's node is cut
    from its cluster routes while the gateway, connected to it, still waits. A worker on another
    node asking about its redelivered work gets "no responders" — the cut hides the gateway's
    subscription — for longer than heartbeat_timeout_s; it must keep the work (it used to drop
    it), and once the routes heal it gets the gateway's own answer."""
    from loadtest.chaos_cluster import ChaosCluster
    from services.common.runtime import Worker
    from shared.messages import RequestStatus, StatusQuery, decode_as

    cluster = ChaosCluster(tmp_path / "cluster")
    cluster.start()
    base = Settings.from_env({}, namespace=namespace, nats_replicas=3, heartbeat_timeout_s=1.0,
                             first_token_timeout_s=30.0, stall_timeout_s=10.0)
    at = [f"nats://{cluster.host}:{n.client_port}" for n in cluster.nodes]
    inbox = base.protocol().gateway_inbox("g-cut")
    meta = RequestMeta(request_id="r-cut", reply_to=inbox, model="m", created_at=time.time() - 5,
                       deadline_at=time.time() + 60)

    async def go():
        import dataclasses

        gateway = await NatsBus.connect(dataclasses.replace(base, nats_url=at[0]), "gateway-on-n0")

        async def status(data: bytes):
            return RequestStatus(request_id=decode_as(data, StatusQuery).request_id, open=True)

        await gateway.serve(base.protocol().gateway_status(inbox), status)
        await gateway.nc.flush()
        worker = Worker(dataclasses.replace(base, nats_url=at[1]))
        worker.bus = await NatsBus.connect(worker.settings, "worker-on-n1")
        end = time.monotonic() + 10  # the gateway's interest reaches n1
        while time.monotonic() < end:
            try:
                await worker.bus.request(base.protocol().gateway_status(inbox), StatusQuery(request_id="x"), 1.0)
                break
            except Exception:
                await asyncio.sleep(0.2)
        cluster.mesh.cut(0)
        await asyncio.sleep(1.0)
        no_responders = False
        try:
            await worker.bus.request(base.protocol().gateway_status(inbox), StatusQuery(request_id="x"), 1.0)
        except Exception as exc:
            no_responders = type(exc).__name__ == "NoResponders"
        started = time.monotonic()
        kept = await worker.still_wanted(meta, num_delivered=2)
        waited = time.monotonic() - started
        cluster.mesh.heal(0)
        end, answered = time.monotonic() + 20, None
        while answered is None and time.monotonic() < end:
            try:
                reply = await worker.bus.request(base.protocol().gateway_status(inbox),
                                                 StatusQuery(request_id="r-cut"), 1.0)
                answered = decode_as(reply, RequestStatus).open
            except Exception:
                await asyncio.sleep(0.3)
        await worker.bus.close()
        await gateway.close()
        return no_responders, kept, waited, answered

    try:
        no_responders, kept, waited, answered = asyncio.run(go())
    finally:
        cluster.stop()
    assert no_responders, "the cut did not hide the gateway (the scenario this test is about)"
    assert kept is True and waited >= 1.0
    assert answered is True
