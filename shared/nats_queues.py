"""JetStream's side of the work queues: one work-queue stream per stage and its durable pull
consumer (``<stage>-workers``), declared idempotently by every process that uses them, with
``PD_NATS_REPLICAS`` copies of both on a cluster (a consumer kept on one node would lose what
it delivered and what was acked with that node). Used by :mod:`shared.nats_bus`."""

from __future__ import annotations

import nats
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from shared.config import Settings
from shared.logging import get_logger
from shared.subjects import Protocol, WorkQueue

log = get_logger(__name__)

#: Seconds JetStream remembers a Nats-Msg-Id for de-duplication.
DUPLICATE_WINDOW_S = 120.0
#: Oldest a queued work item may get before the stream drops it (requests have far
#: shorter deadlines; this only bounds what a dead deployment leaves behind).
MAX_AGE_S = 3600.0
#: Bound on queued work items per stream; publishing beyond it fails (back-pressure).
MAX_MSGS = 100_000
def stream_config(queue: WorkQueue, replicas: int = 1) -> js_api.StreamConfig:
    """A work-queue stream kept on ``replicas`` servers of the cluster (``PD_NATS_REPLICAS``)."""
    return js_api.StreamConfig(
        name=queue.stream,
        subjects=[queue.subject],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        storage=js_api.StorageType.FILE,
        discard=js_api.DiscardPolicy.NEW,
        max_msgs=MAX_MSGS,
        max_age=MAX_AGE_S,
        duplicate_window=DUPLICATE_WINDOW_S,
        num_replicas=replicas,
    )


def consumer_config(queue: WorkQueue, settings: Settings) -> js_api.ConsumerConfig:
    return js_api.ConsumerConfig(
        durable_name=queue.durable,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=10_000,
        max_waiting=512,
        filter_subject=queue.subject,
        deliver_policy=js_api.DeliverPolicy.ALL,
        # as many copies as the stream: a consumer on one node loses its state (what is
        # delivered, what is acked) with that node
        num_replicas=settings.nats_replicas,
    )


async def ensure_work_queue(js: JetStreamContext, queue: WorkQueue, settings: Settings) -> bool:
    """Create (or bring up to date) a work-queue stream and its durable consumer. Idempotent;
    every process that uses a queue calls it at start, so start-up order does not matter.

    Returns:
        whether this call created the stream (it did not exist).
    """
    config = stream_config(queue, settings.nats_replicas)
    created = False
    try:
        info = await js.stream_info(queue.stream)
        if info.config.num_replicas != config.num_replicas or info.config.duplicate_window != config.duplicate_window:
            await js.update_stream(config)
    except NotFoundError:
        try:
            await js.add_stream(config)
            created = True
        except nats.js.errors.BadRequestError:
            await js.stream_info(queue.stream)  # another process created it meanwhile
    cconfig = consumer_config(queue, settings)
    try:
        info = await js.consumer_info(queue.stream, queue.durable)
        if (info.config.ack_wait, info.config.max_deliver, info.config.num_replicas or 0) != (
                cconfig.ack_wait, cconfig.max_deliver, cconfig.num_replicas):
            await js.add_consumer(queue.stream, cconfig)  # updates a durable consumer in place
    except NotFoundError:
        try:
            await js.add_consumer(queue.stream, cconfig)
        except nats.js.errors.BadRequestError:
            await js.consumer_info(queue.stream, queue.durable)
    except nats.js.errors.BadRequestError as exc:
        log.warning("consumer_update_refused", durable=queue.durable, error=str(exc))
    return created


async def ensure_all_queues(js: JetStreamContext, protocol: Protocol, settings: Settings) -> None:
    for queue in protocol.work_queues:
        await ensure_work_queue(js, queue, settings)


async def delete_namespace(js: JetStreamContext, protocol: Protocol) -> None:
    """Delete every stream of a namespace (tests, ``pdserve down --purge``)."""
    for queue in protocol.work_queues:
        try:
            await js.delete_stream(queue.stream)
        except NotFoundError:
            pass
