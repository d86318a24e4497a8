"""The OpenAI-compatible HTTP API: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/tokenize``, ``/detokenize``, health and metrics.

Errors are OpenAI error objects with the right status; client input never causes a 500.
Whatever can fail before streaming (bad JSON, bad parameters, unknown model, no live worker,
a prompt over the context) fails as a real HTTP status; after the first byte of a stream, an
error is a final ``data: {"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.gateway.admission import Admission
from services.gateway.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    openapi_bodies,
    validation_error_to_invalid,
)
from services.gateway.pipeline import PipelineClient
from services.gateway.responses import Responses, sse
from services.gateway.run import Choice, RequestRun
from services.gateway.timelines import Timeline
from services.tokenizer.prompts import PromptProcessor, model_limits
from shared.config import Settings
from shared.errors import (
    Aborted,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    PdError,
    ServiceUnavailable,
)
from shared.logging import get_logger, request_scope
from shared.messages import ChatMessage, RequestMeta, SamplingParams, TokenizeTask
from shared.metrics import gateway_metrics
from shared.models import is_complete, model_dir, served_model_name
from shared.timeline import now_mark
from shared.tracing import start_span

log = get_logger("gateway")

KEEPALIVE_S = 15.0
#: Timelines kept for /debug/timeline.
MAX_TIMELINES = 1000
ENDPOINT_LABELS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/models": "models",
    "/v1/models/{model_id:path}": "models",
    "/v1/usage": "usage",
}


def error_response(exc: PdError) -> JSONResponse:
    headers = {}
    if getattr(exc, "retry_after_s", None):
        headers["Retry-After"] = str(max(1, int(exc.retry_after_s + 0.999)))
    return JSONResponse(exc.to_openai(), status_code=exc.status, headers=headers)


class Gateway:
    """Request handling, independent of FastAPI's routing (kept in :func:`create_app`)."""

    def __init__(self, settings: Settings, client: PipelineClient):
        self.settings = settings
        self.client = client
        self.model_name = served_model_name(settings)
        self.vocab_size = 0
        self.max_model_len = 0
        self.prompts: PromptProcessor | None = None
        self.admission = Admission(settings)
        self.shutting_down_at: float | None = None
        self.timelines: OrderedDict[str, Timeline] = OrderedDict()
        self.metrics = gateway_metrics()
        self.created = int(time.time())

    def load_model(self) -> None:
        """Model limits (vocabulary, context) and the tokenizer (for /tokenize and echo)."""
        from transformers import AutoTokenizer

        folder = model_dir(self.settings)
        if not is_complete(folder):
            from engine.model_loader import ensure_model  # imports torch: only for a first conversion

            folder = ensure_model(self.settings, progress=True)
        self.vocab_size, self.max_model_len = model_limits(folder, self.settings.max_model_len)
        self.prompts = PromptProcessor(AutoTokenizer.from_pretrained(folder), self.vocab_size, self.max_model_len)

    # --- request parsing ------------------------------------------------------------------
    async def read_json(self, request: Request) -> dict:
        """The JSON object of a request body.

        Raises:
            PayloadTooLarge: over ``max_request_body_bytes``.
            InvalidRequest: not UTF-8, not JSON, or not an object.
        """
        limit = self.settings.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"request body is not valid UTF-8: {exc}", code="invalid_body") from None
        try:
            data = json.loads(text, parse_constant=_reject_constant)
            # lone surrogates ("\ud800") decode into str but cannot be encoded again
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                                 code="invalid_json") from None
        except RecursionError:
            raise InvalidRequest("request body is nested too deeply", code="invalid_json") from None
        except UnicodeEncodeError:
            raise InvalidRequest("request body holds a lone UTF-16 surrogate, which is not text",
                                 code="invalid_json") from None
        except ValueError as exc:  # e.g. an integer literal of thousands of digits
            raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise InvalidRequest("request body must be a JSON object", code="invalid_body")
        return data

    def parse(self, cls, data: dict):
        try:
            req = cls.model_validate(data)
        except ValidationError as exc:
            raise validation_error_to_invalid(exc) from None
        except RecursionError:
            raise InvalidRequest("request body is nested too deeply", code="invalid_body") from None
        if req.model != self.model_name:
            raise ModelNotFound(f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                                param="model")
        return req

    def sampling_for(self, req, max_tokens: int, seed: int, num_logprobs: int | None) -> SamplingParams:
        top_k = req.top_k if req.top_k not in (None, 0, -1) else None
        stop_ids = tuple(req.stop_token_ids or ())
        if any(t < 0 or t >= self.vocab_size for t in stop_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {self.vocab_size})", param="stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=req.min_p or 0.0,
            seed=seed,
            stop=req.stop_list(),
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias_ids(self.vocab_size),
            logprobs=num_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )

    def _meta(self, request_id: str, now: float, req, tenant: str) -> RequestMeta:
        salt = self.admission.cache_salt(tenant, req.cache_salt)
        return RequestMeta(
            request_id=request_id,
            reply_to=self.client.inbox,
            model=self.model_name,
            created_at=now,
            deadline_at=now + self.settings.request_timeout_s,
            cache_salt=salt,
        )

    @staticmethod
    def _base_seed(req) -> int:
        return (req.seed % (1 << 63)) if req.seed is not None else random.getrandbits(63)

    def chat_choices(self, req: ChatCompletionRequest, base_id: str, tenant: str = "") -> list[Choice]:
        """One pipeline request per choice; choice k samples with seed + k."""
        now = time.time()
        requested = req.requested_max_tokens()
        max_tokens = requested if requested is not None else self.max_model_len
        messages = [ChatMessage(role=m.role if m.role != "developer" else "system", content=m.text()) for m in req.messages]
        seed = self._base_seed(req)
        return [
            Choice(index=k, prompt_index=0, task=TokenizeTask(
                meta=self._meta(f"{base_id}-{k}", now, req, tenant),
                sampling=self.sampling_for(req, max_tokens, (seed + k) % (1 << 63), req.num_logprobs()),
                messages=messages,
                add_generation_prompt=req.add_generation_prompt,
                max_tokens_is_default=requested is None,
            ))
            for k in range(req.n)
        ]

    def completion_choices(self, req: CompletionRequest, base_id: str, tenant: str = "") -> list[Choice]:
        """One pipeline request per (prompt, choice); choice index = prompt * n + k, sampled
        with seed + index."""
        now = time.time()
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        seed = self._base_seed(req)
        choices = []
        for p, prompt in enumerate(req.prompts()):
            for k in range(req.n):
                index = p * req.n + k
                task = TokenizeTask(
                    meta=self._meta(f"{base_id}-{index}", now, req, tenant),
                    sampling=self.sampling_for(req, max_tokens, (seed + index) % (1 << 63), req.num_logprobs()),
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=prompt if isinstance(prompt, list) else None,
                )
                choices.append(Choice(index=index, prompt_index=p, task=task))
        return choices

    def echo_texts(self, req) -> list[str]:
        """Completions with ``echo``: each prompt's text (token-id prompts detokenized)."""
        if not getattr(req, "echo", False):
            return []
        out = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                out.append(prompt)
            else:
                self._check_token_ids(prompt, "prompt")
                out.append(self.prompts.tokenizer.decode(prompt))
        return out

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size})", param=param)

    # --- serving ----------------------------------------------------------------------------
    def authenticate(self, request: Request) -> str:
        """The caller's API key ("" when keys are off). Raises AuthenticationError (401)."""
        return self.admission.authenticate(request.headers.get("authorization"))

    async def serve(self, request: Request, endpoint: str, req, choices: list[Choice], request_id: str,
                    tenant: str, received_at: float) -> Response:
        if self.shutting_down_at is not None:
            raise ServiceUnavailable("the gateway is shutting down", code="shutting_down")
        self.client.check_ready()
        responses = Responses(endpoint, request_id, self.model_name, int(time.time()), req, self.echo_texts(req))
        try:  # per-key limits: reserves the prompt and max_tokens; settled in _end
            ticket = await self.admission.admit(tenant, self.client.queued, choices, self.prompts)
        except Overloaded as exc:
            self.metrics["rejected"].labels(exc.code or "overloaded").inc()
            raise

        async def on_tick() -> None:
            if await request.is_disconnected():
                raise Aborted("client disconnected")
            if self.shutting_down_at is not None and time.monotonic() - self.shutting_down_at > self.settings.shutdown_drain_s:
                raise ServiceUnavailable("the gateway is shutting down; retry the request", code="shutting_down")
            down = self.client.stages_down(self.settings.stage_down_grace_s)
            if down:
                raise ServiceUnavailable(f"no live worker for stage(s) {', '.join(down)} for "
                                         f"{self.settings.stage_down_grace_s:.0f}s")

        gateway_span = start_span("gateway", None, request_id=request_id, endpoint=endpoint)
        published = now_mark("gateway.published")
        choices = [replace(c, task=msgspec.structs.replace(c.task, meta=msgspec.structs.replace(
            c.task.meta, headers=gateway_span.headers))) for c in choices]
        run = RequestRun(self.client, choices, choices[0].task.meta.deadline_at, self.settings.stall_timeout_s,
                         on_tick=on_tick, first_token_timeout_s=self.settings.first_token_timeout_s)
        run.ticket = ticket  # type: ignore[attr-defined]
        run.timeline = Timeline(request_id, [("gateway.received", received_at), published])  # type: ignore[attr-defined]
        run.span = gateway_span  # type: ignore[attr-defined]
        if not req.stream:
            return await self._complete(endpoint, run, responses)
        return await self._stream(endpoint, run, responses)

    def _finish_timeline(self, run: RequestRun) -> Timeline:
        tl: Timeline = run.timeline  # type: ignore[attr-defined]
        tl.end(run.choices)
        self.timelines[tl.request_id] = tl
        while len(self.timelines) > MAX_TIMELINES:
            self.timelines.popitem(last=False)
        run.span.end()  # type: ignore[attr-defined]
        return tl

    def _begin(self) -> None:
        self.admission.inflight += 1
        self.metrics["in_flight"].inc()

    def _end(self, run: RequestRun, outcome: str | None = None) -> None:
        self.admission.inflight -= 1
        self.metrics["in_flight"].dec()
        self.metrics["output_tokens"].inc(sum(c.num_tokens for c in run.choices))
        if outcome is None:
            outcome = "ok" if all(c.finished for c in run.choices) else "error"
        self.admission.settle(getattr(run, "ticket", None), run.choices, outcome)

    async def _complete(self, endpoint: str, run: RequestRun, responses: Responses) -> Response:
        self._begin()
        try:
            async with run:
                await run.wait_accepted()
                async for delta in run.deltas():
                    if delta is not None and delta.text:
                        self._observe_token(run)
        finally:
            self._end(run)
        self._observe(endpoint, run, "ok")
        body = responses.complete(run.choices)
        tl = self._finish_timeline(run)
        return JSONResponse(body, headers={"X-PD-Timeline": tl.header()})

    async def _stream(self, endpoint: str, run: RequestRun, responses: Responses) -> Response:
        self._begin()
        await run.__aenter__()
        try:
            await run.wait_accepted()
        except BaseException as exc:
            self._end(run)
            await run.__aexit__(type(exc), exc, None)
            raise

        async def events() -> AsyncIterator[bytes]:
            outcome = "ok"
            exc_info: tuple = (None, None)
            last_write = time.monotonic()
            try:
                for first in responses.first_chunks(run.choices):
                    yield first
                async for d in run.deltas():
                    if d is None:
                        if time.monotonic() - last_write >= KEEPALIVE_S:
                            last_write = time.monotonic()
                            yield b": keep-alive\n\n"
                        continue
                    if d.text or d.finish_reason is not None or d.logprobs:
                        if d.text:
                            if run.first_token_at is not None and not run.timeline.first_flush:  # type: ignore[attr-defined]
                                run.timeline.first_flush = time.time()  # type: ignore[attr-defined]
                            self._observe_token(run)
                        last_write = time.monotonic()
                        yield responses.delta_chunk(d, run.choices)
                if responses.include_usage:
                    yield responses.usage_chunk(run.choices)
                yield sse("[DONE]")
                self._finish_timeline(run)
            except PdError as exc:
                outcome = exc.code or exc.type
                exc_info = (type(exc), exc)
                if not isinstance(exc, Aborted):
                    log.warning("stream_failed", request_id=responses.request_id, error=exc.message)
                    yield sse(exc.to_openai())
                    yield sse("[DONE]")
            except (asyncio.CancelledError, GeneratorExit) as exc:
                outcome = "client_disconnected"
                exc_info = (type(exc), exc)
                raise
            finally:
                self._end(run, outcome)
                await run.__aexit__(exc_info[0], exc_info[1], None)
                self._observe(endpoint, run, outcome)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "X-Request-Id": responses.request_id})

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

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self._check_token_ids(req.tokens, "tokens")
        return {"prompt": self.prompts.tokenizer.decode(req.tokens)}

    # --- metrics ----------------------------------------------------------------------------
    def _observe_token(self, run: RequestRun) -> None:
        now = time.monotonic()
        last = getattr(run, "_last_token_at", None)
        if last is None:
            self.metrics["ttft"].observe(now - run.started_at)
        else:
            self.metrics["itl"].observe(now - last)
        run._last_token_at = now  # type: ignore[attr-defined]

    def _observe(self, endpoint: str, run: RequestRun, outcome: str) -> None:
        self.metrics["e2e"].observe(time.monotonic() - run.started_at)
        self.metrics["requests"].labels(endpoint, outcome).inc()


