"""The ledger of staged KV: one authoritative record per staged handle, kept beside the KV
store's values, and the reaper's rules that reconcile it.

Life of a record (one per request id; ``state`` names where its KV is):

1. ``staged`` — prefill put the prompt's KV in the store (:meth:`KVLedger.staged`): owner =
   that prefill instance, ``lease_until`` = the tail's lease, ``bytes`` = the request-scoped
   bytes (the tail; content-addressed blocks are the shared prefix cache, leased and capped on
   their own, and only counted in ``block_bytes``), ``deadline_at`` = the request's deadline.
   Once its DecodeTask is durable in JetStream prefill marks it ``handed_off``: from then on a
   decode worker will take it even if the prefill worker dies.
2. ``imported`` — a decode worker read it (:meth:`KVLedger.imported`): owner = that worker.
3. ``released`` — decode deleted the tail (:meth:`KVLedger.released`); the record is removed.
4. ``orphaned`` — the reaper found nobody will release it and reclaimed it
   (:func:`orphan_reason`, :func:`reclaim`): the tail is deleted, the record removed, the
   bytes counted (``pd_kv_orphaned_bytes_total``, ``pd_kv_reclaimed_bytes_total``).

A record is orphaned when its lease ran out, its request's deadline passed, the request was
aborted, or its owner is dead while nobody else can take it on (``staged`` and not yet handed
off; ``imported``: decode's redelivery recomputes without it). So after any run the ledger
empties itself: records are released or reclaimed, never left behind.

Backends: files under the shared-memory store's folder (``<root>/ledger/<request_id>``, one
msgpack record each, written by rename), or one Redis hash ``<ns>:kv:ledger`` (field = request
id) for the Redis store. Removing a record is a claim only one process wins (a rename, a
compare-and-delete), so several reapers never count one handle twice; a reaper reclaims a
record only if it is unchanged since it judged it (a re-staged record is kept).
"""

from __future__ import annotations

import abc
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from shared.errors import KVTransferError

STAGED = "staged"
IMPORTED = "imported"
RELEASED = "released"
ORPHANED = "orphaned"


class LedgerEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One staged handle. Times are unix seconds; sizes bytes."""

    request_id: str
    owner: str  # instance id of the worker responsible now
    owner_stage: str
    state: str
    lease_until: float
    deadline_at: float
    bytes: int = 0  # request-scoped bytes (the tail): what leaks if nobody releases it
    block_bytes: int = 0  # content-addressed block bytes this request wrote (shared cache)
    tail_key: str | None = None
    handed_off: bool = False
    staged_at: float = 0.0
    updated_at: float = 0.0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LedgerEntry)


@dataclass(slots=True)
class ReapReport:
    """What one reconciliation pass did: records orphaned, their request-scoped bytes, the
    bytes still in the store that it deleted, and ``by_reason``: reason → [records, bytes]."""

    num_orphaned: int = 0
    bytes_orphaned: int = 0
    bytes_reclaimed: int = 0
    by_reason: dict = field(default_factory=dict)


class KVLedger(abc.ABC):
    """Records of staged handles. Synchronous and thread-safe, like the stores.

    Raises (every method): KVTransferError when the backend cannot be reached.
    """

    # --- backend ------------------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, entry: LedgerEntry) -> None:
        """Create or overwrite the record of ``entry.request_id``."""

    @abc.abstractmethod
    def replace_if_present(self, entry: LedgerEntry) -> bool:
        """Overwrite a record that exists; False (nothing written) when it is gone."""

    @abc.abstractmethod
    def get(self, request_id: str) -> LedgerEntry | None: ...

    @abc.abstractmethod
    def entries(self) -> list[LedgerEntry]:
        """Every record (for the reaper, ``pdserve kv ledger`` and the chaos suite)."""

    @abc.abstractmethod
    def take(self, request_id: str, expected: LedgerEntry | None = None) -> LedgerEntry | None:
        """Remove the record and return it — to one caller only. With ``expected``, only if
        the record still equals it (else it is left as it is and None returned)."""

    def clear(self) -> None:
        for e in self.entries():
            self.take(e.request_id)

    # --- transitions --------------------------------------------------------------------------
    def staged(self, request_id: str, owner: str, owner_stage: str, lease_s: float, deadline_at: float,
               nbytes: int, block_bytes: int, tail_key: str | None) -> LedgerEntry:
        now = time.time()
        entry = LedgerEntry(request_id=request_id, owner=owner, owner_stage=owner_stage, state=STAGED,
                            lease_until=now + lease_s, deadline_at=deadline_at, bytes=nbytes,
                            block_bytes=block_bytes, tail_key=tail_key, staged_at=now, updated_at=now)
        self.put(entry)
        return entry

    def handed_off(self, request_id: str) -> bool:
        """Its DecodeTask is durable: a decode worker will take it whoever staged it."""
        return self._update(request_id, handed_off=True)

    def imported(self, request_id: str, owner: str, owner_stage: str = "decode") -> bool:
        return self._update(request_id, state=IMPORTED, owner=owner, owner_stage=owner_stage)

    def released(self, request_id: str) -> LedgerEntry | None:
        """Decode let go of the request-scoped KV: the record is done."""
        return self.take(request_id)

    def _update(self, request_id: str, **changes) -> bool:
        entry = self.get(request_id)
        if entry is None:
            return False
        return self.replace_if_present(msgspec.structs.replace(entry, updated_at=time.time(), **changes))

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections."""


