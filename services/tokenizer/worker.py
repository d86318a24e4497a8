"""Tokenizer stage: TokenizeTask → PrefillTask.

Life cycle of a request here:

1. pull a TokenizeTask (durable ``tokenizer-workers``); drop it if aborted or past deadline;
2. render the chat template (chat requests) and tokenize;
3. validate: a non-empty prompt, token ids inside the vocabulary, prompt + max_tokens inside
   the context (``context_length_exceeded`` names both numbers); fill the default max_tokens;
4. hash the prompt's full blocks (chained SHA-256, ``shared/hashing.py``);
5. route it (``PD_ROUTING``): a PrefillTask for a prefill worker (Nats-Msg-Id
   ``prefill:<request_id>``), or — aggregated serving, or the conditional router's choice — a
   DecodeTask for a decode worker that prefills it locally; wait for JetStream's ack;
6. tell the gateway ``Accepted`` (prompt token count) and ack the TokenizeTask.

A bad prompt ends here with an ErrorEvent to the gateway (a 4xx before any streaming).
"""

from __future__ import annotations

import asyncio

import msgspec

from services.common.consumer import PullConsumer, WorkItem
from services.common.model import servable_model_folder
from services.common.runtime import Worker, main
from services.tokenizer.prompts import PromptProcessor, model_limits
from services.tokenizer.router import Router
from shared.deadline import is_expired, task_headers
from shared.hashing import block_hashes, hash_extra, num_reusable_blocks
from shared.kv import block_key, open_store
from shared.messages import Abort, Accepted, DecodeTask, Heartbeat, PrefillTask, TokenizeTask
from shared.metrics import router_metrics
from shared.model_files import load_tokenizer
from shared.recovery import work_id
from shared.registry import WorkerRegistry
from shared.timeline import with_mark
from shared.tracing import span


