"""Cancellation and deadlines in each stage (issue 30), one worker at a time on the in-memory
bus with the tiny model: work of a cancelled request is dropped before it is computed
(tokenizer, prefill), a prefill in progress stops at its next chunk, a decode at its next
step; a request past its deadline is dropped everywhere, and every wait — in the queue, for
the KV of its prompt, in the engine — ends at its deadline with ``deadline_exceeded``.

Engine steps are slowed (a sleep around the model runner) so that a cancel lands while a
prefill or decode is running; what is asserted is counted work, not time."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from services.decode.worker import DecodeWorker
from services.prefill.worker import PrefillWorker
from services.tokenizer.worker import TokenizerWorker
from shared.config import Settings
from shared.kv.layout import KVHandle
from shared.memory_bus import MemoryBus
from shared.messages import (
    Abort,
    Accepted,
    DecodeTask,
    ErrorEvent,
    Heartbeat,
    PrefillTask,
    RequestMeta,
    SamplingParams,
    TokenChunk,
    TokenizeTask,
)

pytestmark = pytest.mark.timeout(120)
REPLY = "mem.gateway.cancel.events"
PF_INBOX = "mem.postfilter.pf-test.tokens"
NUM_PROMPT_TOKENS = 320  # 20 chunks of 16


def cancelled(stage: str, reason: str, phase: str) -> float:
    return REGISTRY.get_sample_value("pd_cancelled_total", {"stage": stage, "reason": reason, "phase": phase}) or 0.0


def chunks(when: str) -> float:
    return REGISTRY.get_sample_value("pd_prefill_cancelled_chunks_total", {"when": when}) or 0.0


class Stage:
    """One worker on a MemoryBus, a fake live postfilter, and what reaches the gateway inbox
    and the postfilter."""

    def __init__(self, worker, bus: MemoryBus):
        self.worker, self.bus = worker, bus
        self.events: list = []
        self.tokens: list[TokenChunk] = []

    @classmethod
    async def start(cls, worker_cls, model_dir, step_delay_s: float = 0.0, **overrides) -> Stage:
        fields = dict(model=str(model_dir), namespace=f"cx{uuid.uuid4().hex[:8]}", instance_id="",
                      heartbeat_interval_s=0.2, heartbeat_timeout_s=60.0, kv_store="shm",
                      kv_cache_memory_bytes=16 << 20, dtype="float32", max_num_batched_tokens=16,
                      max_prefill_chunk_tokens=16, enable_prefix_caching=False, attention_backend="reference",
                      batch_invariant=False, weights="float")
        fields.update(overrides)
        bus = MemoryBus(ack_wait_s=30.0)
        stage = cls(worker_cls(Settings.from_env({}, **fields), bus=bus), bus)

        async def on_event(message) -> None:
            stage.events.append(message)

        async def on_tokens(message) -> None:
            stage.tokens.append(message)

        await bus.subscribe(REPLY, on_event)
        await bus.subscribe(PF_INBOX, on_tokens)
        await stage.worker.start()
        await bus.publish(stage.worker.protocol.heartbeat_of("postfilter"),
                          Heartbeat(stage="postfilter", instance_id="pf-test", model=stage.worker.model_name,
                                    sent_at=time.time(), inbox=PF_INBOX))
        if step_delay_s:
            runner = stage.worker.engine.runner
            execute = runner.execute

            def slow_execute(scheduled):
                time.sleep(step_delay_s)
                return execute(scheduled)

            runner.execute = slow_execute
        return stage

    def meta(self, rid: str, deadline_in_s: float = 120.0) -> RequestMeta:
        now = time.time()
        return RequestMeta(request_id=rid, reply_to=REPLY, model=self.worker.model_name, created_at=now,
                           deadline_at=now + deadline_in_s)

    async def until(self, predicate, timeout_s: float = 30.0, what: str = "") -> None:
        end = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < end, f"timed out: {what}; events {self.events}"
            await asyncio.sleep(0.01)

    async def abort(self, rid: str, reason: str = "client_disconnected") -> None:
        await self.bus.publish(self.worker.protocol.abort, Abort(request_id=rid, reason=reason))

    def errors(self, rid: str) -> list[ErrorEvent]:
        return [e for e in self.events if isinstance(e, ErrorEvent) and e.request_id == rid]

    async def queue_empty(self, queue) -> bool:
        return await self.bus.queue_depth(queue) == 0 and not await self.bus.pull(queue, 8, 0.05)

    async def stop(self) -> None:
        await self.worker.stop()
        await self.bus.close()


def prompt_ids(n: int = NUM_PROMPT_TOKENS) -> list[int]:
    return [(7 * i) % 300 + 3 for i in range(n)]


# --- tokenizer --------------------------------------------------------------------------------
@pytest.mark.parametrize("why", ["cancelled", "deadline"])
def test_tokenizer_drops_queued_work_of_a_cancelled_or_expired_request_untokenized(tiny_model_dir, why):
    async def go():
        st = await Stage.start(TokenizerWorker, tiny_model_dir)
        calls = []
        tokenize = st.worker.processor.tokenize
        st.worker.processor.tokenize = lambda task: calls.append(task) or tokenize(task)
        before = cancelled("tokenizer", why, "queued")
        try:
            rid = f"t{uuid.uuid4().hex[:8]}"
            if why == "cancelled":
                await st.abort(rid)
            meta = st.meta(rid, deadline_in_s=120.0 if why == "cancelled" else -1.0)
            await st.bus.publish_work(st.worker.protocol.tokenize, TokenizeTask(
                meta=meta, prompt="hello there " * 50, sampling=SamplingParams(max_tokens=4)), rid)
            await st.until(lambda: cancelled("tokenizer", why, "queued") > before, what="not dropped")
            # a live request behind it is served as usual
            ok = f"ok{uuid.uuid4().hex[:6]}"
            await st.bus.publish_work(st.worker.protocol.tokenize, TokenizeTask(
                meta=st.meta(ok), prompt="hello there", sampling=SamplingParams(max_tokens=4)), ok)
            await st.until(lambda: any(isinstance(e, Accepted) and e.request_id == ok for e in st.events))
            assert [t.meta.request_id for t in calls] == [ok]  # the dropped prompt was never tokenized
            assert not any(getattr(e, "request_id", "") == rid for e in st.events)
            assert await st.bus.queue_depth(st.worker.protocol.tokenize) == 0  # acked, not redelivered
        finally:
            await st.stop()

    asyncio.run(go())


# --- prefill ----------------------------------------------------------------------------------
def test_prefill_drops_queued_work_of_a_cancelled_request_uncomputed(tiny_model_dir):
    async def go():
        st = await Stage.start(PrefillWorker, tiny_model_dir)
        before = cancelled("prefill", "cancelled", "queued")
        try:
            rid = f"p{uuid.uuid4().hex[:8]}"
            await st.abort(rid)
            await st.bus.publish_work(st.worker.protocol.prefill, PrefillTask(
                meta=st.meta(rid), sampling=SamplingParams(max_tokens=4), prompt_token_ids=prompt_ids(),
                block_hashes=[]), rid)
            await st.until(lambda: cancelled("prefill", "cancelled", "queued") > before, what="not dropped")
            assert st.worker.engine.stats.num_prefill_tokens == 0
            assert await st.queue_empty(st.worker.protocol.prefill)
            assert await st.queue_empty(st.worker.protocol.decode)
            assert not st.tokens
        finally:
            await st.stop()

    asyncio.run(go())


def test_prefill_in_progress_stops_at_its_next_chunk(tiny_model_dir):
    async def go():
        st = await Stage.start(PrefillWorker, tiny_model_dir, step_delay_s=0.05)
        engine = st.worker.engine
        before_after, before_running = chunks("after_cancel"), cancelled("prefill", "cancelled", "running")
        try:
            rid = f"p{uuid.uuid4().hex[:8]}"
            await st.bus.publish_work(st.worker.protocol.prefill, PrefillTask(
                meta=st.meta(rid), sampling=SamplingParams(max_tokens=4), prompt_token_ids=prompt_ids(),
                block_hashes=[]), rid)
            await st.until(lambda: rid in engine.sequences and engine.sequences[rid].num_prefill_chunks >= 2,
                           what="prefill never started")
            await st.abort(rid)
            await st.until(lambda: rid not in st.worker.pending, what="prefill not stopped")
            await asyncio.sleep(0.3)  # a few more steps' time: nothing more is computed for it
            assert rid not in engine.sequences
            computed = engine.stats.num_prefill_tokens
            assert 32 <= computed < NUM_PROMPT_TOKENS, computed  # stopped part way
            # the chunk in progress when the cancel came, at most
            assert chunks("after_cancel") - before_after <= 1
            assert cancelled("prefill", "cancelled", "running") == before_running + 1
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            assert not st.tokens and await st.queue_empty(st.worker.protocol.decode)  # no first token, no DecodeTask
            assert await st.queue_empty(st.worker.protocol.prefill)  # acked
        finally:
            await st.stop()

    asyncio.run(go())


def test_prefill_past_its_deadline_stops_with_deadline_exceeded(tiny_model_dir):
    async def go():
        st = await Stage.start(PrefillWorker, tiny_model_dir, step_delay_s=0.05)
        engine = st.worker.engine
        try:
            rid = f"p{uuid.uuid4().hex[:8]}"
            await st.bus.publish_work(st.worker.protocol.prefill, PrefillTask(
                meta=st.meta(rid, deadline_in_s=0.6), sampling=SamplingParams(max_tokens=4),
                prompt_token_ids=prompt_ids(), block_hashes=[]), rid)  # 20 chunks of 50 ms: 1 s
            await st.until(lambda: st.errors(rid), what="no error")
            assert st.errors(rid)[0].code == "deadline_exceeded" and st.errors(rid)[0].status == 504
            await st.until(lambda: rid not in st.worker.pending)
            await st.until(lambda: rid not in engine.sequences, what="still in the engine")  # at its next step
            assert engine.stats.num_prefill_tokens < NUM_PROMPT_TOKENS
            assert not st.tokens and await st.queue_empty(st.worker.protocol.decode)
        finally:
            await st.stop()

    asyncio.run(go())


# --- decode -----------------------------------------------------------------------------------
def decode_task(st: Stage, rid: str, max_tokens: int, deadline_in_s: float = 120.0, kv=None) -> DecodeTask:
    return DecodeTask(meta=st.meta(rid, deadline_in_s), sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                               ignore_eos=True),
                      prompt_token_ids=prompt_ids(24), output_token_ids=[5] if kv is not None else [],
                      postfilter=PF_INBOX if kv is not None else "", kv=kv)


def test_decode_stops_a_cancelled_request_at_its_next_step(tiny_model_dir):
    async def go():
        st = await Stage.start(DecodeWorker, tiny_model_dir, step_delay_s=0.01)
        engine = st.worker.engine
        before = cancelled("decode", "cancelled", "running")
        try:
            rid = f"d{uuid.uuid4().hex[:8]}"
            await st.bus.publish_work(st.worker.protocol.decode, decode_task(st, rid, 500), rid)
            await st.until(lambda: len(st.tokens) >= 3, what="not decoding")
            await st.abort(rid)
            await st.until(lambda: rid not in st.worker.active, what="decode not stopped")
            sent = len(st.tokens)
            await asyncio.sleep(0.2)
            assert len(st.tokens) == sent < 500  # no step after the abort
            assert rid not in engine.sequences
            assert cancelled("decode", "cancelled", "running") == before + 1
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            assert await st.queue_empty(st.worker.protocol.decode)  # acked: not redelivered
        finally:
            await st.stop()

    asyncio.run(go())


def test_decode_past_its_deadline_stops_with_deadline_exceeded(tiny_model_dir):
    async def go():
        st = await Stage.start(DecodeWorker, tiny_model_dir, step_delay_s=0.01)
        try:
            rid = f"d{uuid.uuid4().hex[:8]}"
            await st.bus.publish_work(st.worker.protocol.decode, decode_task(st, rid, 900, deadline_in_s=1.0), rid)
            await st.until(lambda: st.errors(rid), what="no error")
            assert st.errors(rid)[0].code == "deadline_exceeded"
            await st.until(lambda: rid not in st.worker.active)
            await st.until(lambda: rid not in st.worker.engine.sequences, what="still in the engine")
            assert len(st.tokens) < 900 and not any(t.finish_reason for t in st.tokens)
        finally:
            await st.stop()

    asyncio.run(go())


def test_decode_waiting_for_prompt_kv_ends_at_the_deadline(tiny_model_dir):
    """The KV store does not answer (a read that hangs): decode's wait for the prompt's KV ends
    at the request's deadline with deadline_exceeded, the task is acked, nothing is decoded."""

    async def go():
        st = await Stage.start(DecodeWorker, tiny_model_dir)
        worker = st.worker

        def hanging_load(task, num_local):
            time.sleep(3.0)
            raise AssertionError("unreachable: the wait ended long before")

        worker._load_kv = hanging_load
        try:
            rid = f"d{uuid.uuid4().hex[:8]}"
            kv = KVHandle(store=worker.store.name, layout=worker.engine.layout, block_hashes=[], num_tokens=24,
                          tail_key=f"tail:{rid}")
            started = time.monotonic()
            await st.bus.publish_work(worker.protocol.decode, decode_task(st, rid, 8, deadline_in_s=0.5, kv=kv), rid)
            await st.until(lambda: st.errors(rid), what="no error")
            waited = time.monotonic() - started
            assert st.errors(rid)[0].code == "deadline_exceeded"
            assert waited < 2.5, waited  # the deadline, not the 3 s read
            await st.until(lambda: rid not in worker.active)
            assert rid not in worker.engine.sequences and not st.tokens
            assert await st.queue_empty(worker.protocol.decode)
        finally:
            await st.stop()

    asyncio.run(go())


def test_decode_drops_an_expired_task_at_fetch(tiny_model_dir):
    async def go():
        st = await Stage.start(DecodeWorker, tiny_model_dir)
        before = cancelled("decode", "deadline", "queued")
        try:
            rid = f"d{uuid.uuid4().hex[:8]}"
            await st.bus.publish_work(st.worker.protocol.decode, decode_task(st, rid, 8, deadline_in_s=-1.0), rid)
            await st.until(lambda: cancelled("decode", "deadline", "queued") > before, what="not dropped")
            assert st.worker.engine.stats.num_decode_tokens == 0 and not st.tokens
            assert await st.queue_empty(st.worker.protocol.decode)
        finally:
            await st.stop()

    asyncio.run(go())
