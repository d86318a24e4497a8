"""Service logic on the in-memory bus (no NATS server, no subprocesses): the postfilter's
stream handling and the tokenizer's hand-off, the same cases the real-NATS integration tests
cover, in a fraction of the time."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.postfilter.worker import PostfilterWorker
from services.tokenizer.worker import TokenizerWorker
from shared.config import Settings
from shared.memory_bus import MemoryBus
from shared.messages import (
    Accepted,
    ErrorEvent,
    PrefillTask,
    RequestMeta,
    SamplingParams,
    StreamSpec,
    TextChunk,
    TextResend,
    TokenChunk,
    TokenizeTask,
    TokenResend,
    decode_as,
)
from shared.model_files import COMPLETE_MARKER, load_tokenizer
from tests.tiny_model import build_tokenizer

pytestmark = pytest.mark.timeout(60)
TEXT = "café naïve — 日本語 😀🎉 done"
REPLY = "mem.gateway.test.events"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A model folder with what the light stages read — tokenizer and config.json — and no
    weights (marked converted), built without torch."""
    folder = tmp_path_factory.mktemp("tokenizer-only") / "tiny-llama"
    tok = build_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({"vocab_size": len(tok), "max_position_embeddings": 1024}))
    (folder / COMPLETE_MARKER).write_text("{}")
    return folder


def settings_for(tiny_model_dir) -> Settings:
    return Settings.from_env({}, model=str(tiny_model_dir), namespace="mem", instance_id="",
                             heartbeat_interval_s=0.2)


class Harness:
    """One worker on a MemoryBus, and everything published to the gateway inbox."""

    def __init__(self, worker, bus: MemoryBus):
        self.worker, self.bus = worker, bus
        self.events: list = []

    @classmethod
    async def start(cls, worker_cls, tiny_model_dir) -> Harness:
        bus = MemoryBus(ack_wait_s=5.0)
        h = cls(worker_cls(settings_for(tiny_model_dir), bus=bus), bus)

        async def on_event(message) -> None:
            h.events.append(message)

        await bus.subscribe(REPLY, on_event)
        await h.worker.start()
        return h

    async def until(self, predicate, timeout_s: float = 10.0) -> None:
        for _ in range(int(timeout_s / 0.01)):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out; events: {self.events}")

    async def stop(self) -> None:
        await self.worker.stop()
        await self.bus.close()

    def texts(self, rid: str) -> list[TextChunk]:
        return [e for e in self.events if isinstance(e, TextChunk) and e.request_id == rid]

    def finished(self, rid: str) -> bool:
        return any(e.finish_reason for e in self.texts(rid)) or any(
            isinstance(e, ErrorEvent) and e.request_id == rid for e in self.events)


def token_chunks(rid: str, ids: list[int], spec: StreamSpec, worker: str = "") -> list[TokenChunk]:
    return [TokenChunk(request_id=rid, index=i, token_ids=[t], spec=spec if i == 0 else None,
                       finish_reason="length" if i == len(ids) - 1 else None, worker=worker)
            for i, t in enumerate(ids)]


def test_postfilter_orders_dedups_and_never_splits_characters(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)

    async def go():
        h = await Harness.start(PostfilterWorker, tiny_model_dir)
        inbox = h.worker.inbox
        chunks = token_chunks("mb", ids, StreamSpec(reply_to=REPLY))
        for c in [chunks[2], chunks[0], chunks[1], chunks[1], *chunks[3:]]:  # early, reordered, duplicated
            await h.bus.publish(inbox, c)
        await h.until(lambda: h.finished("mb"))
        texts = h.texts("mb")
        assert "".join(t.text for t in texts) == TEXT
        assert all("\ufffd" not in t.text for t in texts)
        assert [t.text_offset for t in texts] == [sum(len(x.text) for x in texts[:i]) for i in range(len(texts))]
        assert texts[-1].usage.completion_tokens == len(ids)
        # a gateway that lost text asks for it again from an offset
        await h.bus.publish(h.worker.protocol.postfilter_control(inbox), TextResend(request_id="mb", from_offset=4))
        await h.until(lambda: len(h.texts("mb")) == len(texts) + 1)
        resent = h.texts("mb")[-1]
        assert (resent.text_offset, resent.text, resent.finish_reason) == (4, TEXT[4:], "length")
        await h.stop()

    asyncio.run(go())


def test_postfilter_asks_the_owner_to_resend_a_gap_then_fails_it(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode("hello world again and again", add_special_tokens=False)

    async def go():
        h = await Harness.start(PostfilterWorker, tiny_model_dir)
        resends: list[TokenResend] = []

        async def on_control(m) -> None:
            resends.append(m)

        await h.bus.subscribe(h.worker.protocol.decode_control("decode-1"), on_control)
        chunks = token_chunks("gap", ids, StreamSpec(reply_to=REPLY), worker="decode-1")
        for c in [chunks[0], *chunks[2:-1]]:  # token 1 is lost, and the end
            await h.bus.publish(h.worker.inbox, c)
        await h.until(lambda: resends, timeout_s=5.0)
        assert resends[0].request_id == "gap" and resends[0].from_index == 1
        await h.until(lambda: h.finished("gap"), timeout_s=10.0)
        [err] = [e for e in h.events if isinstance(e, ErrorEvent)]
        assert err.code == "stream_gap" and "token 1" in err.message
        await h.stop()

    asyncio.run(go())


def test_tokenizer_hands_a_valid_prompt_to_prefill_and_rejects_a_long_one(tiny_model_dir):
    async def go():
        h = await Harness.start(TokenizerWorker, tiny_model_dir)
        p = h.worker.protocol
        await h.bus.ensure_queues(p.work_queues)

        def task(rid: str, prompt: str, max_tokens: int) -> TokenizeTask:
            meta = RequestMeta(request_id=rid, reply_to=REPLY, model="m", created_at=1e12, deadline_at=2e12)
            return TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=max_tokens), prompt=prompt)

        await h.bus.publish_work(p.tokenize, task("ok", "hello world", 4), "ok")
        await h.bus.publish_work(p.tokenize, task("long", "hello " * 5000, 4), "long")
        [delivery] = await h.bus.pull(p.prefill, 5, timeout_s=10.0)
        prefill = decode_as(delivery.data, PrefillTask)
        assert prefill.meta.request_id == "ok" and prefill.prompt_token_ids
        await h.until(lambda: any(isinstance(e, ErrorEvent) for e in h.events))
        accepted = [e for e in h.events if isinstance(e, Accepted)]
        [err] = [e for e in h.events if isinstance(e, ErrorEvent)]
        assert [a.request_id for a in accepted] == ["ok"]
        assert accepted[0].num_prompt_tokens == len(prefill.prompt_token_ids)
        assert err.request_id == "long" and err.status == 400
        assert await h.bus.queue_depth(p.tokenize) == 0  # both acked
        await h.stop()

    asyncio.run(go())
