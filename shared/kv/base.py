"""The KV store interface: where prefill stages KV blocks and decode picks them up.

KV bytes never ride NATS; messages carry a :class:`~shared.kv.layout.KVHandle` naming keys
here. Every value has a lease (TTL): content-addressed blocks double as a prefix cache shared
by all workers, request-scoped tails are deleted by decode once loaded, and anything
abandoned expires. Implementations are synchronous and thread-safe; async callers run them
with ``asyncio.to_thread`` so model steps and the event loop never wait on each other.
"""

from __future__ import annotations

import abc
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Buffer = bytes | bytearray | memoryview | mmap.mmap


@dataclass(slots=True)
class KVStoreStats:
    """Counters since the store object was created (bytes and seconds)."""

    put_bytes: int = 0
    put_seconds: float = 0.0
    get_bytes: int = 0
    get_seconds: float = 0.0
    num_puts: int = 0
    num_gets: int = 0
    num_get_misses: int = 0
    extra: dict = field(default_factory=dict)


class KVStore(abc.ABC):
    """A key → bytes store with per-key leases.

    Keys come from :mod:`shared.kv.keys`. All methods take several keys at once so that a
    network store can pipeline them.
    """

    name: str = "abstract"

    def __init__(self) -> None:
        self.stats = KVStoreStats()

    @abc.abstractmethod
    def put(self, items: Mapping[str, Buffer], ttl_s: float) -> int:
        """Store values with a lease of ``ttl_s`` seconds; overwrites. Returns bytes written.

        Raises:
            KVTransferError: the store could not take the values.
        """

    @abc.abstractmethod
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values in key order; None for a key that is missing or expired.

        Raises:
            KVTransferError: the store could not be read.
        """

    def get_views(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Like :meth:`get`, for a caller that only reads each value once and soon (importing
        blocks into a KV pool): a store may hand out views of memory it already holds instead
        of copies (the shared-memory store maps its files). Drop the views after use.

        Raises:
            KVTransferError: the store could not be read.
        """
        return list(self.get(keys))

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a live value."""

    @abc.abstractmethod
    def touch(self, keys: Sequence[str], ttl_s: float) -> list[bool]:
        """Renew leases to ``ttl_s`` from now; False where the key is gone."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> int:
        """Remove keys; returns how many existed."""

    @abc.abstractmethod
    def staged_bytes(self, kind: str | None = None) -> int:
        """Bytes held now (of one key kind, or all); expired values do not count."""

    @abc.abstractmethod
    def list_keys(self, kind: str | None = None) -> list[str]:
        """Live keys (of one key kind, or all). For tests and operations, not hot paths."""

    def reap(self) -> int:
        """Free what has expired or is over capacity; returns values removed. Stores whose
        backend expires keys itself (Redis) do nothing."""
        return 0

    def clear(self) -> None:
        """Remove everything under this store's namespace."""
        self.delete(self.list_keys())

    def close(self) -> None:  # noqa: B027 (optional hook: most stores hold nothing to release)
        """Release connections."""
