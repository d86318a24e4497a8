"""What every pdserve worker process shares: the NATS connection, heartbeats, the abort
broadcast, the probe server (``/metrics``, ``/healthz``, ``/readyz``), signal handling and
graceful shutdown.

A stage subclasses :class:`Worker`, loads what it needs in :meth:`Worker.setup`, starts its
consumers in :meth:`Worker.serve`, and reports its load in :meth:`Worker.heartbeat_fields`.
Shutdown on SIGTERM/SIGINT: stop fetching new work → let in-flight work finish (up to
``drain_timeout_s``) → nak what is left so another replica takes it at once → drain the
NATS connection.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections import OrderedDict

from services.common.consumer import PullConsumer
from shared.bus import Bus, NoResponders
from shared.config import Settings
from shared.deadline import bounded, is_expired
from shared.logging import configure_logging, get_logger
from shared.messages import (
    Abort,
    ErrorEvent,
    Heartbeat,
    Message,
    RequestMeta,
    RequestStatus,
    StatusQuery,
    decode_as,
)
from shared.metrics import ProbeServer, cancel_metrics
from shared.model_files import served_model_name
from shared.nats_bus import NatsBus
from shared.tracing import configure_tracing

log = get_logger(__name__)


class RecentSet:
    """Ids seen in the last ``ttl_s`` seconds (aborted requests), bounded in size."""

    def __init__(self, ttl_s: float = 600.0, max_items: int = 100_000):
        self.ttl_s = ttl_s
        self.max_items = max_items
        self._items: OrderedDict[str, float] = OrderedDict()

    def add(self, key: str) -> None:
        self._items[key] = time.monotonic()
        self._items.move_to_end(key)
        self._expire()

    def __contains__(self, key: str) -> bool:
        self._expire()
        return key in self._items

    def has(self, key: str) -> bool:
        """Membership without expiring anything: safe to call from another thread (a dict
        lookup under the GIL), at the price of maybe seeing an id past its ``ttl_s``."""
        return key in self._items

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items:
            key, at = next(iter(self._items.items()))
            if now - at <= self.ttl_s and len(self._items) <= self.max_items:
                break
            self._items.popitem(last=False)


class Worker:
    """Base of the stage workers. Subclasses set ``stage`` and override the hooks."""

    stage: str = "worker"
    drain_timeout_s: float = 20.0

    def __init__(self, settings: Settings, bus: Bus | None = None):
        """``bus`` defaults to a NATS connection made at :meth:`start` (a test passes a
        :class:`~shared.memory_bus.MemoryBus`)."""
        self.settings = settings
        self.instance_id = settings.instance_id or f"{self.stage}-{uuid.uuid4().hex[:8]}"
        self.protocol = settings.protocol()
        self.model_name = served_model_name(settings)
        self.bus: Bus | None = bus
        self._owns_bus = bus is None
        self.aborted = RecentSet()
        self.started_at = time.time()
        self.gateway_heard: dict[str, float] = {}  # gateway inbox → monotonic time of its last heartbeat
        self.ready = False
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._probe: ProbeServer | None = None
        self.consumer: PullConsumer | None = None  # the stage's work queue, once serve() made it
        self.log = get_logger(self.stage)

    # --- hooks ------------------------------------------------------------------------------
    async def setup(self) -> None:
        """Load models/tokenizers (blocking work in threads). Runs before ``ready``."""

    async def serve(self) -> None:
        """Start consumers and subscriptions. Returns once they run."""

    async def on_abort(self, abort: Abort) -> None:
        """Drop all work on ``abort.request_id``."""

    async def drop_work(self, message) -> None:
        """A work item of a cancelled or expired request was dropped at fetch, unstarted: release
        what it holds elsewhere (decode: the staged tail of its KV)."""

    async def before_drain(self) -> None:
        """Stop taking work; finish or hand back in-flight work (nak). The base drains the
        stage's work-queue consumer, if it has one."""
        if self.consumer is not None:
            await self.consumer.drain(self.drain_timeout_s / 2)

    def heartbeat_fields(self) -> dict:
        """Extra Heartbeat fields: ``num_running``, ``num_waiting``, ``capacity``, ``inbox``."""
        return {}

    # --- cancellation and deadlines --------------------------------------------------------
    def cancel_reason(self, meta: RequestMeta) -> str | None:
        """"cancelled" (an Abort for it was heard), "deadline" (past ``meta.deadline_at``), or
        None: go on. The cancel set is this worker's :class:`RecentSet` of broadcast Aborts, so
        asking costs a dict lookup; every stage asks before it computes anything."""
        if meta.request_id in self.aborted:
            return "cancelled"
        if is_expired(meta.deadline_at):
            return "deadline"
        return None

    def count_cancelled(self, reason: str, phase: str) -> None:
        """Count a cancelled request's work: ``phase`` "queued" (dropped before computing) or
        "running" (stopped part way)."""
        cancel_metrics()["dropped"].labels(self.stage, reason, phase).inc()

    # --- helpers for subclasses ---------------------------------------------------------------
    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def send_error(self, reply_to: str, request_id: str, exc: Exception) -> None:
        """Report a failed request to its gateway as an ErrorEvent (OpenAI fields)."""
        from shared.errors import PdError

        if isinstance(exc, PdError):
            event = ErrorEvent(request_id=request_id, status=exc.status, message=exc.message, type=exc.type,
                               param=exc.param, code=exc.code)
        else:
            event = ErrorEvent(request_id=request_id, status=500, message=f"{self.stage} failed: {exc}",
                               type="server_error", code="internal_error")
        await self.publish(reply_to, event)

    @property
    def gateway_gone_s(self) -> float:
        """Silence after which a gateway that does not answer counts as gone: its own patience
        with a request that makes no progress (``first_token_timeout_s``, ``stall_timeout_s``).
        A gateway cut off from this worker that long has failed the request itself."""
        return max(self.settings.first_token_timeout_s, self.settings.stall_timeout_s)

    def gateway_silent_s(self, meta: RequestMeta) -> float:
        """Seconds since the request's gateway was last known alive: its last heartbeat heard
        here, or the request's creation (it was alive then), whichever is later."""
        since_created = max(0.0, time.time() - meta.created_at)
        heard = self.gateway_heard.get(meta.reply_to)
        return since_created if heard is None else min(since_created, time.monotonic() - heard)

    async def _on_gateway_heartbeat(self, message: Message) -> None:
        if isinstance(message, Heartbeat) and message.inbox:
            self.gateway_heard[message.inbox] = time.monotonic()

    async def still_wanted(self, meta: RequestMeta, num_delivered: int) -> bool:
        """Whether to start (or go on with) work on a request. Aborted or past-deadline
        requests are not. Redelivered work, or work queued before this worker started (it
        missed any Abort broadcast since), is checked with the request's gateway: closed means
        no; no answer in time means yes.

        "No responders" says only that no server route leads to the gateway now: right after a
        broker restart it has not subscribed again yet, and a cluster node cut off from its
        routes (a partition) hides every client on it — while the gateway still waits for the
        request. So it is asked again for ``heartbeat_timeout_s``; if it still cannot be
        reached, the request counts as wanted, unless the gateway has been silent (no
        heartbeat) for ``gateway_gone_s``: then it is dead, or it has given the request up
        (issue 19: a partition longer than heartbeat_timeout_s made workers drop
        redelivered work whose gateway was alive)."""
        reason = self.cancel_reason(meta)
        if reason is not None:
            self.count_cancelled(reason, "queued")
            return False
        if num_delivered <= 1 and meta.created_at >= self.started_at:
            return True
        ask_until = time.monotonic() + self.settings.heartbeat_timeout_s
        while True:
            if is_expired(meta.deadline_at):  # asking is a wait too: bounded by the deadline
                self.count_cancelled("deadline", "queued")
                return False
            try:
                reply = await self.bus.request(self.protocol.gateway_status(meta.reply_to),
                                               StatusQuery(request_id=meta.request_id),
                                               timeout_s=max(0.05, bounded(1.0, meta.deadline_at)))
                is_open = decode_as(reply, RequestStatus).open
                if not is_open:
                    self.count_cancelled("cancelled", "queued")
                return is_open
            except NoResponders:
                if self.gateway_silent_s(meta) >= self.gateway_gone_s:
                    self.log.warning("gateway_gone_dropping", request_id=meta.request_id,
                                     silent_s=round(self.gateway_silent_s(meta), 1))
                    return False
                if time.monotonic() >= ask_until or self.stopping.is_set():
                    self.log.info("gateway_unreachable_keeping", request_id=meta.request_id,
                                  silent_s=round(self.gateway_silent_s(meta), 1))
                    return True
                await asyncio.sleep(0.5)
            except Exception:
                return True

    async def publish(self, subject: str, message: Message) -> None:
        try:
            await self.bus.publish(subject, message)
        except Exception as exc:  # a lost core message is caught by the gateway's deadlines
            self.log.warning("publish_failed", subject=subject, error=str(exc))

    def post(self, subject: str, message: Message) -> None:
        """Queue a core publish from synchronous code; messages leave in the order posted."""
        self._outbox.put_nowait((subject, message, time.perf_counter()))

    async def _outbox_loop(self) -> None:
        from shared.metrics import stage_metrics

        waited = stage_metrics(self.stage).outbox_seconds
        while True:
            subject, message, posted_at = await self._outbox.get()
            waited.observe(time.perf_counter() - posted_at)
            await self.publish(subject, message)

    # --- life cycle ---------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        subject = self.protocol.heartbeat_of(self.stage)
        while not self.stopping.is_set():
            hb = Heartbeat(
                stage=self.stage,
                instance_id=self.instance_id,
                model=self.model_name,
                sent_at=time.time(),
                ready=self.ready,
                metrics_port=self._probe.port if self._probe else 0,
                **self.heartbeat_fields(),
            )
            if self.bus is not None and self.bus.is_connected:
                await self.publish(subject, hb)
            try:
                await asyncio.wait_for(self.stopping.wait(), self.settings.heartbeat_interval_s)
            except TimeoutError:
                pass

    async def _on_control(self, message: Message) -> None:
        if isinstance(message, Abort):
            if message.worker:
                if message.worker == self.instance_id:
                    await self.on_abort(message)  # only this worker lets go; the request goes on
                return
            self.aborted.add(message.request_id)
            await self.on_abort(message)

    async def start(self) -> None:
        s = self.settings
        configure_logging(self.stage, self.instance_id, s.log_level, s.log_json)
        configure_tracing(self.stage, s.tracing, s.otel_endpoint)
        self._probe = ProbeServer(s.metrics_host, s.metrics_port, lambda: self.ready and bool(self.bus and self.bus.is_connected)).start()
        self.log.info("starting", metrics_port=self._probe.port, nats=s.nats_url, namespace=s.namespace)
        if self.bus is None:
            self.bus = await NatsBus.connect(s, f"pdserve-{self.instance_id}")
        await self.bus.ensure_queues(self.protocol.work_queues)
        await self.bus.subscribe(self.protocol.abort, self._on_control)
        await self.bus.subscribe(self.protocol.heartbeat_of("gateway"), self._on_gateway_heartbeat)
        self.spawn(self._heartbeat_loop(), "heartbeat")
        self.spawn(self._outbox_loop(), "outbox")
        await self.setup()
        await self.serve()
        self.ready = True
        self.log.info("ready")

    async def stop(self) -> None:
        if self.stopping.is_set():
            return
        self.log.info("stopping")
        self.ready = False
        self.stopping.set()
        try:
            await asyncio.wait_for(self.before_drain(), self.drain_timeout_s)
        except TimeoutError:
            self.log.warning("drain_timeout")
        flush_until = time.monotonic() + 2.0
        while not self._outbox.empty() and time.monotonic() < flush_until:
            await asyncio.sleep(0.01)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.bus is not None and self._owns_bus:
            await self.bus.close()
        if self._probe:
            self._probe.stop()
        self.log.info("stopped")

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, then shut down gracefully."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            await stop.wait()
        finally:
            await self.stop()


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (capped at 1,048,576) and
    return the soft limit now in force. A decode worker maps every KV block of a prompt it
    imports from the shared-memory store (one descriptor per live map before Python 3.13: about
    370 for a 5,900-token prompt), and several hand-offs can be in flight; 1,024, a common default
    soft limit, would make a few long prompts fall back to slower reads. vLLM raises the same
    limit at start for its sockets."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            return soft
    return soft


def main(worker_cls: type[Worker]) -> None:
    """Entry point of ``python -m services.<stage>``."""
    settings = Settings.from_env()
    try:
        asyncio.run(worker_cls(settings).run())
    except KeyboardInterrupt:
        pass
