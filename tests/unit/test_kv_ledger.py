"""The ledger of staged KV (``shared/kv/ledger.py``), one contract over both backends (files
beside the shared-memory store, a hash beside the Redis store), the reaper's rules, and the
reaper reclaiming the handle of an owner whose heartbeats stopped."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.common.kv_reaper import KVReaper
from services.common.runtime import RecentSet
from shared.config import Settings
from shared.kv import open_store, tail_key
from shared.kv.ledger import IMPORTED, STAGED, LedgerEntry, ledger_for, orphan_reason, reclaim
from shared.logging import get_logger
from shared.messages import Heartbeat
from shared.metrics import kv_ledger_metrics
from shared.registry import WorkerRegistry


@pytest.fixture(params=["shm", "redis"])
def store(request, tmp_path, redis_url):
    settings = Settings.from_env({}, namespace=f"t{uuid.uuid4().hex[:10]}", kv_store=request.param,
                                 shm_dir=str(tmp_path), redis_url=redis_url)
    s = open_store(settings)
    yield s
    ledger_for(s).clear()
    s.clear()
    s.close()


def stage(ledger, store, rid: str, owner: str = "prefill-a", nbytes: int = 100, lease_s: float = 30.0,
          deadline_in_s: float = 600.0):
    store.put({tail_key(rid): b"t" * nbytes}, lease_s)
    return ledger.staged(rid, owner, "prefill", lease_s, time.time() + deadline_in_s, nbytes, 4096, tail_key(rid))


def test_a_handle_goes_staged_handed_off_imported_released(store):
    ledger = ledger_for(store)
    stage(ledger, store, "r1")
    e = ledger.get("r1")
    assert (e.state, e.owner, e.bytes, e.block_bytes, e.handed_off) == (STAGED, "prefill-a", 100, 4096, False)
    assert e.lease_until > time.time() + 25
    assert ledger.handed_off("r1") and ledger.get("r1").handed_off
    assert ledger.imported("r1", "decode-b")
    e = ledger.get("r1")
    assert (e.state, e.owner, e.owner_stage) == (IMPORTED, "decode-b", "decode")
    assert [x.request_id for x in ledger.entries()] == ["r1"]
    assert ledger.released("r1").request_id == "r1"
    assert ledger.entries() == [] and ledger.get("r1") is None
    # transitions of a record that is gone write nothing (it does not come back)
    assert not ledger.imported("r1", "decode-b") and ledger.get("r1") is None


def test_a_record_is_taken_once_and_only_if_unchanged(store):
    ledger = ledger_for(store)
    old = stage(ledger, store, "r2")
    new = stage(ledger, store, "r2", owner="prefill-b")  # re-staged by another worker (a redelivery)
    assert ledger.take("r2", expected=old) is None  # judged on the old record: kept
    assert ledger.get("r2") == new
    assert ledger.take("r2", expected=new) == new
    assert ledger.take("r2") is None  # a second reaper gets nothing


def test_orphan_rules():
    now = time.time()
    base = dict(request_id="r", owner="prefill-a", owner_stage="prefill", lease_until=now + 30, deadline_at=now + 60)
    staged = LedgerEntry(state=STAGED, **base)
    alive = {"prefill-a"}.__contains__
    dead = set().__contains__
    never = set().__contains__
    assert orphan_reason(staged, now, alive, never) is None
    assert orphan_reason(staged, now + 31, alive, never) == "lease_expired"
    late = LedgerEntry(state=STAGED, **{**base, "lease_until": now + 100})
    assert orphan_reason(late, now + 61, alive, never) == "deadline"
    assert orphan_reason(staged, now, alive, lambda r: r == "r") == "aborted"
    assert orphan_reason(staged, now, dead, never) == "owner_dead"
    assert orphan_reason(staged, now, None, never) is None  # cannot judge owners yet
    handed = LedgerEntry(state=STAGED, handed_off=True, **base)
    assert orphan_reason(handed, now, dead, never) is None  # its DecodeTask is durable: decode takes it
    imported = LedgerEntry(state=IMPORTED, **{**base, "owner": "decode-a", "owner_stage": "decode"})
    assert orphan_reason(imported, now, dead, never) == "owner_dead"


def test_reclaim_deletes_the_tail_and_counts_the_bytes(store):
    ledger = ledger_for(store)
    e1 = stage(ledger, store, "r3", nbytes=300)
    e2 = stage(ledger, store, "r4", nbytes=50)
    store.delete([tail_key("r4")])  # its tail already expired in the store
    report = reclaim(ledger, store, [(e1, "owner_dead"), (e2, "lease_expired")])
    assert report.num_orphaned == 2 and report.bytes_orphaned == 350 and report.bytes_reclaimed == 300
    assert report.by_reason == {"owner_dead": [1, 300], "lease_expired": [1, 50]}
    assert store.get([tail_key("r3")]) == [None] and ledger.entries() == []
    assert reclaim(ledger, store, [(e1, "owner_dead")]).num_orphaned == 0  # nothing twice


class _Worker:
    """What the reaper needs of a worker: its registry of heartbeats, aborted ids, identity."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.instance_id = "prefill-reaper"
        self.started_at = time.time() - 3600
        self.registry = WorkerRegistry(settings.heartbeat_timeout_s, deaf_after_s=1e9)
        self.aborted = RecentSet()
        self.log = get_logger("test")


