"""The bus seam: the few operations the services need from the message bus.

* **work** — ``publish_work`` a work item on a stage's queue (de-duplicated by
  ``queue.msg_id(request_id)`` inside the duplicate window), ``pull`` up to n items from the
  stage's durable consumer (shared by its replicas: each item goes to one of them), and settle
  each :class:`Delivery` with ``ack`` / ``nak(delay)`` / ``in_progress`` / ``term``. An item
  neither acked nor marked in progress within ``ack_wait`` is delivered again (at least once),
  up to ``max_deliver`` times.
* **events** — ``publish`` / ``subscribe`` on subjects (no persistence; per-subscriber order
  kept; ``*`` and ``>`` wildcards as in NATS).
* **request/reply** — ``request`` a subject and await one answer; ``serve`` answers.

Two implementations pass one contract test (``tests/unit/test_bus_contract.py``):
:class:`shared.nats_bus.NatsBus` (JetStream work-queue streams + core NATS) and
:class:`shared.memory_bus.MemoryBus` (in-process, for service tests that run in
milliseconds). Messages are the msgspec structs of :mod:`shared.messages`.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Iterable

from shared.messages import Message
from shared.subjects import WorkQueue

#: Called with each decoded event.
EventHandler = Callable[[Message], Awaitable[None]]
#: Called with the raw payload of an undecodable event.
PoisonHandler = Callable[[Exception, bytes], None]
#: Answers a request's raw payload with a message (None: no answer).
RequestHandler = Callable[[bytes], Awaitable[Message | None]]


class NoResponders(Exception):
    """A request found nobody serving its subject."""


class Delivery(abc.ABC):
    """One delivery of a work item. Settle it exactly once (later calls are ignored)."""

    data: bytes
    #: 1 on the first delivery, 2 on the first redelivery, ...
    num_delivered: int
    #: unix seconds when the item was published
    queued_at: float

    @abc.abstractmethod
    async def ack(self) -> None:
        """Done: the item is removed from the queue."""

    @abc.abstractmethod
    async def nak(self, delay_s: float | None = None) -> None:
        """Not done here: deliver it again (to any replica) after ``delay_s`` seconds."""

    @abc.abstractmethod
    async def in_progress(self) -> None:
        """Still working on it: restart its ``ack_wait`` clock."""

    @abc.abstractmethod
    async def term(self) -> None:
        """Never deliver it again (a poison item)."""


class Bus(abc.ABC):
    """A connection to the bus (one per process)."""

    @property
    @abc.abstractmethod
    def is_connected(self) -> bool: ...

    @abc.abstractmethod
    async def ensure_queues(self, queues: Iterable[WorkQueue]) -> None:
        """Create the queues and their durable consumers if missing (idempotent)."""

    @abc.abstractmethod
    async def publish_work(self, queue: WorkQueue, message: Message, request_id: str,
                           headers: dict[str, str] | None = None) -> None:
        """Queue a work item once it is stored; a second item with the same
        ``queue.msg_id(request_id)`` inside the duplicate window is dropped.

        Raises:
            PayloadTooLarge: the item does not fit on the bus.
            ServiceUnavailable: the bus did not take it.
        """

    @abc.abstractmethod
    async def pull(self, queue: WorkQueue, max_items: int, timeout_s: float) -> list[Delivery]:
        """Up to ``max_items`` deliveries from the queue's durable consumer; waits up to
        ``timeout_s`` for the first, and returns [] when none came."""

    @abc.abstractmethod
    async def queue_depth(self, queue: WorkQueue) -> int:
        """Items waiting in the queue, not yet delivered."""

    @abc.abstractmethod
    async def publish(self, subject: str, message: Message) -> None:
        """Fire and forget: every current subscriber of ``subject`` gets it (or nobody)."""

    @abc.abstractmethod
    async def subscribe(self, subject: str, handler: EventHandler, *, on_poison: PoisonHandler | None = None) -> None:
        """Call ``handler`` with each decoded message on ``subject``, in order."""

    @abc.abstractmethod
    async def request(self, subject: str, message: Message, timeout_s: float) -> bytes:
        """The raw payload of the first answer.

        Raises:
            NoResponders: nobody serves ``subject``.
            TimeoutError: no answer within ``timeout_s``.
        """

    @abc.abstractmethod
    async def serve(self, subject: str, handler: RequestHandler) -> None:
        """Answer requests on ``subject`` with ``handler``'s message."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush what is buffered (bounded) and disconnect."""
