"""The OpenAI-compatible HTTP API: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, health and metrics.

Errors are OpenAI error objects with the right status; client input never causes a 500.
Whatever can fail before streaming (bad JSON, bad parameters, unknown model, no live worker,
a prompt over the context) fails as a real HTTP status; after the first byte of a stream, an
error is a final ``data: {"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    validation_error_to_invalid,
)
from services.gateway.pipeline import PipelineClient
from services.gateway.run import Choice, Delta, RequestRun
from services.tokenizer.worker import model_limits
from shared.config import Settings
from shared.errors import Aborted, InvalidRequest, ModelNotFound, PayloadTooLarge, PdError
from shared.logging import get_logger, request_scope
from shared.messages import ChatMessage, RequestMeta, SamplingParams, TokenizeTask
from shared.metrics import gateway_metrics
from shared.models import is_complete, model_dir, served_model_name

log = get_logger("gateway")

KEEPALIVE_S = 15.0
_json = msgspec.json.Encoder()


def sse(payload: dict | str) -> bytes:
    """One SSE event: ``data: <json>`` and a blank line."""
    data = payload.encode() if isinstance(payload, str) else _json.encode(payload)
    return b"data: " + data + b"\n\n"


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
        self.metrics = gateway_metrics()
        self.created = int(time.time())

    def load_model_limits(self) -> None:
        folder = model_dir(self.settings)
        if not is_complete(folder):
            from engine.model_loader import ensure_model  # imports torch: only for a first conversion

            folder = ensure_model(self.settings, progress=True)
        self.vocab_size, self.max_model_len = model_limits(folder, self.settings.max_model_len)

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
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                                 code="invalid_json") from None
        if not isinstance(data, dict):
            raise InvalidRequest("request body must be a JSON object", code="invalid_body")
        return data

    def parse(self, cls, data: dict):
        try:
            req = cls.model_validate(data)
        except ValidationError as exc:
            raise validation_error_to_invalid(exc) from None
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

    def _meta(self, request_id: str, now: float, req, headers: dict[str, str]) -> RequestMeta:
        return RequestMeta(
            request_id=request_id,
            reply_to=self.client.inbox,
            model=self.model_name,
            created_at=now,
            deadline_at=now + self.settings.request_timeout_s,
            cache_salt=req.cache_salt or "",
            headers=headers,
        )

    def _base_seed(self, req) -> int:
        return (req.seed % (1 << 63)) if req.seed is not None else random.getrandbits(63)

    def chat_choices(self, req: ChatCompletionRequest, base_id: str) -> list[Choice]:
        now = time.time()
        requested = req.requested_max_tokens()
        max_tokens = requested if requested is not None else self.max_model_len
        messages = [ChatMessage(role=m.role if m.role != "developer" else "system", content=m.text()) for m in req.messages]
        seed = self._base_seed(req)
        choices = []
        for k in range(req.n):
            task = TokenizeTask(
                meta=self._meta(f"{base_id}-{k}", now, req, {}),
                sampling=self.sampling_for(req, max_tokens, (seed + k) % (1 << 63), req.num_logprobs()),
                messages=messages,
                add_generation_prompt=req.add_generation_prompt,
                max_tokens_is_default=requested is None,
            )
            choices.append(Choice(index=k, prompt_index=0, task=task))
        return choices

    def completion_choices(self, req: CompletionRequest, base_id: str) -> list[Choice]:
        now = time.time()
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        seed = self._base_seed(req)
        choices = []
        for p, prompt in enumerate(req.prompts()):
            for k in range(req.n):
                index = p * req.n + k
                task = TokenizeTask(
                    meta=self._meta(f"{base_id}-{index}", now, req, {}),
                    sampling=self.sampling_for(req, max_tokens, (seed + k) % (1 << 63), req.num_logprobs()),
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=prompt if isinstance(prompt, list) else None,
                )
                choices.append(Choice(index=index, prompt_index=p, task=task))
        return choices

    # --- responses ------------------------------------------------------------------------
    @staticmethod
    def usage_of(choices: list[Choice]) -> dict:
        prompt_tokens = {}
        cached = {}
        completion = 0
        for c in choices:
            prompt_tokens[c.prompt_index] = c.num_prompt_tokens
            if c.usage is not None:
                cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.usage.cached_tokens)
            completion += c.usage.completion_tokens if c.usage else c.num_tokens
        p = sum(prompt_tokens.values())
        return {
            "prompt_tokens": p,
            "completion_tokens": completion,
            "total_tokens": p + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }

    async def run(self, request: Request, endpoint: str, req, choices: list[Choice], request_id: str) -> Response:
        self.client.check_ready()

        async def check_client() -> None:
            if await request.is_disconnected():
                raise Aborted("client disconnected")

        run = RequestRun(self.client, choices, choices[0].task.meta.deadline_at, self.settings.stall_timeout_s,
                         on_tick=check_client)
        if not req.stream:
            return await self._complete(endpoint, req, run, request_id)
        return await self._stream(endpoint, req, run, request_id)

    async def _complete(self, endpoint: str, req, run: RequestRun, request_id: str) -> Response:
        async with run:
            await run.wait_accepted()
            async for _ in run.deltas():
                pass
        self._observe(endpoint, run, "ok")
        created = int(time.time())
        if endpoint == "chat":
            body = {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": chat_logprobs(c.tokens, c.logprobs) if req.logprobs else None,
                        "finish_reason": c.finish_reason,
                    }
                    for c in run.choices
                ],
                "usage": self.usage_of(run.choices),
            }
        else:
            body = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": c.index,
                        "text": "".join(c.text),
                        "logprobs": completion_logprobs(c.tokens, c.logprobs) if req.logprobs is not None else None,
                        "finish_reason": c.finish_reason,
                    }
                    for c in run.choices
                ],
                "usage": self.usage_of(run.choices),
            }
        return JSONResponse(body)

    async def _stream(self, endpoint: str, req, run: RequestRun, request_id: str) -> Response:
        await run.__aenter__()
        try:
            await run.wait_accepted()
        except BaseException as exc:
            await run.__aexit__(type(exc), exc, None)
            raise
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            body = {"id": request_id, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        def choice_delta(d: Delta) -> dict:
            if endpoint == "chat":
                out = {"index": d.choice.index, "delta": {"content": d.text} if d.text else {},
                       "logprobs": chat_logprobs(d.tokens, d.logprobs) if req.logprobs and d.logprobs else None,
                       "finish_reason": d.finish_reason}
            else:
                out = {"index": d.choice.index, "text": d.text,
                       "logprobs": completion_logprobs(d.tokens, d.logprobs) if req.logprobs is not None and d.logprobs else None,
                       "finish_reason": d.finish_reason}
            return out

        async def events() -> AsyncIterator[bytes]:
            outcome = "ok"
            exc_info = (None, None)
            last_write = time.monotonic()
            try:
                if endpoint == "chat":
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for c in run.choices])
                async for d in run.deltas():
                    if d is None:
                        if time.monotonic() - last_write >= KEEPALIVE_S:
                            last_write = time.monotonic()
                            yield b": keep-alive\n\n"
                        continue
                    if d.text or d.finish_reason is not None:
                        if d.text:
                            self._observe_token(run)
                        last_write = time.monotonic()
                        yield chunk([choice_delta(d)])
                if include_usage:
                    yield chunk([], self.usage_of(run.choices))
                yield sse("[DONE]")
            except PdError as exc:
                outcome = exc.code or exc.type
                exc_info = (type(exc), exc)
                if not isinstance(exc, Aborted):
                    log.warning("stream_failed", request_id=request_id, error=exc.message)
                    yield sse(exc.to_openai())
                    yield sse("[DONE]")
            except BaseException as exc:  # client went away (cancelled) or a bug
                outcome = "client_disconnected" if isinstance(exc, (GeneratorExit,)) or type(exc).__name__ == "CancelledError" else "error"
                exc_info = (type(exc), exc)
                raise
            finally:
                await run.__aexit__(exc_info[0], exc_info[1], None)
                self._observe(endpoint, run, outcome)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id})

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
        if outcome == "ok" and getattr(run, "_last_token_at", None) is None and run.first_token_at is not None:
            self.metrics["ttft"].observe(run.first_token_at - run.started_at)
        self.metrics["e2e"].observe(time.monotonic() - run.started_at)
        self.metrics["requests"].labels(endpoint, outcome).inc()


def chat_logprobs(tokens: list[str], logprobs) -> dict:
    """OpenAI chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for text, lp in zip(tokens, logprobs):
        content.append({
            "token": text,
            "logprob": lp.logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": str(t), "logprob": v, "bytes": None} for t, v in lp.top],
        })
    return {"content": content}


def completion_logprobs(tokens: list[str], logprobs) -> dict:
    """Legacy completions ``logprobs`` object."""
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{str(t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def create_app(settings: Settings, client: PipelineClient | None = None) -> FastAPI:
    """The gateway application. ``client`` defaults to one built from ``settings``."""
    client = client or PipelineClient(settings)
    gw = Gateway(settings, client)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.load_model_limits()
        await client.start()
        log.info("gateway_ready", url=f"http://{settings.gateway_host}:{settings.gateway_port}", model=gw.model_name,
                 instance=client.instance_id)
        yield
        await client.stop()

    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gw

    @app.exception_handler(PdError)
    async def on_pd_error(request: Request, exc: PdError):
        gw.metrics["requests"].labels(request.url.path, exc.code or exc.type).inc()
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
        return error_response(err)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        log.exception("unhandled_error", path=request.url.path)
        return JSONResponse({"error": {"message": "internal error", "type": "server_error", "param": None,
                                       "code": "internal_error"}}, status_code=500)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gw.model_name, "object": "model", "created": gw.created,
                                            "owned_by": "pdserve", "max_model_len": gw.max_model_len}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != gw.model_name:
            raise ModelNotFound(f"The model '{model_id}' does not exist", param="model")
        return {"id": gw.model_name, "object": "model", "created": gw.created, "owned_by": "pdserve"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = gw.parse(ChatCompletionRequest, await gw.read_json(request))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        with request_scope(request_id):
            return await gw.run(request, "chat", req, gw.chat_choices(req, request_id), request_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = gw.parse(CompletionRequest, await gw.read_json(request))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        with request_scope(request_id):
            return await gw.run(request, "completion", req, gw.completion_choices(req, request_id), request_id)

    @app.get("/health")
    @app.get("/healthz")
    async def health():
        return {"status": "ok"}

    @app.get("/health/ready")
    @app.get("/readyz")
    async def ready():
        missing = client.missing_stages()
        ok = client.is_connected and not missing
        body = {"status": "ready" if ok else "not ready", "nats": client.is_connected, "missing_stages": missing,
                "workers": {s: len(client.registry.live(s)) for s in ("tokenizer", "prefill", "decode", "postfilter")}}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
