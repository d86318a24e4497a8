"""Per-key limits that hold across every gateway replica: a token rate (prompt + completion
tokens per window), a request rate and a cap on concurrent requests.

Both rates are token buckets (capacity = the limit, refilled at limit / window). The shared
store keeps each bucket in a Redis hash and changes it only inside one Lua script per step
(Redis runs a script atomically), so replicas never race; the script reads Redis's own clock
(``TIME``), so the replicas' clocks do not matter. This is the token-bucket-in-Lua pattern of
Stripe's rate limiters (Paul Tarjan, "Scaling your API with rate limiters", stripe.com blog,
2017), extended with variable cost and settlement:

* **reserve** at admission: a request's prompt tokens plus its ``max_tokens`` (all choices)
  leave the token bucket at once, so a burst of concurrent requests on many gateways cannot
  overspend before any of them finishes; a request larger than the whole bucket is admitted
  only when the bucket is full;
* **settle** at completion: the difference between the tokens used and the reservation
  goes back (a refund when negative).

Concurrent requests are members of a sorted set scored by their lease's expiry: a slot is
taken with ``ZADD``, given back with ``ZREM``, renewed by the gateway every third of the lease
while the request runs, and the members of a gateway that died expire with their leases.

Why not the ``limits`` package: its strategies take a variable ``cost`` on ``hit`` but have no
way to give tokens back (no settlement of the unused reservation) and no concurrency cap, so
the reserve/settle pattern would not fit; redis-py's ``register_script`` (EVALSHA, EVAL on
NOSCRIPT) carries the three short scripts below.

:class:`LocalLimits` does the same arithmetic in process (one gateway, or the fail-open
fallback); :class:`Limits` picks between the two and applies the failure policy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.gateway.tenancy.local_limits import LocalLimits
from services.gateway.tenancy.quota import REASONS, Quota, refusal
from shared.config import Settings
from shared.errors import Overloaded, ServiceUnavailable
from shared.logging import get_logger

log = get_logger("gateway.limits")


# KEYS: token bucket, request bucket, in-flight set.
# ARGV: now_ms ("" = Redis TIME), window_ms, max_tokens, max_requests, max_concurrent, cost,
#       request_id, lease_ms.
# Returns {1, 0, 0} when admitted, else {0, reason, retry_after_ms}.
#: Every script's first lines: ``now`` in ms from ARGV[1], or Redis's own clock when it is "".
_NOW_LUA = """
local now = ARGV[1]
if now == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(now)
end
"""

ADMIT_LUA = """
local function now_ms()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function level(key, cap, window, now)
  local v = redis.call('HMGET', key, 'level', 'at')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * cap / window)
end
local function wait_ms(lvl, need, cap, window)
  local short = math.max(need - lvl, 1 - lvl, 0)
  if lvl > 0 and lvl >= need then return 0 end
  return math.max(1, math.ceil(short * window / cap))
end
local function store(key, lvl, cap, window, now)
  redis.call('HSET', key, 'level', tostring(lvl), 'at', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((cap - lvl) * window / cap) + 1000)
end
local now = now_ms()
local window, max_tokens, max_requests = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local max_concurrent, cost, lease = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[8])
local tokens, requests
if max_tokens > 0 then
  tokens = level(KEYS[1], max_tokens, window, now)
  local w = wait_ms(tokens, math.min(cost, max_tokens), max_tokens, window)
  if w > 0 then return {0, 1, w} end
end
if max_requests > 0 then
  requests = level(KEYS[2], max_requests, window, now)
  local w = wait_ms(requests, 1, max_requests, window)
  if w > 0 then return {0, 2, w} end
end
if max_concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= max_concurrent then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    return {0, 3, math.max(1000, math.min(lease, tonumber(first[2]) - now))}
  end
  redis.call('ZADD', KEYS[3], now + lease, ARGV[7])
  redis.call('PEXPIRE', KEYS[3], 2 * lease)
