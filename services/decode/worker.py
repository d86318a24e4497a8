"""Decode stage: DecodeTask → a stream of TokenChunks, one per engine step per request.

Life cycle of a request here:

1. pull a DecodeTask (durable ``decode-workers``) while the running batch has room; drop it if
   aborted or past its deadline;
2. if this is a redelivery (the worker that had it died), ask the request's postfilter which
   output tokens it already has, and continue after those: the prompt and those tokens are
   recomputed (recompute from prompt + tokens already sent), so the client's stream goes on
   with nothing repeated and nothing missing;
3. load its prompt KV: full blocks this worker already holds in its prefix cache are not
   fetched (among them those read ahead of the task: a long prompt's prefill announces each
   chunk's blocks as it stages them, a KVPrefetch, and a decode worker with a free slot reads
   them into its prefix cache while the prompt is still being prefilled, ``PD_KV_PREFETCH``);
   the others and the request-scoped tail come from the KV store in one batched read; a
   layout mismatch, a missing block or an unreachable store means recompute from there
   (``PD_KV_FAILURE_POLICY=recompute``) or a clean error (``fail``);
4. admit it into the continuous batch; delete the tail from the store (nothing
   request-scoped stays staged once decode holds the KV); the KV ledger's record of the
   handle goes ``imported`` (owned by this worker) when read, and is released with the tail;
5. every step, send the new token to the request's postfilter instance (core NATS) through
   the request's :class:`shared.streams.StreamSender`, which keeps what was sent to answer
   the postfilter's resend requests; if that instance dies, replay the whole output so far to
   a live one (the gateway drops text it already delivered);
6. when the request finishes (EOS, stop token, max_tokens, context end) ack the DecodeTask.
   The task stays unacked — and marked in progress — while the request runs, so if this
   worker dies JetStream redelivers it within ``ack_wait`` to another decode worker.

An Abort (client gone, stop string matched, deadline) drops the request from the batch at
the next step and frees its blocks; so does the death of the gateway instance waiting for it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engine.outputs import StepOutput
from services.common.consumer import PullConsumer, WorkItem
from services.common.model_worker import ModelWorker
from services.common.runtime import main
from shared.bus import Bus
from shared.config import Settings
from shared.deadline import wait_within
from shared.errors import DeadlineExceeded, EngineError, KVTransferError, ServiceUnavailable
from shared.kv import block_key
from shared.messages import (
    Abort,
    DecodeTask,
    KVPrefetch,
    ResumeQuery,
    ResumeState,
    SpecStats,
    StreamSpec,
    TextResend,
    TokenChunk,
    TokenResend,
    decode_as,
)
from shared.metrics import kv_ledger_metrics
from shared.streams import Piece, SentStreams, StreamSender
from shared.timeline import now_mark
from shared.tracing import span, start_span

#: How long a new owner waits for the old postfilter's answer about a request's tokens.
RESUME_TIMEOUT_S = 1.0


#: Finished token streams kept: a postfilter that missed the end, or died before delivering
#: it, can still get it.
MAX_FINISHED_STREAMS = 4096


@dataclass(slots=True, eq=False)
class ActiveRequest:
    task: DecodeTask
    done: asyncio.Future
    postfilter: str  # its postfilter's inbox until the stream opens; then ``stream.target``
    started_at: float = field(default_factory=time.monotonic)
    seq: object = None  # the engine's Sequence once admitted (read-only here)
    stream: StreamSender | None = None  # its token stream, once admitted
    marks: list = field(default_factory=list)  # the request's timeline, with this worker's marks


class DecodeWorker(ModelWorker):
    stage = "decode"

    def __init__(self, settings: Settings, bus: Bus | None = None):
        super().__init__(settings, bus)
        self.active: dict[str, ActiveRequest] = {}  # request id → what this worker decodes for it

    async def setup(self) -> None:
        await super().setup()
        # token streams: running ones, and finished ones kept for resends and replays
        self.streams = SentStreams(MAX_FINISHED_STREAMS, finished_ttl_s=float("inf"))
        self.checking_gateway: set[str] = set()  # requests whose gateway is being asked about
        self.gateway_checks: set[asyncio.Task] = set()
        # KVPrefetch hints not acted on yet, the latest per request (each names every block
        # staged so far), and the request whose blocks are being read now with its end
        self.prefetch_hints: dict[str, KVPrefetch] = {}
        self.prefetch_wake = asyncio.Event()
        self.prefetching: tuple[str, asyncio.Future] | None = None

    async def serve(self) -> None:
        await super().serve()
        await self.bus.subscribe(self.protocol.decode_control(self.instance_id), self._on_control_message)
        await self.bus.subscribe(self.protocol.resend, self._on_resend_broadcast)
        if self.settings.kv_prefetch != "off" and self.settings.enable_prefix_caching:
            await self.bus.subscribe(self.protocol.kv_prefetch, self._on_kv_prefetch)
            self.spawn(self._prefetch_loop(), "kv-prefetch")
        self.consumer = PullConsumer(self, self.protocol.decode, DecodeTask, self.handle, capacity=self._capacity)
        self.spawn(self.consumer.run(), "consume")
        self.spawn(self.consumer.keepalive(), "keepalive")
        self.spawn(self._watch_peers(), "watch-peers")

    def _capacity(self) -> int:
        slots = self.engine.config.max_num_seqs - len(self.active)
        # leave a little of the pool for running sequences to grow into
        if self.engine.block_manager.num_free_blocks < max(4, self.engine.num_kv_blocks // 20):
            return 0
        return max(0, slots)

    @property
    def num_running(self) -> int:
        return len(self.active)

    # --- engine callbacks (on the event loop) ---------------------------------------------
    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            req = self.active.get(out.request_id)
            if req is None:
                continue
            if out.error is not None:  # the engine ended it: a terminal error event, not a finish
                if not req.done.done():
                    req.done.set_exception(EngineError(f"structured output failed: {out.error}"))
                continue
            spec = None
            if out.index == 0:  # this worker prefilled the prompt itself: it opens the stream
                task = req.task
                spec = StreamSpec.of(task.meta, task.sampling, len(task.prompt_token_ids), out.seq.num_cached_tokens)
                self.waiting_first_token.pop(out.request_id, None)
            marks = []
            spec_stats = None
            if out.finished:
                req.marks.append(now_mark("decode.last_token"))
                marks = req.marks
                seq = out.seq
                spec_stats = SpecStats(seq.num_draft_tokens, seq.num_accepted_tokens, seq.num_step_tokens,
                                       seq.num_output_steps)
            req.stream.push(out.new_token_ids, out.finish_reason)
            self.post(req.stream.target, TokenChunk(
                request_id=out.request_id,
                index=out.index,
                token_ids=out.new_token_ids,
                spec=spec,
                finish_reason=out.finish_reason,
                logprobs=out.logprobs if req.task.sampling.logprobs is not None else None,
                worker=self.instance_id,
                marks=marks,
                prompt_logprobs=out.prompt_logprobs,
                spec_stats=spec_stats,
            ))
            if out.finished and not req.done.done():
                req.done.set_result(out.finish_reason)
                self.streams.finish(out.request_id, time.monotonic())

    def _on_step_error(self, request_ids: list[str], exc: Exception) -> None:
        for rid in request_ids:
            req = self.active.get(rid)
            if req is not None and not req.done.done():
                req.done.set_exception(EngineError(f"decode failed: {exc}"))

    def held_requests(self) -> list:
        return [req.task.meta for req in self.active.values()]

    async def on_abort(self, abort: Abort) -> None:
        rid = abort.request_id
        self.prefetch_hints.pop(rid, None)
        req = self.active.get(rid)
        if req is None:
            return
        # not awaited: the engine drops it before its next step, and the next Abort (a storm of
        # them) must not wait for that step boundary behind this one
        call = self.engine_loop.call(lambda e: e.abort(rid))
        if req.done.done():
            return
        req.done.set_result("superseded" if abort.worker else "abort")
        if not abort.worker:
            reason = "deadline" if abort.reason == "deadline" else "cancelled"
            call.add_done_callback(lambda f: self.count_cancelled(
                reason, "running" if not f.cancelled() and not f.exception() and f.result() is not None else "queued"))

    async def _on_control_message(self, message) -> None:
        """A postfilter missed tokens of a request this worker streams: send them again."""
        if not isinstance(message, TokenResend):
            return
        stream = self.streams.get(message.request_id)
        piece = stream.resend(message.from_index) if stream is not None else None
        if piece is not None:
            self.post(stream.target, TokenChunk(request_id=message.request_id, index=piece.index,
                                                token_ids=piece.items, finish_reason=piece.finish_reason,
                                                worker=self.instance_id))

    async def _on_resend_broadcast(self, message) -> None:
        """A broadcast resend: a postfilter that does not know which decode worker streams a
        request (only prefill's first token came) asks all of them (a TokenResend, answered as
        one sent here); a gateway with no text yet (a TextResend from 0) gets the tokens sent
        again from index 0 with the StreamSpec, to the same postfilter — the first token may
        have been lost before the postfilter knew the request. Duplicates are dropped there."""
        if isinstance(message, TokenResend):
            await self._on_control_message(message)
            return
        if not isinstance(message, TextResend) or message.from_offset != 0:
            return
        stream = self.streams.get(message.request_id)
        if stream is None or stream.num_items == 0:
            return
        task: DecodeTask = stream.context
        spec = StreamSpec.of(task.meta, task.sampling, len(task.prompt_token_ids), task.num_cached_tokens)
        self.post(stream.target, TokenChunk(request_id=message.request_id, index=0, token_ids=list(stream.items()),
                                            spec=spec, finish_reason=stream.finish_reason, worker=self.instance_id))

    # --- reading a long prompt's KV ahead of its DecodeTask ----------------------------------
    async def _on_kv_prefetch(self, message) -> None:
        """A prefill worker staged more of a prompt's leading blocks: note it (the latest hint
        per request replaces the earlier, which names fewer blocks) for :meth:`_prefetch_loop`."""
        if not isinstance(message, KVPrefetch) or message.request_id in self.active:
            return  # the DecodeTask came first: its own read takes the blocks
        self.prefetch_hints[message.request_id] = message
        self.prefetch_wake.set()

    def _reads_ahead(self) -> bool:
        """Whether this worker acts on KVPrefetch hints now: ``PD_KV_PREFETCH=all``, or ``auto``
        while it is the only live decode worker (its own heartbeats count it; none heard yet
        counts as alone). With more, the work queue hands the DecodeTask to whichever fetches
        first, and every other worker's read and engine-thread copy would be for nothing: the
        simulator's sweep on a profile whose import costs engine time (``h200-llama2-7b``, the
        azure-code mix, 6 prefill and 2 decode workers, load 0.6 and 0.95) put the split's ITL
        p90 at 4.8-5.7 s with every decode worker reading against 1.2-2.0 s without
        (docs/decisions.md, "Reading a long prompt's KV ahead")."""
        if self.settings.kv_prefetch == "all":
            return True
        return len(self.registry.live("decode", ready_only=False)) <= 1

    async def _prefetch_loop(self) -> None:
        """Act on KVPrefetch hints one at a time, oldest request first: while this worker reads
        ahead (:meth:`_reads_ahead`) and has a free slot (:meth:`_capacity`: it could take the
        DecodeTask), read the blocks its prefix cache lacks from the store into it
        (:meth:`import_from_store`: the read in a thread, the copy on the engine thread between
        steps, one chunk's blocks at a time rather than the whole prompt's at the hand-off).
        Blocks read for a request another worker takes stay as evictable prefix cache. This is
        Mooncake's and Splitwise's overlap of the KV transfer with prefill (Qin et al., FAST 2025;
        Patel et al., ISCA 2024) carried to the reading side, chunk by chunk."""
        while True:
            await self.prefetch_wake.wait()
            self.prefetch_wake.clear()
            while self.prefetch_hints:
                rid = next(iter(self.prefetch_hints))
                hint = self.prefetch_hints.pop(rid)
                if (rid in self.active or hint.layout != self.engine.layout or self._capacity() <= 0
                        or not self._reads_ahead()):
                    continue
                done = asyncio.get_running_loop().create_future()
                self.prefetching = (rid, done)
                try:
                    with span("decode.kv_prefetch", hint.headers, request_id=rid, blocks=len(hint.block_hashes)):
                        n = await self.import_from_store(rid, hint.block_hashes, "kv_prefetch_failed")
                    self.kv_metrics["prefetch_blocks"].inc(n)
                except Exception as exc:  # a hint is never worth this loop: the hand-off reads instead
                    self.log.warning("kv_prefetch_failed", request_id=rid, error=repr(exc))
                finally:
                    self.prefetching = None
                    done.set_result(None)

    async def _after_prefetch(self, rid: str) -> None:
        """The DecodeTask of ``rid`` came: drop its pending hint, and if its blocks are being
        read ahead right now, let that read finish (its blocks are then local hits, not read
        twice)."""
        self.prefetch_hints.pop(rid, None)
        if self.prefetching is not None and self.prefetching[0] == rid:
            await asyncio.shield(self.prefetching[1])

    # --- peers ------------------------------------------------------------------------------
    def _postfilter_alive(self, inbox: str) -> bool:
        return any(h.inbox == inbox for h in self.registry.live("postfilter"))

    def _new_postfilter(self, rid: str) -> str:
        inbox = self.pick_postfilter(rid)
        if inbox is None:
            raise ServiceUnavailable("no postfilter worker is alive")
        return inbox

    def _replay(self, rid: str, stream: StreamSender, postfilter: str) -> None:
        """Send a request's whole output so far to its (new) postfilter, from index 0."""
        piece: Piece = stream.replay(postfilter)
        task: DecodeTask = stream.context
        spec = StreamSpec.of(task.meta, task.sampling, len(task.prompt_token_ids), task.num_cached_tokens)
        self.post(postfilter, TokenChunk(request_id=rid, index=0, token_ids=list(piece.items), spec=spec,
                                         finish_reason=piece.finish_reason, worker=self.instance_id, replay=True))

    async def _watch_peers(self) -> None:
        """Re-route streams whose postfilter died; drop requests whose gateway died."""
        period = self.settings.heartbeat_interval_s
        while True:
            await asyncio.sleep(period)
            gateways = {h.inbox for h in self.registry.live("gateway", ready_only=False)}
            for rid, req in list(self.active.items()):
                if req.seq is None or req.done.done():
                    continue
                reply_to = req.task.meta.reply_to
                if reply_to in self.gateways_seen and reply_to not in gateways:
                    if rid not in self.checking_gateway:
                        self.checking_gateway.add(rid)
                        task = asyncio.get_running_loop().create_task(self._drop_if_gateway_gone(rid, req))
                        self.gateway_checks.add(task)
                        task.add_done_callback(self.gateway_checks.discard)
                    continue
                self._reroute_if_orphaned(rid, req.stream)
            # finished here, but the postfilter died before it could deliver the end: a death
            # is noticed within heartbeat_timeout_s, so that is how long this matters
            horizon = time.monotonic() - 2 * self.settings.heartbeat_timeout_s - period
            for rid, stream in list(self.streams.finished_since(horizon)):
                if stream.context.meta.reply_to in gateways:
                    self._reroute_if_orphaned(rid, stream)

    async def _drop_if_gateway_gone(self, rid: str, req: ActiveRequest) -> None:
        """The request's gateway has sent no heartbeat for a while: drop the request only if
        the gateway confirms it (asked as for redelivered work: no answer means alive). Its
        heartbeats may just be stuck behind a frozen or restarting broker node (issue 19)."""
        try:
            if not await self.still_wanted(req.task.meta, num_delivered=2):
                self.log.warning("gateway_gone", request_id=rid)
                await self.on_abort(Abort(request_id=rid, reason="gateway_gone"))
        finally:
            self.checking_gateway.discard(rid)

    def _reroute_if_orphaned(self, rid: str, stream: StreamSender) -> None:
        """If the stream's postfilter died, replay the stream to a live one."""
        if self._postfilter_alive(stream.target):
            return
        try:
            postfilter = self._new_postfilter(rid)
        except ServiceUnavailable:
            return  # none alive now; the gateway's stall timeout bounds the wait
        self.log.warning("postfilter_rerouted", request_id=rid, to=postfilter, finished=stream.is_finished)
        self._replay(rid, stream, postfilter)
        if stream.is_finished:  # watched again for as long as the new owner might die with it
            self.streams.refresh(rid, time.monotonic())

    async def _resume_point(self, req: ActiveRequest, rid: str) -> tuple[list[int], bool, bool]:
        """For a redelivered task: (output tokens to continue after, whether the stream must be
        replayed to a new postfilter, whether the request already finished)."""
        task = req.task
        if self._postfilter_alive(req.postfilter):
            try:
                reply = await self.bus.request(self.protocol.postfilter_resume(req.postfilter),
                                               ResumeQuery(request_id=rid, worker=self.instance_id),
                                               timeout_s=RESUME_TIMEOUT_S)
                state = decode_as(reply, ResumeState)
                if state.finished:
                    return [], False, True
                if state.known and len(state.output_token_ids) > len(task.output_token_ids):
                    self.log.info("resumed", request_id=rid, num_tokens=len(state.output_token_ids))
                    return list(state.output_token_ids), False, False
                return list(task.output_token_ids), not state.known, False
            except Exception as exc:  # no answer, nobody there, a garbled answer
                self.log.warning("resume_query_failed", request_id=rid, error=str(exc))
        req.postfilter = self._new_postfilter(rid)
        return list(task.output_token_ids), True, False

    # --- the work ---------------------------------------------------------------------------
    def _load_kv(self, task: DecodeTask, num_local: int) -> tuple[list, bytes | None]:
        """Read the blocks this worker lacks and the tail from the store (in a thread), as views
        where the store has them (``KVStore.get_views``): the engine copies each once into its
        pool."""
        handle = task.kv
        keys = [block_key(h, handle.layout.dtype) for h in handle.block_hashes[num_local:]]
        if handle.tail_key:
            keys.append(handle.tail_key)
        values = self.store.get_views(keys) if keys else []
        tail = values.pop() if handle.tail_key else None
        try:
            if self.ledger.imported(task.meta.request_id, self.instance_id):
                kv_ledger_metrics()["transitions"].labels("imported").inc()
        except KVTransferError as exc:  # bookkeeping only: the request goes on
            self.log.warning("kv_ledger_update_failed", request_id=task.meta.request_id, error=exc.message)
        return [None] * num_local + values, tail

    async def _fetch_kv(self, task: DecodeTask) -> tuple[list, bytes | None]:
        handle = task.kv
        self.kv_metrics["prefix_query_tokens"].labels(self.stage).inc(len(task.prompt_token_ids))
        if handle is None or handle.layout != self.engine.layout:
            return [], None
        num_local = self.engine.cached_block_hashes(handle.block_hashes)
        started = time.perf_counter()
        try:
            blocks, tail = await asyncio.to_thread(self._load_kv, task, num_local)
        except KVTransferError as exc:
            if self.settings.kv_failure_policy == "fail":
                raise
            self.log.warning("kv_load_failed_recomputing", request_id=task.meta.request_id, error=exc.message)
            return [None] * num_local, None
        nbytes = sum(len(b) for b in blocks if b is not None) + (len(tail) if tail else 0)
        self.kv_metrics["get_bytes"].inc(nbytes)
        self.kv_metrics["get_seconds"].inc(time.perf_counter() - started)
        if num_local:
            self.kv_metrics["prefix_hit_tokens"].labels(self.stage, "local").inc(num_local * handle.layout.block_size)
        return blocks, tail

    async def handle(self, item: WorkItem) -> str | None:
        task: DecodeTask = item.message  # type: ignore[assignment]
        meta = task.meta
        rid = meta.request_id
        if rid in self.active:
            item.done = True  # redelivery of a request running here: the first delivery acks
            return "duplicate"
        if not await self.still_wanted(meta, item.num_delivered):
            await self._drop_tail(task)
            await item.ack()
            return "dropped"
        req = ActiveRequest(task, asyncio.get_running_loop().create_future(), task.postfilter,
                            marks=[*meta.marks, now_mark("decode.fetched")])
        self.active[rid] = req
        decode_span = start_span("decode", meta.headers, request_id=rid, delivery=item.num_delivered)
        try:
            output_ids, replay, finished = list(task.output_token_ids), False, False
            if item.num_delivered > 1 and req.postfilter:
                output_ids, replay, finished = await self._resume_point(req, rid)
            if finished:
                await item.ack()
                return "already_finished"
            if not req.postfilter:
                req.postfilter = self._new_postfilter(rid)  # a local prefill: this worker opens the stream
            if not output_ids:
                self.waiting_first_token[rid] = meta
            await self._after_prefetch(rid)
            with span("decode.kv_get", decode_span.headers, has_kv=task.kv is not None):
                try:
                    blocks, tail = await wait_within(self._fetch_kv(task), meta.deadline_at,
                                                     "waiting for its prompt's KV")
                except DeadlineExceeded:
                    self.count_cancelled("deadline", "queued")
                    await self._drop_tail(task)
                    raise  # the gateway hears deadline_exceeded; the task is acked
            handle = task.kv
            hashes = handle.block_hashes if handle else task.block_hashes
            if handle is None and hashes:
                await self.import_store_hits(rid, hashes, len(task.prompt_token_ids))
            # opened before admission: the engine's first output may reach _on_outputs before
            # this coroutine resumes
            req.stream = self.streams.open(rid, req.postfilter, items=output_ids, context=task)
            await self.engine.grammar.precompile(task.sampling.grammar)  # off the engine thread
            req.seq = await self.engine_loop.call(lambda e: e.admit_with_kv(
                rid, task.prompt_token_ids, output_ids, task.sampling, hashes, blocks, tail,
                cache_salt=meta.cache_salt))
            blocks = tail = None  # copied into the pool: let go of the store's pages now
            req.marks.append(now_mark("decode.kv_loaded" if handle is not None else "decode.admitted"))
            await self._drop_tail(task)
            if replay:
                self._replay(rid, req.stream, req.postfilter)
            if req.done.done():  # aborted while its KV was loading
                await self.engine_loop.call(lambda e: e.abort(rid))
            reason = await req.done
            if reason == "superseded":
                # another decode worker took the request over: its delivery acks the task
                item.done = True
                return "superseded"
            await item.ack()
            return "aborted" if reason == "abort" else "ok"
        finally:
            decode_span.end()
            self.streams.drop(rid)  # unless it finished (then it is kept a while)
            self.active.pop(rid, None)
            self.waiting_first_token.pop(rid, None)
            self.consumer.notify_room()

    async def drop_work(self, message) -> None:
        await self._drop_tail(message)

    async def _drop_tail(self, task: DecodeTask) -> None:
        if task.kv is not None:
            try:
                await asyncio.to_thread(self._release_kv, task)
            except KVTransferError as exc:
                self.log.warning("kv_tail_delete_failed", request_id=task.meta.request_id, error=exc.message)

    def _release_kv(self, task: DecodeTask) -> None:
        """Delete the request-scoped tail and release the handle's ledger record (in a thread)."""
        if task.kv.tail_key:
            self.store.delete([task.kv.tail_key])
        if self.ledger.released(task.meta.request_id) is not None:
            kv_ledger_metrics()["transitions"].labels("released").inc()


def main_entry() -> None:
    main(DecodeWorker)
