"""Usage metered per key name: requests, prompt tokens, cached prompt tokens and completion
tokens, by outcome.

Each gateway counts into Prometheus (``pd_gateway_key_requests_total{key_name,outcome}``,
``pd_gateway_key_tokens_total{key_name,kind}``; labels are key names from the keys file,
never keys) and, with the Redis store, into one Redis hash per key name
(``<ns>:usage:{<name>}``, fields ``<outcome>:<counter>``, ``HINCRBY``) so that
``GET /v1/usage`` sums every replica. Without Redis, or while it is unreachable, the report
holds this gateway's own counts and says so (``"scope": "gateway"``).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

from prometheus_client import Counter

from services.gateway.tenancy.limits import is_unreachable
from shared.logging import get_logger

log = get_logger("gateway.usage")

COUNTERS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")


@functools.cache
def usage_metrics() -> dict[str, Counter]:
    return {
        "requests": Counter("pd_gateway_key_requests_total", "requests by API key name and outcome",
                            ["key_name", "outcome"]),
        "tokens": Counter("pd_gateway_key_tokens_total",
                          "tokens by API key name and kind (prompt, cached_prompt, completion)",
                          ["key_name", "kind"]),
    }


def usage_key(namespace: str, name: str) -> str:
    """Redis hash of one key name's usage."""
    return f"{namespace}:usage:{{{name}}}"


def names_key(namespace: str) -> str:
    """Redis set of the key names with usage."""
    return f"{namespace}:usage:names"


def report(rows: dict[str, dict[str, int]]) -> list[dict]:
    """``{name: {"<outcome>:<counter>": n}}`` → the endpoint's list, sorted by name: per key
    name the totals and the same counters by outcome."""
    data = []
    for name in sorted(rows):
        by_outcome: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
        for field, value in rows[name].items():
            outcome, _, counter = field.rpartition(":")
            if counter in COUNTERS and outcome:
                by_outcome[outcome][counter] += int(value)
        totals = {c: sum(o[c] for o in by_outcome.values()) for c in COUNTERS}
        data.append({"key_name": name, **totals, "by_outcome": dict(sorted(by_outcome.items()))})
    return data


class UsageMeter:
    """Counts usage here and (``redis`` given) in Redis.

    Args:
        namespace: prefix of the Redis keys.
        redis: returns the Redis client of the running loop; None = this gateway only.
    """

    def __init__(self, namespace: str, redis: Callable[[], object] | None = None):
        self.namespace = namespace
        self.redis = redis
        self.local: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.metrics = usage_metrics()
        self.redis_failed = False

    def counts(self, outcome: str, prompt: int = 0, cached: int = 0, completion: int = 0) -> dict[str, int]:
        return {f"{outcome}:requests": 1, f"{outcome}:prompt_tokens": prompt,
                f"{outcome}:cached_prompt_tokens": cached, f"{outcome}:completion_tokens": completion}

    async def record(self, name: str, outcome: str, prompt: int = 0, cached: int = 0, completion: int = 0) -> None:
        """Count one request of key ``name`` that ended with ``outcome`` (``ok``, or an error
        code such as ``rate_limit_exceeded``)."""
        self.metrics["requests"].labels(name, outcome).inc()
        for kind, n in (("prompt", prompt), ("cached_prompt", cached), ("completion", completion)):
            if n:
                self.metrics["tokens"].labels(name, kind).inc(n)
        fields = self.counts(outcome, prompt, cached, completion)
        for field, n in fields.items():
            self.local[name][field] += n
        if self.redis is None:
            return
        try:
            pipe = self.redis().pipeline(transaction=False)
            pipe.sadd(names_key(self.namespace), name)
            for field, n in fields.items():
                if n:
                    pipe.hincrby(usage_key(self.namespace, name), field, n)
            await pipe.execute()
            self.redis_failed = False
        except Exception as exc:
            if not is_unreachable(exc):
                raise
            if not self.redis_failed:
                log.warning("usage_store_unreachable", error=str(exc) or type(exc).__name__)
            self.redis_failed = True

    async def summary(self) -> dict:
        """The usage of every key name: from Redis (all gateways) when it answers, else this
        gateway's own counts."""
        if self.redis is not None:
            try:
                client = self.redis()
                names = sorted(n.decode() if isinstance(n, bytes) else n
                               for n in await client.smembers(names_key(self.namespace)))
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.hgetall(usage_key(self.namespace, name))
                rows = {name: {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in h.items()}
                        for name, h in zip(names, await pipe.execute(), strict=True)}
                return {"object": "list", "scope": "all_gateways", "data": report(rows)}
            except Exception as exc:
                if not is_unreachable(exc):
                    raise
                log.warning("usage_store_unreachable", error=str(exc) or type(exc).__name__)
        return {"object": "list", "scope": "gateway", "data": report({n: dict(c) for n, c in self.local.items()})}
