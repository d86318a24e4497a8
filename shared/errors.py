"""Error classes. Each maps to exactly one HTTP status, one OpenAI error type and one ack
action for the work item that raised it.

Ack actions: ``ack`` (done, do not redeliver: the request has been failed cleanly),
``nak`` (redeliver later, the failure may pass), ``term`` (never redeliver: poison).
``assert`` is kept for bugs in our own code; these classes are for everything else.
"""

from __future__ import annotations

from typing import ClassVar


class PdError(Exception):
    """Base class. ``status``/``type``/``code`` fill OpenAI's error object: each subclass
    sets them once, as class attributes; only :class:`RelayedError` takes them per instance
    (a status decided elsewhere). ``code`` may be narrowed per instance."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None
    ack_action: ClassVar[str] = "ack"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict:
        """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(PdError):
    """The client sent a value we cannot serve (400)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class NotFound(PdError):
    """No such resource (an unknown path, a request timeline no longer kept)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(PdError):
    """The path exists but not with this HTTP method."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RelayedError(PdError):
    """An error whose status and type were decided elsewhere and are passed on as they are:
    a stage's ErrorEvent re-raised at the gateway, or an HTTP error of the web framework.

    Args:
        message: shown to the client.
        status: the HTTP status (4xx or 5xx).
        type: OpenAI's error type.
    """

    def __init__(self, message: str, *, status: int, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type = type


class ModelNotFound(PdError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(PdError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class AuthenticationError(PdError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Overloaded(PdError):
    """Admission control said no; the client should retry after ``retry_after_s``."""

    status = 429
    type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kwargs):
        super().__init__(message, **kwargs)
        self.retry_after_s = retry_after_s


class ServiceUnavailable(PdError):
    """A stage has no live worker, or the bus is down (503)."""

    status = 503
    type = "server_error"
    code = "service_unavailable"
    ack_action = "nak"


class DeadlineExceeded(PdError):
    """The request ran past its deadline (code ``deadline_exceeded``, see ``shared/deadline.py``)
    or a stage stopped answering (code ``timeout``): 504."""

    status = 504
    type = "server_error"
    code = "timeout"


class Aborted(PdError):
    """The request was aborted (client gone, stop string reached); nothing to report."""

    status = 499
    type = "aborted"
    code = "aborted"


class KVTransferError(PdError):
    """Staged KV could not be written or read."""

    status = 503
    type = "server_error"
    code = "kv_transfer_failed"
    ack_action = "nak"


class PoisonMessage(PdError):
    """A bus message that cannot be decoded or handled; terminated, never redelivered."""

    status = 500
    type = "server_error"
    code = "poison_message"
    ack_action = "term"


class EngineError(PdError):
    """The model raised while running a request."""

    status = 500
    type = "server_error"
    code = "engine_error"
