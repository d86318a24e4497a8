"""Every message that crosses a process boundary, in one place.

Messages are frozen msgspec structs, tagged (``"type"`` field) and encoded as MessagePack.
They form one union, :data:`Message`; :func:`decode` turns bytes back into a struct and
raises :class:`~shared.errors.PoisonMessage` on anything that is not a known, well-formed
message (an unknown tag, a missing field, random bytes), so a worker can terminate it instead
of redelivering it forever.

Life cycle of a request (see ``docs/protocol.md`` for subjects and ack policies):

1. gateway → ``TokenizeTask`` (JetStream) → tokenizer
2. tokenizer → ``Accepted`` (core, to the gateway) and ``PrefillTask`` (JetStream) → prefill
3. prefill → KV blocks into the KV store; first token as ``TokenChunk`` (core) → postfilter;
   ``DecodeTask`` carrying a ``KVHandle`` (JetStream) → decode
4. decode → ``TokenChunk`` per step (core) → postfilter
5. postfilter → ``TextChunk`` (core) → gateway → SSE to the client
6. anyone → ``Abort`` (core broadcast) when a client goes away, a stop string is hit or a
   deadline passes; any stage → ``ErrorEvent`` (core, to the gateway) when it fails a request.
"""

from __future__ import annotations

from typing import Union

import msgspec

from shared.errors import PoisonMessage
from shared.kv.layout import KVHandle, KVLayout


class _Message(msgspec.Struct, frozen=True, tag_field="kind", omit_defaults=True):
    """Base of every top-level message: the ``kind`` field is its tag."""


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to pick tokens. Validated at the gateway; the engine trusts these values.

    ``temperature`` 0 is greedy. ``top_k`` None and ``top_p`` 1.0 and ``min_p`` 0.0 are off.
    ``seed`` is always set by the gateway (a random one when the client gave none), so every
    request is reproducible and can be regenerated token for token after a worker dies.
    ``max_tokens`` counts output tokens. ``logprobs``: None = off, k = the chosen token's
    log-probability plus the k most likely alternatives. ``prompt_logprobs``: the same for
    every prompt token after the first, computed in prefill (``echo`` with ``logprobs``).
    ``grammar``: llguidance grammar (``shared/structured.py``) the output must follow.
    ``speculative``: False opts the request out of speculative decoding (``engine/speculative.py``;
    it never changes tokens, only how many a step produces).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    grammar: str | None = None
    speculative: bool = True

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or so close to it that dividing logits by it overflows float32:
        below 1e-5 sampling is greedy (the threshold vLLM uses, ``_SAMPLING_EPS``)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE


#: Temperatures below this sample greedily (see :attr:`SamplingParams.is_greedy`).
GREEDY_BELOW_TEMPERATURE = 1e-5


class RequestMeta(msgspec.Struct, frozen=True, omit_defaults=True):
    """What every stage knows about a request.

    ``reply_to`` is the gateway instance's inbox subject; ``deadline_at`` is unix seconds
    after which every stage drops the request; ``cache_salt`` separates tenants' prefix
    caches; ``headers`` carries trace context; ``marks`` is the request's timeline so far,
    ``(event, unix seconds)`` appended by each stage (``shared/timeline.py``).
    """

    request_id: str
    reply_to: str
    model: str
    created_at: float
    deadline_at: float
    cache_salt: str = ""
    headers: dict[str, str] = {}
    marks: list[tuple[str, float]] = []


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    content: str
    tool_calls: list[dict] | None = None  # these two only for chat templates that render tools
    tool_call_id: str | None = None


class TokenizeTask(_Message, tag="tokenize"):
    """Gateway → tokenizer. Exactly one of ``messages``, ``prompt``, ``prompt_token_ids``."""

    meta: RequestMeta
    sampling: SamplingParams
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    add_generation_prompt: bool = True
    max_tokens_is_default: bool = False
    tools: list[dict] | None = None  # function tools for a chat template that renders them


