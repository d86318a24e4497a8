"""KV store: the staging area of the prefill → decode hand-off and the shared prefix cache."""

from __future__ import annotations

from pathlib import Path

from shared.config import Settings
from shared.kv.base import KVStore, KVStoreStats
from shared.kv.keys import BLOCK, TAIL, block_key, kv_key, tail_key

__all__ = ["KVStore", "KVStoreStats", "BLOCK", "TAIL", "block_key", "kv_key", "tail_key", "open_store"]


def open_store(settings: Settings, kind: str | None = None) -> KVStore:
    """The store named by ``kind`` (default ``settings.kv_store``): ``shm`` or ``redis``.

    Raises:
        ValueError: unknown store kind.
    """
    kind = kind or settings.kv_store
    if kind == "shm":
        from shared.kv.shm import ShmKVStore

        return ShmKVStore(Path(settings.shm_dir) / f"pdserve-{settings.namespace}", settings.kv_store_max_bytes)
    if kind == "redis":
        from shared.kv.redis_store import RedisKVStore

        return RedisKVStore(settings.redis_url, settings.namespace)
    raise ValueError(f"unknown KV store {kind!r}")