def orphan_reason(entry: LedgerEntry, now: float, is_alive: Callable[[str], bool] | None,
                  is_aborted: Callable[[str], bool]) -> str | None:
    """Why nobody will release ``entry`` (None: it is still wanted).

    Args:
        now: unix seconds.
        is_alive: whether a worker instance id is alive; None when the caller cannot judge
            (it has not heard heartbeats long enough).
        is_aborted: whether a request was aborted.
    """
    if now > entry.lease_until:
        return "lease_expired"
    if now > entry.deadline_at:
        return "deadline"
    if is_aborted(entry.request_id):
        return "aborted"
    if is_alive is not None and not is_alive(entry.owner):
        if entry.state == IMPORTED or not entry.handed_off:
            return "owner_dead"
    return None


def reclaim(ledger: KVLedger, store, victims: Iterable[tuple[LedgerEntry, str]]) -> ReapReport:
    """Take each judged record (if unchanged) and delete its request-scoped KV from ``store``.
    Returns what was orphaned (record bytes) and reclaimed (bytes that were still there)."""
    report = ReapReport()
    for entry, reason in victims:
        taken = ledger.take(entry.request_id, expected=entry)
        if taken is None:
            continue  # released, re-staged or claimed by another reaper meanwhile
        report.num_orphaned += 1
        report.bytes_orphaned += taken.bytes
        counts = report.by_reason.setdefault(reason, [0, 0])
        counts[0] += 1
        counts[1] += taken.bytes
        if taken.tail_key and store.exists([taken.tail_key])[0]:
            if store.delete([taken.tail_key]):
                report.bytes_reclaimed += taken.bytes
    return report