class PrefillTask(_Message, tag="prefill"):
    """Tokenizer → prefill. ``block_hashes[i]`` is the chained SHA-256 of full block i."""

    meta: RequestMeta
    sampling: SamplingParams
    prompt_token_ids: list[int]
    block_hashes: list[bytes]


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One output token's log-probability and its ``top`` alternatives ((token_id, logprob))."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class DecodeTask(_Message, tag="decode"):
    """Prefill → decode. ``output_token_ids`` holds the tokens already sampled (at least the
    first one, from prefill); decode continues after them and streams to ``postfilter``.

    Routed straight from the tokenizer (aggregated serving, or the router chose a local
    prefill): no output tokens, no KV handle, no postfilter yet; decode prefills the prompt
    itself (reusing prefix blocks named by ``block_hashes``), picks the postfilter and streams
    from the first token."""

    meta: RequestMeta
    sampling: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    postfilter: str = ""
    kv: KVHandle | None = None
    num_cached_tokens: int = 0
    block_hashes: list[bytes] = []
    route: str = ""


class KVPrefetch(_Message, tag="kv_prefetch"):
    """Prefill → every decode worker (core broadcast), after each early put of a long prompt
    (``PD_KV_STAGE_DURING_PREFILL``): the prompt's leading full blocks ``block_hashes`` are in
    the KV store now. A decode worker with a free slot reads the ones it lacks into its prefix
    cache before the DecodeTask comes (``PD_KV_PREFETCH``), so the hand-off after the first token
    reads only the last chunk's blocks and the tail. A hint: missing it, or acting on it late,
    only means reading those blocks at the hand-off as without it."""

    request_id: str
    layout: KVLayout
    block_hashes: list[bytes]
    headers: dict[str, str] = {}  # the request's trace context: the read's span joins its trace


class SpecStats(msgspec.Struct, frozen=True, array_like=True):
    """Speculative decoding of one request on the decode worker that finished it
    (engine/speculative.py): draft tokens verified, drafts accepted, and the output tokens and
    engine steps that produced them there."""

    num_draft_tokens: int
    num_accepted_tokens: int
    num_tokens: int
    num_steps: int


class StreamSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the postfilter needs to know about a request; sent with its first token chunk."""

    reply_to: str
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    deadline_at: float = 0.0
    headers: dict[str, str] = {}
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, meta: RequestMeta, sampling: SamplingParams, num_prompt_tokens: int, num_cached_tokens: int) -> StreamSpec:
        return cls(reply_to=meta.reply_to, stop=sampling.stop, skip_special_tokens=sampling.skip_special_tokens,
                   include_stop_str_in_output=sampling.include_stop_str_in_output,
                   num_prompt_tokens=num_prompt_tokens, num_cached_tokens=num_cached_tokens,
                   deadline_at=meta.deadline_at, headers=meta.headers, stop_token_ids=sampling.stop_token_ids)


class TokenChunk(_Message, tag="tokens"):
    """Prefill/decode → postfilter. ``token_ids`` are output tokens ``index, index+1, ...``.

    ``spec`` is present exactly when ``index`` is 0, and so are ``prompt_logprobs`` (prompt
    tokens 1.., when the request asked for them). ``finish_reason`` ("stop" | "length")
    is set on the request's last chunk. ``worker`` is the sending instance: one decode worker
    owns a request's stream at a time (the last to take it over, or to ``replay`` it from index
    0 to a new postfilter); chunks from any other are dropped.
    """

    request_id: str
    index: int
    token_ids: list[int]
    spec: StreamSpec | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    worker: str = ""
    replay: bool = False
    marks: list[tuple[str, float]] = []
    prompt_logprobs: list[TokenLogprob] | None = None
    spec_stats: SpecStats | None = None  # on the last chunk


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """An alternative token: its text, log-probability and raw bytes (a byte-level token
    may hold part of a UTF-8 character)."""

    token: str
    logprob: float
    bytes: list[int]


class OutputLogprob(msgspec.Struct, frozen=True, array_like=True):
    """An output token's text, log-probability, raw bytes and top alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[TopLogprob] = []


class TextChunk(_Message, tag="text"):
    """Postfilter → gateway. ``text`` starts at character ``text_offset`` of the output, so a
    gateway can drop text it already sent when a chunk is re-sent after a failover.
    ``logprobs`` (when asked for) has one entry per output token this chunk consumed.
    ``source`` is the postfilter's inbox: where to ask for a resend (:class:`TextResend`).
    ``prompt_logprobs`` (prompt tokens 1.., when asked for) rides on the request's first chunk."""

    request_id: str
    text: str
    text_offset: int
    num_tokens: int
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[OutputLogprob] | None = None
    source: str = ""
    marks: list[tuple[str, float]] = []
    prompt_logprobs: list[OutputLogprob] | None = None
    spec_stats: SpecStats | None = None  # on the last chunk, from the decode worker


