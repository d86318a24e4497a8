"""Prometheus metrics and the small probe server every worker runs (``/metrics``,
``/healthz``, ``/readyz``).

Names follow ``pd_<stage>_<quantity>_<unit>``. Histograms of latency are in seconds.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

#: Per-token hand-offs inside a process (sub-millisecond when the event loop is free).
HANDOFF_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128)
#: Latency buckets from 1 ms to 2 min, for TTFT/ITL/E2E and stage timings.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256)


@dataclass(frozen=True)
class StageMetrics:
    """What every stage reports about its work items."""

    tasks: Counter  # labels: outcome
    queue_wait_seconds: Histogram
    process_seconds: Histogram
    batch_size: Histogram
    in_flight: Gauge
    step_seconds: Histogram
    step_tokens: Histogram
    kv_blocks_used: Gauge
    kv_blocks_total: Gauge
    handoff_seconds: Histogram
    handoff_hold_seconds: Counter
    outbox_seconds: Histogram
    spec_draft_tokens: Counter
    spec_accepted_tokens: Counter
    spec_acceptance_ratio: Gauge
    seq_step_tokens: Histogram


@functools.cache
def stage_metrics(stage: str) -> StageMetrics:
    p = f"pd_{stage}"
    return StageMetrics(
        tasks=Counter(f"{p}_tasks_total", f"{stage} work items by outcome", ["outcome"]),
        queue_wait_seconds=Histogram(
            f"{p}_queue_wait_seconds", f"time a {stage} work item waited before a worker took it",
            buckets=LATENCY_BUCKETS,
        ),
        process_seconds=Histogram(
            f"{p}_process_seconds", f"time a {stage} worker spent on one work item", buckets=LATENCY_BUCKETS
        ),
        batch_size=Histogram(f"{p}_batch_size", f"sequences per {stage} engine step", buckets=BATCH_BUCKETS),
        in_flight=Gauge(f"{p}_in_flight", f"work items a {stage} worker holds now"),
        step_seconds=Histogram(f"{p}_step_seconds", f"duration of one {stage} engine step", buckets=LATENCY_BUCKETS),
        step_tokens=Histogram(f"{p}_step_tokens", f"tokens computed in one {stage} engine step",
                              buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)),
        kv_blocks_used=Gauge(f"{p}_kv_blocks_used", f"KV blocks of the {stage} worker's pool held by sequences"),
        kv_blocks_total=Gauge(f"{p}_kv_blocks_total", f"KV blocks in the {stage} worker's pool"),
        handoff_seconds=Histogram(
            f"{p}_handoff_seconds", f"engine step's end to its outputs being handled on the {stage} event loop",
            buckets=HANDOFF_BUCKETS),
        handoff_hold_seconds=Counter(
            f"{p}_handoff_hold_seconds_total", f"time the {stage} engine waited before a step for the KV hand-offs of "
            "prompts it finished (their final put and publish)"),
        outbox_seconds=Histogram(
            f"{p}_outbox_seconds", f"a message posted by the {stage} worker to its publish on the bus",
            buckets=HANDOFF_BUCKETS),
        spec_draft_tokens=Counter(f"{p}_spec_draft_tokens_total",
                                  f"speculative draft tokens verified by the {stage} worker"),
        spec_accepted_tokens=Counter(f"{p}_spec_accepted_tokens_total",
                                     f"speculative draft tokens the {stage} worker's verification kept"),
        spec_acceptance_ratio=Gauge(f"{p}_spec_acceptance_ratio",
                                    f"accepted / drafted speculative tokens since the {stage} worker started"),
        seq_step_tokens=Histogram(f"{p}_seq_step_tokens",
                                  f"output tokens one sequence got from one {stage} engine step (1 without "
                                  "speculative decoding)", buckets=(1, 2, 3, 4, 5, 6, 8, 12, 16)),
    )


@functools.cache
def kv_metrics() -> dict:
    return {
        "put_bytes": Counter("pd_kv_put_bytes_total", "bytes written to the KV store"),
        "put_seconds": Counter("pd_kv_put_seconds_total", "seconds spent writing to the KV store"),
        "get_bytes": Counter("pd_kv_get_bytes_total", "bytes read from the KV store"),
        "get_seconds": Counter("pd_kv_get_seconds_total", "seconds spent reading from the KV store"),
        "staged_bytes": Gauge("pd_kv_staged_bytes", "bytes staged in the KV store now", ["kind"]),
        "prefix_hit_tokens": Counter(
            "pd_prefix_cache_hit_tokens_total", "prompt tokens whose KV was reused", ["stage", "source"]
        ),
        "prefix_query_tokens": Counter(
            "pd_prefix_cache_query_tokens_total", "prompt tokens looked up in the prefix cache", ["stage"]
        ),
        "prefetch_blocks": Counter(
            "pd_kv_prefetch_blocks_total",
            "KV blocks a decode worker read into its prefix cache ahead of their DecodeTask (KVPrefetch)",
        ),
    }


@functools.cache
def kv_ledger_metrics() -> dict:
    """The ledger of staged KV (``shared/kv/ledger.py``), as its reaper sees it."""
    return {
        "outstanding": Gauge("pd_kv_handles_outstanding", "staged KV handles recorded in the ledger now"),
        "outstanding_bytes": Gauge("pd_kv_handles_outstanding_bytes",
                                   "request-scoped bytes of the handles in the ledger now"),
        "orphaned": Counter("pd_kv_handles_orphaned_total", "ledger records the reaper found orphaned", ["reason"]),
        "orphaned_bytes": Counter("pd_kv_orphaned_bytes_total",
                                  "request-scoped bytes of handles found orphaned", ["reason"]),
        "reclaimed_bytes": Counter("pd_kv_reclaimed_bytes_total",
                                   "bytes the reaper deleted from the store for orphaned handles"),
        "transitions": Counter("pd_kv_handle_transitions_total", "ledger records entering a state", ["state"]),
    }


@functools.cache
def router_metrics() -> Counter:
    """Conditional disaggregation: where prompts were prefilled, and on what basis."""
    return Counter("pd_router_decisions_total", "prefill placement decisions", ["target", "basis"])


@functools.cache
def cancel_metrics() -> dict:
    """Work of cancelled requests (client gone, stop string, gateway gone) and of requests past
    their deadline, by stage. ``phase`` "queued": dropped before any of it was computed (at
    fetch, or before tokenizing); "running": stopped part way (a prefill at its next chunk, a
    decode at its next step). ``reason``: "cancelled" | "deadline"."""
    return {
        "dropped": Counter("pd_cancelled_total", "work items of cancelled or expired requests dropped or stopped",
                           ["stage", "reason", "phase"]),
        "prefill_chunks": Counter(
            "pd_prefill_cancelled_chunks_total",
            "prefill chunks computed for requests that were then cancelled or expired; when=after_cancel: "
            "computed after the cancel reached the worker (the chunk in progress then)", ["when"]),
    }


@functools.cache
def queue_metrics() -> Gauge:
    """JetStream consumer backlog per stage (messages not yet delivered), seen by a gateway."""
    return Gauge("pd_queue_backlog", "work items waiting in a stage's JetStream work queue", ["stage"])


@functools.cache
def gateway_metrics() -> dict:
    return {
        "requests": Counter("pd_gateway_requests_total", "requests by endpoint and outcome", ["endpoint", "outcome"]),
        "in_flight": Gauge("pd_gateway_requests_in_flight", "requests being served now"),
        "ttft": Histogram("pd_gateway_ttft_seconds", "time to first content token", buckets=LATENCY_BUCKETS),
        "itl": Histogram("pd_gateway_itl_seconds", "time between content chunks", buckets=LATENCY_BUCKETS),
        "e2e": Histogram("pd_gateway_e2e_seconds", "request end-to-end latency", buckets=LATENCY_BUCKETS),
        "rejected": Counter("pd_gateway_rejected_total", "requests refused before queueing", ["reason"]),
        "output_tokens": Counter("pd_gateway_output_tokens_total", "output tokens delivered to clients"),
    }


@functools.cache
def admission_metrics() -> dict:
    """Admission by predicted wait (``services/gateway/tenancy/waits.py``)."""
    return {
        "decisions": Counter("pd_gateway_admission_total", "admission decisions by predicted wait",
                             ["decision", "reason"]),
        "predicted_wait": Histogram("pd_gateway_predicted_wait_seconds",
                                    "predicted queue time of each new request", buckets=LATENCY_BUCKETS),
        "backlog_tokens": Gauge("pd_gateway_admitted_backlog_tokens",
                                "prompt tokens this gateway admitted that have no first token yet, at the share prefill is expected to compute"),
    }


class ProbeServer:
    """``/metrics`` (Prometheus text), ``/healthz`` (200 while the process runs) and
    ``/readyz`` (200 when ``is_ready()``, else 503) on a daemon thread.

    Args:
        host, port: where to listen; port 0 picks a free one (see :attr:`port`).
        is_ready: called per ``/readyz`` request.
    """

    def __init__(self, host: str, port: int, is_ready: Callable[[], bool]):
        ready = is_ready

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path == "/metrics":
                    body, status, ctype = generate_latest(), 200, CONTENT_TYPE_LATEST
                elif self.path == "/healthz":
                    body, status, ctype = b"ok\n", 200, "text/plain"
                elif self.path == "/readyz":
                    ok = ready()
                    body, status, ctype = (b"ready\n", 200, "text/plain") if ok else (b"not ready\n", 503, "text/plain")
                else:
                    body, status, ctype = b"not found\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="probe", daemon=True)

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
