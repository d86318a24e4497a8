"""Decode stage: DecodeTask → a stream of TokenChunks, one per engine step per request.

Life cycle of a request here:

1. pull a DecodeTask (durable ``decode-workers``) while the running batch has room; drop it if
   aborted or past its deadline;
2. load its prompt KV: full blocks this worker already holds in its prefix cache are not
   fetched; the others and the request-scoped tail come from the KV store in one batched
   read; a layout mismatch or a missing block means recompute from there;
3. admit it into the continuous batch; delete the tail from the store (nothing
   request-scoped stays staged once decode holds the KV);
4. every step, send the new token to the request's postfilter instance (core NATS);
5. when the request finishes (EOS, stop token, max_tokens, context end) ack the DecodeTask.
   The task stays unacked — and marked in progress — while the request runs, so if this
   worker dies JetStream redelivers it to another decode worker, which regenerates the
   same tokens (seeded sampling is per token index) and the postfilter drops what it
   already has.

An Abort (client gone, stop string matched, deadline) drops the request from the batch at
the next step and frees its blocks.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engine.engine import StepOutput
from engine.factory import build_engine
from services.common.consumer import PullConsumer, WorkItem
from services.common.engine_loop import EngineLoop
from services.common.runtime import Worker, main
from shared.errors import EngineError
from shared.kv import block_key, open_store
from shared.messages import Abort, DecodeTask, TokenChunk
from shared.metrics import kv_metrics, stage_metrics


@dataclass(slots=True, eq=False)
class ActiveRequest:
    task: DecodeTask
    done: asyncio.Future
    started_at: float = field(default_factory=time.monotonic)


class DecodeWorker(Worker):
    stage = "decode"

    async def setup(self) -> None:
        self.engine = await asyncio.to_thread(build_engine, self.settings)
        self.store = open_store(self.settings)
        self.active: dict[str, ActiveRequest] = {}
        self.metrics = stage_metrics(self.stage)
        self.engine_loop = EngineLoop(self.engine, asyncio.get_running_loop(), self._on_outputs, self._on_step_error,
                                      self.metrics).start()
        self.kv_metrics = kv_metrics()

    async def serve(self) -> None:
        self.consumer = PullConsumer(self, self.protocol.decode, DecodeTask, self.handle, capacity=self._capacity)
        self.spawn(self.consumer.run(), "consume")
        self.spawn(self.consumer.keepalive(), "keepalive")

    def _capacity(self) -> int:
        slots = self.engine.config.max_num_seqs - len(self.active)
        # leave a little of the pool for running sequences to grow into
        if self.engine.block_manager.num_free_blocks < max(4, self.engine.num_kv_blocks // 20):
            return 0
        return max(0, slots)

    def heartbeat_fields(self) -> dict:
        active = getattr(self, "active", {})
        return {"num_running": len(active), "capacity": self.settings.max_num_seqs}

    async def before_drain(self) -> None:
        await self.consumer.drain(self.drain_timeout_s / 2)
        self.engine_loop.stop()

    # --- engine callbacks (on the event loop) ---------------------------------------------
    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            req = self.active.get(out.request_id)
            if req is None:
                continue
            self.post(req.task.postfilter, TokenChunk(
                request_id=out.request_id,
                index=out.index,
                token_ids=out.new_token_ids,
                finish_reason=out.finish_reason,
                logprobs=out.logprobs if req.task.sampling.logprobs is not None else None,
                worker=self.instance_id,
            ))
            if out.finished and not req.done.done():
                req.done.set_result(out.finish_reason)

    def _on_step_error(self, request_ids: list[str], exc: Exception) -> None:
        for rid in request_ids:
            req = self.active.get(rid)
            if req is not None and not req.done.done():
                req.done.set_exception(EngineError(f"decode failed: {exc}"))

    async def on_abort(self, abort: Abort) -> None:
        req = self.active.get(abort.request_id)
        if req is not None:
            await self.engine_loop.call(lambda e: e.abort(abort.request_id))
            if not req.done.done():
                req.done.set_result("abort")

    # --- the work ---------------------------------------------------------------------------
    def _load_kv(self, task: DecodeTask, num_local: int) -> tuple[list, bytes | None]:
        """Read the blocks this worker lacks and the tail from the store (in a thread)."""
        handle = task.kv
        keys = [block_key(h, handle.layout.dtype) for h in handle.block_hashes[num_local:]]
        if handle.tail_key:
            keys.append(handle.tail_key)
        values = self.store.get(keys) if keys else []
        tail = values.pop() if handle.tail_key else None
        return [None] * num_local + values, tail

    async def handle(self, item: WorkItem) -> None:
        task: DecodeTask = item.message  # type: ignore[assignment]
        meta = task.meta
        rid = meta.request_id
        if rid in self.active:
            item.done = True  # redelivery of a request running here: the first delivery acks
            return
        if rid in self.aborted or time.time() > meta.deadline_at:
            if task.kv and task.kv.tail_key:
                await asyncio.to_thread(self.store.delete, [task.kv.tail_key])
            await item.ack()
            return
        req = ActiveRequest(task, asyncio.get_running_loop().create_future())
        self.active[rid] = req
        try:
            blocks: list = []
            tail = None
            handle = task.kv
            if handle is not None and handle.layout == self.engine.layout:
                num_local = self.engine.cached_block_hashes(handle.block_hashes)
                started = time.perf_counter()
                blocks, tail = await asyncio.to_thread(self._load_kv, task, num_local)
                nbytes = sum(len(b) for b in blocks if b is not None) + (len(tail) if tail else 0)
                self.kv_metrics["get_bytes"].inc(nbytes)
                self.kv_metrics["get_seconds"].inc(time.perf_counter() - started)
                if num_local:
                    self.kv_metrics["prefix_hit_tokens"].labels(self.stage, "local").inc(num_local * handle.layout.block_size)
            await self.engine_loop.call(lambda e: e.admit_with_kv(
                rid, task.prompt_token_ids, task.output_token_ids, task.sampling,
                handle.block_hashes if handle else [], blocks, tail, cache_salt=meta.cache_salt))
            if handle is not None and handle.tail_key:
                await asyncio.to_thread(self.store.delete, [handle.tail_key])
            if req.done.done():  # aborted while its KV was loading
                await self.engine_loop.call(lambda e: e.abort(rid))
            await req.done
            await item.ack()
        finally:
            self.active.pop(rid, None)
            self.consumer.notify_room()


def main_entry() -> None:
    main(DecodeWorker)