def test_the_reaper_reclaims_the_handle_of_an_owner_that_died(store):
    """Two prefill workers staged handles; one stops heartbeating (killed). After the heartbeat
    timeout the reaper reclaims the dead one's un-handed-off handle — tail deleted, bytes
    counted — and keeps the live one's and the handed-off one's."""
    settings = Settings.from_env({}, heartbeat_timeout_s=0.5)
    worker = _Worker(settings)
    ledger = ledger_for(store)
    reaper = KVReaper(worker, ledger, store)
    for name in ("prefill-dead", "prefill-live"):
        worker.registry.observe(Heartbeat(stage="prefill", instance_id=name, model="m", sent_at=time.time()))
    stage(ledger, store, "mine-dead", owner="prefill-dead", nbytes=1000)
    stage(ledger, store, "sent-dead", owner="prefill-dead", nbytes=10)
    ledger.handed_off("sent-dead")
    stage(ledger, store, "mine-live", owner="prefill-live", nbytes=20)
    m = kv_ledger_metrics()
    before = (m["orphaned_bytes"].labels("owner_dead")._value.get(), m["reclaimed_bytes"]._value.get())

    first = asyncio.run(reaper.sweep())
    assert first.num_orphaned == 0 and m["outstanding"]._value.get() == 3
    time.sleep(0.6)  # prefill-dead is silent past the timeout; prefill-live still beats
    worker.registry.observe(Heartbeat(stage="prefill", instance_id="prefill-live", model="m", sent_at=time.time()))
    report = asyncio.run(reaper.sweep())
    assert report.by_reason == {"owner_dead": [1, 1000]} and report.bytes_reclaimed == 1000
    assert store.get([tail_key("mine-dead")]) == [None]
    assert sorted(e.request_id for e in ledger.entries()) == ["mine-live", "sent-dead"]
    assert m["outstanding"]._value.get() == 2
    assert m["orphaned_bytes"].labels("owner_dead")._value.get() - before[0] == 1000
    assert m["reclaimed_bytes"]._value.get() - before[1] == 1000
    # an abort heard by the reaper's worker ends the handed-off one too
    worker.aborted.add("sent-dead")
    assert asyncio.run(reaper.sweep()).by_reason == {"aborted": [1, 10]}


def test_a_reaper_that_just_started_judges_no_owner(store):
    settings = Settings.from_env({}, heartbeat_timeout_s=5.0)
    worker = _Worker(settings)
    worker.started_at = time.time()  # it has heard nobody yet
    ledger = ledger_for(store)
    stage(ledger, store, "r", owner="prefill-unknown")
    assert asyncio.run(KVReaper(worker, ledger, store).sweep()).num_orphaned == 0
    assert [e.request_id for e in ledger.entries()] == ["r"]


