"""Pulling work items from a stage's durable consumer, with back-pressure.

A worker fetches only as many items as it has room for (``capacity()``), so a busy replica
leaves work in the stream for an idle one. Each item is handled in its own task. The
handler acks when the item's hand-off downstream is durable; this module deals with what the
handler does not:

* an undecodable item is terminated (never redelivered) and, when its request id and
  reply subject can still be read, the request gets an error;
* an exception whose class says ``nak`` is retried via redelivery with a delay, until the
  item's last delivery, when the request gets an error instead;
* any other exception fails the request with an error event and acks the item;
* an item whose request was cancelled (an Abort was heard) or is past its deadline is acked
  and dropped at fetch, before any handler runs (``Worker.cancel_reason``);
* items held a long time (decode holds its item until the request finishes) are marked
  in progress well inside ``ack_wait``, so JetStream does not redeliver them while alive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from shared.bus import Delivery
from shared.errors import PdError, PoisonMessage
from shared.logging import request_scope
from shared.messages import decode_as
from shared.metrics import stage_metrics
from shared.subjects import WorkQueue


@dataclass(slots=True, eq=False)
class WorkItem:
    """One fetched work item and its delivery."""

    delivery: Delivery
    message: msgspec.Struct
    num_delivered: int
    max_deliver: int = 1
    fetched_at: float = field(default_factory=time.monotonic)
    done: bool = False

    @property
    def request_id(self) -> str:
        return self.message.meta.request_id  # type: ignore[attr-defined]

    @property
    def is_last_delivery(self) -> bool:
        return self.num_delivered >= self.max_deliver

    async def ack(self) -> None:
        if not self.done:
            self.done = True
            await _quiet(self.delivery.ack())

    async def nak(self, delay_s: float | None = None) -> None:
        if not self.done:
            self.done = True
            await _quiet(self.delivery.nak(delay_s))

    async def term(self) -> None:
        if not self.done:
            self.done = True
            await _quiet(self.delivery.term())


async def _quiet(coro) -> None:
    try:
        await coro
    except Exception:
        pass  # the connection is gone: JetStream redelivers after ack_wait


def _best_effort_ids(data: bytes) -> tuple[str | None, str | None]:
    """(request_id, reply_to) from a message that failed strict decoding, if readable."""
    try:
        raw = msgspec.msgpack.decode(data)
        meta = raw.get("meta", {})
        return meta.get("request_id"), meta.get("reply_to")
    except Exception:
        return None, None


class PullConsumer:
    """Fetch loop of one work queue.

    Args:
        worker: the owning :class:`~services.common.runtime.Worker`.
        queue: the work queue.
        kind: expected message type; anything else is poison.
        handler: coroutine run per item; it acks (or naks) the item, and may return an
            outcome label for metrics ("ok" when it returns None).
        capacity: how many more items the worker can take now.
        max_batch: most items per fetch.
    """

    def __init__(self, worker, queue: WorkQueue, kind: type, handler: Callable[[WorkItem], Awaitable[None]],
                 capacity: Callable[[], int], max_batch: int = 16):
        self.worker = worker
        self.queue = queue
        self.kind = kind
        self.handler = handler
        self.capacity = capacity
        self.max_batch = max_batch
        self.in_flight: set[WorkItem] = set()
        self.room = asyncio.Event()
        self.metrics = stage_metrics(queue.stage)
        self.log = worker.log

    def notify_room(self) -> None:
        """Call when capacity may have grown (a request finished)."""
        self.room.set()

    async def run(self) -> None:
        w = self.worker
        while not w.stopping.is_set():
            n = min(self.capacity(), self.max_batch)
            if n <= 0:
                self.room.clear()
                try:
                    await asyncio.wait_for(self.room.wait(), 0.25)
                except TimeoutError:
                    pass
                continue
            try:
                deliveries = await w.bus.pull(self.queue, n, timeout_s=1.0)
            except Exception as exc:
                if w.stopping.is_set():
                    break
                self.log.warning("fetch_failed", queue=self.queue.stream, error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                if w.stopping.is_set():
                    await _quiet(delivery.nak())
                    continue
                self._start(delivery)

    def _start(self, msg: Delivery) -> None:
        delivered = msg.num_delivered
        if msg.queued_at:
            self.metrics.queue_wait_seconds.observe(max(0.0, time.time() - msg.queued_at))
        try:
            message = decode_as(msg.data, self.kind)
        except PoisonMessage as exc:
            self.metrics.tasks.labels("poison").inc()
            request_id, reply_to = _best_effort_ids(msg.data)
            self.log.error("poison_message", queue=self.queue.stream, error=str(exc), request_id=request_id)
            asyncio.ensure_future(self._fail_poison(msg, exc, request_id, reply_to))
            return
        item = WorkItem(delivery=msg, message=message, num_delivered=delivered, max_deliver=self.worker.settings.max_deliver)
        reason = self.worker.cancel_reason(message.meta)
        if reason is not None:  # cancelled or expired while queued: drop it uncomputed
            self.worker.count_cancelled(reason, "queued")
            self.metrics.tasks.labels("dropped").inc()
            asyncio.ensure_future(self._drop(item))
            return
        self.in_flight.add(item)
        self.metrics.in_flight.set(len(self.in_flight))
        asyncio.ensure_future(self._run_handler(item))

    async def _drop(self, item: WorkItem) -> None:
        await item.ack()
        try:
            await self.worker.drop_work(item.message)
        except Exception as exc:
            self.log.warning("drop_work_failed", request_id=item.request_id, error=str(exc))

    async def _fail_poison(self, msg: Delivery, exc: Exception, request_id, reply_to) -> None:
        await _quiet(msg.term())
        if isinstance(request_id, str) and isinstance(reply_to, str):
            await self.worker.send_error(reply_to, request_id, exc)

    async def _run_handler(self, item: WorkItem) -> None:
        started = time.perf_counter()
        outcome = "ok"
        try:
            with request_scope(item.request_id):
                outcome = await self.handler(item) or "ok"
                self.log.debug("task_done", outcome=outcome, delivery=item.num_delivered,
                               ms=round((time.perf_counter() - started) * 1e3, 2))
        except PdError as exc:
            outcome = exc.code or exc.type
            if exc.ack_action == "nak" and not item.is_last_delivery and not self.worker.stopping.is_set():
                self.log.warning("task_retry", request_id=item.request_id, error=exc.message, delivery=item.num_delivered)
                await item.nak(delay_s=0.5 * item.num_delivered)
            else:
                self.log.warning("task_failed", request_id=item.request_id, error=exc.message)
                await self.worker.send_error(item.message.meta.reply_to, item.request_id, exc)
                await (item.term() if exc.ack_action == "term" else item.ack())
        except Exception as exc:
            outcome = "error"
            self.log.exception("task_crashed", request_id=item.request_id)
            await self.worker.send_error(item.message.meta.reply_to, item.request_id, exc)
            await item.ack()
        finally:
            self.in_flight.discard(item)
            self.metrics.in_flight.set(len(self.in_flight))
            self.metrics.tasks.labels(outcome).inc()
            self.metrics.process_seconds.observe(time.perf_counter() - started)
            self.room.set()

    async def keepalive(self) -> None:
        """Mark long-held items in progress every ``ack_wait / 3``."""
        period = max(0.5, self.worker.settings.ack_wait_s / 3)
        while not self.worker.stopping.is_set():
            await asyncio.sleep(period)
            now = time.monotonic()
            for item in list(self.in_flight):
                if not item.done and now - item.fetched_at >= period:
                    await _quiet(item.delivery.in_progress())

    async def drain(self, timeout_s: float) -> None:
        """Wait for in-flight items to finish, then nak the rest for another replica."""
        end = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for item in list(self.in_flight):
            await item.nak()
