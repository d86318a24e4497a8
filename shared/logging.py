"""Structured logs: one JSON object per line, with ``service``, ``instance`` and, inside a
request's scope, ``request_id`` on every line (structlog contextvars)."""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

import structlog


def configure_logging(service: str, instance_id: str, level: str = "INFO", json: bool = True) -> None:
    """Route structlog and the standard library's logging through one JSON (or console)
    renderer on stderr, at ``level``."""
    shared_processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*shared_processors, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, instance=instance_id)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[*shared_processors, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def get_logger(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)


@contextmanager
def request_scope(request_id: str, **fields):
    """Bind ``request_id`` (and other fields) to every log line inside the block."""
    with structlog.contextvars.bound_contextvars(request_id=request_id, **fields):
        yield