end
if max_tokens > 0 then store(KEYS[1], tokens - cost, max_tokens, window, now) end
if max_requests > 0 then store(KEYS[2], requests - 1, max_requests, window, now) end
return {1, 0, 0}
"""

# KEYS: token bucket, in-flight set. ARGV: now_ms, window_ms, max_tokens, delta, request_id.
# Returns the bucket's level after settling (a string: Lua numbers reply as integers).
SETTLE_LUA = _NOW_LUA + """
local window, cap, delta = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[5])
if cap <= 0 then return '0' end
local v = redis.call('HMGET', KEYS[1], 'level', 'at')
local lvl = cap
if v[1] then lvl = math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * cap / window) end
lvl = math.min(cap, lvl - delta)
redis.call('HSET', KEYS[1], 'level', tostring(lvl), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - lvl) * window / cap) + 1000)
return tostring(lvl)
"""

# KEYS: in-flight set. ARGV: now_ms, lease_ms, request ids... Renews the leases still held.
RENEW_LUA = _NOW_LUA + """
local lease = tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 2 * lease)
return #ARGV - 2
"""


def redis_key(namespace: str, name: str, kind: str) -> str:
    """Redis key of one key name's state: ``<ns>:limits:{<name>}:<kind>`` (``tokens``,
    ``requests``, ``inflight``); the hash tag keeps one key name's state on one Cluster slot."""
    return f"{namespace}:limits:{{{name}}}:{kind}"


class RedisLimits:
    """The shared store: buckets and in-flight sets in Redis, changed by Lua scripts.

    Args:
        redis: returns the ``redis.asyncio.Redis`` client of the running event loop.
        namespace: prefix of every key (``PD_NAMESPACE``).
        clock: unix seconds for the scripts; None = Redis's own clock (``TIME``). Tests pass
            a logical clock.

    Errors of the Redis client (``redis.exceptions.ConnectionError``, ``TimeoutError``)
    propagate; :class:`Limits` applies the failure policy.
    """

    def __init__(self, redis: Callable[[], object], namespace: str, clock: Callable[[], float] | None = None):
        self.redis = redis
        self.namespace = namespace
        self.clock = clock

    async def _run(self, script: str, keys: list[str], args: list) -> object:
        # a Script object only holds the text and its SHA-1: EVALSHA, EVAL on NOSCRIPT
        return await self.redis().register_script(script)(keys=keys, args=args)

    def _now(self) -> str:
        return "" if self.clock is None else str(int(self.clock() * 1000))

    def _keys(self, name: str) -> list[str]:
        return [redis_key(self.namespace, name, k) for k in ("tokens", "requests", "inflight")]

    async def acquire(self, name: str, quota: Quota, cost: int, request_id: str, lease_s: float) -> None:
        """Take ``cost`` tokens, one request and (with a concurrency cap) one slot, or none.

        Raises:
            Overloaded: a limit is reached (429 with the wait until it may pass).
        """
        ok, reason, wait_ms = await self._run(ADMIT_LUA, keys=self._keys(name), args=[
            self._now(), int(quota.window_s * 1000), quota.tokens, quota.requests, quota.concurrent, cost,
            request_id, int(lease_s * 1000)])
        if not ok:
            raise refusal(name, quota, REASONS[int(reason)], int(wait_ms) / 1000)

    async def settle(self, name: str, quota: Quota, delta: int, request_id: str) -> float:
        """Spend ``delta`` more tokens (refund when negative) and free the request's slot;
        returns the bucket's level after."""
        keys = self._keys(name)
        level = await self._run(SETTLE_LUA, keys=[keys[0], keys[2]], args=[
            self._now(), int(quota.window_s * 1000), quota.tokens, delta, request_id])
        return float(level)

    async def renew(self, name: str, request_ids: list[str], lease_s: float) -> None:
        """Extend the leases of ``request_ids`` (those still in the set) by ``lease_s``."""
        await self._run(RENEW_LUA, keys=[self._keys(name)[2]], args=[self._now(), int(lease_s * 1000), *request_ids])

    async def tokens_left(self, name: str, quota: Quota) -> float:
        """The token bucket's level now (settling zero tokens)."""
        return await self.settle(name, quota, 0, "")


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means the limits' Redis cannot be reached (rather than a bug)."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError))


