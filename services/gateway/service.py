"""The gateway's request handling, apart from HTTP routing (``routes.py``): admit a parsed
request, open its :class:`~services.gateway.request_run.RequestRun` (register → submit → events →
finish or abort) with ``async with``, and render the answer — whole, or as an SSE stream.

A stream fails before its first byte when it can: the run is entered and the prompt accepted
before the response starts, so a bad prompt or a missing stage is a real HTTP status; after
that an error is a final ``data: {"error": ...}`` event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.common.model import servable_model_folder
from services.gateway.disconnect import DisconnectWatch
from services.gateway.echo import PromptEcho
from services.gateway.openai_models import DetokenizeRequest, TokenizeRequest
from services.gateway.parse import ChoiceBuilder
from services.gateway.pipeline import PipelineClient
from services.gateway.request_run import Choice, RequestRun
from services.gateway.responses import Responses, sse
from services.gateway.tenancy.admission import Admission, Ticket
from services.gateway.tenancy.keys import Tenant
from services.gateway.timelines import Timeline
from services.gateway.tools.responses import responses_for
from services.tokenizer.prompts import PromptProcessor, model_limits
from shared.config import Settings
from shared.errors import Aborted, Overloaded, PdError, ServiceUnavailable
from shared.logging import get_logger
from shared.metrics import gateway_metrics
from shared.model_files import load_tokenizer, served_model_name
from shared.timeline import now_mark
from shared.tracing import start_span

log = get_logger("gateway")
KEEPALIVE_S = 15.0
#: Longest a request waits for the gateway to reconnect to NATS before a 503 (a broker restart
#: takes a few seconds; see issue 19).
RECONNECT_WAIT_S = 10.0
#: Timelines kept for /debug/timeline.
MAX_TIMELINES = 1000


class Gateway:
    """One gateway instance: its pipeline client, admission, model limits and metrics."""

    def __init__(self, settings: Settings, client: PipelineClient):
        self.settings = settings
        self.client = client
        self.model_name = served_model_name(settings)
        self.vocab_size = 0
        self.max_model_len = 0
        self.prompts: PromptProcessor | None = None
        self.choices: ChoiceBuilder | None = None
        self.admission = Admission(settings)
        client.admitted_prompt_tokens = lambda: self.admission.waits.backlog.prompt_tokens  # in its heartbeats
        self.shutting_down_at: float | None = None
        self.timelines: OrderedDict[str, Timeline] = OrderedDict()
        self.metrics = gateway_metrics()
        self.created = int(time.time())

    def load_model(self) -> None:
        """Model limits (vocabulary, context) and the tokenizer (for /tokenize and echo)."""
        folder = servable_model_folder(self.settings)
        self.vocab_size, self.max_model_len = model_limits(folder, self.settings.max_model_len)
        self.prompts = PromptProcessor(load_tokenizer(folder), self.vocab_size, self.max_model_len)
        self.choices = ChoiceBuilder(self.settings, self.model_name, self.client.inbox, self.prompts)

    def authenticate(self, request: Request) -> str:
        """The caller's API key ("" when keys are off). Raises AuthenticationError (401)."""
        return self.admission.authenticate(request.headers.get("authorization"))

    # --- admit → submit → render ------------------------------------------------------------
    async def serve(self, request: Request, endpoint: str, req, choices: list[Choice], request_id: str,
                    tenant: Tenant, received_at: float) -> Response:
        """Answer one completion request.

        Raises:
            ServiceUnavailable: shutting down, or a stage has no live worker (503).
            Overloaded: admission refused it (429; 503 when the predicted wait is too long).
            PdError: whatever the pipeline reports before the first byte of a stream.
        """
        if self.shutting_down_at is not None:
            raise ServiceUnavailable("the gateway is shutting down", code="shutting_down")
        reconnect_until = time.monotonic() + RECONNECT_WAIT_S
        while not self.client.is_connected and time.monotonic() < reconnect_until:
            await asyncio.sleep(0.05)  # a broker restart delays requests rather than refusing them
        # a stage unheard for a moment — the gateway's NATS node cut from its routes, a node
        # restarting — delays requests the same way; one missing for stage_down_grace_s is
        # refused at once (issue 19: a 5 s partition of the gateway's node refused 200 of 491)
        while (self.client.missing_stages() and time.monotonic() < reconnect_until
               and not self.client.stages_down(self.settings.stage_down_grace_s)):
            await asyncio.sleep(0.1)
        self.client.check_ready()
        # echo prompts are checked first: a 400 never holds a concurrent slot or a reservation
        responses = responses_for(endpoint, request_id, self.model_name, int(time.time()), req,
                                  self.choices.echo_texts(req), PromptEcho.of(req, self.prompts))
        ticket = await self._admit(tenant, choices)
        run = self._new_run(request, endpoint, choices, request_id, ticket, received_at)
        if not req.stream:
            return await self._complete(endpoint, run, responses)
        return await self._stream(endpoint, run, responses)

    async def _admit(self, tenant: Tenant, choices: list[Choice]) -> Ticket:
        """Admission, with the per-key limits' reservation (prompt + max_tokens), settled when
        the run closes (:meth:`_opened`)."""
        try:
            return await self.admission.admit(tenant, self.client.queued, choices, self.prompts,
                                              self._heartbeats(), self.client.instance_id)
        except Overloaded as exc:
            self.metrics["rejected"].labels(exc.code or "overloaded").inc()
            raise

    def _heartbeats(self) -> dict:
        """The live heartbeats admission predicts waits from, by stage."""
        live = self.client.registry.live
        return {stage: live(stage) for stage in ("prefill", "decode", "gateway")}

    def _new_run(self, request: Request, endpoint: str, choices: list[Choice], request_id: str, ticket: Ticket,
                 received_at: float) -> RequestRun:
        gateway_span = start_span("gateway", None, request_id=request_id, endpoint=endpoint)
        published = now_mark("gateway.published")
        choices = [replace(c, task=msgspec.structs.replace(c.task, meta=msgspec.structs.replace(
            c.task.meta, headers=gateway_span.headers))) for c in choices]
        return RequestRun(self.client, choices, choices[0].task.meta.deadline_at, self.settings.stall_timeout_s,
                          on_tick=lambda: self._check_alive(request),
                          first_token_timeout_s=self.settings.first_token_timeout_s,
                          ticket=ticket, span=gateway_span, watch=DisconnectWatch(request.receive),
                          timeline=Timeline(request_id, [("gateway.received", received_at), published]))

    async def _check_alive(self, request: Request) -> None:
        """Called every second of a request's wait: the client, the drain, the stages."""
        if await request.is_disconnected():
            raise Aborted("client disconnected")
        if self.shutting_down_at is not None and time.monotonic() - self.shutting_down_at > self.settings.shutdown_drain_s:
            raise ServiceUnavailable("the gateway is shutting down; retry the request", code="shutting_down")
        down = self.client.stages_down(self.settings.stage_down_grace_s)
        if down:
            raise ServiceUnavailable(f"no live worker for stage(s) {', '.join(down)} for "
                                     f"{self.settings.stage_down_grace_s:.0f}s")

    @asynccontextmanager
    async def _opened(self, run: RequestRun):
        """The run, counted in flight while open; on close its key's reservation is settled
        and its usage metered under the outcome (ok, the error's code, client_disconnected)."""
        self.admission.inflight += 1
        self.metrics["in_flight"].inc()
        outcome = "ok"
        try:
            async with run:
                yield run
        except PdError as exc:
            outcome = exc.code or exc.type
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_disconnected"
            raise
        finally:
            self.admission.inflight -= 1
            self.metrics["in_flight"].dec()
            self.metrics["output_tokens"].inc(sum(c.num_tokens for c in run.choices))
            self.admission.settle(run.ticket, run.choices, outcome)

    async def _complete(self, endpoint: str, run: RequestRun, responses: Responses) -> Response:
        async with self._opened(run):
            await run.wait_accepted()
            async for delta in run.deltas():
                if delta is not None and delta.text:
                    self._observe_token(run)
        self._observe(endpoint, run, "ok")
        body = responses.complete(run.choices)
        tl = self._finish_timeline(run)
        return JSONResponse(body, headers={"X-PD-Timeline": tl.header()})

    async def _stream(self, endpoint: str, run: RequestRun, responses: Responses) -> Response:
        events = self._events(endpoint, run, responses)
        await anext(events)  # the run is open and its prompts accepted (or this raised: a real status)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "X-Request-Id": responses.request_id})

    async def _events(self, endpoint: str, run: RequestRun, responses: Responses) -> AsyncIterator[bytes]:
        """The SSE body. Its first item (b"") comes once the prompts are accepted; an error
        before that propagates, an error after it is the stream's last event."""
        outcome, started = "ok", False
        try:
            async with self._opened(run):
                await run.wait_accepted()
                started = True
                yield b""
                for first in responses.first_chunks(run.choices):
                    yield first
                async for chunk in self._deltas(run, responses):
                    yield chunk
                if responses.include_usage:
                    yield responses.usage_chunk(run.choices)
                yield sse("[DONE]")
                self._finish_timeline(run)
        except PdError as exc:
            if not started:
                raise
            outcome = exc.code or exc.type
            if not isinstance(exc, Aborted):
                log.warning("stream_failed", request_id=responses.request_id, error=exc.message)
                yield sse(exc.to_openai())
                yield sse("[DONE]")
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_disconnected"
            raise
        finally:
            if started:
                self._observe(endpoint, run, outcome)

    async def _deltas(self, run: RequestRun, responses: Responses) -> AsyncIterator[bytes]:
        """Each choice's new text as chunks, with keep-alives through silences."""
        last_write = time.monotonic()
        async for d in run.deltas():
            if d is None:
                if time.monotonic() - last_write >= KEEPALIVE_S:
                    last_write = time.monotonic()
                    yield b": keep-alive\n\n"
                continue
            if d.text or d.finish_reason is not None or d.logprobs or d.prompt_logprobs is not None:
                if d.text:
                    if run.first_token_at is not None and not run.timeline.first_flush:
                        run.timeline.first_flush = time.time()
                    self._observe_token(run)
                last_write = time.monotonic()
                yield responses.delta_chunk(d, run.choices)

    def _finish_timeline(self, run: RequestRun) -> Timeline:
        tl = run.timeline
        tl.end(run.choices)
        self.timelines[tl.request_id] = tl
        while len(self.timelines) > MAX_TIMELINES:
            self.timelines.popitem(last=False)
        run.span.end()
        return tl

    # --- tokenizer helpers ----------------------------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> dict:
        if req.messages is not None:
            text = self.prompts.render_chat([m.model_dump() | {"content": m.text()} for m in req.messages],
                                            req.add_generation_prompt)
            ids = self.prompts.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.prompts.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = self.prompts.tokenizer.convert_ids_to_tokens(ids)
        return body

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.choices.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.prompts.tokenizer.decode(req.tokens)}

    async def offload(self, fn, *args):
        """Run a CPU-bound helper (``/tokenize``, ``/detokenize``) in a thread, so a large one
        never stalls the event loop that streams everyone's tokens; it counts against the
        in-flight limit like any request.

        Raises:
            Overloaded: the in-flight limit is reached (429).
        """
        try:
            self.admission.check_inflight()
        except Overloaded as exc:
            self.metrics["rejected"].labels(exc.code or "overloaded").inc()
            raise
        self.admission.inflight += 1
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self.admission.inflight -= 1

    # --- metrics ----------------------------------------------------------------------------
    def _observe_token(self, run: RequestRun) -> None:
        now = time.monotonic()
        if run.last_token_at is None:
            self.metrics["ttft"].observe(now - run.started_at)
            self.admission.first_token(run.ticket, run.choices)
        else:
            self.metrics["itl"].observe(now - run.last_token_at)
        run.last_token_at = now

    def _observe(self, endpoint: str, run: RequestRun, outcome: str) -> None:
        self.metrics["e2e"].observe(time.monotonic() - run.started_at)
        self.metrics["requests"].labels(endpoint, outcome).inc()
