"""A request's timeline: marks each stage appends as the request passes, and the phases
between them, which add up to its end-to-end time.

The marks travel with the request (``RequestMeta.marks``, then the final TokenChunk and
TextChunk) and are unix times from each host's clock (exact on one host; across hosts, as good
as their clock sync). Phases are the gaps between consecutive marks on the request's critical
path, each named by the mark that ends it.
"""

from __future__ import annotations

import time

import msgspec

#: mark → the phase that ends at it
PHASES = {
    "gateway.published": "gateway",
    "tokenizer.fetched": "queue.tokenizer",
    "tokenizer.published": "tokenize",
    "prefill.fetched": "queue.prefill",
    "prefill.first_token": "prefill",
    "prefill.published": "kv_put",
    "decode.fetched": "queue.decode",
    "decode.kv_loaded": "kv_get",
    "decode.admitted": "admit",
    "decode.last_token": "decode",
    "postfilter.final": "postfilter",
    "gateway.end": "respond",
}
START = "gateway.received"


def now_mark(name: str) -> tuple[str, float]:
    return (name, time.time())


def with_mark(meta, name: str):
    """A copy of ``meta`` (a RequestMeta) with one more mark."""
    return msgspec.structs.replace(meta, marks=[*meta.marks, now_mark(name)])


def phases(marks: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """(phase, seconds) along the critical path, from the first ``gateway.received`` mark.
    Marks outside :data:`PHASES` (e.g. ``gateway.first_flush``) are skipped."""
    out: list[tuple[str, float]] = []
    prev = next((t for name, t in marks if name == START), None)
    if prev is None:
        return out
    for name, t in marks:
        # built-in marks, and "<stage>.done" of pluggable pre-stages
        phase = PHASES.get(name) or (name.removesuffix(".done") if name.endswith(".done") else None)
        if phase is None:
            continue
        out.append((phase, max(0.0, t - prev)))
        prev = max(prev, t)
    return out
