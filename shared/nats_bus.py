"""The NATS implementation of the bus seam (:class:`NatsBus`, see ``shared/bus.py``) and its
plumbing: connecting, declaring the work-queue streams and their durable pull consumers,
publishing work items idempotently, and core-NATS publish/subscribe.

Work items (TokenizeTask, PrefillTask, DecodeTask) ride JetStream work-queue streams: a
message is removed once acked, every replica of a stage pulls from the one durable consumer
(``<stage>-workers``), acks are explicit, unacked work is redelivered after ``ack_wait``, up to
``max_deliver`` times, and a re-published item with the same ``Nats-Msg-Id`` inside the
duplicate window is dropped by the server. Per-token traffic (TokenChunk, TextChunk) and
control messages (Abort, Heartbeat, Accepted, ErrorEvent) use core NATS: see
``docs/decisions.md`` for the measurement behind that choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_random_exponential

from shared import messages
from shared.bus import Bus, Delivery, EventHandler, NoResponders, PoisonHandler, RequestHandler
from shared.config import Settings
from shared.errors import PayloadTooLarge, ServiceUnavailable
from shared.logging import get_logger
from shared.nats_queues import (  # noqa: F401 (re-exported: tools and tests import them from here)
    DUPLICATE_WINDOW_S,
    MAX_AGE_S,
    MAX_MSGS,
    consumer_config,
    delete_namespace,
    ensure_all_queues,
    ensure_work_queue,
    stream_config,
)
from shared.subjects import WorkQueue

log = get_logger(__name__)

#: How long a work item's publish is retried (a broker restarting, a stream leader being
#: elected) before the request fails. A NATS restart takes a few seconds; a client on a
#: cluster node cut off from its routes waits for the cut to heal and a stream leader to be
#: elected (20 s was too short for 4 of 653 requests in a partition run, issue 19).
PUBLISH_RETRY_S = 60.0
#: Publish errors that mean "not now" rather than "never".
RETRYABLE_PUBLISH_ERRORS = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionReconnectingError,
                            nats.errors.StaleConnectionError,
                            nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError)
#: Seconds between checks that an idle work queue's consumer still exists.
CONSUMER_CHECK_S = 5.0
#: Lookups of a stream found missing before it is declared again (a second apart).
STREAM_LOOKUPS = 3
#: JetStream's "duplicate message id is in process": the first publish of this id is still being
#: replicated (a retry crossed it during a leader election); asking again gets its answer.
DUPLICATE_IN_PROCESS = 10158


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed publish (or declaration) means "not now" rather than "never"."""
    return isinstance(exc, RETRYABLE_PUBLISH_ERRORS) or (
        isinstance(exc, nats.js.errors.APIError) and exc.err_code == DUPLICATE_IN_PROCESS)


def is_retryable_declaration(exc: BaseException) -> bool:
    """Whether a failed queue declaration may succeed when asked again: what
    :func:`is_retryable` says, and "not found" answers (a stream's assignment not yet known to
    the node that answered, during a meta-leader election)."""
    return is_retryable(exc) or isinstance(exc, NotFoundError)


#: How long a one-shot client waits for its first connection to NATS.
CONNECT_DEADLINE_S = 5.0