def _reject_constant(name: str):
    raise InvalidRequest(f"request body is not valid JSON: {name} is not a JSON number", code="invalid_json")


def create_app(settings: Settings, client: PipelineClient | None = None) -> FastAPI:
    """The gateway application. ``client`` defaults to one built from ``settings``."""
    client = client or PipelineClient(settings)
    gw = Gateway(settings, client)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(gw.load_model)
        await client.start()
        gw.admission.start()  # SIGHUP reloads the keys file
        log.info("gateway_ready", url=f"http://{settings.gateway_host}:{settings.gateway_port}", model=gw.model_name,
                 instance=client.instance_id)
        yield
        await gw.admission.stop()
        await client.stop()

    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                  description="OpenAI-compatible API of a disaggregated LLM serving pipeline.")
    app.state.gateway = gw

    def endpoint_of(request: Request) -> str:
        """A bounded metric label: the matched route's name, never the raw path."""
        route = request.scope.get("route")
        return ENDPOINT_LABELS.get(getattr(route, "path", ""), "other")

    @app.exception_handler(PdError)
    async def on_pd_error(request: Request, exc: PdError):
        gw.metrics["requests"].labels(endpoint_of(request), exc.code or exc.type).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        return error_response(InvalidRequest(str(exc.errors()[0].get("msg", "invalid request"))))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        err = PdError(str(exc.detail))
        err.status = exc.status_code  # type: ignore[misc]
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"  # type: ignore[misc]
        err.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)  # type: ignore[misc]
        response = error_response(err)
        response.headers.update(getattr(exc, "headers", None) or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, exc: ClientDisconnect):
        # the client hung up while sending its body: nobody reads this answer, and it is not
        # a server error (nginx logs it as 499)
        gw.metrics["requests"].labels(endpoint_of(request), "client_disconnected").inc()
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        log.exception("unhandled_error", path=request.url.path)
        gw.metrics["requests"].labels(endpoint_of(request), "internal_error").inc()
        return JSONResponse({"error": {"message": "internal error", "type": "server_error", "param": None,
                                       "code": "internal_error"}}, status_code=500)

    bodies = openapi_bodies()

    @app.get("/v1/models")
    async def models(request: Request):
        gw.authenticate(request)
        return {"object": "list", "data": [{"id": gw.model_name, "object": "model", "created": gw.created,
                                            "owned_by": "pdserve", "max_model_len": gw.max_model_len,
                                            "vocab_size": gw.vocab_size}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        gw.authenticate(request)
        if model_id != gw.model_name:
            raise ModelNotFound(f"The model '{model_id}' does not exist", param="model")
        return {"id": gw.model_name, "object": "model", "created": gw.created, "owned_by": "pdserve"}

    @app.post("/v1/chat/completions", openapi_extra=bodies["chat"])
    async def chat_completions(request: Request):
        received_at = time.time()
        tenant = gw.authenticate(request)
        req = gw.parse(ChatCompletionRequest, await gw.read_json(request))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        with request_scope(request_id, user=req.user or ""):
            return await gw.serve(request, "chat", req, gw.chat_choices(req, request_id, tenant), request_id, tenant,
                                  received_at)

    @app.post("/v1/completions", openapi_extra=bodies["completion"])
    async def completions(request: Request):
        received_at = time.time()
        tenant = gw.authenticate(request)
        req = gw.parse(CompletionRequest, await gw.read_json(request))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        with request_scope(request_id, user=req.user or ""):
            return await gw.serve(request, "completion", req, gw.completion_choices(req, request_id, tenant),
                                  request_id, tenant, received_at)

    @app.post("/tokenize", openapi_extra=bodies["tokenize"])
    async def tokenize(request: Request):
        gw.authenticate(request)
        return await gw.offload(gw.tokenize, gw.parse(TokenizeRequest, await gw.read_json(request)))

    @app.post("/detokenize", openapi_extra=bodies["detokenize"])
    async def detokenize(request: Request):
        gw.authenticate(request)
        return await gw.offload(gw.detokenize, gw.parse(DetokenizeRequest, await gw.read_json(request)))

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    @app.api_route("/healthz", methods=["GET", "HEAD"], include_in_schema=False)
    async def health():
        return {"status": "ok"}

    @app.get("/health/ready")
    @app.head("/health/ready", include_in_schema=False)
    @app.api_route("/readyz", methods=["GET", "HEAD"], include_in_schema=False)
    async def ready():
        missing = client.missing_stages()
        ok = client.is_connected and not missing
        body = {"status": "ready" if ok else "not ready", "nats": client.is_connected, "missing_stages": missing,
                "workers": {s: len(client.registry.live(s)) for s in ("tokenizer", "prefill", "decode", "postfilter")}}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/debug/timeline/{request_id}")
    async def timeline(request_id: str, request: Request):
        """Where one recent request spent its time (phases that add up to its end-to-end time)."""
        gw.authenticate(request)
        tl = gw.timelines.get(request_id)
        if tl is None:
            err = PdError(f"no timeline for {request_id!r}: unknown, or older than the last {MAX_TIMELINES} requests")
            err.status, err.type, err.code = 404, "invalid_request_error", "not_found"  # type: ignore[misc]
            raise err
        return tl.to_dict()

    @app.get("/v1/usage")
    async def usage(request: Request):
        """Usage per API key name, summed over every gateway (admin key only)."""
        return await gw.admission.usage_report(request.headers.get("authorization"))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
