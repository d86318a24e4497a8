"""The postfilter process on its own, driven over NATS with hand-made token streams:
multi-byte characters split across tokens, stop strings across chunks, reordering,
duplicates and gaps."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared import nats_bus as bus
from shared.messages import ErrorEvent, StreamSpec, TextChunk, TokenChunk
from shared.subjects import Protocol
from tests.pipeline_fixture import heartbeats

pytestmark = pytest.mark.timeout(120)

TEXT = "café naïve — 日本語 😀🎉 done"


@pytest.fixture(scope="module")
def postfilter_inbox(pipeline):
    live = heartbeats(pipeline.settings)
    inbox = next(h.inbox for h in live.values() if h.stage == "postfilter")
    assert inbox
    return inbox


def drive(pipeline, inbox: str, chunks: list[TokenChunk], reply_to: str, wait_s: float = 3.0) -> list:
    async def run():
        nc = await bus.connect(pipeline.settings, "pdserve-test-postfilter", max_reconnect_attempts=0)
        got: list = []
        done = asyncio.Event()

        async def on(msg) -> None:
            got.append(msg)
            if isinstance(msg, ErrorEvent) or (isinstance(msg, TextChunk) and msg.finish_reason):
                done.set()

        await bus.subscribe_messages(nc, reply_to, on)
        for chunk in chunks:
            await bus.publish_core(nc, inbox, chunk)
        await nc.flush()
        try:
            await asyncio.wait_for(done.wait(), wait_s + 6)
        except TimeoutError:
            pass
        await nc.close()
        return got

    return asyncio.run(run())


def token_chunks(rid: str, ids: list[int], spec: StreamSpec, finish: str = "length") -> list[TokenChunk]:
    out = []
    for i, t in enumerate(ids):
        out.append(TokenChunk(request_id=rid, index=i, token_ids=[t], spec=spec if i == 0 else None,
                              finish_reason=finish if i == len(ids) - 1 else None))
    return out


def test_multibyte_characters_never_split(pipeline, postfilter_inbox, tiny_model):
    check_multibyte(pipeline, postfilter_inbox, tiny_model, "mb-1")


def check_multibyte(pipeline, postfilter_inbox, tiny_model, rid: str) -> None:
    _, _, tok = tiny_model
    ids = tok.encode(TEXT, add_special_tokens=False)
    reply = f"{pipeline.settings.namespace}.test.reply.{time.monotonic_ns()}"
    got = drive(pipeline, postfilter_inbox, token_chunks(rid, ids, StreamSpec(reply_to=reply)), reply)
    texts = [m for m in got if isinstance(m, TextChunk)]
    assert "".join(m.text for m in texts) == TEXT
    assert all("\ufffd" not in m.text for m in texts)
    assert [m.text_offset for m in texts] == [sum(len(t.text) for t in texts[:i]) for i in range(len(texts))]
    assert texts[-1].finish_reason == "length" and texts[-1].usage.completion_tokens == len(ids)


def test_stop_string_across_tokens_and_out_of_order_duplicates(pipeline, postfilter_inbox, tiny_model):
    _, _, tok = tiny_model
    ids = tok.encode(TEXT, add_special_tokens=False)
    reply = f"{pipeline.settings.namespace}.test.reply.{time.monotonic_ns()}"
    chunks = token_chunks("mb-2", ids, StreamSpec(reply_to=reply, stop=("日本",)))
    # deliver out of order and with duplicates: the postfilter restores the order
    shuffled = [chunks[0], chunks[2], chunks[1], chunks[1], *chunks[3:]]
    got = drive(pipeline, postfilter_inbox, shuffled, reply)
    texts = [m for m in got if isinstance(m, TextChunk)]
    assert "".join(m.text for m in texts) == TEXT[: TEXT.index("日本")]
    assert texts[-1].finish_reason == "stop"


def test_a_gap_that_never_closes_fails_the_request(pipeline, postfilter_inbox, tiny_model):
    _, _, tok = tiny_model
    ids = tok.encode("hello world again", add_special_tokens=False)
    reply = f"{pipeline.settings.namespace}.test.reply.{time.monotonic_ns()}"
    chunks = token_chunks("gap-1", ids, StreamSpec(reply_to=reply))
    got = drive(pipeline, postfilter_inbox, [chunks[0], *chunks[2:]], reply, wait_s=6)
    errors = [m for m in got if isinstance(m, ErrorEvent)]
    assert errors and errors[0].code == "stream_gap"
    assert not any(isinstance(m, TextChunk) and m.finish_reason for m in got)


def test_poison_on_the_inbox_is_survived(pipeline, postfilter_inbox, tiny_model):
    async def send_garbage():
        nc = await bus.connect(pipeline.settings, "pdserve-test-poison", max_reconnect_attempts=0)
        for payload in (b"", b"\x00\xff garbage", b"\x81\xa4kind\xa6tokens"):
            await nc.publish(postfilter_inbox, payload)
        await nc.publish(Protocol(pipeline.settings.namespace).abort, b"\x93not an abort")
        await nc.flush()
        await nc.close()

    asyncio.run(send_garbage())
    check_multibyte(pipeline, postfilter_inbox, tiny_model, "after-poison")
