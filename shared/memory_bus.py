"""An in-process :class:`~shared.bus.Bus`: JetStream's work-queue semantics (one durable
consumer per queue, explicit acks, redelivery after ``ack_wait`` up to ``max_deliver``,
de-duplication by message id) and core NATS's events and request/reply, in one event loop.

Services started with ``bus=MemoryBus(...)`` run without a NATS server, so their logic is
tested in milliseconds; one bus object is shared by every service of the test. It passes the
same contract test as :class:`shared.nats_bus.NatsBus` (``tests/unit/test_bus_contract.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared import messages
from shared.bus import Bus, Delivery, EventHandler, NoResponders, PoisonHandler, RequestHandler
from shared.logging import get_logger
from shared.messages import Message
from shared.subjects import WorkQueue

log = get_logger(__name__)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` the rest (one or more tokens)."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


@dataclass(slots=True, eq=False)
class _Item:
    data: bytes
    msg_id: str
    queued_at: float
    num_delivered: int = 0
    available_at: float = 0.0  # monotonic: when it may be delivered (a nak delay)
    deadline: float = 0.0  # monotonic: ack_wait of its current delivery


@dataclass(slots=True, eq=False)
class _Queue:
    waiting: deque = field(default_factory=deque)
    in_flight: dict = field(default_factory=dict)  # delivery token → _Item
    seen: dict = field(default_factory=dict)  # msg id → monotonic publish time
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class _MemoryDelivery(Delivery):
    def __init__(self, bus: MemoryBus, queue: _Queue, token: int, item: _Item):
        self._bus, self._queue, self._token, self._item = bus, queue, token, item
        self.data = item.data
        self.num_delivered = item.num_delivered
        self.queued_at = item.queued_at

    def _settle(self) -> _Item | None:
        return self._queue.in_flight.pop(self._token, None)

    async def ack(self) -> None:
        self._settle()

    async def term(self) -> None:
        self._settle()

    async def nak(self, delay_s: float | None = None) -> None:
        item = self._settle()
        if item is not None:
            item.available_at = time.monotonic() + (delay_s or 0.0)
            self._queue.waiting.append(item)
            self._queue.changed.set()

    async def in_progress(self) -> None:
        if self._token in self._queue.in_flight:
            self._item.deadline = time.monotonic() + self._bus.ack_wait_s


class MemoryBus(Bus):
    """Args:
        ack_wait_s: seconds before an unsettled delivery is delivered again.
        max_deliver: deliveries of one item at most.
        duplicate_window_s: seconds a message id is remembered for de-duplication.
    """

    def __init__(self, ack_wait_s: float = 30.0, max_deliver: int = 5, duplicate_window_s: float = 120.0):
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver
        self.duplicate_window_s = duplicate_window_s
        self._queues: dict[str, _Queue] = {}
        self._subs: list[tuple[str, asyncio.Queue]] = []
        self._servers: list[tuple[str, RequestHandler]] = []
        self._tasks: set[asyncio.Task] = set()
        self._tokens = itertools.count()
        self._closed = False

    @property
    def is_connected(self) -> bool:
        return not self._closed

    def _queue(self, queue: WorkQueue) -> _Queue:
        return self._queues.setdefault(queue.subject, _Queue())

    # --- work -------------------------------------------------------------------------------
    async def ensure_queues(self, queues: Iterable[WorkQueue]) -> None:
        for queue in queues:
            self._queue(queue)

    async def publish_work(self, queue: WorkQueue, message: Message, request_id: str,
                           headers: dict[str, str] | None = None) -> None:
        q = self._queue(queue)
        now = time.monotonic()
        for msg_id, at in list(q.seen.items()):
            if now - at > self.duplicate_window_s:
                del q.seen[msg_id]
        msg_id = queue.msg_id(request_id)
        if msg_id in q.seen:
            return
        q.seen[msg_id] = now
        q.waiting.append(_Item(messages.encode(message), msg_id, time.time()))
        q.changed.set()

    def _redeliver_expired(self, q: _Queue, now: float) -> None:
        for token, item in list(q.in_flight.items()):
            if item.deadline <= now:
                del q.in_flight[token]
                q.waiting.append(item)

    def _take(self, q: _Queue, max_items: int) -> list[Delivery]:
        now = time.monotonic()
        self._redeliver_expired(q, now)
        out: list[Delivery] = []
        for item in list(q.waiting):
            if len(out) >= max_items:
                break
            if item.available_at > now:
                continue
            q.waiting.remove(item)
            if item.num_delivered >= self.max_deliver:
                continue  # delivered max_deliver times: JetStream stops delivering it
            item.num_delivered += 1
            item.deadline = now + self.ack_wait_s
            token = next(self._tokens)
            q.in_flight[token] = item
            out.append(_MemoryDelivery(self, q, token, item))
        return out

    def _next_wake(self, q: _Queue) -> float:
        times = [i.deadline for i in q.in_flight.values()] + [i.available_at for i in q.waiting]
        return min(times, default=float("inf"))

    async def pull(self, queue: WorkQueue, max_items: int, timeout_s: float) -> list[Delivery]:
        q = self._queue(queue)
        end = time.monotonic() + timeout_s
        while True:
            got = self._take(q, max_items)
            now = time.monotonic()
            if got or now >= end:
                return got
            q.changed.clear()
            wait = min(end, self._next_wake(q)) - now
            try:
                await asyncio.wait_for(q.changed.wait(), max(0.001, wait))
            except TimeoutError:
                pass

    async def queue_depth(self, queue: WorkQueue) -> int:
        return len(self._queue(queue).waiting)

    # --- events -----------------------------------------------------------------------------
    async def publish(self, subject: str, message: Message) -> None:
        data = messages.encode(message)
        for pattern, inbox in self._subs:
            if subject_matches(pattern, subject):
                inbox.put_nowait(data)

    async def subscribe(self, subject: str, handler: EventHandler, *, on_poison: PoisonHandler | None = None) -> None:
        inbox: asyncio.Queue = asyncio.Queue()
        self._subs.append((subject, inbox))
        self._spawn(self._deliver(subject, inbox, handler, on_poison))

    async def _deliver(self, subject: str, inbox: asyncio.Queue, handler: EventHandler,
                       on_poison: PoisonHandler | None) -> None:
        while True:
            data = await inbox.get()
            try:
                decoded = messages.decode(data)
            except Exception as exc:
                if on_poison:
                    on_poison(exc, data)
                else:
                    log.warning("poison_message", subject=subject, error=str(exc))
                continue
            try:
                await handler(decoded)
            except Exception:
                log.exception("subscriber_failed", subject=subject)

    # --- request/reply ----------------------------------------------------------------------
    async def request(self, subject: str, message: Message, timeout_s: float) -> bytes:
        handler = next((h for pattern, h in self._servers if subject_matches(pattern, subject)), None)
        if handler is None:
            raise NoResponders(subject)
        reply = await asyncio.wait_for(handler(messages.encode(message)), timeout_s)
        if reply is None:
            raise TimeoutError(f"no answer on {subject}")
        return messages.encode(reply)

    async def serve(self, subject: str, handler: RequestHandler) -> None:
        self._servers.append((subject, handler))

    # --- life cycle ---------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._subs.clear()
        self._servers.clear()
