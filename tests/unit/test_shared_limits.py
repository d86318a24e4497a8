"""The per-key limits' arithmetic on logical time: one body over both stores (the Redis Lua
scripts on the real Redis, under a namespace of their own, and the in-process buckets), plus
the Redis-only lease expiry and the failure policy against a port where nothing listens."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from services.gateway.tenancy.limits import Limits, RedisLimits
from services.gateway.tenancy.local_limits import LocalLimits
from services.gateway.tenancy.quota import Quota
from shared.config import Settings
from shared.errors import Overloaded, ServiceUnavailable
from tests.pipeline_fixture import free_port

LEASE_S = 30.0


class Clock:
    """Logical unix seconds: tests move time, never wait for it."""

    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def run(coro):
    return asyncio.run(coro)


async def cleanup(url: str, namespace: str) -> None:
    client = aioredis.Redis.from_url(url)
    keys = [k async for k in client.scan_iter(f"{namespace}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def per_loop(url: str, **kwargs):
    """A client getter: one Redis client per event loop (each asyncio.run is a new loop)."""
    clients: dict = {}

    def client():
        loop = asyncio.get_running_loop()
        if loop not in clients:
            clients[loop] = aioredis.Redis.from_url(url, **kwargs)
        return clients[loop]

    return client


@pytest.fixture(params=["redis", "local"])
def store(request, redis_url, namespace):
    """(store, clock) — each test runs once on each."""
    clock = Clock()
    if request.param == "local":
        yield LocalLimits(clock=clock), clock
        return
    yield RedisLimits(per_loop(redis_url), namespace, clock), clock
    run(cleanup(redis_url, namespace))


def test_reservations_hold_a_burst_and_settlement_refunds_the_unused_part(store):
    limits, clock = store
    quota = Quota(tokens=100, window_s=60.0)

    async def go():
        for i in range(3):
            await limits.acquire("k", quota, 30, f"r{i}", LEASE_S)
        with pytest.raises(Overloaded) as refused:
            await limits.acquire("k", quota, 30, "r3", LEASE_S)
        levels = [await limits.settle("k", quota, 7 - 30, f"r{i}") for i in range(3)]  # each used 7 of 30
        return refused.value, levels

    refused, levels = run(go())
    assert refused.code == "rate_limit_exceeded" and refused.status == 429
    # 10 tokens left, 30 needed, 100 per 60 s: 12 s
    assert refused.retry_after_s == pytest.approx(12.0, abs=0.01)
    assert levels == pytest.approx([33.0, 56.0, 79.0])


def test_the_bucket_refills_at_limit_per_window_and_never_above_the_limit(store):
    limits, clock = store
    quota = Quota(tokens=100, window_s=60.0)

    async def go():
        await limits.acquire("k", quota, 90, "a", LEASE_S)
        clock.t += 6.0  # +10 tokens
        after_6s = await limits.tokens_left("k", quota)
        clock.t += 600.0
        return after_6s, await limits.tokens_left("k", quota)

    assert run(go()) == pytest.approx((20.0, 100.0))


def test_a_request_larger_than_the_bucket_passes_only_when_it_is_full(store):
    limits, clock = store
    quota = Quota(tokens=100, window_s=60.0)

    async def go():
        await limits.acquire("k", quota, 5, "small", LEASE_S)
        with pytest.raises(Overloaded) as not_full:
            await limits.acquire("k", quota, 150, "big", LEASE_S)
        clock.t += 3.0  # full again
        await limits.acquire("k", quota, 150, "big", LEASE_S)
        with pytest.raises(Overloaded) as in_debt:
            await limits.acquire("k", quota, 1, "next", LEASE_S)
        return not_full.value, in_debt.value, await limits.tokens_left("k", quota)

    not_full, in_debt, level = run(go())
    assert not_full.retry_after_s == pytest.approx(3.0, abs=0.01)
    assert level == pytest.approx(-50.0)
    # the key waits until the level is above zero: 51 tokens at 100 per 60 s
    assert in_debt.retry_after_s == pytest.approx(30.6, abs=0.01)


def test_request_rate_and_concurrency_caps(store):
    limits, clock = store
    rate, conc = Quota(requests=2, window_s=60.0), Quota(concurrent=2, window_s=60.0)

    async def go():
        await limits.acquire("r", rate, 0, "a", LEASE_S)
        await limits.acquire("r", rate, 0, "b", LEASE_S)
        with pytest.raises(Overloaded) as rate_refused:
            await limits.acquire("r", rate, 0, "c", LEASE_S)
        await limits.acquire("c", conc, 0, "a", LEASE_S)
        await limits.acquire("c", conc, 0, "b", LEASE_S)
        with pytest.raises(Overloaded) as conc_refused:
            await limits.acquire("c", conc, 0, "c", LEASE_S)
        await limits.settle("c", conc, 0, "a")
        await limits.acquire("c", conc, 0, "c", LEASE_S)  # a's slot is free again
        return rate_refused.value, conc_refused.value

    rate_refused, conc_refused = run(go())
    assert "request rate limit of 2" in rate_refused.message
    assert rate_refused.retry_after_s == pytest.approx(30.0, abs=0.01)
    assert "2 concurrent requests" in conc_refused.message


def test_keys_are_independent(store):
    limits, _ = store
    quota = Quota(tokens=10, window_s=60.0)

    async def go():
        await limits.acquire("a", quota, 10, "1", LEASE_S)
        with pytest.raises(Overloaded):
            await limits.acquire("a", quota, 1, "2", LEASE_S)
        await limits.acquire("b", quota, 10, "3", LEASE_S)

    run(go())


def test_the_slots_of_a_dead_gateway_expire_with_their_leases_unless_renewed(redis_url, namespace):
    clock = Clock()
    limits = RedisLimits(per_loop(redis_url), namespace, clock)
    quota = Quota(concurrent=1, window_s=60.0)

    async def go():
        await limits.acquire("k", quota, 0, "held", LEASE_S)
        clock.t += LEASE_S - 1
        await limits.renew("k", ["held"], LEASE_S)  # a live gateway renews its leases
        clock.t += LEASE_S - 1
        with pytest.raises(Overloaded):
            await limits.acquire("k", quota, 0, "other", LEASE_S)
        clock.t += 2  # the holder stopped renewing (it died): its lease runs out
        await limits.acquire("k", quota, 0, "other", LEASE_S)

    try:
        run(go())
    finally:
        run(cleanup(redis_url, namespace))


def dead_redis() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def limits_on(url: str, policy: str, namespace: str) -> Limits:
    settings = Settings.from_env({}, namespace=namespace, rate_limit_failure_policy=policy)
    return Limits(settings, per_loop(url, socket_connect_timeout=0.5, retry=None))


def test_fail_open_falls_back_to_local_buckets_when_redis_is_unreachable(namespace):
    limits = limits_on(dead_redis(), "open", namespace)
    quota = Quota(tokens=100, window_s=60.0)

    async def go():
        store = await limits.acquire("k", quota, 60, "a")
        with pytest.raises(Overloaded):  # still limited, by this gateway's own bucket
            await limits.acquire("k", quota, 60, "b")
        return store

    assert run(go()) == "local"
    assert limits.down_until > 0


def test_fail_closed_refuses_with_503_when_redis_is_unreachable(namespace):
    limits = limits_on(dead_redis(), "closed", namespace)

    async def go():
        await limits.acquire("k", Quota(tokens=100, window_s=60.0), 1, "a")

    with pytest.raises(ServiceUnavailable) as exc:
        run(go())
    assert exc.value.status == 503 and exc.value.code == "rate_limiter_unavailable"
    assert exc.value.to_openai()["error"]["type"] == "server_error"


def test_a_reachable_redis_is_shared_by_two_gateways(redis_url, namespace):
    a, b = limits_on(redis_url, "closed", namespace), limits_on(redis_url, "closed", namespace)
    quota = Quota(tokens=100, window_s=3600.0)

    async def go():
        assert await a.acquire("k", quota, 60, "a") == "redis"
        with pytest.raises(Overloaded):
            await b.acquire("k", quota, 60, "b")  # the other gateway sees a's reservation
        await a.settle("redis", "k", quota, -50, "a")  # a used 10 of its 60
        return await b.acquire("k", quota, 60, "b")

    try:
        assert run(go()) == "redis"
    finally:
        run(cleanup(redis_url, namespace))
