"""The gateway's side of lost-work recovery (``shared/recovery.py``): when a worker reports
that a stage's work-queue stream was lost (``<ns>.control.stream_lost``), every request of
this gateway that has no text yet may have had its work item in it, so it is submitted again
as a new attempt (its own de-duplication ids). A request whose work survived elsewhere is
then computed twice at worst; the stream receivers drop the duplicate tokens and text."""

from __future__ import annotations

import time

import msgspec

from shared.deadline import task_headers
from shared.logging import get_logger
from shared.messages import Message, TextChunk, TokenizeTask, WorkQueueLost
from shared.recovery import RESUBMITTED, work_id
from shared.timeline import with_mark

log = get_logger(__name__)

#: One stream loss is reported by each stream lost at once: a request is resubmitted at most
#: once in this many seconds.
RESUBMIT_DEBOUNCE_S = 5.0


class Resubmitter:
    """What one gateway submitted and which requests have text, to resubmit after a loss.

    Args:
        client: the gateway's PipelineClient (its ``bus`` and ``protocol``).
    """

    def __init__(self, client):
        self.client = client
        self.tasks: dict[str, TokenizeTask] = {}
        self.has_text: set[str] = set()
        self.resubmitted_at: dict[str, float] = {}

    def submitted(self, task: TokenizeTask) -> None:
        self.tasks[task.meta.request_id] = task

    def forget(self, request_id: str) -> None:
        self.tasks.pop(request_id, None)
        self.has_text.discard(request_id)
        self.resubmitted_at.pop(request_id, None)

    def observe(self, message: Message) -> None:
        """An event for one of this gateway's requests (text means its work is past the queues)."""
        if isinstance(message, TextChunk) and message.request_id in self.tasks:
            self.has_text.add(message.request_id)

    async def on_stream_lost(self, message: Message) -> None:
        """Resubmit every request without text (not one resubmitted in the last few seconds)."""
        if not isinstance(message, WorkQueueLost):
            return
        now = time.monotonic()
        waiting = [rid for rid in self.tasks if rid not in self.has_text
                   and now - self.resubmitted_at.get(rid, float("-inf")) > RESUBMIT_DEBOUNCE_S]
        log.warning("stream_lost_resubmitting", stage=message.stage, requests=len(waiting))
        for rid in waiting:
            task = self.tasks[rid]
            task = msgspec.structs.replace(task, meta=with_mark(task.meta, RESUBMITTED))
            self.tasks[rid] = task
            self.resubmitted_at[rid] = now
            try:
                await self.client.bus.publish_work(self.client.protocol.entry, task, work_id(task.meta),
                                                   headers=task_headers(task.meta.deadline_at))
            except Exception as exc:
                log.warning("resubmit_failed", request_id=rid, error=str(exc))
