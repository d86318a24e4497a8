"""A dead gateway's work is dropped, end to end (services/decode/worker.py ``_watch_peers``,
services/common/runtime.py ``still_wanted``): the whole pipeline runs in one process on the
in-memory bus (tests/unit/test_lost_messages.py's set-up); a gateway submits a long request,
receives its first text and dies without a word (its heartbeats stop reaching the workers and its
status subject has no responders: the bus of test_lost_messages cut off for good; a gateway that
stops cleanly aborts its requests itself). Decode notices the
silence, confirms it by asking the gateway (no responders, silent past its patience), aborts
the request and acks its task: the engine stops generating for nobody, and nothing is redelivered."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.decode.worker import DecodeWorker
from services.gateway.pipeline import PipelineClient
from services.postfilter.worker import PostfilterWorker
from services.prefill.worker import PrefillWorker
from services.tokenizer.worker import TokenizerWorker
from shared.config import Settings
from shared.messages import RequestMeta, SamplingParams, TextChunk, TokenizeTask
from tests.unit.test_lost_messages import DroppingBus

pytestmark = pytest.mark.timeout(180)
MAX_TOKENS = 900  # far more than decode makes before the gateway's death is confirmed


async def until(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.05)


def test_work_of_a_gateway_that_died_is_dropped(tiny_model_dir):
    async def go():
        settings = Settings.from_env({}, model=str(tiny_model_dir), namespace=f"dead{uuid.uuid4().hex[:8]}",
                                     instance_id="", heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0,
                                     first_token_timeout_s=2.0, stall_timeout_s=2.0, kv_store="shm",
                                     kv_cache_memory_bytes=16 << 20, dtype="float32",
                                     speculative_method="off")  # one token per (paced) step
        bus = DroppingBus(lambda subject, message: False)
        workers = [cls(settings, bus=bus) for cls in (TokenizerWorker, PrefillWorker, DecodeWorker, PostfilterWorker)]
        decode = workers[2]
        for w in workers:
            await w.start()
        real_step = decode.engine.step

        def paced_step():  # at most ~100 steps/s: the 900 tokens outlast the ~3 s a death takes to
            time.sleep(0.01)  # confirm on any CPU (a fast one decoded them all before it)
            return real_step()

        decode.engine.step = paced_step
        gateway = PipelineClient(settings, bus=bus)
        await gateway.start()
        try:
            await until(lambda: not gateway.missing_stages(), 30, "stages not live")
            rid = f"r{uuid.uuid4().hex[:8]}"
            meta = RequestMeta(request_id=rid, reply_to=gateway.inbox, model=workers[0].model_name,
                               created_at=time.time(), deadline_at=time.time() + 120)
            events: asyncio.Queue = asyncio.Queue()
            gateway.register(rid, events)
            await gateway.submit(TokenizeTask(meta=meta, prompt="a long answer for nobody",
                                              sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                      ignore_eos=True)))
            while not isinstance(await asyncio.wait_for(events.get(), 60), TextChunk):
                pass  # Accepted, then the first text: the request streams
            await until(lambda: rid in decode.active and decode.active[rid].seq is not None, 30, "not decoding")
            bus.gateway_cut_until = float("inf")  # the gateway dies: no heartbeats, no status answers
            died = time.monotonic()
            await until(lambda: rid not in decode.active, 60, "decode kept the request of a dead gateway")
            dropped_after = time.monotonic() - died
            seq = await decode.engine_loop.call(lambda e: e.sequences.get(rid))
            assert seq is None  # out of the engine: no more steps for it
            made = decode.engine.stats.num_decode_tokens
            assert made < MAX_TOKENS - 1, made  # stopped early, not run to its end
            # not before the gateway's silence passed its own patience (2 s) and the heartbeat timeout
            assert dropped_after >= settings.heartbeat_timeout_s, dropped_after
            # acked, not left to be redelivered to another decode worker
            await asyncio.sleep(0.5)
            assert await bus.pull(workers[2].protocol.decode, 8, 1.0) == []
        finally:
            await gateway.stop()
            for w in workers:
                await w.stop()
            await bus.close()

    asyncio.run(go())