def test_pdserve_kv_ledger_lists_the_records(tmp_path, monkeypatch, capsys):
    from services.cli import main

    ns = f"t{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("PD_NAMESPACE", ns)
    monkeypatch.setenv("PD_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("PD_KV_STORE", "shm")
    store = open_store(Settings.from_env({}, namespace=ns, shm_dir=str(tmp_path)))
    stage(ledger_for(store), store, "chatcmpl-listed-0", owner="prefill-x", nbytes=777)
    assert main(["kv", "ledger"]) == 0
    out = capsys.readouterr().out
    assert "1 staged KV handle(s)" in out and "777 request-scoped bytes" in out
    assert "chatcmpl-listed-0" in out and "prefill-x" in out and "staged" in out


def test_a_hand_off_writes_only_what_the_early_puts_did_not(store):
    """``PD_KV_STAGE_DURING_PREFILL``: blocks 0-1 were staged while the prompt was prefilled,
    block 2's early put failed (its buffer kept), block 3 comes with the final export. The
    hand-off writes blocks 2 and 3 and the tail, nothing twice, and the ledger record counts the
    early bytes with the rest."""
    from engine.outputs import PromptKV
    from services.prefill.worker import EarlyStage, KVStager
    from shared.kv import block_key
    from shared.kv.layout import KVLayout

    layout = KVLayout(model_id="m", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
    hashes = [uuid.uuid4().bytes for _ in range(4)]
    blocks = [bytes([i]) * 64 for i in range(4)]
    keys = [block_key(h, layout.dtype) for h in hashes]
    ledger = ledger_for(store)
    stager = KVStager(store, 30.0, 30.0, ledger, "prefill-a")
    touched: list[str] = []
    touch = store.touch
    store.touch = lambda ks, ttl: (touched.extend(ks), touch(ks, ttl))[1]
    early = EarlyStage(staged={0, 1}, unstaged={2: memoryview(blocks[2])})
    early.bytes_written = stager.put_blocks({keys[0]: blocks[0], keys[1]: blocks[1]})
    assert early.bytes_written == 128
    assert stager.put_blocks({keys[0]: blocks[0]}) == 0  # held already: lease renewed, not rewritten
    kv = PromptKV(block_hashes=hashes, blocks=[memoryview(blocks[3])], tail=memoryview(b"t" * 10),
                  num_tail_tokens=1, num_tokens=17, first_block=3)
    touched.clear()
    handle, written = stager.stage("req-early", kv, layout, early=early)
    assert written == 64 + 64 + 10
    assert touched == keys[:2]  # the early blocks' leases run from the hand-off, as a re-staged block's
    assert handle.block_hashes == hashes and handle.tail_key == tail_key("req-early")
    assert [bytes(v) for v in store.get(keys)] == blocks
    (entry,) = [e for e in ledger.entries() if e.request_id == "req-early"]
    assert entry.block_bytes == 4 * 64 and entry.bytes == 10


def test_early_puts_stop_at_the_first_store_failure_and_skip_aborted_prompts(tmp_path):
    """An unreachable store costs a prompt one failed early put, not one per chunk: later chunks
    keep their buffers for the hand-off's single attempt. A prompt aborted between chunks stages
    nothing more."""
    import types

    from services.prefill.worker import EarlyStage, KVStager, PrefillWorker
    from shared.errors import KVTransferError
    from shared.kv.layout import KVLayout
    from shared.kv.shm import ShmKVStore

    class DownStore(ShmKVStore):
        calls = 0

        def exists(self, keys):
            DownStore.calls += 1
            raise KVTransferError("store down")

    class Counter:
        def inc(self, *_):
            pass

    layout = KVLayout(model_id="m", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)

    def worker(store):
        w = types.SimpleNamespace(early={}, pending={}, engine=types.SimpleNamespace(layout=layout),
                                  stager=KVStager(store, 30.0, 30.0), log=get_logger("test"),
                                  kv_metrics={"put_bytes": Counter(), "put_seconds": Counter()},
                                  settings=types.SimpleNamespace(kv_prefetch=True),
                                  protocol=types.SimpleNamespace(kv_prefetch="pd.control.kv_prefetch"), posted=[])
        w.post = lambda subject, message: w.posted.append((subject, message))
        w._stage_early = types.MethodType(PrefillWorker._stage_early, w)
        return w

    async def scenario():
        hashes = [uuid.uuid4().bytes for _ in range(8)]
        bufs = [memoryview(bytes([i]) * 64) for i in range(8)]
        w = worker(DownStore(tmp_path / "down"))
        w.pending["r"], w.early["r"] = asyncio.get_running_loop().create_future(), EarlyStage()
        for c in range(4):
            w._stage_early("r", 2 * c, hashes[2 * c:2 * c + 2], bufs[2 * c:2 * c + 2])
        await w.early["r"].puts
        assert DownStore.calls == 1 and w.early["r"].failed
        assert sorted(w.early["r"].unstaged) == list(range(8)) and not w.early["r"].staged

        # the first token arriving (the outcome set) before a queued put ran: the put still runs
        store = ShmKVStore(tmp_path / "up")
        w = worker(store)
        fut = w.pending["f"] = asyncio.get_running_loop().create_future()
        w.early["f"] = EarlyStage(block_hashes=hashes[:5])
        w._stage_early("f", 0, hashes[:2], bufs[:2])
        w._stage_early("f", 2, hashes[2:4], bufs[2:4])
        fut.set_result("first token")
        await w.early["f"].puts
        assert w.early["f"].staged == {0, 1, 2, 3}
        # each put announced to the decode workers (PD_KV_PREFETCH): the leading run staged so far
        assert [(s, m.request_id, m.block_hashes) for s, m in w.posted] == [
            ("pd.control.kv_prefetch", "f", hashes[:2]), ("pd.control.kv_prefetch", "f", hashes[:4])]
        store.clear()

        w = worker(store)
        fut = w.pending["a"] = asyncio.get_running_loop().create_future()
        w.early["a"] = EarlyStage(block_hashes=hashes[:5])
        w._stage_early("a", 0, hashes[:2], bufs[:2])
        await w.early["a"].puts
        fut.set_exception(RuntimeError("aborted"))
        fut.exception()
        w._stage_early("a", 2, hashes[2:4], bufs[2:4])
        assert w.early["a"].staged == {0, 1} and store.staged_bytes() == 128
        assert [m.block_hashes for _, m in w.posted] == [hashes[:2]]  # nothing announced after the abort

    asyncio.run(scenario())
