"""OpenTelemetry tracing across the five services, off by default.

``PD_TRACING``: empty (off), ``otlp`` (OTLP over HTTP to ``PD_OTEL_ENDPOINT``), ``console``, or
``file:<folder>`` (one JSON line per span in ``<folder>/<service>-<pid>.jsonl``; used by the
tests). The trace context rides in each request's ``RequestMeta.headers`` (W3C
``traceparent``), so a request's spans in every service — gateway, tokenizer, prefill
(with its KV put), decode (with its KV get), postfilter — form one trace.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

_enabled = False
_tracer = None


def configure_tracing(service: str, mode: str, endpoint: str = "") -> None:
    """Install a tracer provider for this process (no-op when ``mode`` is empty)."""
    global _enabled, _tracer
    if not mode:
        return
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"pdserve-{service}"}))
    if mode == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
    elif mode == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif mode.startswith("file:"):
        provider.add_span_processor(SimpleSpanProcessor(_FileExporter(Path(mode[5:]) / f"{service}-{os.getpid()}.jsonl")))
    else:
        raise ValueError(f"PD_TRACING must be otlp, console or file:<folder>, not {mode!r}")
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("pdserve")
    _enabled = True


class _FileExporter:
    """Writes each finished span as one JSON line (trace id, span id, parent, name, times,
    attributes)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        with open(self.path, "a") as fh:
            for s in spans:
                fh.write(json.dumps({
                    "name": s.name,
                    "trace_id": f"{s.context.trace_id:032x}",
                    "span_id": f"{s.context.span_id:016x}",
                    "parent_id": f"{s.parent.span_id:016x}" if s.parent else None,
                    "service": s.resource.attributes.get("service.name"),
                    "start": s.start_time,
                    "end": s.end_time,
                    "attributes": dict(s.attributes or {}),
                }) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


@contextlib.contextmanager
def span(name: str, headers: dict[str, str] | None = None, **attributes):
    """A span, child of the context in ``headers`` (when given) or of the current span.
    Yields a dict of headers that carry this span's context onward (empty when off)."""
    if not _enabled:
        yield {}
        return
    from opentelemetry import propagate

    ctx = propagate.extract(headers) if headers else None
    with _tracer.start_as_current_span(name, context=ctx, attributes={k: str(v) for k, v in attributes.items()}):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        yield carrier


def enabled() -> bool:
    return _enabled


class _NoSpan:
    headers: dict[str, str] = {}

    def end(self) -> None:
        pass


class _OpenSpan:
    def __init__(self, span, headers: dict[str, str]):
        self._span = span
        self.headers = headers

    def end(self) -> None:
        self._span.end()


def start_span(name: str, headers: dict[str, str] | None = None, **attributes):
    """A span that outlives one block of code (ended by ``.end()``), child of ``headers``'
    context; ``.headers`` carries its own context onward."""
    if not _enabled:
        return _NoSpan()
    from opentelemetry import propagate, trace

    ctx = propagate.extract(headers) if headers else None
    s = _tracer.start_span(name, context=ctx, attributes={k: str(v) for k, v in attributes.items()})
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(s))
    return _OpenSpan(s, carrier)