class Limits:
    """The limits the gateway applies: shared through Redis (``PD_RATE_LIMIT_STORE=redis``)
    or local, and when Redis cannot be reached, ``PD_RATE_LIMIT_FAILURE_POLICY``: ``open``
    falls back to this gateway's own buckets (logged once per outage), ``closed`` refuses
    with 503. A request is settled where it was admitted.

    Args:
        settings: the ``rate_limit_*`` settings.
        redis: returns the shared store's client (None with the local store).
    """

    #: After an unreachable Redis, seconds before the shared store is tried again.
    RETRY_S = 2.0

    def __init__(self, settings: Settings, redis=None, clock: Callable[[], float] | None = None):
        self.settings = settings
        self.local = LocalLimits()
        self.shared = RedisLimits(redis, settings.namespace, clock) if redis is not None else None
        self.down_until = 0.0
        # key name -> request id -> (store, monotonic time after which it is no longer renewed)
        self.leases: dict[str, dict[str, tuple[str, float]]] = {}
        self._renewer: asyncio.Task | None = None

    def _shared_usable(self) -> bool:
        return self.shared is not None and time.monotonic() >= self.down_until

    def _went_down(self, exc: BaseException) -> None:
        if self.down_until == 0.0:
            log.warning("rate_limit_store_unreachable", policy=self.settings.rate_limit_failure_policy,
                        error=str(exc) or type(exc).__name__)
        self.down_until = time.monotonic() + self.RETRY_S

    def _closed(self) -> ServiceUnavailable:
        return ServiceUnavailable("the rate-limit store is unreachable; retry shortly",
                                  code="rate_limiter_unavailable")

    async def acquire(self, name: str, quota: Quota, cost: int, request_id: str) -> str:
        """Admit or refuse; returns the store that admitted (``redis`` or ``local``).

        Raises:
            Overloaded: a limit is reached (429).
            ServiceUnavailable: Redis is unreachable and the policy is ``closed`` (503).
        """
        lease_s = self.settings.rate_limit_lease_s
        store = "local"
        if self._shared_usable():
            try:
                await asyncio.wait_for(self.shared.acquire(name, quota, cost, request_id, lease_s), lease_s / 3)
                store = "redis"
            except Overloaded:
                raise
            except Exception as exc:
                if not is_unreachable(exc):
                    raise
                self._went_down(exc)
        if store == "local":
            if self.shared is not None and self.settings.rate_limit_failure_policy == "closed":
                raise self._closed()
            await self.local.acquire(name, quota, cost, request_id, lease_s)
        elif self.down_until:
            log.info("rate_limit_store_reachable")
            self.down_until = 0.0
        if quota.concurrent:
            # no request outlives its deadline: a lease never settled (a bug) stops being renewed
            renew_until = time.monotonic() + self.settings.request_timeout_s + self.settings.rate_limit_lease_s
            self.leases.setdefault(name, {})[request_id] = (store, renew_until)
            self._ensure_renewer()
        return store

    async def settle(self, store: str, name: str, quota: Quota, delta: int, request_id: str) -> None:
        """Settle a request on the store that admitted it; a lost settlement is logged (the
        lease frees the slot, and the tokens stay spent)."""
        self.leases.get(name, {}).pop(request_id, None)
        try:
            await (self.shared if store == "redis" else self.local).settle(name, quota, delta, request_id)
        except Exception as exc:
            if not is_unreachable(exc):
                raise
            log.warning("rate_limit_settle_lost", key_name=name, request_id=request_id, tokens=delta)

    def _ensure_renewer(self) -> None:
        if self.shared is not None and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        lease_s = self.settings.rate_limit_lease_s
        while any(self.leases.values()):
            await asyncio.sleep(lease_s / 3)
            now = time.monotonic()
            for name, held in list(self.leases.items()):
                for rid in [rid for rid, (_, until) in held.items() if until < now]:
                    del held[rid]
                ids = [rid for rid, (store, _) in held.items() if store == "redis"]
                if ids:
                    try:
                        await self.shared.renew(name, ids, lease_s)
                    except Exception as exc:
                        if not is_unreachable(exc):
                            raise
                        self._went_down(exc)

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
