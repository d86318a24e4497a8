"""Redis KV store: for prefill and decode workers on different hosts.

Values are plain strings with a millisecond TTL (``SET key value PX ttl``); Redis expires
them itself. Operations on several keys go in one pipeline. Reads, existence checks and
writes of content-addressed blocks are idempotent, so they are retried briefly (tenacity)
on connection errors; JetStream redelivery is the outer retry.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import redis
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from shared.errors import KVTransferError
from shared.kv.base import Buffer, KVStore
from shared.kv.keys import BLOCK, TAIL, redis_key

_retry = retry(
    retry=retry_if_exception_type((redis.ConnectionError, redis.TimeoutError)),
    stop=stop_after_attempt(3),
    wait=wait_random_exponential(multiplier=0.05, max=0.5),
    reraise=True,
)


class RedisKVStore(KVStore):
    """KV store in Redis under ``<namespace>:kv:``.

    Args:
        url: ``redis://host:port/db``.
        namespace: key prefix (``PD_NAMESPACE``).
        timeout_s: socket timeout of each command.
    """

    name = "redis"

    def __init__(self, url: str, namespace: str, timeout_s: float = 5.0):
        super().__init__()
        self.namespace = namespace
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=30
        )

    @property
    def client(self):
        """The Redis connection (the KV ledger keeps its hash beside the values)."""
        return self._client

    def _k(self, key: str) -> str:
        return redis_key(self.namespace, key)

    def _wrap(self, what: str, fn):
        try:
            return fn()
        except redis.RedisError as exc:
            raise KVTransferError(f"Redis KV store {what} failed: {exc}") from exc

    def put(self, items: Mapping[str, Buffer], ttl_s: float) -> int:
        started = time.perf_counter()
        ttl_ms = max(1, int(ttl_s * 1000))

        @_retry
        def run() -> int:
            pipe = self._client.pipeline(transaction=False)
            nbytes = 0
            for key, value in items.items():
                pipe.set(self._k(key), bytes(value) if isinstance(value, memoryview) else value, px=ttl_ms)
                nbytes += memoryview(value).nbytes
            pipe.execute()
            return nbytes

        written = self._wrap("write", run)
        self.stats.put_bytes += written
        self.stats.put_seconds += time.perf_counter() - started
        self.stats.num_puts += len(items)
        return written

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        started = time.perf_counter()
        values = self._wrap("read", _retry(lambda: self._client.mget([self._k(k) for k in keys])))
        self.stats.get_bytes += sum(len(v) for v in values if v is not None)
        self.stats.get_seconds += time.perf_counter() - started
        self.stats.num_gets += len(keys)
        self.stats.num_get_misses += sum(v is None for v in values)
        return list(values)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        @_retry
        def run():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._k(key))
            return [bool(n) for n in pipe.execute()]

        return self._wrap("exists", run)

    def touch(self, keys: Sequence[str], ttl_s: float) -> list[bool]:
        if not keys:
            return []
        ttl_ms = max(1, int(ttl_s * 1000))

        @_retry
        def run():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.pexpire(self._k(key), ttl_ms)
            return [bool(n) for n in pipe.execute()]

        return self._wrap("touch", run)

    def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        return int(self._wrap("delete", _retry(lambda: self._client.delete(*[self._k(k) for k in keys]))))

    def _scan(self, kind: str | None) -> list[str]:
        kinds = (kind,) if kind else (BLOCK, TAIL)
        out = []
        for k in kinds:
            prefix = f"{self.namespace}:kv:{k}:"
            for raw in self._client.scan_iter(match=prefix + "*", count=1000):
                out.append(f"{k}/{raw.decode()[len(prefix):]}")
        return out

    def staged_bytes(self, kind: str | None = None) -> int:
        def run():
            keys = self._scan(kind)
            if not keys:
                return 0
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self._k(key))
            return sum(pipe.execute())

        return self._wrap("scan", run)

    def list_keys(self, kind: str | None = None) -> list[str]:
        return sorted(self._wrap("scan", lambda: self._scan(kind)))

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        self._client.close()
