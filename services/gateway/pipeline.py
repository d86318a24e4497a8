"""The gateway's side of the bus: submitting requests, receiving their events, aborting,
and knowing which stages are alive.

Each gateway instance has one inbox subject (``<ns>.gateway.<instance>.events``). A request
is registered (its event queue exists) *before* its TokenizeTask is published, so no event
can arrive unrouted; it is unregistered in ``finally``.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from services.gateway.recovery import Resubmitter
from shared import messages
from shared.bus import Bus
from shared.config import Settings
from shared.deadline import task_headers
from shared.errors import PoisonMessage, ServiceUnavailable
from shared.logging import get_logger
from shared.messages import Abort, Heartbeat, Message, RequestStatus, StatusQuery, TextResend, TokenizeTask
from shared.metrics import queue_metrics
from shared.model_files import served_model_name
from shared.registry import WorkerRegistry

log = get_logger(__name__)

#: Stages that must have a live, ready worker for the gateway to accept requests.
PIPELINE_STAGES = ("tokenizer", "prefill", "decode", "postfilter")


class PipelineClient:
    """Bus connection, inbox routing and the worker registry of one gateway.

    Args:
        settings: the gateway's settings.
        bus: the bus; defaults to a NATS connection made at :meth:`start`.
    """

    def __init__(self, settings: Settings, bus: Bus | None = None):
        self.settings = settings
        self.protocol = settings.protocol()
        self.instance_id = settings.instance_id or f"gateway-{uuid.uuid4().hex[:8]}"
        self.inbox = self.protocol.gateway_inbox(self.instance_id)
        self.registry = WorkerRegistry(settings.heartbeat_timeout_s)
        self.bus: Bus | None = bus
        self._owns_bus = bus is None
        self._routes: dict[str, asyncio.Queue] = {}
        self.backlog: dict[str, int] = {}
        self.missing_since: dict[str, float] = {}
        self.resubmitter = Resubmitter(self)
        #: Prompt tokens this gateway admitted that have no first token yet, announced in its
        #: heartbeats (``queued_prefill_tokens``) for the other gateways' admission; set by the Gateway.
        self.admitted_prompt_tokens = lambda: 0
        self._heartbeat_task: asyncio.Task | None = None  # both started by start()
        self._watch_task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.bus is None:
            from shared.nats_bus import NatsBus

            self.bus = await NatsBus.connect(self.settings, f"pdserve-{self.instance_id}")
        await self.bus.ensure_queues(self.protocol.work_queues)
        await self.bus.subscribe(self.inbox, self._on_event)
        await self.bus.serve(self.protocol.gateway_status(self.inbox), self._on_status)
        await self.bus.subscribe(self.protocol.heartbeat, self._on_heartbeat)
        await self.bus.subscribe(self.protocol.stream_lost, self.resubmitter.on_stream_lost)
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())
        self._watch_task = asyncio.create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        """Every second: the work queues' backlogs, and since when each stage has had no
        live worker."""
        backlog_gauge = queue_metrics()
        while True:
            now = time.monotonic()
            for stage in self.required_stages:
                if self.registry.live(stage):
                    self.missing_since.pop(stage, None)
                else:
                    self.missing_since.setdefault(stage, now)
            if self.is_connected:
                for queue in self.protocol.work_queues:
                    try:
                        depth = await self.bus.queue_depth(queue)
                    except Exception:
                        continue
                    self.backlog[queue.stage] = depth
                    backlog_gauge.labels(queue.stage).set(depth)
            await asyncio.sleep(1.0)

    @property
    def queued(self) -> int:
        """Work items waiting for a tokenizer or prefill worker (not yet delivered)."""
        return self.backlog.get("tokenizer", 0) + self.backlog.get("prefill", 0)

    def stages_down(self, grace_s: float) -> list[str]:
        """Stages that have had no live worker for longer than ``grace_s``."""
        now = time.monotonic()
        return [s for s, since in self.missing_since.items() if now - since > grace_s]

    async def _heartbeat_loop(self) -> None:
        """The gateway announces itself too (``pdserve status``, dashboards)."""
        subject = self.protocol.heartbeat_of("gateway")
        while True:
            if self.is_connected:
                hb = Heartbeat(stage="gateway", instance_id=self.instance_id, model=served_model_name(self.settings),
                               sent_at=time.time(), inbox=self.inbox, num_running=len(self._routes),
                               metrics_port=self.settings.gateway_port,
                               queued_prefill_tokens=self.admitted_prompt_tokens())
                try:
                    await self.bus.publish(subject, hb)
                except Exception:
                    pass
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def stop(self) -> None:
        """Abort whatever is still open (its clients are gone with this gateway), then close."""
        if self.is_connected:
            for rid in list(self._routes):
                await self.abort(rid, "gateway_shutdown")
        for task in (self._heartbeat_task, self._watch_task):
            if task is not None:
                task.cancel()
        if self.bus is not None and self._owns_bus:
            await self.bus.close()

    async def _on_event(self, message: Message) -> None:
        queue = self._routes.get(getattr(message, "request_id", ""))
        if queue is not None:
            self.resubmitter.observe(message)
            queue.put_nowait(message)

    async def _on_status(self, data: bytes) -> RequestStatus | None:
        """A worker asks whether a request is still wanted (before redelivered work)."""
        try:
            query = messages.decode_as(data, StatusQuery)
        except PoisonMessage:
            return None
        return RequestStatus(request_id=query.request_id, open=query.request_id in self._routes)

    async def _on_heartbeat(self, message: Message) -> None:
        if isinstance(message, Heartbeat):
            self.registry.observe(message)

    # --- readiness ------------------------------------------------------------------------
    @property
    def required_stages(self) -> tuple[str, ...]:
        """The stages requests need: the pluggable pre-stages, then the pipeline (aggregated
        serving has no prefill workers; conditional routing prefills on the decode worker when
        no prefill worker is alive)."""
        stages = tuple(f"stage-{n}" for n in self.protocol.pre_stages) + PIPELINE_STAGES
        if self.settings.routing in ("aggregated", "conditional"):
            return tuple(s for s in stages if s != "prefill")
        return stages

    def missing_stages(self) -> list[str]:
        """Stages with no live, ready worker now."""
        return [stage for stage in self.required_stages if not self.registry.live(stage)]

    @property
    def is_connected(self) -> bool:
        return self.bus is not None and self.bus.is_connected

    def check_ready(self) -> None:
        """Raises ServiceUnavailable naming what is missing."""
        if not self.is_connected:
            raise ServiceUnavailable("the gateway is not connected to NATS")
        missing = self.missing_stages()
        if missing:
            raise ServiceUnavailable(f"no live worker for stage(s): {', '.join(missing)}")

    # --- requests -------------------------------------------------------------------------
    def register(self, request_id: str, queue: asyncio.Queue) -> None:
        self._routes[request_id] = queue

    def unregister(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
        self.resubmitter.forget(request_id)

    async def submit(self, task: TokenizeTask) -> None:
        """Queue a request for the tokenizer (durable once this returns).

        Raises:
            ServiceUnavailable: JetStream did not take it.
        """
        self.resubmitter.submitted(task)
        await self.bus.publish_work(self.protocol.entry, task, task.meta.request_id,
                                    headers=task_headers(task.meta.deadline_at))

    async def resend_text(self, source: str, request_id: str, from_offset: int) -> None:
        """Ask the postfilter at ``source`` for a request's text from ``from_offset`` on; with no
        text yet (``from_offset`` 0) every postfilter and decode worker is asked: the first
        token may have been lost before the postfilter knew the request."""
        subject = self.protocol.postfilter_control(source) if source and from_offset else self.protocol.resend
        try:
            await self.bus.publish(subject,
                                   TextResend(request_id=request_id, from_offset=from_offset))
        except Exception as exc:
            log.warning("resend_publish_failed", request_id=request_id, error=str(exc))

    async def abort(self, request_id: str, reason: str) -> None:
        """Tell every stage to drop ``request_id`` (best effort)."""
        try:
            await self.bus.publish(self.protocol.abort, Abort(request_id=request_id, reason=reason))
        except Exception as exc:
            log.warning("abort_publish_failed", request_id=request_id, error=str(exc))
