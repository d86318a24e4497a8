"""One contract, run over every KV store implementation (shared memory and Redis)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from shared.config import Settings
from shared.kv import BLOCK, TAIL, block_key, open_store, tail_key


@pytest.fixture(params=["shm", "redis"])
def store(request, tmp_path, redis_url):
    ns = f"t{uuid.uuid4().hex[:10]}"
    settings = Settings.from_env({}, namespace=ns, kv_store=request.param, shm_dir=str(tmp_path),
                                 redis_url=redis_url, kv_store_max_bytes=1 << 20)
    s = open_store(settings)
    yield s
    s.clear()
    s.close()


def test_put_get_roundtrip_and_missing(store):
    a, b = block_key(os.urandom(32), "float32"), tail_key("req-1")
    assert store.put({a: b"x" * 1000, b: memoryview(b"tail")}, ttl_s=30) == 1004
    assert store.get([a, b, block_key(os.urandom(32), "float32")]) == [b"x" * 1000, b"tail", None]
    assert store.exists([a, b, tail_key("nope")]) == [True, True, False]
    assert store.stats.put_bytes == 1004 and store.stats.get_bytes == 1004 and store.stats.num_get_misses == 1


def test_views_read_what_get_reads_and_outlive_their_files(store):
    """get_views: the same bytes as get (missing and expired values None, an empty value empty),
    and a view taken before its value is deleted or overwritten still reads the old bytes (the
    decode worker deletes a tail right after importing it; writers rename whole files over
    blocks)."""
    a, b, e = block_key(os.urandom(32), "bfloat16"), tail_key("view"), tail_key("empty")
    payload = os.urandom(368_640)
    store.put({a: payload, b: b"tail" * 3, e: b""}, ttl_s=30)
    store.put({tail_key("old"): b"o"}, ttl_s=0.05)
    time.sleep(0.1)
    views = store.get_views([a, b, e, tail_key("missing"), tail_key("old")])
    assert [None if v is None else bytes(v) for v in views] == [payload, b"tail" * 3, b"", None, None]
    store.delete([b])
    store.put({a: b"y" * len(payload)}, ttl_s=30)
    assert bytes(views[0]) == payload and bytes(views[1]) == b"tail" * 3
    assert store.get([a]) == [b"y" * len(payload)]


def test_kinds_listing_and_staged_bytes(store):
    blocks = {block_key(os.urandom(32), "float32"): b"b" * 100 for _ in range(3)}
    store.put(blocks, 30)
    store.put({tail_key("r"): b"t" * 7}, 30)
    assert sorted(store.list_keys(BLOCK)) == sorted(blocks)
    assert store.list_keys(TAIL) == [tail_key("r")]
    assert store.staged_bytes(BLOCK) == 300
    assert store.staged_bytes(TAIL) == 7
    assert store.staged_bytes() == 307


def test_delete(store):
    k = tail_key("gone")
    store.put({k: b"1"}, 30)
    assert store.delete([k, tail_key("never")]) == 1
    assert store.get([k]) == [None]
    assert store.staged_bytes() == 0


def test_lease_expires_and_touch_renews(store):
    short, renewed = tail_key("short"), tail_key("renewed")
    store.put({short: b"s", renewed: b"r"}, ttl_s=0.3)
    assert store.touch([renewed, tail_key("absent")], ttl_s=30) == [True, False]
    time.sleep(0.5)
    assert store.get([short, renewed]) == [None, b"r"]
    assert store.exists([short]) == [False]
    store.reap()
    assert store.list_keys() == [renewed]


def test_overwrite_is_idempotent(store):
    k = block_key(os.urandom(32), "bfloat16")
    store.put({k: b"same"}, 30)
    store.put({k: b"same"}, 30)
    assert store.get([k]) == [b"same"]
    assert store.staged_bytes() == 4


def test_unsafe_keys_are_refused():
    from shared.kv.keys import kv_key

    for bad in ("../etc", "a/b", "", "x" * 300):
        with pytest.raises(ValueError):
            kv_key(TAIL, bad)
    with pytest.raises(ValueError):
        kv_key("other", "x")


def test_shm_capacity_evicts_soonest_expiring_blocks(tmp_path):
    from shared.kv.shm import ShmKVStore

    s = ShmKVStore(tmp_path / "cap", max_bytes=250)
    old, new = block_key(os.urandom(32), "float32"), block_key(os.urandom(32), "float32")
    s.put({old: b"o" * 100}, ttl_s=10)
    s.put({new: b"n" * 100}, ttl_s=100)
    s.put({tail_key("t"): b"t" * 100}, ttl_s=5)  # over the cap: the block that expires soonest goes
    assert s.list_keys() == sorted([new, tail_key("t")])
    assert s.staged_bytes() == 200


def test_shm_capacity_keeps_a_block_a_prefill_reused(tmp_path):
    """PD_KV_STORE_MAX_BYTES as documented: with one lease for every block, the soonest-expiring
    is the least recently staged or reused (a prefill that reuses a block renews its lease,
    services/prefill/worker.py), so a reused old block outlives a newer one nobody reused."""
    from shared.kv.shm import ShmKVStore

    s = ShmKVStore(tmp_path / "cap", max_bytes=250)
    first, second, third = (block_key(os.urandom(32), "float32") for _ in range(3))
    s.put({first: b"a" * 100}, ttl_s=60)
    s.put({second: b"b" * 100}, ttl_s=60)
    assert s.touch([first], ttl_s=60) == [True]  # reused
    s.put({third: b"c" * 100}, ttl_s=60)  # over the cap: one block goes
    assert s.list_keys() == sorted([first, third])


def test_shm_views_fall_back_to_reads_when_maps_run_out(tmp_path, monkeypatch):
    """Out of descriptors (EMFILE) while mapping: the rest of the call is read as bytes, the same
    values; any other mapping error is a KVTransferError."""
    import errno
    import mmap as mmap_module

    from shared.errors import KVTransferError
    from shared.kv import shm

    store = shm.ShmKVStore(tmp_path)
    keys = [block_key(os.urandom(32), "bfloat16") for _ in range(4)]
    values = [os.urandom(4096) for _ in keys]
    store.put(dict(zip(keys, values)), 30)
    real, calls = mmap_module.mmap, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(*args, **kwargs)

    monkeypatch.setattr(shm.mmap, "mmap", flaky)
    got = store.get_views(keys)
    assert [bytes(v) for v in got] == values
    assert isinstance(got[0], real) and all(isinstance(v, bytes) for v in got[1:])
    assert len(calls) == 2  # no more maps tried after the first refusal

    def broken(*args, **kwargs):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(shm.mmap, "mmap", broken)
    with pytest.raises(KVTransferError, match="read failed"):
        store.get_views(keys)


def test_workers_raise_their_open_file_limit():
    """services.common.runtime.raise_open_file_limit lifts a low soft limit to the hard one (run in
    a child process, whose limits are its own)."""
    import subprocess
    import sys

    code = ("import resource; from services.common.runtime import raise_open_file_limit as r; "
            "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); "
            "print(r() > 256 or hard == 256, resource.getrlimit(resource.RLIMIT_NOFILE)[0] == r())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr
