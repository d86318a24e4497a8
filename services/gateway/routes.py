"""The OpenAI-compatible HTTP API: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/tokenize``, ``/detokenize``, health and metrics.

Each completion route reads as a straight line: authenticate → parse (``parse.py``) →
admit, submit and render (:meth:`services.gateway.service.Gateway.serve`). Errors are
OpenAI error objects with the right status; client input never causes a 500. Whatever can
fail before streaming (bad JSON, bad parameters, unknown model, no live worker, a prompt over
the context) fails as a real HTTP status; after the first byte of a stream, an error is a
final ``data: {"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.gateway.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    openapi_bodies,
)
from services.gateway.parse import parse_body, read_json
from services.gateway.pipeline import PipelineClient
from services.gateway.playground import mount_playground
from services.gateway.service import MAX_TIMELINES, Gateway
from shared.config import Settings
from shared.deadline import requested_timeout_s
from shared.errors import InvalidRequest, MethodNotAllowed, ModelNotFound, NotFound, PdError, RelayedError
from shared.logging import get_logger, request_scope

log = get_logger("gateway")
ENDPOINT_LABELS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/models": "models",
    "/v1/models/{model_id:path}": "models",
    "/v1/usage": "usage",
}
BODIES = openapi_bodies()
router = APIRouter()


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def error_response(exc: PdError) -> JSONResponse:
    headers = {}
    if getattr(exc, "retry_after_s", None):
        headers["Retry-After"] = str(max(1, int(exc.retry_after_s + 0.999)))
    return JSONResponse(exc.to_openai(), status_code=exc.status, headers=headers)


# --- completions: authenticate → parse → serve ---------------------------------------------
async def _parsed(request: Request, cls):
    gw = gateway_of(request)
    tenant = gw.authenticate(request)
    return gw, tenant, parse_body(cls, await read_json(request, gw.settings.max_request_body_bytes), gw.model_name)


def _timeout_s(request: Request, gw: Gateway) -> float:
    """The request's deadline in seconds from now (``X-Request-Timeout``, within the maximum)."""
    s = gw.settings
    return requested_timeout_s(request.headers, s.request_timeout_s, s.max_request_timeout_s)


@router.post("/v1/chat/completions", openapi_extra=BODIES["chat"])
async def chat_completions(request: Request):
    received_at = time.time()
    gw, tenant, req = await _parsed(request, ChatCompletionRequest)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    with request_scope(request_id, user=req.user or ""):
        choices = gw.choices.chat(req, request_id, tenant, timeout_s=_timeout_s(request, gw))
        return await gw.serve(request, "chat", req, choices, request_id, tenant, received_at)


@router.post("/v1/completions", openapi_extra=BODIES["completion"])
async def completions(request: Request):
    received_at = time.time()
    gw, tenant, req = await _parsed(request, CompletionRequest)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    with request_scope(request_id, user=req.user or ""):
        choices = gw.choices.completion(req, request_id, tenant, timeout_s=_timeout_s(request, gw))
        return await gw.serve(request, "completion", req, choices, request_id, tenant, received_at)


@router.post("/tokenize", openapi_extra=BODIES["tokenize"])
async def tokenize(request: Request):
    gw, _, req = await _parsed(request, TokenizeRequest)
    return await gw.offload(gw.tokenize, req)


@router.post("/detokenize", openapi_extra=BODIES["detokenize"])
async def detokenize(request: Request):
    gw, _, req = await _parsed(request, DetokenizeRequest)
    return await gw.offload(gw.detokenize, req)


# --- models, health, metrics ----------------------------------------------------------------
@router.get("/v1/models")
async def models(request: Request):
    gw = gateway_of(request)
    gw.authenticate(request)
    return {"object": "list", "data": [{"id": gw.model_name, "object": "model", "created": gw.created,
                                        "owned_by": "pdserve", "max_model_len": gw.max_model_len,
                                        "vocab_size": gw.vocab_size}]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    gw = gateway_of(request)
    gw.authenticate(request)
    if model_id != gw.model_name:
        raise ModelNotFound(f"The model '{model_id}' does not exist", param="model")
    return {"id": gw.model_name, "object": "model", "created": gw.created, "owned_by": "pdserve"}


@router.get("/health")
@router.head("/health", include_in_schema=False)
@router.api_route("/healthz", methods=["GET", "HEAD"], include_in_schema=False)
async def health():
    return {"status": "ok"}


@router.get("/health/ready")
@router.head("/health/ready", include_in_schema=False)
@router.api_route("/readyz", methods=["GET", "HEAD"], include_in_schema=False)
async def ready(request: Request):
    client = gateway_of(request).client
    missing = client.missing_stages()
    ok = client.is_connected and not missing
    body = {"status": "ready" if ok else "not ready", "nats": client.is_connected, "missing_stages": missing,
            "workers": {s: len(client.registry.live(s)) for s in ("tokenizer", "prefill", "decode", "postfilter")}}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/v1/usage")
async def usage(request: Request):
    """Usage per API key name, summed over every gateway (admin key only)."""
    return await gateway_of(request).admission.usage_report(request.headers.get("authorization"))


@router.get("/debug/timeline/{request_id}")
async def timeline(request_id: str, request: Request):
    """Where one recent request spent its time (phases that add up to its end-to-end time)."""
    gw = gateway_of(request)
    gw.authenticate(request)
    tl = gw.timelines.get(request_id)
    if tl is None:
        raise NotFound(f"no timeline for {request_id!r}: unknown, or older than the last {MAX_TIMELINES} requests")
    return tl.to_dict()


@router.get("/metrics")
async def metrics():
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


# --- errors ------------------------------------------------------------------------------------
def _count(request: Request, outcome: str) -> None:
    """A bounded metric label: the matched route's name, never the raw path."""
    route = request.scope.get("route")
    endpoint = ENDPOINT_LABELS.get(getattr(route, "path", ""), "other")
    gateway_of(request).metrics["requests"].labels(endpoint, outcome).inc()


async def on_pd_error(request: Request, exc: PdError):
    _count(request, exc.code or exc.type)
    return error_response(exc)


async def on_validation(request: Request, exc: RequestValidationError):
    return error_response(InvalidRequest(str(exc.errors()[0].get("msg", "invalid request"))))


async def on_http(request: Request, exc: StarletteHTTPException):
    typed = {404: NotFound, 405: MethodNotAllowed}.get(exc.status_code)
    err = typed(str(exc.detail)) if typed else RelayedError(
        str(exc.detail), status=exc.status_code,
        type="invalid_request_error" if exc.status_code < 500 else "server_error")
    response = error_response(err)
    response.headers.update(getattr(exc, "headers", None) or {})  # e.g. Allow on a 405
    return response


async def on_client_gone(request: Request, exc: ClientDisconnect):
    # the client hung up while sending its body: nobody reads this answer, and it is not
    # a server error (nginx logs it as 499)
    _count(request, "client_disconnected")
    return Response(status_code=499)


async def on_crash(request: Request, exc: Exception):
    log.exception("unhandled_error", path=request.url.path)
    _count(request, "internal_error")
    return JSONResponse({"error": {"message": "internal error", "type": "server_error", "param": None,
                                   "code": "internal_error"}}, status_code=500)


ERROR_HANDLERS = {PdError: on_pd_error, RequestValidationError: on_validation, StarletteHTTPException: on_http,
                  ClientDisconnect: on_client_gone, Exception: on_crash}


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
                  description="OpenAI-compatible API of a disaggregated LLM serving pipeline.",
                  exception_handlers=ERROR_HANDLERS)
    app.state.gateway = gw
    app.include_router(router)
    if settings.playground:
        mount_playground(app)
    return app
