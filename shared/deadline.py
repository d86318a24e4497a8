"""Request deadlines, end to end.

Every request gets one absolute deadline at the gateway (``RequestMeta.deadline_at``, unix
seconds): ``PD_REQUEST_TIMEOUT_S`` from its arrival, or what the client asked for in the
``X-Request-Timeout`` header (seconds), up to ``PD_MAX_REQUEST_TIMEOUT_S``. The deadline rides
in every task's meta (TokenizeTask, PrefillTask, DecodeTask) and, for tools that look at the
bus, in the ``Pd-Deadline-At`` NATS header of every work item. Each stage bounds each of its
waits by it (:func:`bounded`, :func:`wait_within`) and drops expired work without computing it
(:func:`is_expired`); the client gets the typed error ``deadline_exceeded``: a 504 OpenAI
error object before streaming, a terminal error event after.

This module is torch-free and has no state: the clock is ``time.time()`` (deadlines cross
processes, so they are wall-clock; the hosts' clocks are assumed NTP-synchronised).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Mapping
from typing import TypeVar

from shared.errors import DeadlineExceeded, InvalidRequest

T = TypeVar("T")

#: The request header in which a client asks for its own deadline (seconds from now).
TIMEOUT_HEADER = "x-request-timeout"
#: The NATS header carrying a work item's deadline (unix seconds, as text).
DEADLINE_HEADER = "Pd-Deadline-At"
#: The error code of a request that ran past its deadline.
DEADLINE_CODE = "deadline_exceeded"


def requested_timeout_s(headers: Mapping[str, str], default_s: float, max_s: float) -> float:
    """The request's timeout: the ``X-Request-Timeout`` header (seconds, > 0) when given,
    else ``default_s``; never above ``max_s`` (0 = no maximum).

    Raises:
        InvalidRequest: the header is not a positive finite number, or is above ``max_s``.
    """
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return min(default_s, max_s) if max_s > 0 else default_s
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequest(f"X-Request-Timeout must be a positive number of seconds, not {raw!r}",
                             param="X-Request-Timeout")
    if max_s > 0 and value > max_s:
        raise InvalidRequest(f"X-Request-Timeout {value:g}s is over this server's maximum of {max_s:g}s",
                             param="X-Request-Timeout")
    return value


def seconds_left(deadline_at: float, now: float | None = None) -> float:
    """Seconds until ``deadline_at`` (unix seconds); negative once it passed."""
    return deadline_at - (time.time() if now is None else now)


def is_expired(deadline_at: float, now: float | None = None) -> bool:
    """Whether the deadline has passed (a deadline of 0 means none: never expired)."""
    return bool(deadline_at) and seconds_left(deadline_at, now) <= 0


def bounded(timeout_s: float, deadline_at: float) -> float:
    """``timeout_s`` cut to what is left of the deadline (at least 0)."""
    if not deadline_at:
        return timeout_s
    return max(0.0, min(timeout_s, seconds_left(deadline_at)))


def deadline_exceeded(what: str) -> DeadlineExceeded:
    """The typed error of a request past its deadline, while ``what`` (e.g. "waiting for the
    KV of its prompt")."""
    return DeadlineExceeded(f"the request ran past its deadline {what}", code=DEADLINE_CODE)


async def wait_within(aw: Awaitable[T], deadline_at: float, what: str) -> T:
    """Await ``aw`` until the deadline at most.

    Raises:
        DeadlineExceeded: (code ``deadline_exceeded``) the deadline passed first; ``aw`` is
            cancelled (a thread behind it runs on, its result unused).
    """
    left = bounded(float("inf"), deadline_at)
    if left == float("inf"):
        return await aw
    try:
        return await asyncio.wait_for(aw, left)
    except TimeoutError:
        raise deadline_exceeded(what) from None


def task_headers(deadline_at: float) -> dict[str, str]:
    """NATS headers of a work item with this deadline."""
    return {DEADLINE_HEADER: f"{deadline_at:.3f}"} if deadline_at else {}