class Accepted(_Message, tag="accepted"):
    """Tokenizer → gateway: the prompt is valid and queued for prefill."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    prompt_token_ids: list[int] = []


class ErrorEvent(_Message, tag="error"):
    """Any stage → gateway: the request failed. Fields map onto OpenAI's error object."""

    request_id: str
    status: int
    message: str
    type: str = "server_error"
    param: str | None = None
    code: str | None = None


class Abort(_Message, tag="abort"):
    """Broadcast: stop all work on ``request_id`` and release its KV.

    ``reason``: "client_disconnected" | "stop" | "deadline" | "error" | "superseded" | ...
    With ``worker`` set, only that worker instance stops (it lost the request to another:
    a redelivered DecodeTask now runs elsewhere); the request itself goes on.
    """

    request_id: str
    reason: str
    worker: str = ""


class ResumeQuery(_Message, tag="resume_query"):
    """Decode → the postfilter that owns a request (request/reply): which tokens have you got?
    Asked by a decode worker that took over a request from a dead one."""

    request_id: str
    worker: str = ""


class ResumeState(_Message, tag="resume_state"):
    """Postfilter → decode: the output tokens received so far, in order, without gaps;
    ``finished`` when the request already ended (nothing left to do)."""

    request_id: str
    output_token_ids: list[int] = []
    known: bool = False
    finished: bool = False


class Progress(_Message, tag="progress"):
    """A stage → gateway: the request is being worked on (a long prefill), so silence on its
    stream is not a stall."""

    request_id: str
    stage: str


class WorkQueueLost(_Message, tag="work_queue_lost"):
    """A worker → every gateway (core NATS broadcast on ``<ns>.control.stream_lost``): the
    work-queue stream of ``stage`` was lost by the broker and declared again empty, so work
    queued in it is gone and the gateways resubmit (``services/gateway/recovery.py``)."""

    stage: str
    stream: str = ""


class StatusQuery(_Message, tag="status_query"):
    """A worker → the gateway that owns a request (request/reply): is it still wanted? Asked
    before redelivered or old work is started, so nobody computes for a client that left."""

    request_id: str


class RequestStatus(_Message, tag="request_status"):
    request_id: str
    open: bool


class TokenResend(_Message, tag="token_resend"):
    """Postfilter → the decode worker that owns a request: tokens from ``from_index`` on never
    arrived (a broker restart lost them); send them again."""

    request_id: str
    from_index: int


class TextResend(_Message, tag="text_resend"):
    """Gateway → the postfilter that owns a request: text from character ``from_offset`` on
    never arrived (or the stream went quiet); send it again, with the finish if there was one."""

    request_id: str
    from_offset: int


class Heartbeat(_Message, tag="heartbeat"):
    """Every worker, every ``heartbeat_interval_s``. ``inbox`` is the worker's own subject
    (postfilter instances receive token streams there). ``ready`` is false until the model or
    tokenizer is loaded. Model workers add what the router's cost model needs: their measured
    prefill rate, decode step time, and prompt tokens still to prefill."""

    stage: str
    instance_id: str
    model: str
    sent_at: float
    ready: bool = True
    inbox: str = ""
    num_running: int = 0
    num_waiting: int = 0
    capacity: int = 0
    metrics_port: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    queued_prefill_tokens: int = 0
    kv_dtype: str = ""
    kv_bytes_per_token: int = 0


Message = Union[  # noqa: UP007 (a runtime union for msgspec)
    TokenizeTask,
    PrefillTask,
    DecodeTask,
    TokenChunk,
    TextChunk,
    Accepted,
    ErrorEvent,
    Abort,
    ResumeQuery,
    ResumeState,
    Progress,
    WorkQueueLost,
    StatusQuery,
    RequestStatus,
    TokenResend,
    TextResend,
    Heartbeat,
    KVPrefetch,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """MessagePack bytes of one message (its tag included)."""
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Decode bytes into a message.

    Raises:
        PoisonMessage: the bytes are not a well-formed message of a known type.
    """
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PoisonMessage(f"undecodable message ({len(data)} bytes): {exc}") from None


def decode_as(data: bytes, kind: type[msgspec.Struct]) -> Message:
    """Decode and check the message is a ``kind``.

    Raises:
        PoisonMessage: undecodable, or a different message type than expected.
    """
    message = decode(data)
    if not isinstance(message, kind):
        raise PoisonMessage(f"expected {kind.__name__}, got {type(message).__name__}")
    return message