async def connect(settings: Settings, name: str, *, max_reconnect_attempts: int = -1) -> NATS:
    """Connect to ``settings.nats_url`` (a comma-separated list: every node of a cluster; the
    client fails over between them).

    With the default ``max_reconnect_attempts=-1`` (services) it waits for the server as long
    as it takes, then reconnects forever after any disconnect. With ``>= 0`` (one-shot
    clients: ``pdserve status``, benchmarks, tests) the first connection must succeed within
    ``CONNECT_DEADLINE_S``.

    Raises:
        ServiceUnavailable: with ``max_reconnect_attempts >= 0``, no NATS server answered in time.
    """

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", error=str(exc))

    closing = {"nc": None}

    async def on_disconnect() -> None:
        nc = closing["nc"]
        if nc is not None and (nc.is_closed or nc.is_draining):
            return  # our own close
        log.warning("nats_disconnected")

    async def on_reconnect() -> None:
        log.info("nats_reconnected")

    fail_fast = max_reconnect_attempts >= 0
    try:
        # nats-py retries the first connection forever when max_reconnect_attempts is 0 or
        # negative, whatever allow_reconnect says: bound it here.
        connecting = nats.connect(
            servers=nats_servers(settings.nats_url),
            name=name,
            connect_timeout=3,
            allow_reconnect=True,
            max_reconnect_attempts=max_reconnect_attempts,
            reconnect_time_wait=0.5,
            ping_interval=5,
            max_outstanding_pings=3,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
        closing["nc"] = await (asyncio.wait_for(connecting, CONNECT_DEADLINE_S) if fail_fast else connecting)
        return closing["nc"]
    except Exception as exc:  # nats raises several unrelated types here
        why = "no answer" if isinstance(exc, asyncio.TimeoutError) else (str(exc) or exc.__class__.__name__)
        raise ServiceUnavailable(f"cannot reach NATS at {settings.nats_url}: {why}") from exc


def nats_servers(url: str) -> list[str]:
    """``PD_NATS_URL`` as a list of server URLs (it may name every node of a cluster)."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def publish_task(
    js: JetStreamContext,
    queue: WorkQueue,
    message: messages.Message,
    request_id: str,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = 5.0,
) -> js_api.PubAck:
    """Publish a work item and wait until JetStream has stored it.

    The ``Nats-Msg-Id`` is ``queue.msg_id(request_id)``, so retrying (here, or after a
    redelivery of the task that produced this one) never queues the work twice.

    Raises:
        PayloadTooLarge: the message is over the server's max_payload.
        ServiceUnavailable: JetStream did not take the message within ``PUBLISH_RETRY_S``.
    """
    payload = messages.encode(message)
    limit = js._nc.max_payload
    if limit and len(payload) > limit - 1024:
        raise PayloadTooLarge(f"the request is {len(payload)} bytes on the bus; at most {limit - 1024} fit")
    hdrs = {"Nats-Msg-Id": queue.msg_id(request_id), **(headers or {})}
    try:
        # through a broker restart or a stream leader election: the same Nats-Msg-Id, so a
        # publish that was stored but whose ack was lost is not queued twice
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(is_retryable),
            stop=stop_after_delay(PUBLISH_RETRY_S),
            wait=wait_random_exponential(multiplier=0.1, max=1.0),
            reraise=True,
        ):
            with attempt:
                return await js.publish(queue.subject, payload, timeout=timeout_s, headers=hdrs)
    except Exception as exc:
        raise ServiceUnavailable(f"could not queue work for {queue.stage}: {exc}") from exc
    raise AssertionError("unreachable")


async def publish_core(nc: NATS, subject: str, message: messages.Message) -> None:
    """Fire-and-forget publish on core NATS (no persistence, no ack)."""
    await nc.publish(subject, messages.encode(message))


async def subscribe_messages(
    nc: NATS,
    subject: str,
    handler: Callable[[messages.Message], Awaitable[None]],
    *,
    queue: str = "",
    on_poison: Callable[[Exception, bytes], None] | None = None,
):
    """Subscribe to a core subject and call ``handler`` with each decoded message. An
    undecodable payload goes to ``on_poison`` (logged by default); the subscription lives on."""

    async def cb(msg) -> None:
        try:
            decoded = messages.decode(msg.data)
        except Exception as exc:
            if on_poison:
                on_poison(exc, msg.data)
            else:
                log.warning("poison_message", subject=msg.subject, error=str(exc))
            return
        await handler(decoded)

    return await nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=1_000_000,
                              pending_bytes_limit=1 << 30)


async def wait_connected(nc: NATS, timeout_s: float) -> bool:
    """True once ``nc`` is connected (it may be reconnecting after a broker restart)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not nc.is_connected:
        if loop.time() > end:
            return False
        await asyncio.sleep(0.05)
    return True


async def close(nc: NATS) -> None:
    """Flush what is buffered (bounded) and close. Subscriptions are not drained: work
    items still held are nak'ed by their workers before this, or redelivered by JetStream."""
    try:
        await asyncio.wait_for(nc.flush(), 1.0)
    except Exception:
        pass
    try:
        await asyncio.wait_for(nc.close(), 2.0)
    except Exception:
        pass


class _NatsDelivery(Delivery):
    def __init__(self, msg):
        self._msg = msg
        self.data = msg.data
        try:
            self.num_delivered = msg.metadata.num_delivered
            self.queued_at = msg.metadata.timestamp.timestamp()
        except Exception:
            self.num_delivered, self.queued_at = 1, 0.0

    async def ack(self) -> None:
        await self._msg.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        await self._msg.nak(delay=delay_s)

    async def in_progress(self) -> None:
        await self._msg.in_progress()

    async def term(self) -> None:
        await self._msg.term()


class NatsBus(Bus):
    """The bus over NATS: work queues on JetStream, events and requests on core NATS.

    Build it with :meth:`connect`; ``nc`` is the underlying connection (for tools).
    """

    def __init__(self, nc: NATS, settings: Settings):
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self._pull_subs: dict[str, object] = {}
        self._checked_at: dict[str, float] = {}  # durable → loop time of its last existence check

    @classmethod
    async def connect(cls, settings: Settings, name: str, *, max_reconnect_attempts: int = -1) -> NatsBus:
        """Raises ServiceUnavailable as :func:`connect` does."""
        return cls(await connect(settings, name, max_reconnect_attempts=max_reconnect_attempts), settings)

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    async def ensure_queues(self, queues: Iterable[WorkQueue]) -> None:
        """Declare the queues; JetStream not answering yet (a cluster electing its meta leader,
        a node restarting) is waited for, up to ``PUBLISH_RETRY_S``.

        A "not found" is waited for too: while a cluster's meta leader is being elected, a node
        can answer a stream or consumer lookup (or the consumer's creation) with "stream not
        found" (10059) for a stream that exists; declaring again once a leader answers finds it.

        Raises:
            nats.js.errors.Error: JetStream still refused the declaration after ``PUBLISH_RETRY_S``.
        """
        for queue in queues:
            async for attempt in AsyncRetrying(retry=retry_if_exception(is_retryable_declaration),
                                               stop=stop_after_delay(PUBLISH_RETRY_S),
                                               wait=wait_random_exponential(multiplier=0.2, max=2.0), reraise=True):
                with attempt:
                    await ensure_work_queue(self.js, queue, self.settings)

    async def publish_work(self, queue: WorkQueue, message: messages.Message, request_id: str,
                           headers: dict[str, str] | None = None) -> None:
        await publish_task(self.js, queue, message, request_id, headers=headers)

    async def pull(self, queue: WorkQueue, max_items: int, timeout_s: float) -> list[Delivery]:
        """Fetch from the durable consumer; a stream or consumer gone (a broker restarted
        without its storage) is declared again and this returns []."""
        try:
            psub = self._pull_subs.get(queue.durable)
            if psub is None:
                psub = await self.js.pull_subscribe_bind(durable=queue.durable, stream=queue.stream)
                self._pull_subs[queue.durable] = psub
            msgs = await psub.fetch(max_items, timeout=timeout_s)
        except (TimeoutError, nats.errors.TimeoutError):
            await self._check_consumer(queue)
            return []
        except (NotFoundError, nats.js.errors.ServiceUnavailableError) as exc:
            log.warning("consumer_missing", queue=queue.stream, error=str(exc))
            self._pull_subs.pop(queue.durable, None)
            await self._recover_queue(queue)
            return []
        return [_NatsDelivery(m) for m in msgs]

    async def _check_consumer(self, queue: WorkQueue) -> None:
        """After an empty fetch, at most every ``CONSUMER_CHECK_S``: a fetch from a consumer
        (or stream) that is gone just times out, so ask whether it still exists."""
        now = asyncio.get_running_loop().time()
        if now - self._checked_at.get(queue.durable, now - CONSUMER_CHECK_S - 1) < CONSUMER_CHECK_S:
            return
        self._checked_at[queue.durable] = now
        try:
            await self.js.consumer_info(queue.stream, queue.durable, timeout=2.0)
        except NotFoundError as exc:
            log.warning("consumer_missing", queue=queue.stream, error=str(exc))
            self._pull_subs.pop(queue.durable, None)
            await self._recover_queue(queue)
        except Exception:
            pass  # no answer now (reconnecting, electing a leader): the next check asks again

    async def _recover_queue(self, queue: WorkQueue) -> None:
        """Declare a queue found missing again. A server still recovering its streams after a
        restart answers "not found" for a moment, so the stream is looked up a few times
        first; if it has to be created, what was queued in it is lost: say so on
        ``<ns>.control.stream_lost``, so gateways resubmit (``shared/recovery.py``)."""
        await asyncio.sleep(0.5)
        for _ in range(STREAM_LOOKUPS):
            try:
                await self.js.stream_info(queue.stream)
                break
            except NotFoundError:
                await asyncio.sleep(1.0)
            except Exception:
                return  # no answer at all (no leader yet, reconnecting): try again at the next pull
        try:
            created = await ensure_work_queue(self.js, queue, self.settings)
        except Exception as exc:
            log.warning("queue_declare_failed", queue=queue.stream, error=str(exc))
            return
        if created:
            log.error("work_queue_lost", queue=queue.stream)
            try:
                await publish_core(self.nc, self.settings.protocol().stream_lost,
                                   messages.WorkQueueLost(stage=queue.stage, stream=queue.stream))
            except Exception as exc:
                log.warning("stream_lost_publish_failed", error=str(exc))

    async def queue_depth(self, queue: WorkQueue) -> int:
        info = await self.js.consumer_info(queue.stream, queue.durable, timeout=1.0)
        return info.num_pending or 0

    async def publish(self, subject: str, message: messages.Message) -> None:
        await publish_core(self.nc, subject, message)

    async def subscribe(self, subject: str, handler: EventHandler, *, on_poison: PoisonHandler | None = None) -> None:
        await subscribe_messages(self.nc, subject, handler, on_poison=on_poison)

    async def request(self, subject: str, message: messages.Message, timeout_s: float) -> bytes:
        try:
            reply = await self.nc.request(subject, messages.encode(message), timeout=timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(subject) from exc
        except nats.errors.TimeoutError as exc:
            raise TimeoutError(f"no answer on {subject}") from exc
        return reply.data

    async def serve(self, subject: str, handler: RequestHandler) -> None:
        async def cb(msg) -> None:
            answer = await handler(msg.data)
            if answer is not None and msg.reply:
                await self.nc.publish(msg.reply, messages.encode(answer))

        await self.nc.subscribe(subject, cb=cb)

    async def close(self) -> None:
        await close(self.nc)