class TokenizerWorker(Worker):
    stage = "tokenizer"

    async def setup(self) -> None:
        folder = await asyncio.to_thread(servable_model_folder, self.settings)
        tokenizer = await asyncio.to_thread(load_tokenizer, folder)
        vocab, max_len = model_limits(folder, self.settings.max_model_len)
        self.processor = PromptProcessor(tokenizer, vocab, max_len)
        self.registry = WorkerRegistry(self.settings.heartbeat_timeout_s)
        self.router = Router(self.settings.router_local_max_tokens, kv_bytes_per_token=0)
        self.store = open_store(self.settings) if self.settings.routing == "conditional" else None
        self.route_metrics = router_metrics()

    async def serve(self) -> None:
        async def on_heartbeat(hb) -> None:
            if isinstance(hb, Heartbeat):
                self.registry.observe(hb)

        await self.bus.subscribe(self.protocol.heartbeat, on_heartbeat)
        self.consumer = PullConsumer(
            self, self.protocol.tokenize, TokenizeTask, self.handle,
            capacity=lambda: self.settings.tokenizer_concurrency - len(self.consumer.in_flight),
        )
        self.spawn(self.consumer.run(), "consume")
        self.spawn(self.consumer.keepalive(), "keepalive")

    def heartbeat_fields(self) -> dict:
        consumer = self.consumer
        return {"num_running": len(consumer.in_flight) if consumer else 0, "capacity": self.settings.tokenizer_concurrency}

    async def handle(self, item: WorkItem) -> str | None:
        task: TokenizeTask = item.message  # type: ignore[assignment]
        meta = with_mark(task.meta, "tokenizer.fetched")
        if not await self.still_wanted(meta, item.num_delivered):
            await item.ack()
            return "dropped"
        with span("tokenizer", meta.headers, request_id=meta.request_id) as carry:
            # the thread pool runs a few prompts at a time: one queued behind others whose client
            # left meanwhile is not tokenized at all
            ids = await asyncio.to_thread(self._tokenize_if_wanted, task)
            if ids is None or self.cancel_reason(meta) is not None:
                self.count_cancelled(self.cancel_reason(meta) or "cancelled", "queued" if ids is None else "running")
                await item.ack()
                return "dropped" if ids is None else "aborted"
            max_tokens = self.processor.max_tokens_for(len(ids), task.sampling.max_tokens, task.max_tokens_is_default,
                                                       param="prompt" if task.messages is None else "messages")
            sampling = task.sampling
            if max_tokens != sampling.max_tokens:
                sampling = msgspec.structs.replace(sampling, max_tokens=max_tokens)
            extra = hash_extra(self.model_name, self.settings.block_size, meta.cache_salt)
            hashes = block_hashes(ids, self.settings.block_size, extra)
            target, reason = await self.route(meta.request_id, ids, hashes)
            meta = with_mark(msgspec.structs.replace(meta, headers=carry or meta.headers), "tokenizer.published")
            if target == "remote":
                task_out = PrefillTask(meta=meta, sampling=sampling, prompt_token_ids=ids, block_hashes=hashes)
                await self.bus.publish_work(self.protocol.prefill, task_out, work_id(meta),
                                            headers=task_headers(meta.deadline_at))
            else:
                task_out = DecodeTask(meta=meta, sampling=sampling, prompt_token_ids=ids, output_token_ids=[],
                                      block_hashes=hashes, route=reason)
                await self.bus.publish_work(self.protocol.decode, task_out, work_id(meta),
                                            headers=task_headers(meta.deadline_at))
        await self.publish(meta.reply_to, Accepted(request_id=meta.request_id, num_prompt_tokens=len(ids),
                                                   max_tokens=max_tokens))
        await item.ack()

    def _tokenize_if_wanted(self, task: TokenizeTask) -> list[int] | None:
        """The prompt's token ids, or None without tokenizing when its request was cancelled or
        expired while it waited for a thread (runs in a worker thread: reads the cancel set
        without expiring it)."""
        meta = task.meta
        if self.aborted.has(meta.request_id) or is_expired(meta.deadline_at):
            return None
        return self.processor.tokenize(task)

    async def route(self, request_id: str, ids: list[int], hashes: list[bytes]) -> tuple[str, str]:
        """("remote" | "local", reason): where the prompt is prefilled (``PD_ROUTING``)."""
        mode = self.settings.routing
        if mode != "conditional":
            target = "remote" if mode == "disaggregated" else "local"
            self.route_metrics.labels(target, "mode").inc()
            return target, mode
        prefill = self.registry.live("prefill")
        decode = self.registry.live("decode")
        cached = await self._staged_prefix_tokens(hashes, len(ids), prefill + decode)
        self.router.kv_bytes_per_token = next((h.kv_bytes_per_token for h in prefill + decode if h.kv_bytes_per_token), 0)
        decision = self.router.decide(len(ids), cached, prefill, decode)
        basis = ("limit" if "local limit" in decision.reason else "cost" if "cheaper" in decision.reason
                 else "backlog" if "backed up" in decision.reason else "liveness")
        self.route_metrics.labels(decision.target, basis).inc()
        self.log.info("route", request_id=request_id, target=decision.target, reason=decision.reason)
        return decision.target, f"{decision.target}: {decision.reason}"

    async def _staged_prefix_tokens(self, hashes: list[bytes], num_tokens: int, workers) -> int:
        """Leading prompt tokens whose blocks are already in the KV store (either path reuses them)."""
        dtype = next((h.kv_dtype for h in workers if h.kv_dtype), "")
        usable = hashes[: num_reusable_blocks(num_tokens, self.settings.block_size)]
        if not usable or not dtype or self.store is None:
            return 0
        try:
            present = await asyncio.to_thread(self.store.exists, [block_key(h, dtype) for h in usable])
        except Exception:
            return 0
        run = next((i for i, p in enumerate(present) if not p), len(present))
        return run * self.settings.block_size

    async def on_abort(self, abort: Abort) -> None:
        pass  # tasks check the cancel set before and after tokenizing; one prompt is too short to cut


def main_entry() -> None:
    main(TokenizerWorker)
