"""Shared-memory KV store: one file per value on a tmpfs (``/dev/shm`` by default).

A file on tmpfs *is* POSIX shared memory (``shm_open`` makes the same files); using plain
files instead of ``multiprocessing.shared_memory`` avoids its resource tracker, which
unlinks a segment when the process that created it exits — exactly wrong for a hand-off
from a prefill process to a decode process.

* Writes go to a temporary name and are renamed into place, so a reader never sees half a
  value, and writing the same content-addressed block twice is harmless.
* A value's lease is its file's mtime, set into the future: ``mtime = now + ttl``. A file
  whose mtime has passed is expired; readers treat it as missing and :meth:`reap` deletes
  it. Renewing a lease is one ``utime`` call.
* ``max_bytes`` caps the store: :meth:`reap` (and a put that finds the store over its cap)
  removes the values whose leases end soonest until it fits.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from shared.errors import KVTransferError
from shared.kv.base import Buffer, KVStore
from shared.kv.keys import BLOCK, TAIL

#: Fill a map's page tables in the mmap call (Linux), not by a fault per page during the copy.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class ShmKVStore(KVStore):
    """KV store in a folder on a tmpfs. Thread- and process-safe.

    Args:
        root: the folder, e.g. ``/dev/shm/pdserve-pd``; created if missing.
        max_bytes: capacity; 0 = unbounded.
    """

    name = "shm"

    def __init__(self, root: str | Path, max_bytes: int = 0):
        super().__init__()
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        for kind in (BLOCK, TAIL):
            (self.root / kind).mkdir(parents=True, exist_ok=True)
        self._approx_bytes = self.staged_bytes()

    def _path(self, key: str) -> Path:
        return self.root / key

    def put(self, items: Mapping[str, Buffer], ttl_s: float) -> int:
        started = time.perf_counter()
        written = 0
        expires_at = time.time() + ttl_s
        try:
            for key, value in items.items():
                path = self._path(key)
                tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
                with open(tmp, "wb") as fh:
                    fh.write(value)
                os.utime(tmp, (expires_at, expires_at))
                os.replace(tmp, path)
                written += memoryview(value).nbytes
        except OSError as exc:
            raise KVTransferError(f"shared-memory KV store write failed: {exc}") from exc
        with self._lock:
            self._approx_bytes += written
            self.stats.put_bytes += written
            self.stats.put_seconds += time.perf_counter() - started
            self.stats.num_puts += len(items)
            over = self.max_bytes and self._approx_bytes > self.max_bytes
        if over:
            self.reap()
        return written

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._read(keys, views=False)

    def get_views(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Each value as a read-only map of its file (``mmap``, populated at once): the block's
        bytes are copied once, from the tmpfs pages into the caller's pool, instead of first
        into a new ``bytes`` per value. Reading 369 blocks of 360 KiB (a 5,900-token prompt of
        SmolLM2, bf16) into a pool took 115-123 ms by ``get`` and 48-49 ms by maps (one thread,
        AMD EPYC Zen 4, 2026-12-03); the fresh memory each ``bytes`` needs (page faults) was most
        of the difference. A map stays valid after its file is replaced or unlinked (writers
        rename whole files into place and never truncate one). Before Python 3.13 each live map
        holds a file descriptor (mmap keeps a duplicate): the model workers raise their soft
        ``RLIMIT_NOFILE`` to the hard limit at start (:func:`services.common.runtime.raise_open_file_limit`), and
        when descriptors or maps run out anyway the remaining values of the call are read as
        ``bytes``, as :meth:`get` does."""
        return self._read(keys, views=True)

    def _read(self, keys: Sequence[str], views: bool) -> list:
        started = time.perf_counter()
        now = time.time()
        out: list = []
        nbytes = misses = 0
        for key in keys:
            path = self._path(key)
            try:
                with open(path, "rb", buffering=0) as fh:
                    st = os.fstat(fh.fileno())
                    if st.st_mtime < now:
                        out.append(None)
                        misses += 1
                        continue
                    data = None
                    if views and st.st_size:
                        try:
                            data = mmap.mmap(fh.fileno(), st.st_size, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                                             prot=mmap.PROT_READ)
                        except OSError as exc:  # out of descriptors or maps: copy the rest
                            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                                raise
                            views = False
                    if data is None:
                        data = fh.read()
            except FileNotFoundError:
                out.append(None)
                misses += 1
                continue
            except (OSError, ValueError) as exc:
                raise KVTransferError(f"shared-memory KV store read failed: {exc}") from exc
            nbytes += len(data)
            out.append(data)
        with self._lock:
            self.stats.get_bytes += nbytes
            self.stats.get_seconds += time.perf_counter() - started
            self.stats.num_gets += len(keys)
            self.stats.num_get_misses += misses
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        now = time.time()
        out = []
        for key in keys:
            try:
                out.append(os.stat(self._path(key)).st_mtime >= now)
            except FileNotFoundError:
                out.append(False)
            except OSError as exc:  # the store itself is broken: the KV failure policy decides
                raise KVTransferError(f"shared-memory KV store read failed: {exc}") from exc
        return out

    def touch(self, keys: Sequence[str], ttl_s: float) -> list[bool]:
        now = time.time()
        expires_at = now + ttl_s
        out = []
        for key in keys:
            path = self._path(key)
            try:
                if os.stat(path).st_mtime < now:
                    out.append(False)
                    continue
                os.utime(path, (expires_at, expires_at))
                out.append(True)
            except FileNotFoundError:
                out.append(False)
            except OSError as exc:
                raise KVTransferError(f"shared-memory KV store write failed: {exc}") from exc
        return out

    def delete(self, keys: Sequence[str]) -> int:
        removed = 0
        freed = 0
        for key in keys:
            path = self._path(key)
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            removed += 1
            freed += size
        with self._lock:
            self._approx_bytes = max(0, self._approx_bytes - freed)
        return removed

    def _entries(self, kind: str | None):
        kinds = (kind,) if kind else (BLOCK, TAIL)
        for k in kinds:
            try:
                with os.scandir(self.root / k) as it:
                    for entry in it:
                        if entry.name.startswith("."):
                            continue
                        try:
                            st = entry.stat()
                        except FileNotFoundError:
                            continue
                        yield f"{k}/{entry.name}", st.st_mtime, st.st_size
            except FileNotFoundError:
                continue

    def staged_bytes(self, kind: str | None = None) -> int:
        now = time.time()
        return sum(size for _, mtime, size in self._entries(kind) if mtime >= now)

    def list_keys(self, kind: str | None = None) -> list[str]:
        now = time.time()
        return sorted(key for key, mtime, _ in self._entries(kind) if mtime >= now)

    def reap(self) -> int:
        """Delete expired values, then the soonest-expiring blocks while over ``max_bytes``."""
        now = time.time()
        live = []
        expired = []
        for key, mtime, size in self._entries(None):
            (expired if mtime < now else live).append((mtime, key, size))
        removed = self.delete([key for _, key, _ in expired])
        total = sum(size for _, _, size in live)
        if self.max_bytes and total > self.max_bytes:
            victims = []
            for _, key, size in sorted(live):
                if total <= self.max_bytes:
                    break
                if key.startswith(TAIL):
                    continue  # tails are request-scoped and short-lived; evict blocks first
                victims.append(key)
                total -= size
            removed += self.delete(victims)
        with self._lock:
            self._approx_bytes = total
        # stray temporaries of a writer that died mid-write
        for kind in (BLOCK, TAIL):
            with os.scandir(self.root / kind) as it:
                for entry in it:
                    if entry.name.endswith(".tmp"):
                        try:
                            if entry.stat().st_mtime < now - 60:
                                os.unlink(entry.path)
                        except FileNotFoundError:
                            pass
        return removed
