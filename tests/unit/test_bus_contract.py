"""One contract, two buses: the in-memory bus and NATS JetStream behave the same in what the
services rely on — work-queue delivery to one consumer of many, de-duplication by message id,
at-least-once redelivery after ``ack_wait``, nak/in-progress/term, ordered events with
wildcards, and request/reply."""

from __future__ import annotations

import asyncio

import pytest

from shared import nats_bus
from shared.bus import Bus, NoResponders
from shared.config import Settings
from shared.memory_bus import MemoryBus, subject_matches
from shared.messages import Abort, RequestStatus, StatusQuery, TokenizeTask, decode_as
from shared.subjects import Protocol

ACK_WAIT_S = 1.0
pytestmark = pytest.mark.timeout(120)


def task(rid: str) -> TokenizeTask:
    from shared.messages import RequestMeta, SamplingParams

    meta = RequestMeta(request_id=rid, reply_to="r", model="m", created_at=0.0, deadline_at=1e12)
    return TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=4), prompt="hi")


@pytest.fixture(params=["memory", "nats"])
def make_bus(request, namespace):
    """A factory of connected buses (several connections share one NATS namespace)."""
    protocol = Protocol(namespace)
    opened: list[Bus] = []
    memory = MemoryBus(ack_wait_s=ACK_WAIT_S, max_deliver=3)

    async def make() -> Bus:
        if request.param == "memory":
            return memory
        settings = Settings.from_env({}, nats_url=request.getfixturevalue("nats_url"), namespace=namespace,
                                     ack_wait_s=ACK_WAIT_S, max_deliver=3)
        bus = await nats_bus.NatsBus.connect(settings, "contract-test", max_reconnect_attempts=0)
        opened.append(bus)
        await bus.ensure_queues(protocol.work_queues)
        return bus

    make.protocol = protocol
    yield make
    if opened:
        async def cleanup():
            bus = await nats_bus.NatsBus.connect(opened[0].settings, "contract-cleanup", max_reconnect_attempts=0)
            await nats_bus.delete_namespace(bus.js, protocol)
            await bus.close()

        asyncio.run(cleanup())


def run(coro):
    return asyncio.run(coro)


def test_each_item_goes_to_one_consumer_and_ack_removes_it(make_bus):
    async def go():
        bus = await make_bus()
        q = make_bus.protocol.tokenize
        for i in range(6):
            await bus.publish_work(q, task(f"r{i}"), f"r{i}")
        first = await bus.pull(q, 4, timeout_s=2.0)
        second = await bus.pull(q, 4, timeout_s=2.0)
        ids = [decode_as(d.data, TokenizeTask).meta.request_id for d in first + second]
        assert sorted(ids) == [f"r{i}" for i in range(6)]
        assert all(d.num_delivered == 1 for d in first + second)
        for d in first + second:
            await d.ack()
        assert await bus.pull(q, 4, timeout_s=ACK_WAIT_S * 2) == []  # acked: never again
        await bus.close()

    run(go())


def test_same_message_id_is_queued_once(make_bus):
    async def go():
        bus = await make_bus()
        q = make_bus.protocol.prefill
        await bus.publish_work(q, task("dup"), "dup")
        await bus.publish_work(q, task("dup"), "dup")
        got = await bus.pull(q, 10, timeout_s=1.0)
        assert len(got) == 1
        await got[0].ack()
        assert await bus.pull(q, 10, timeout_s=0.5) == []
        await bus.close()

    run(go())


def test_unacked_item_is_redelivered_after_ack_wait_unless_in_progress(make_bus):
    """``a`` is held and forgotten: redelivered after ack_wait. ``b``'s worker reports progress
    every quarter of ack_wait, as a live worker does: never redelivered while it does (each
    report restarts its clock, so the margin is three quarters of ack_wait, not a race)."""
    async def go():
        bus = await make_bus()
        q = make_bus.protocol.decode
        await bus.publish_work(q, task("a"), "a")
        await bus.publish_work(q, task("b"), "b")
        held = {decode_as(d.data, TokenizeTask).meta.request_id: d for d in await bus.pull(q, 2, timeout_s=1.0)}
        assert set(held) == {"a", "b"}

        async def keep_b_alive() -> None:
            while True:
                await held["b"].in_progress()
                await asyncio.sleep(ACK_WAIT_S / 4)

        alive = asyncio.create_task(keep_b_alive())
        try:
            again = await bus.pull(q, 1, timeout_s=ACK_WAIT_S * 3)
            assert [decode_as(d.data, TokenizeTask).meta.request_id for d in again] == ["a"]
            assert again[0].num_delivered == 2
            await again[0].term()  # never again
            assert await bus.pull(q, 2, timeout_s=ACK_WAIT_S * 1.5) == []  # b still in progress
        finally:
            alive.cancel()
        await held["b"].ack()
        assert await bus.pull(q, 2, timeout_s=ACK_WAIT_S * 1.5) == []
        await bus.close()

    run(go())


def test_nak_redelivers_after_its_delay(make_bus):
    async def go():
        bus = await make_bus()
        q = make_bus.protocol.tokenize
        await bus.publish_work(q, task("n"), "n")
        [d] = await bus.pull(q, 1, timeout_s=1.0)
        await d.nak(delay_s=0.3)
        [d2] = await bus.pull(q, 1, timeout_s=2.0)
        assert d2.num_delivered == 2 and decode_as(d2.data, TokenizeTask).meta.request_id == "n"
        await d2.ack()
        await bus.close()

    run(go())


def test_events_reach_every_subscriber_in_order_with_wildcards(make_bus):
    async def go():
        bus = await make_bus()
        ns = make_bus.protocol.namespace
        got_exact, got_wild = [], []

        async def exact(m):
            got_exact.append(m.request_id)

        async def wild(m):
            got_wild.append(m.request_id)

        await bus.subscribe(f"{ns}.abort.x", exact)
        await bus.subscribe(f"{ns}.abort.*", wild)
        for i in range(20):
            await bus.publish(f"{ns}.abort.x", Abort(request_id=str(i), reason="test"))
        await bus.publish(f"{ns}.abort.y", Abort(request_id="y", reason="test"))
        for _ in range(100):
            if len(got_wild) == 21:
                break
            await asyncio.sleep(0.02)
        assert got_exact == [str(i) for i in range(20)]
        assert got_wild == [str(i) for i in range(20)] + ["y"]
        await bus.close()

    run(go())


def test_request_reply_and_no_responders(make_bus):
    async def go():
        bus = await make_bus()
        ns = make_bus.protocol.namespace

        async def answer(data: bytes):
            q = decode_as(data, StatusQuery)
            return RequestStatus(request_id=q.request_id, open=q.request_id == "open")

        await bus.serve(f"{ns}.status", answer)
        await asyncio.sleep(0.05)
        reply = await bus.request(f"{ns}.status", StatusQuery(request_id="open"), timeout_s=2.0)
        assert decode_as(reply, RequestStatus).open
        with pytest.raises(NoResponders):
            await bus.request(f"{ns}.nobody", StatusQuery(request_id="x"), timeout_s=2.0)
        await bus.close()

    run(go())


@pytest.mark.parametrize(("pattern", "subject", "match"), [
    ("a.b", "a.b", True), ("a.*", "a.b", True), ("a.*", "a.b.c", False), ("a.>", "a.b.c", True),
    ("a.>", "a", False), ("a.b", "a.c", False), ("*.b", "a.b", True),
])
def test_subject_matching(pattern, subject, match):
    assert subject_matches(pattern, subject) is match
