"""Issue 19: a broker restart loses core-NATS messages. The whole pipeline (tokenizer, prefill,
decode, postfilter and the gateway's client, on the tiny model) runs in one process on an
in-memory bus that drops exactly one chosen message; the request must still complete with
the text an undisturbed run of the same request gives."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.decode.worker import DecodeWorker
from services.gateway.pipeline import PipelineClient
from services.gateway.request_run import Choice, RequestRun
from services.postfilter.worker import PostfilterWorker
from services.prefill.worker import PrefillWorker
from services.tokenizer.worker import TokenizerWorker
from shared.bus import NoResponders
from shared.config import Settings
from shared.memory_bus import MemoryBus
from shared.messages import RequestMeta, SamplingParams, TextChunk, TokenChunk, TokenizeTask

pytestmark = pytest.mark.timeout(120)
MAX_TOKENS = 12


class DroppingBus(MemoryBus):
    """A MemoryBus whose core publishes matching ``drop`` (subject, message) → bool are lost,
    each kind at most ``budget`` times."""

    def __init__(self, drop, budget: int = 1):
        super().__init__(ack_wait_s=5.0)
        self.drop, self.budget = drop, budget
        self.dropped: list = []
        self.gateway_cut_until = 0.0  # monotonic: till then the gateways are cut off (see below)
        self.unanswered: list[str] = []

    def gateway_cut(self) -> bool:
        return time.monotonic() < self.gateway_cut_until

    async def publish(self, subject, message) -> None:
        if self.gateway_cut() and subject.endswith(".heartbeat.gateway"):
            return  # a partition: the gateway's heartbeats do not reach the workers
        if len(self.dropped) < self.budget and self.drop(subject, message):
            self.dropped.append(message)
            return
        await super().publish(subject, message)

    async def request(self, subject, message, timeout_s):
        """While the gateways are cut off, a status query finds no route to them: NATS
        answers "no responders", as a cluster node cut from its routes makes it do."""
        if self.gateway_cut() and ".gateway." in subject:
            self.unanswered.append(subject)
            raise NoResponders(subject)
        return await super().request(subject, message, timeout_s)


async def run_pipeline(model: str, drop=lambda s, m: False, budget: int = 1, *, queued_s_before: float = 0.0,
                       gateway_cut_s: float = 0.0, decode_overrides: dict | None = None,
                       prompt: str = "the lost message", overrides: dict | None = None,
                       on_started=None) -> tuple[str, DroppingBus]:
    """One greedy request through a fresh in-process pipeline; (its text, the bus: what it
    dropped, and ``bus.workers``). ``queued_s_before``: the request was created that long before
    (queued before the workers started: every stage checks it with the gateway, as redelivered
    work); ``gateway_cut_s``: the gateway is cut off from the workers that long from its
    submission; ``decode_overrides``: settings of the decode worker alone (another host's);
    ``overrides``: settings of every stage; ``on_started(workers)``: called once they run."""
    fields = dict(model=model, namespace=f"lost{uuid.uuid4().hex[:8]}", instance_id="", heartbeat_interval_s=0.2,
                  heartbeat_timeout_s=2.0, kv_store="shm", kv_cache_memory_bytes=16 << 20, dtype="float32")
    settings = Settings.from_env({}, **{**fields, **(overrides or {})})
    bus = DroppingBus(drop, budget)
    workers = [cls(settings.replace(**decode_overrides) if cls is DecodeWorker and decode_overrides else settings,
                   bus=bus) for cls in (TokenizerWorker, PrefillWorker, DecodeWorker, PostfilterWorker)]
    bus.workers = workers
    for w in workers:
        await w.start()
    if on_started is not None:
        on_started(workers)
    client = PipelineClient(settings, bus=bus)
    await client.start()
    try:
        end = time.monotonic() + 30
        while client.missing_stages() and time.monotonic() < end:
            await asyncio.sleep(0.1)
        meta = RequestMeta(request_id=f"r{uuid.uuid4().hex[:8]}", reply_to=client.inbox, model=workers[0].model_name,
                           created_at=time.time() - queued_s_before, deadline_at=time.time() + 60)
        task = TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                            prompt=prompt)
        bus.gateway_cut_until = time.monotonic() + gateway_cut_s
        run = RequestRun(client, [Choice(0, 0, task)], meta.deadline_at, stall_timeout_s=15.0, tick_s=0.2)
        text = []
        async with run:
            async for delta in run.deltas():
                if delta is not None:
                    text.append(delta.text)
        assert run.choices[0].num_tokens == MAX_TOKENS
        return "".join(text), bus
    finally:
        await client.stop()
        for w in workers:
            await w.stop()
        await bus.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> str:
    text, _ = asyncio.run(run_pipeline(str(tiny_model_dir)))
    assert text
    return text


def test_first_token_lost_on_its_way_to_the_postfilter(tiny_model_dir, reference):
    """Prefill's token 0 (it carries the StreamSpec) never arrives: the postfilter cannot know
    the request; the gateway's resend broadcast makes decode send the stream again from 0."""
    text, bus = asyncio.run(run_pipeline(
        str(tiny_model_dir), lambda s, m: isinstance(m, TokenChunk) and m.index == 0))
    assert len(bus.dropped) == 1 and bus.dropped[0].spec is not None
    assert text == reference


def test_first_text_lost_on_its_way_to_the_gateway(tiny_model_dir, reference):
    """The postfilter's first TextChunk never arrives: the gateway knows no postfilter to ask;
    its broadcast reaches the one that has the text."""
    text, bus = asyncio.run(run_pipeline(
        str(tiny_model_dir), lambda s, m: isinstance(m, TextChunk) and m.text_offset == 0))
    assert len(bus.dropped) == 1
    assert text == reference


def test_a_whole_token_stream_lost_including_its_end(tiny_model_dir, reference):
    """Every token chunk of the request is lost, its end included (the broker was away for all
    of it): nobody downstream of decode knows the request; decode still has the stream."""
    ended = []

    def drop(subject, message) -> bool:
        if not isinstance(message, TokenChunk) or ended:
            return False
        ended.extend([True] if message.finish_reason else [])
        return True

    text, bus = asyncio.run(run_pipeline(str(tiny_model_dir), drop, budget=10_000))
    assert sum(len(m.token_ids) for m in bus.dropped) == MAX_TOKENS and bus.dropped[-1].finish_reason
    assert text == reference


def test_every_decode_token_lost_after_prefills_first(tiny_model_dir, reference):
    """Prefill's token 0 arrives, every token decode sends is lost, its end included: the
    postfilter has heard from no decode worker, so it asks them all."""
    ended = []

    def drop(subject, message) -> bool:
        if not isinstance(message, TokenChunk) or message.index == 0 or ended:
            return False
        ended.extend([True] if message.finish_reason else [])
        return True

    text, bus = asyncio.run(run_pipeline(str(tiny_model_dir), drop, budget=10_000))
    assert sum(len(m.token_ids) for m in bus.dropped) == MAX_TOKENS - 1 and bus.dropped[-1].finish_reason
    assert text == reference


def test_work_whose_gateway_is_cut_off_longer_than_the_heartbeat_timeout_goes_on(tiny_model_dir, reference):
    """A partition (issue 19's lost partition request): the gateway, alive and waiting, cannot be
    reached from the workers for 5 s — more than twice ``heartbeat_timeout_s`` — so its status
    answers are "no responders" and its heartbeats are lost. The request was queued before the
    workers started, so every stage asks the gateway before it works on it, exactly as for a
    redelivered work item. Each stage must go on with the work; it used to ack and drop it after
    heartbeat_timeout_s of "no responders", and the request waited for its timeout."""
    text, bus = asyncio.run(run_pipeline(str(tiny_model_dir), queued_s_before=5.0, gateway_cut_s=5.0))
    assert bus.unanswered, "no status query met the cut"
    assert text == reference


def test_no_responders_right_after_a_restart_is_not_a_dead_gateway():
    """A redelivered item's gateway answers "no responders" while it re-subscribes after a broker
    restart: the worker keeps asking, and the answer it then gets counts. A gateway that stays
    unreachable is given the benefit of the doubt (a partition hides a live one), unless it has
    been silent — no heartbeat, and the request older — for its own patience
    (first_token_timeout_s / stall_timeout_s): then the work is dropped at once."""
    from services.common.runtime import Worker
    from shared.messages import Heartbeat, RequestStatus, StatusQuery, decode_as

    async def go():
        settings = Settings.from_env({}, namespace="nr", heartbeat_timeout_s=1.5, first_token_timeout_s=4.0,
                                     stall_timeout_s=2.0)
        bus = MemoryBus()
        worker = Worker(settings, bus=bus)
        await bus.subscribe(worker.protocol.heartbeat_of("gateway"), worker._on_gateway_heartbeat)
        assert worker.gateway_gone_s == 4.0

        def meta_of(rid: str, gateway: str, age_s: float) -> RequestMeta:
            return RequestMeta(request_id=rid, reply_to=f"nr.gateway.{gateway}.events", model="m",
                               created_at=time.time() - age_s, deadline_at=time.time() + 60)

        async def status(data: bytes):
            return RequestStatus(request_id=decode_as(data, StatusQuery).request_id, open=False)

        async def gateway_back_later() -> None:
            await asyncio.sleep(0.6)
            await bus.serve(worker.protocol.gateway_status("nr.gateway.g1.events"), status)

        back = asyncio.create_task(gateway_back_later())
        assert await worker.still_wanted(meta_of("r1", "g1", 10), num_delivered=2) is False  # its answer: closed
        await back

        # cut off but heard from 1 s ago (a partition): kept, after asking for heartbeat_timeout_s
        await bus.publish(worker.protocol.heartbeat_of("gateway"),
                          Heartbeat(stage="gateway", instance_id="g2", model="m", sent_at=time.time(),
                                    inbox="nr.gateway.g2.events"))
        for _ in range(1000):  # delivered by the bus's own task
            if "nr.gateway.g2.events" in worker.gateway_heard:
                break
            await asyncio.sleep(0.01)
        worker.gateway_heard["nr.gateway.g2.events"] -= 1.0
        started = time.monotonic()
        assert await worker.still_wanted(meta_of("r2", "g2", 10), num_delivered=2) is True
        assert time.monotonic() - started >= 1.5
        # a young request of a gateway never heard from: it was alive when it sent it
        assert await worker.still_wanted(meta_of("r3", "g3", 1), num_delivered=2) is True
        # silent for longer than its patience: gone, no waiting (one status query each, no retry)
        asked: list[str] = []
        real_request = bus.request

        async def counted_request(subject, message, timeout_s):
            asked.append(message.request_id)
            return await real_request(subject, message, timeout_s)

        bus.request = counted_request
        assert await worker.still_wanted(meta_of("r4", "g4", 10), num_delivered=2) is False
        worker.gateway_heard["nr.gateway.g2.events"] -= 5.0
        assert await worker.still_wanted(meta_of("r5", "g2", 10), num_delivered=2) is False
        assert asked == ["r4", "r5"]
        await bus.close()

    asyncio.run(go())


def test_a_lost_stream_resubmits_requests_without_text_once():
    """``<ns>.control.stream_lost`` makes the gateway queue its requests that have no text again,
    as a new attempt (its own de-duplication id), once per loss."""
    from shared.messages import WorkQueueLost, decode_as
    from shared.recovery import attempt, work_id

    async def go():
        settings = Settings.from_env({}, namespace="sl", heartbeat_interval_s=0.2)
        bus = MemoryBus()
        client = PipelineClient(settings, bus=bus)
        await client.start()
        tasks = {}
        for rid in ("waiting", "streaming"):
            meta = RequestMeta(request_id=rid, reply_to=client.inbox, model="m", created_at=time.time(),
                               deadline_at=time.time() + 60)
            tasks[rid] = TokenizeTask(meta=meta, sampling=SamplingParams(max_tokens=4), prompt="p")
            client.register(rid, asyncio.Queue())
            await client.submit(tasks[rid])
        await bus.publish(client.inbox, TextChunk(request_id="streaming", text="a", text_offset=0, num_tokens=1))
        entry = client.protocol.entry
        assert len(await bus.pull(entry, 10, 0.1)) == 2
        for _ in range(2):  # two streams lost at once: one resubmission
            await bus.publish(client.protocol.stream_lost, WorkQueueLost(stage="prefill"))
        await asyncio.sleep(0.2)
        again = [decode_as(d.data, TokenizeTask) for d in await bus.pull(entry, 10, 0.2)]
        assert [t.meta.request_id for t in again] == ["waiting"]
        assert attempt(again[0].meta) == 1 and work_id(again[0].meta) == "waiting~1"
        await client.stop()
        await bus.close()

    asyncio.run(go())
