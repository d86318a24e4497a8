"""A worker's graceful shutdown (services/common/runtime.py, docs/operations.md "Shutdown"): on
stop (what SIGTERM calls) it stops fetching, lets in-flight work finish within its drain, and
naks what is still running after it so another replica takes that at once. A stage of three
lines on the in-memory bus: one item finishes during the drain, one never does, one is queued
after the stop began."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.consumer import PullConsumer
from services.common.runtime import Worker
from shared.config import Settings
from shared.memory_bus import MemoryBus
from shared.messages import RequestMeta, SamplingParams, TokenizeTask, decode_as

pytestmark = pytest.mark.timeout(60)
DRAIN_S = 2.0  # the consumer gets half of it for in-flight work


def task(rid: str) -> TokenizeTask:
    meta = RequestMeta(request_id=rid, reply_to="r", model="m", created_at=time.time(), deadline_at=time.time() + 60)
    return TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=1), prompt="p")


class Stage(Worker):
    stage = "tokenizer"
    drain_timeout_s = DRAIN_S

    def __init__(self, settings, bus):
        super().__init__(settings, bus=bus)
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.finished: list[str] = []

    async def serve(self) -> None:
        self.consumer = PullConsumer(self, self.protocol.tokenize, TokenizeTask, self.handle, capacity=lambda: 8)
        self.spawn(self.consumer.run(), "consume")

    async def handle(self, item) -> str:
        rid = item.message.meta.request_id
        self.started.append(rid)
        if rid == "stuck":
            await asyncio.Event().wait()  # never finishes
        await self.release.wait()
        await item.ack()
        self.finished.append(rid)
        return "ok"


def test_stop_finishes_in_flight_work_naks_the_rest_and_fetches_nothing_new():
    async def go():
        bus = MemoryBus(ack_wait_s=30.0)  # no redelivery by ack_wait within this test: only a nak brings one back
        settings = Settings.from_env({}, namespace="drain", instance_id="", heartbeat_interval_s=0.2)
        worker = Stage(settings, bus)
        await worker.start()
        queue = worker.protocol.tokenize
        for rid in ("quick", "stuck"):
            await bus.publish_work(queue, task(rid), rid)
        for _ in range(1000):
            if len(worker.started) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(worker.started) == ["quick", "stuck"]

        stopping = asyncio.create_task(worker.stop())
        for _ in range(1000):
            if worker.stopping.is_set():
                break
            await asyncio.sleep(0.01)
        await bus.publish_work(queue, task("late"), "late")  # queued while the worker stops
        await asyncio.sleep(0.2)
        worker.release.set()  # quick finishes inside the drain
        started = time.monotonic()
        await stopping
        assert time.monotonic() - started >= DRAIN_S / 2 * 0.9  # it waited for stuck before giving it back
        assert worker.finished == ["quick"] and "late" not in worker.started

        # another replica: stuck comes back at once (naked: its second delivery), and so does late,
        # never started here (still queued, or naked unopened by a fetch that was already waiting
        # when the stop began); quick is gone (acked). At once: well before ack_wait (30 s).
        got = {decode_as(d.data, TokenizeTask).meta.request_id: d.num_delivered for d in await bus.pull(queue, 8, 1.0)}
        assert set(got) == {"stuck", "late"} and got["stuck"] == 2 and got["late"] in (1, 2), got
        await bus.close()

    asyncio.run(go())
