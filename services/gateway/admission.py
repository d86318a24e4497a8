"""Who may send a request now: API keys, the in-flight limit, the JetStream backlog and a
per-key token rate limit. Every refusal is a clean 401 or 429 (with ``Retry-After``) before
any work is queued, instead of a queue that grows without end.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass, field

from shared.config import Settings
from shared.errors import AuthenticationError, Overloaded


@dataclass(slots=True)
class TokenBucket:
    """``rate_per_s`` tokens per second, holding at most ``capacity``. Spending may take the
    level below zero (a request's size is known only afterwards); the key then waits until
    the bucket refills above zero."""

    rate_per_s: float
    capacity: float
    level: float = 0.0
    updated_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.capacity

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated_at) * self.rate_per_s)
        self.updated_at = now

    def seconds_until_positive(self, now: float | None = None) -> float:
        self._refill(time.monotonic() if now is None else now)
        return 0.0 if self.level > 0 else (1.0 - self.level) / self.rate_per_s

    def seconds_until(self, tokens: float, now: float | None = None) -> float:
        """Seconds until the bucket holds ``tokens``."""
        self._refill(time.monotonic() if now is None else now)
        return max(0.0, (tokens - self.level) / self.rate_per_s)

    def spend(self, tokens: float, now: float | None = None) -> None:
        self._refill(time.monotonic() if now is None else now)
        self.level -= tokens


class Admission:
    """The gateway's admission decisions.

    Args:
        settings: ``api_keys``, ``max_inflight_requests``, ``max_queued_tasks``,
            ``rate_limit_tokens_per_minute``.
    """

    def __init__(self, settings: Settings):
        self.keys = [k.strip() for k in settings.api_keys.split(",") if k.strip()]
        self.max_inflight = settings.max_inflight_requests
        self.max_queued = settings.max_queued_tasks
        self.rate_per_min = settings.rate_limit_tokens_per_minute
        self.buckets: dict[str, TokenBucket] = {}
        self.inflight = 0

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key ("" when keys are off).

        Raises:
            AuthenticationError: keys are on and the header is missing or wrong.
        """
        if not self.keys:
            return ""
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthenticationError("Missing API key: send 'Authorization: Bearer <key>'")
        given = authorization[7:].strip()
        for key in self.keys:
            if hmac.compare_digest(given.encode(), key.encode()):
                return key
        raise AuthenticationError("Incorrect API key provided")

    @staticmethod
    def tenant_salt(key: str) -> str:
        """A per-key prefix-cache salt: tenants never share KV blocks."""
        return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""

    def admit(self, key: str, backlog: int, reserve_tokens: int = 0) -> None:
        """Admit a request, or raise Overloaded (429) when the gateway, the queues or the key's
        budget are full.

        ``reserve_tokens`` (the most completion tokens the request may produce, all choices) are
        taken from the key's bucket now, so a burst of concurrent requests cannot overspend
        the budget before any of them has finished; :meth:`charge` settles the difference.
        A request larger than the whole bucket is admitted only when the bucket is full.
        """
        self.check_inflight()
        if self.max_queued and backlog >= self.max_queued:
            raise Overloaded(f"{backlog} requests are queued for prefill; retry shortly", retry_after_s=2.0)
        if self.rate_per_min and key is not None:
            bucket = self.bucket(key)
            wait = max(bucket.seconds_until_positive(), bucket.seconds_until(min(reserve_tokens, bucket.capacity)))
            if wait > 0:
                raise Overloaded(f"token rate limit of {self.rate_per_min} tokens/minute reached for this key",
                                 retry_after_s=wait, code="rate_limit_exceeded")
            bucket.spend(reserve_tokens)

    def check_inflight(self) -> None:
        """Raises Overloaded (429) when the gateway already serves its limit of requests."""
        if self.max_inflight and self.inflight >= self.max_inflight:
            raise Overloaded(f"the server is at its limit of {self.max_inflight} requests in flight; retry shortly",
                             retry_after_s=1.0)

    def bucket(self, key: str) -> TokenBucket:
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = TokenBucket(self.rate_per_min / 60.0, float(self.rate_per_min))
        return bucket

    def charge(self, key: str, tokens: int, reserved: int = 0) -> None:
        """Settle a finished (or failed) request: its prompt and completion ``tokens`` used,
        less the ``reserved`` tokens :meth:`admit` already took (a refund when negative)."""
        if self.rate_per_min and tokens - reserved != 0:
            self.bucket(key).spend(tokens - reserved)
