"""``PD_KV_PREFETCH``: a decode worker reads a long prompt's blocks while the prompt is still
being prefilled (each early put announced by a KVPrefetch), so the hand-off after the first token
reads only what the last chunk added. The whole pipeline runs in one process on the tiny model
(tests/unit/test_lost_messages.py's harness), its prefill slowed so that chunks take time."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.decode.worker import DecodeWorker
from services.prefill.worker import PrefillWorker
from shared.kv import block_key
from shared.kv.layout import KVLayout
from shared.messages import Heartbeat, KVPrefetch
from tests.unit.test_lost_messages import run_pipeline

pytestmark = pytest.mark.timeout(180)

#: chunks of 16 tokens in blocks of 4: the prompt below is prefilled in 4+ chunks
CHUNKED = dict(block_size=4, max_prefill_chunk_tokens=16, max_num_batched_tokens=16)
PROMPT = " ".join(f"word{i}" for i in range(40))


def watch(workers, step_delay_s: float = 0.15) -> dict:
    """Slow the prefill worker's steps, and record the decode worker's reads: the keys its
    hand-off read (``_load_kv``) and the blocks it imported ahead (``import_from_store``)."""
    seen = {"handoff_keys": [], "prefetched": [], "prefill": None, "decode": None}
    prefill = next(w for w in workers if isinstance(w, PrefillWorker))
    decode = next(w for w in workers if isinstance(w, DecodeWorker))
    seen["prefill"], seen["decode"] = prefill, decode
    runner = prefill.engine.runner
    execute = runner.execute

    def slow_execute(scheduled):
        time.sleep(step_delay_s)
        return execute(scheduled)

    runner.execute = slow_execute
    get_views = decode.store.get_views
    load_kv = decode._load_kv

    def spy_load_kv(task, num_local):
        decode.store.get_views = lambda keys: (seen["handoff_keys"].extend(keys), get_views(keys))[1]
        try:
            return load_kv(task, num_local)
        finally:
            decode.store.get_views = get_views

    decode._load_kv = spy_load_kv
    import_from_store = decode.import_from_store

    async def spy_import(rid, hashes, failure_event):
        n = await import_from_store(rid, hashes, failure_event)
        seen["prefetched"].append(n)
        return n

    decode.import_from_store = spy_import
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: PD_DTYPE=auto on an AVX512-BF16 / AMX CPU
def test_the_hand_off_reads_only_what_the_last_chunk_added(tiny_model_dir, dtype):
    """Early puts are announced with the leading run staged so far; the decode worker reads
    those blocks ahead; at the hand-off it reads the blocks it still lacks and the tail, and
    the text is the one the same request gives with prefetching off."""
    hints: list[KVPrefetch] = []

    def observe(subject, message) -> bool:
        if isinstance(message, KVPrefetch):
            hints.append(message)
        return False

    runs, announced = {}, {}
    for prefetch in ("off", "auto"):
        holder = {}
        text, _ = asyncio.run(run_pipeline(
            str(tiny_model_dir), observe, prompt=PROMPT, overrides={**CHUNKED, "dtype": dtype, "kv_prefetch": prefetch},
            on_started=lambda ws, h=holder: h.update(watch(ws))))
        runs[prefetch] = (text, holder)
        announced[prefetch] = len(hints)
    assert runs["auto"][0] == runs["off"][0]  # the same KV, read earlier: the same tokens

    # with prefetching off nothing is announced, and the hand-off reads every full block
    off = runs["off"][1]
    assert announced["off"] == 0 and not off["prefetched"]
    on = runs["auto"][1]
    hashes_seen = [len(h.block_hashes) for h in hints]
    assert len(hashes_seen) >= 2 and hashes_seen == sorted(hashes_seen), hashes_seen  # one per early put, growing
    full = hints[-1].block_hashes
    assert all(h.block_hashes == full[: len(h.block_hashes)] for h in hints)  # leading runs of one prompt
    assert hints[-1].layout == on["decode"].engine.layout
    assert sum(on["prefetched"]) >= len(full) - 4  # read ahead: all of the announced blocks, give or take the last put's
    dtype = on["decode"].engine.layout.dtype
    early_keys = {block_key(h, dtype) for h in full}
    off_full = [k for k in off["handoff_keys"] if k in early_keys]  # the same prompt: the same hashes
    on_full = [k for k in on["handoff_keys"] if k in early_keys]
    assert len(off_full) >= len(full), (off_full, full)  # without: the hand-off read them all
    assert len(on_full) < len(full), on_full  # with: the early blocks were local hits by then


def test_a_hint_is_ignored_without_a_free_slot_or_with_another_layout(tiny_model_dir):
    """A decode worker that could not take the request (no free slot), or whose pool has another
    layout, reads nothing for a hint; nor, with ``PD_KV_PREFETCH=auto``, one that hears another
    live decode worker (the task may go there); with ``all`` it reads."""

    async def scenario():
        from shared.config import Settings
        from shared.memory_bus import MemoryBus

        settings = Settings.from_env({}, model=str(tiny_model_dir), namespace="pfx", instance_id="", kv_store="shm",
                                     kv_cache_memory_bytes=16 << 20, dtype="float32", heartbeat_interval_s=0.2)
        bus = MemoryBus(ack_wait_s=30.0)
        w = DecodeWorker(settings, bus=bus)
        await w.start()
        try:
            calls = []

            async def fake_import(rid, hashes, failure_event):
                calls.append(rid)
                return 0

            w.import_from_store = fake_import
            layout = w.engine.layout
            other = KVLayout(**{**{f: getattr(layout, f) for f in layout.__struct_fields__}, "block_size": 99})
            await bus.publish(w.protocol.kv_prefetch, KVPrefetch(request_id="other-layout", layout=other,
                                                                 block_hashes=[b"x" * 16]))
            capacity = w._capacity
            w._capacity = lambda: 0
            await bus.publish(w.protocol.kv_prefetch, KVPrefetch(request_id="full", layout=layout,
                                                                 block_hashes=[b"y" * 16]))
            await asyncio.sleep(0.3)
            assert calls == [] and not w.prefetch_hints
            w._capacity = capacity
            await bus.publish(w.protocol.kv_prefetch, KVPrefetch(request_id="ok", layout=layout,
                                                                 block_hashes=[b"z" * 16]))
            for _ in range(100):
                if calls:
                    break
                await asyncio.sleep(0.01)
            assert calls == ["ok"]

            # another decode worker is alive: auto leaves the hint, all reads it
            await bus.publish(w.protocol.heartbeat_of("decode"), Heartbeat(
                stage="decode", instance_id="decode-other", model=w.model_name, sent_at=time.time()))
            await asyncio.sleep(0.1)
            assert len(w.registry.live("decode", ready_only=False)) >= 2
            await bus.publish(w.protocol.kv_prefetch, KVPrefetch(request_id="two", layout=layout,
                                                                 block_hashes=[b"w" * 16]))
            await asyncio.sleep(0.3)
            assert calls == ["ok"]
            w.settings = w.settings.replace(kv_prefetch="all")
            await bus.publish(w.protocol.kv_prefetch, KVPrefetch(request_id="all", layout=layout,
                                                                 block_hashes=[b"v" * 16]))
            for _ in range(100):
                if len(calls) > 1:
                    break
                await asyncio.sleep(0.01)
            assert calls == ["ok", "all"]
        finally:
            await w.stop()
            await bus.close()

    asyncio.run(scenario())
