"""Per-key limits in one process: the same token-bucket arithmetic as the shared Redis store
(:mod:`services.gateway.tenancy.limits`), for one gateway or as the fail-open fallback."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.tenancy.quota import Quota, refusal


@dataclass(slots=True)
class TokenBucket:
    """``rate_per_s`` tokens per second, holding at most ``capacity``. Spending may take the
    level below zero (a request's size is known only afterwards); the key then waits until
    the bucket refills above zero."""

    rate_per_s: float
    capacity: float
    level: float = 0.0
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        self.level = self.capacity

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + max(0.0, now - self.updated_at) * self.rate_per_s)
        self.updated_at = now
        return self.level

    def seconds_until(self, tokens: float, now: float) -> float:
        """Seconds until the bucket holds ``tokens`` and more than zero."""
        level = self.refill(now)
        if level > 0 and level >= tokens:
            return 0.0
        return max(tokens - level, 1.0 - level, 0.0) / self.rate_per_s

    def spend(self, tokens: float, now: float) -> None:
        self.level = min(self.capacity, self.refill(now) - tokens)


@dataclass(slots=True)
class LocalLimits:
    """The same limits held in this process (one gateway's view). ``clock``: seconds."""

    clock: Callable[[], float] = time.monotonic
    buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    inflight: dict[str, set[str]] = field(default_factory=dict)

    def bucket(self, name: str, kind: str, capacity: int, window_s: float) -> TokenBucket:
        bucket = self.buckets.get((name, kind))
        if bucket is None or bucket.capacity != capacity:
            bucket = self.buckets[(name, kind)] = TokenBucket(capacity / window_s, float(capacity),
                                                              updated_at=self.clock())
            bucket.level = float(capacity)
        return bucket

    async def acquire(self, name: str, quota: Quota, cost: int, request_id: str, lease_s: float) -> None:
        """As :meth:`RedisLimits.acquire`, in process."""
        now = self.clock()
        tokens = self.bucket(name, "tokens", quota.tokens, quota.window_s) if quota.tokens else None
        requests = self.bucket(name, "requests", quota.requests, quota.window_s) if quota.requests else None
        if tokens is not None and (wait := tokens.seconds_until(min(cost, quota.tokens), now)) > 0:
            raise refusal(name, quota, "tokens", wait)
        if requests is not None and (wait := requests.seconds_until(1, now)) > 0:
            raise refusal(name, quota, "requests", wait)
        held = self.inflight.setdefault(name, set())
        if quota.concurrent and len(held) >= quota.concurrent:
            raise refusal(name, quota, "concurrent", 1.0)
        if quota.concurrent:
            held.add(request_id)
        if tokens is not None:
            tokens.spend(cost, now)
        if requests is not None:
            requests.spend(1, now)

    async def settle(self, name: str, quota: Quota, delta: int, request_id: str) -> float:
        """As :meth:`RedisLimits.settle`, in process."""
        self.inflight.get(name, set()).discard(request_id)
        if not quota.tokens:
            return 0.0
        bucket = self.bucket(name, "tokens", quota.tokens, quota.window_s)
        bucket.spend(delta, self.clock())
        return bucket.level

    async def renew(self, name: str, request_ids: list[str], lease_s: float) -> None:
        """Nothing to renew: a process's slots die with it."""

    async def tokens_left(self, name: str, quota: Quota) -> float:
        return await self.settle(name, quota, 0, "")
