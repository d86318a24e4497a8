"""Every NATS subject, JetStream stream and durable consumer, named in one module.

Subjects are lowercase dotted ``<ns>.<stage>.<kind>``; streams are UPPER_SNAKE; durables
are ``<stage>-workers``. ``<ns>`` is ``PD_NAMESPACE`` (default ``pd``), so that deployments
and test runs sharing one NATS server never see each other's traffic.
``docs/protocol.md`` has the same table in prose.
"""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("gateway", "tokenizer", "prefill", "decode", "postfilter")


@dataclass(frozen=True, slots=True)
class WorkQueue:
    """A JetStream work-queue stream with one durable pull consumer shared by all replicas."""

    stage: str
    subject: str
    stream: str
    durable: str

    def msg_id(self, request_id: str) -> str:
        """``Nats-Msg-Id`` of a request's work item here: JetStream drops a duplicate
        published within the stream's duplicate window, so a retried hand-off is idempotent."""
        return f"{self.stage}:{request_id}"


@dataclass(frozen=True, slots=True)
class Protocol:
    """Names for one namespace. ``pre_stages`` are the names of pluggable pre-processing
    stages (``PD_PRE_STAGES``), in order: requests pass through them before the tokenizer."""

    namespace: str = "pd"
    pre_stages: tuple[str, ...] = ()

    def _queue(self, stage: str) -> WorkQueue:
        ns = self.namespace
        return WorkQueue(
            stage=stage,
            subject=f"{ns}.{stage}.tasks",
            stream=f"{ns.upper().replace('-', '_')}_{stage.upper().replace('-', '_')}_TASKS",
            durable=f"{stage}-workers",
        )

    def stage_queue(self, name: str) -> WorkQueue:
        """TokenizeTask: into the pluggable pre-stage ``name``."""
        return self._queue(f"stage-{name}")

    @property
    def entry(self) -> WorkQueue:
        """Where the gateway sends a request: the first pre-stage, else the tokenizer."""
        return self.stage_queue(self.pre_stages[0]) if self.pre_stages else self.tokenize

    def after_stage(self, name: str) -> WorkQueue:
        """Where pre-stage ``name`` passes a request on: the next pre-stage, or the tokenizer."""
        i = self.pre_stages.index(name)
        return self.stage_queue(self.pre_stages[i + 1]) if i + 1 < len(self.pre_stages) else self.tokenize

    @property
    def tokenize(self) -> WorkQueue:
        """TokenizeTask: gateway → tokenizer."""
        return self._queue("tokenizer")

    @property
    def prefill(self) -> WorkQueue:
        """PrefillTask: tokenizer → prefill."""
        return self._queue("prefill")

    @property
    def decode(self) -> WorkQueue:
        """DecodeTask: prefill → decode."""
        return self._queue("decode")

    @property
    def work_queues(self) -> tuple[WorkQueue, ...]:
        return (*(self.stage_queue(n) for n in self.pre_stages), self.tokenize, self.prefill, self.decode)

    def postfilter_inbox(self, instance_id: str) -> str:
        """Core NATS: TokenChunk stream of the requests assigned to one postfilter instance."""
        return f"{self.namespace}.postfilter.{instance_id}.tokens"

    def postfilter_resume(self, inbox: str) -> str:
        """Core NATS request/reply: ResumeQuery → ResumeState, for the instance whose token
        inbox is ``inbox``."""
        return inbox.removesuffix(".tokens") + ".resume"

    def postfilter_control(self, inbox: str) -> str:
        """Core NATS: TextResend for the postfilter instance whose token inbox is ``inbox``."""
        return inbox.removesuffix(".tokens") + ".control"

    def decode_control(self, instance_id: str) -> str:
        """Core NATS: TokenResend for one decode worker instance."""
        return f"{self.namespace}.decode.{instance_id}.control"

    def gateway_inbox(self, instance_id: str) -> str:
        """Core NATS: Accepted / TextChunk / ErrorEvent for one gateway instance's requests."""
        return f"{self.namespace}.gateway.{instance_id}.events"

    def gateway_status(self, reply_to: str) -> str:
        """Core NATS request/reply: StatusQuery → RequestStatus, at the gateway whose event
        inbox is ``reply_to``."""
        return reply_to.removesuffix(".events") + ".status"

    @property
    def abort(self) -> str:
        """Core NATS broadcast: Abort, seen by every worker of every stage."""
        return f"{self.namespace}.control.abort"

    @property
    def resend(self) -> str:
        """Core NATS broadcast: TextResend from offset 0 for a request whose gateway has no text
        yet and does not know who streams it; every postfilter and decode worker hears it."""
        return f"{self.namespace}.control.resend"

    @property
    def kv_prefetch(self) -> str:
        """Core NATS broadcast: KVPrefetch from a prefill worker after each early put of a long
        prompt's blocks; every decode worker hears it (``PD_KV_PREFETCH``)."""
        return f"{self.namespace}.control.kv_prefetch"

    @property
    def stream_lost(self) -> str:
        """Core NATS broadcast: WorkQueueLost(stage, stream) when a worker found the
        stage's work-queue stream gone and declared it again: what was queued there is lost,
        and the gateways resubmit their requests that have no text yet."""
        return f"{self.namespace}.control.stream_lost"

    @property
    def heartbeat(self) -> str:
        """Core NATS: Heartbeat of every worker (``<ns>.heartbeat.<stage>``)."""
        return f"{self.namespace}.heartbeat.*"

    def heartbeat_of(self, stage: str) -> str:
        return f"{self.namespace}.heartbeat.{stage}"

    @property
    def token_stream_js(self) -> str:
        """JetStream subject used only by the token-transport benchmark (core NATS is what
        the pipeline uses; see docs/decisions.md)."""
        return f"{self.namespace}.bench.tokens"
