"""Prefill stage: PrefillTask → KV blocks in the KV store + first token + DecodeTask.

Life cycle of a request here:

1. pull a PrefillTask (durable ``prefill-workers``) while the engine has room; drop it if
   aborted or past its deadline; pick the postfilter instance that will own the request's
   token stream (rendezvous hash over live postfilter heartbeats);
2. the engine prefills the prompt (batched with other prompts, chunked when long, reusing
   this worker's prefix cache) and samples the first token;
3. the first token goes to the postfilter at once (TTFT does not wait for the KV hand-off);
   if it already ends the request (EOS, max_tokens = 1) the request is done here;
4. the prompt's KV is copied out of the pool and staged: full blocks under their
   content-addressed keys (skipped when the store already has them, leases renewed), the
   partial tail under a request-scoped key. A prompt prefilled in several chunks has its full
   blocks staged chunk by chunk while the rest is computed (``PD_KV_STAGE_DURING_PREFILL``,
   :class:`EarlyStage`), so this step writes only the last chunk's blocks and the tail; each
   early put is announced to the decode workers (a KVPrefetch broadcast, ``PD_KV_PREFETCH``),
   which read those blocks ahead of the DecodeTask; an
   aborted prompt leaves its early blocks to their lease, as any staged block (they are the
   store's prefix cache);
   Every staged handle is recorded in the KV ledger (``shared/kv/ledger.py``: owner, lease,
   bytes, state ``staged``), which this worker's reaper reconciles with the other workers';
5. the DecodeTask with its KVHandle is published (Nats-Msg-Id ``decode:<request_id>``), the
   ledger record marked handed off, and only once JetStream has stored it is the PrefillTask acked. A redelivered PrefillTask
   redoes the same work and publishes a DecodeTask that JetStream de-duplicates.

An Abort cancels the request in the engine between steps (so between prefill chunks).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from engine.outputs import StepOutput
from services.common.consumer import PullConsumer, WorkItem
from services.common.kv_reaper import KVReaper
from services.common.model_worker import ModelWorker
from services.common.runtime import main
from shared.bus import Bus
from shared.config import Settings
from shared.deadline import task_headers
from shared.errors import Aborted, EngineError, KVTransferError, ServiceUnavailable
from shared.kv import BLOCK, TAIL, block_key, tail_key
from shared.kv.layout import KVHandle
from shared.kv.ledger import KVLedger, ShmKVLedger
from shared.messages import (
    Abort,
    DecodeTask,
    KVPrefetch,
    PrefillTask,
    RequestMeta,
    StreamSpec,
    TokenChunk,
)
from shared.metrics import cancel_metrics, kv_ledger_metrics
from shared.recovery import work_id
from shared.timeline import with_mark
from shared.tracing import span

#: Seconds between sweeps of expired staged KV (and updates of the staged-bytes gauge).
REAP_INTERVAL_S = 2.0


@dataclass(slots=True)
class EarlyStage:
    """What a prompt still being prefilled has staged so far (``PD_KV_STAGE_DURING_PREFILL``).

    Attributes:
        staged: indices of full blocks written to the store, or found there, by early puts.
        unstaged: buffers of full blocks whose early put failed, by index: the hand-off
            writes them (a buffer is dropped as soon as its block is staged).
        bytes_written: bytes the early puts wrote.
        puts: the latest early put of this prompt; each waits for the one before, so the
            hand-off waits for all of them by awaiting this one.
        headers: the request's trace context (the puts' spans are children of its prefill).
        failed: an early put failed: later chunks keep their buffers for the hand-off instead
            of waiting on the store again (an unreachable store costs one timeout, not one per
            chunk).
        block_hashes: the prompt's full blocks' hashes (its PrefillTask's), from which each
            successful put's KVPrefetch names the leading run staged so far.
    """

    staged: set[int] = field(default_factory=set)
    unstaged: dict[int, memoryview] = field(default_factory=dict)
    bytes_written: int = 0
    puts: asyncio.Future | None = None
    headers: dict[str, str] | None = None
    failed: bool = False
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class KVStager:
    """Puts a prompt's exported KV into the store (runs in a thread) and records the handle in
    the ledger (owned by ``owner``, leased for the tail's TTL).

    Full blocks the store already holds are not written again, only their leases renewed.
    Returns the handle decode needs, and the bytes written.
    """

    store: object
    block_ttl_s: float
    tail_ttl_s: float
    ledger: KVLedger | None = None
    owner: str = ""

    def put_blocks(self, items: dict[str, memoryview]) -> int:
        """Write the full blocks ``{key: buffer}`` the store does not hold yet and renew the
        leases of those it holds. Returns the bytes written.

        Raises:
            KVTransferError: the store cannot be read or written.
        """
        keys = list(items)
        present = self.store.exists(keys) if keys else []
        missing = {k: items[k] for k, p in zip(keys, present) if not p}
        have = [k for k, p in zip(keys, present) if p]
        written = self.store.put(missing, self.block_ttl_s) if missing else 0
        if have:
            self.store.touch(have, self.block_ttl_s)
        return written

    def stage(self, request_id: str, prompt_kv, layout, deadline_at: float = float("inf"),
              early: EarlyStage | None = None) -> tuple[KVHandle, int]:
        """Stage ``prompt_kv`` (its ``blocks`` start at full block ``first_block``; the blocks
        before it are in ``early``: staged, or their buffers kept after a failed put)."""
        keys = [block_key(h, layout.dtype) for h in prompt_kv.block_hashes]
        early = early or EarlyStage()
        first = prompt_kv.first_block
        items = {k: (early.unstaged[i] if i < first else prompt_kv.blocks[i - first])
                 for i, k in enumerate(keys) if i not in early.staged}
        present = self.store.exists(list(items)) if items else []
        missing = {k: buf for (k, buf), p in zip(items.items(), present) if not p}
        # the early-staged blocks' leases are renewed from the hand-off too, as a block found
        # already staged is: over the store's cap the soonest-ending leases go first
        have = [k for k, p in zip(items, present) if p] + [keys[i] for i in sorted(early.staged)]
        tkey = tail_key(request_id) if prompt_kv.tail is not None else None
        if self.ledger is not None:
            # recorded before the tail is written: a reaper that judged an older record of this
            # request (its owner died, this is the redelivery) then finds it changed and keeps
            # both the record and the tail
            tail_bytes = memoryview(prompt_kv.tail).nbytes if tkey else 0
            self.ledger.staged(request_id, self.owner, "prefill", self.tail_ttl_s, deadline_at, tail_bytes,
                               early.bytes_written + sum(memoryview(b).nbytes for b in missing.values()), tkey)
            kv_ledger_metrics()["transitions"].labels("staged").inc()
        written = 0
        if missing:
            written += self.store.put(missing, self.block_ttl_s)
        if have:
            self.store.touch(have, self.block_ttl_s)
        if tkey:
            written += self.store.put({tkey: prompt_kv.tail}, self.tail_ttl_s)
        handle = KVHandle(store=self.store.name, layout=layout, block_hashes=list(prompt_kv.block_hashes),
                          num_tokens=prompt_kv.num_tokens, tail_key=tkey)
        return handle, written


class PrefillWorker(ModelWorker):
    stage = "prefill"
    holds_handoffs = True  # the next prefill step waits for a hand-off's final put (EngineLoop)

    def __init__(self, settings: Settings, bus: Bus | None = None):
        super().__init__(settings, bus)
        self.pending: dict[str, asyncio.Future] = {}  # request id → its prefill's outcome
        self.early: dict[str, EarlyStage] = {}  # request id → its blocks staged during prefill

    async def setup(self) -> None:
        await super().setup()
        self.cancel_metrics = cancel_metrics()
        self.stager = KVStager(self.store, self.settings.kv_block_ttl_s, self.settings.kv_tail_ttl_s,
                               self.ledger, self.instance_id)
        self.reaper = KVReaper(self, self.ledger, self.store)
        if self.settings.kv_stage_during_prefill:
            loop = asyncio.get_running_loop()
            self.engine.on_prompt_blocks = lambda *args: loop.call_soon_threadsafe(self._stage_early, *args)

    async def serve(self) -> None:
        await super().serve()
        self.consumer = PullConsumer(
            self, self.protocol.prefill, PrefillTask, self.handle,
            capacity=lambda: self.engine.config.max_num_seqs - len(self.pending),
        )
        self.spawn(self.consumer.run(), "consume")
        self.spawn(self.consumer.keepalive(), "keepalive")
        self.spawn(self._reap_loop(), "reap")

    @property
    def num_running(self) -> int:
        return len(self.pending)

    async def _reap_loop(self) -> None:
        """Free expired (abandoned) staged KV, reclaim orphaned handles of the ledger, and
        report what is staged."""
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                await self.reaper.sweep()
                await asyncio.to_thread(self.store.reap)
                if isinstance(self.ledger, ShmKVLedger):
                    await asyncio.to_thread(self.ledger.sweep_temporaries)
                for kind in (BLOCK, TAIL):
                    staged = await asyncio.to_thread(self.store.staged_bytes, kind)
                    self.kv_metrics["staged_bytes"].labels(kind).set(staged)
            except Exception as exc:
                self.log.warning("kv_reap_failed", error=str(exc))

    # --- engine callbacks (on the event loop) ---------------------------------------------
    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            fut = self.pending.get(out.request_id)
            if fut is not None and not fut.done():
                if out.error is not None:  # the engine ended it: a terminal error event, not a finish
                    fut.set_exception(EngineError(f"structured output failed: {out.error}"))
                else:
                    fut.set_result(out)

    def _on_step_error(self, request_ids: list[str], exc: Exception) -> None:
        for rid in request_ids:
            fut = self.pending.get(rid)
            if fut is not None and not fut.done():
                fut.set_exception(EngineError(f"prefill failed: {exc}"))

    async def on_abort(self, abort: Abort) -> None:
        """Stop the request's prefill: queued in the engine it is dropped, running it stops
        after the chunk in progress (the engine runs the abort between steps). Counts the
        chunks it had computed, and how many of those came after the cancel arrived."""
        rid = abort.request_id
        fut = self.pending.get(rid)
        if fut is None or fut.done():
            return
        fut.set_exception(Aborted(abort.reason))
        seq = self.engine.sequences.get(rid)  # read across threads: the count when the cancel came
        chunks_before = seq.num_prefill_chunks if seq is not None else 0
        reason = "deadline" if abort.reason == "deadline" else "cancelled"

        def account(done: asyncio.Future) -> None:
            seq = None if done.cancelled() or done.exception() else done.result()
            if seq is not None:
                chunks = self.cancel_metrics["prefill_chunks"]
                chunks.labels("before_cancel").inc(min(chunks_before, seq.num_prefill_chunks))
                chunks.labels("after_cancel").inc(max(0, seq.num_prefill_chunks - chunks_before))
            self.count_cancelled(reason, "running" if seq is not None and seq.num_prefill_chunks else "queued")

        # not awaited: this runs in the abort subscription's callback, and the next Abort (a
        # storm of them) must not wait for the engine's step boundary behind this one
        self.engine_loop.call(lambda e: e.abort(rid)).add_done_callback(account)

    def _stage_early(self, request_id: str, first: int, block_hashes: list[bytes], buffers: list[memoryview]) -> None:
        """Put full blocks a prompt's last prefill chunk finished into the store, in a thread,
        after the prompt's earlier such puts (on the event loop, from the engine thread)."""
        rec, fut = self.early.get(request_id), self.pending.get(request_id)
        if rec is None or fut is None or _failed(fut):
            return  # aborted, or handed off already
        dtype = self.engine.layout.dtype
        blocks = {first + i: buf for i, buf in enumerate(buffers)}
        before = rec.puts

        async def put() -> None:
            if before is not None:
                await before
            if _failed(fut):
                return  # aborted meanwhile: nothing will be handed off (done with a result: the
                # first token is out and the hand-off waits for this put)
            if rec.failed:  # the store failed this prompt once: the hand-off tries once more, not each chunk
                rec.unstaged.update(blocks)
                return
            items = {block_key(block_hashes[i - first], dtype): buf for i, buf in blocks.items()}
            started = time.perf_counter()
            try:
                with span("prefill.kv_put_early", rec.headers, request_id=request_id, blocks=len(items)):
                    written = await asyncio.to_thread(self.stager.put_blocks, items)
            except Exception as exc:  # the hand-off writes them (and raises what it raises)
                rec.failed = True
                rec.unstaged.update(blocks)
                self.log.warning("kv_early_stage_failed", request_id=request_id,
                                 error=getattr(exc, "message", None) or repr(exc))
                return
            rec.staged.update(blocks)
            rec.bytes_written += written
            self.kv_metrics["put_bytes"].inc(written)
            self.kv_metrics["put_seconds"].inc(time.perf_counter() - started)
            if self.settings.kv_prefetch != "off" and rec.block_hashes and not _failed(fut):
                # the leading run up to this chunk's last block: the decode side reads what it lacks
                self.post(self.protocol.kv_prefetch, KVPrefetch(
                    request_id=request_id, layout=self.engine.layout,
                    block_hashes=rec.block_hashes[: first + len(blocks)], headers=rec.headers or {}))

        rec.puts = asyncio.ensure_future(put())

    # --- the work ---------------------------------------------------------------------------
    def held_requests(self) -> list[RequestMeta]:
        return list(self.waiting_first_token.values())

    async def handle(self, item: WorkItem) -> str | None:
        task: PrefillTask = item.message  # type: ignore[assignment]
        meta = with_mark(task.meta, "prefill.fetched")
        rid = meta.request_id
        if rid in self.pending:
            item.done = True  # a redelivery of work this worker is doing now: the first delivery acks
            return "duplicate"
        if not await self.still_wanted(meta, item.num_delivered):
            await item.ack()
            return "dropped"
        postfilter = self.pick_postfilter(rid)
        if postfilter is None:
            raise ServiceUnavailable("no postfilter worker is alive")
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        early = self.early[rid] = EarlyStage(block_hashes=task.block_hashes)
        self.waiting_first_token[rid] = meta
        try:
            with span("prefill", meta.headers, request_id=rid, prompt_tokens=len(task.prompt_token_ids)) as carry:
                meta = msgspec.structs.replace(meta, headers=carry or meta.headers)
                early.headers = meta.headers
                store_hit_tokens = await self.import_store_hits(rid, task.block_hashes, len(task.prompt_token_ids))
                await self.engine.grammar.precompile(task.sampling.grammar)  # off the engine thread
                if fut.done():  # cancelled while its prefix was read: never queued in the engine
                    fut.exception()
                    await item.ack()
                    return "aborted"
                # an abort arriving from here on is queued after this call on the engine thread
                await self.engine_loop.call(lambda e: e.add_request(
                    rid, task.prompt_token_ids, task.sampling, stop_after_prefill=True,
                    cache_salt=meta.cache_salt, block_hashes=task.block_hashes))
                try:
                    out: StepOutput = await fut
                except Aborted:
                    await item.ack()
                    return "aborted"
                meta = with_mark(meta, "prefill.first_token")
                await self._hand_off(item, task, meta, out, postfilter, store_hit_tokens)
        finally:
            self.engine_loop.release_handoff(rid)  # put and published, or never to be
            self.pending.pop(rid, None)
            self.early.pop(rid, None)
            self.waiting_first_token.pop(rid, None)
            if not fut.done():
                fut.cancel()
            self.consumer.notify_room()

    async def _hand_off(self, item: WorkItem, task: PrefillTask, meta: RequestMeta, out: StepOutput,
                        postfilter: str, store_hit_tokens: int) -> None:
        sp, seq = task.sampling, out.seq
        self.kv_metrics["prefix_query_tokens"].labels(self.stage).inc(seq.num_prompt_tokens)
        local_hits = max(0, seq.num_cached_tokens - store_hit_tokens)
        if local_hits:
            self.kv_metrics["prefix_hit_tokens"].labels(self.stage, "local").inc(local_hits)
        spec = StreamSpec.of(meta, sp, seq.num_prompt_tokens, seq.num_cached_tokens)
        self.post(postfilter, TokenChunk(
            request_id=meta.request_id, index=0, token_ids=out.new_token_ids, spec=spec,
            finish_reason=out.finish_reason, logprobs=out.logprobs if sp.logprobs is not None else None,
            worker=self.instance_id, marks=meta.marks if out.finish_reason is not None else [],
            prompt_logprobs=out.prompt_logprobs,
        ))
        if out.finish_reason is not None:
            await item.ack()
            return
        early = self.early.pop(meta.request_id, None)
        started = time.perf_counter()  # put_seconds counts the wait for the early puts too
        if early is not None and early.puts is not None:
            await early.puts  # the puts of earlier chunks (never raises: a failed one left its buffers)
        with span("prefill.kv_put", tokens=seq.num_prompt_tokens, early_blocks=len(early.staged) if early else 0,
                  waited_ms=round((time.perf_counter() - started) * 1e3, 1)):
            try:
                handle, written = await asyncio.to_thread(self.stager.stage, meta.request_id, out.prompt_kv,
                                                          self.engine.layout, meta.deadline_at, early)
            except KVTransferError as exc:
                if self.settings.kv_failure_policy == "fail":
                    raise
                # the store is down: decode recomputes the prompt rather than failing the request
                self.log.warning("kv_stage_failed_decode_recomputes", error=exc.message)
                handle, written = None, 0
        self.kv_metrics["put_bytes"].inc(written)
        self.kv_metrics["put_seconds"].inc(time.perf_counter() - started)
        decode = DecodeTask(
            meta=with_mark(meta, "prefill.published"),
            sampling=sp,
            prompt_token_ids=task.prompt_token_ids,
            output_token_ids=out.new_token_ids,
            postfilter=postfilter,
            kv=handle,
            num_cached_tokens=seq.num_cached_tokens,
        )
        await self.bus.publish_work(self.protocol.decode, decode, work_id(meta), headers=task_headers(meta.deadline_at))
        self.engine_loop.release_handoff(meta.request_id)  # the next prefill step may start
        if handle is not None:
            try:
                await asyncio.to_thread(self.ledger.handed_off, meta.request_id)
            except KVTransferError as exc:  # the lease still bounds the record
                self.log.warning("kv_ledger_update_failed", request_id=meta.request_id, error=exc.message)
        await item.ack()


def _failed(fut: asyncio.Future) -> bool:
    """The prefill's outcome is an abort or an error (not its first token)."""
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


def main_entry() -> None:
    main(PrefillWorker)