# --- backends -----------------------------------------------------------------------------------
class ShmKVLedger(KVLedger):
    """Records as files in ``<store root>/ledger``: one per request id, msgpack, written to a
    temporary name and renamed into place."""

    def __init__(self, root: str | Path):
        self.root = Path(root) / "ledger"
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, request_id: str) -> Path:
        if "/" in request_id or request_id.startswith("."):
            raise ValueError(f"unsafe request id {request_id!r}")
        return self.root / request_id

    def _write(self, path: Path, entry: LedgerEntry) -> Path:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_bytes(_encoder.encode(entry))
        return tmp

    def put(self, entry: LedgerEntry) -> None:
        path = self._path(entry.request_id)
        try:
            os.replace(self._write(path, entry), path)
        except OSError as exc:
            raise KVTransferError(f"KV ledger write failed: {exc}") from exc

    def replace_if_present(self, entry: LedgerEntry) -> bool:
        path = self._path(entry.request_id)
        if not path.exists():
            return False
        try:
            os.replace(self._write(path, entry), path)
        except OSError as exc:
            raise KVTransferError(f"KV ledger write failed: {exc}") from exc
        return True

    def get(self, request_id: str) -> LedgerEntry | None:
        try:
            return _decoder.decode(self._path(request_id).read_bytes())
        except FileNotFoundError:
            return None
        except msgspec.DecodeError:
            return None

    def entries(self) -> list[LedgerEntry]:
        out = []
        try:
            names = [n for n in os.listdir(self.root) if not n.startswith(".")]
        except FileNotFoundError:
            return []
        for name in names:
            entry = self.get(name)
            if entry is not None:
                out.append(entry)
        return sorted(out, key=lambda e: e.staged_at)

    def take(self, request_id: str, expected: LedgerEntry | None = None) -> LedgerEntry | None:
        path = self._path(request_id)
        claimed = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.taken")
        try:
            os.rename(path, claimed)  # atomic: one caller wins
        except FileNotFoundError:
            return None
        try:
            entry = _decoder.decode(claimed.read_bytes())
        except msgspec.DecodeError:
            entry = None
        if expected is not None and entry != expected:
            try:  # a newer record (re-staged): put it back unless a newer one still took its place
                os.link(claimed, path)
            except FileExistsError:
                pass
            claimed.unlink(missing_ok=True)
            return None
        claimed.unlink(missing_ok=True)
        return entry

    def sweep_temporaries(self, older_than_s: float = 60.0) -> None:
        """Remove temporaries of a writer that died between writing and renaming."""
        now = time.time()
        for name in os.listdir(self.root):
            if name.startswith("."):
                path = self.root / name
                try:
                    if path.stat().st_mtime < now - older_than_s:
                        path.unlink()
                except FileNotFoundError:
                    pass


#: Compare-and-delete: HDEL the field only if it still holds ARGV[2] (or ARGV[2] is empty).
_TAKE_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return false end
if ARGV[2] ~= '' and v ~= ARGV[2] then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
return v
"""
#: Overwrite a field only if it exists.
_REPLACE_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class RedisKVLedger(KVLedger):
    """Records in the Redis hash ``<namespace>:kv:ledger`` beside the Redis store's values."""

    def __init__(self, client, namespace: str):
        self._client = client
        self.key = f"{namespace}:kv:ledger"
        self._take = client.register_script(_TAKE_LUA)
        self._replace = client.register_script(_REPLACE_LUA)

    def _wrap(self, fn):
        import redis

        try:
            return fn()
        except redis.RedisError as exc:
            raise KVTransferError(f"KV ledger (Redis) failed: {exc}") from exc

    def put(self, entry: LedgerEntry) -> None:
        self._wrap(lambda: self._client.hset(self.key, entry.request_id, _encoder.encode(entry)))

    def replace_if_present(self, entry: LedgerEntry) -> bool:
        return bool(self._wrap(lambda: self._replace(keys=[self.key], args=[entry.request_id, _encoder.encode(entry)])))

    def get(self, request_id: str) -> LedgerEntry | None:
        raw = self._wrap(lambda: self._client.hget(self.key, request_id))
        return _decoder.decode(raw) if raw else None

    def entries(self) -> list[LedgerEntry]:
        raw = self._wrap(lambda: self._client.hgetall(self.key))
        return sorted((_decoder.decode(v) for v in raw.values()), key=lambda e: e.staged_at)

    def take(self, request_id: str, expected: LedgerEntry | None = None) -> LedgerEntry | None:
        want = _encoder.encode(expected) if expected is not None else b""
        raw = self._wrap(lambda: self._take(keys=[self.key], args=[request_id, want]))
        return _decoder.decode(raw) if raw else None


def ledger_for(store) -> KVLedger:
    """The ledger kept with a KV store (a :class:`~shared.kv.shm.ShmKVStore` or
    :class:`~shared.kv.redis_store.RedisKVStore`).

    Raises:
        ValueError: a store kind without a ledger.
    """
    if store.name == "shm":
        return ShmKVLedger(store.root)
    if store.name == "redis":
        return RedisKVLedger(store.client, store.namespace)
    raise ValueError(f"no KV ledger for a {store.name!r} store")
