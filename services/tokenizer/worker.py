"""Tokenizer stage: TokenizeTask → PrefillTask.

Life cycle of a request here:

1. pull a TokenizeTask (durable ``tokenizer-workers``); drop it if aborted or past deadline;
2. render the chat template (chat requests) and tokenize;
3. validate: a non-empty prompt, token ids inside the vocabulary, prompt + max_tokens inside
   the context (``context_length_exceeded`` names both numbers); fill the default max_tokens;
4. hash the prompt's full blocks (chained SHA-256, ``shared/hashing.py``);
5. publish the PrefillTask (Nats-Msg-Id ``prefill:<request_id>``) and wait for JetStream's ack;
6. tell the gateway ``Accepted`` (prompt token count) and ack the TokenizeTask.

A bad prompt ends here with an ErrorEvent to the gateway (a 4xx before any streaming).
"""

from __future__ import annotations

import asyncio

import msgspec

from services.common.consumer import PullConsumer, WorkItem
from services.common.runtime import Worker, main
from services.tokenizer.prompts import PromptProcessor, model_limits
from shared import bus
from shared.hashing import block_hashes, hash_extra
from shared.messages import Abort, Accepted, PrefillTask, TokenizeTask


class TokenizerWorker(Worker):
    stage = "tokenizer"

    async def setup(self) -> None:
        from engine.model_loader import ensure_model, load_tokenizer

        folder = await asyncio.to_thread(ensure_model, self.settings)
        tokenizer = await asyncio.to_thread(load_tokenizer, folder)
        vocab, max_len = model_limits(folder, self.settings.max_model_len)
        self.processor = PromptProcessor(tokenizer, vocab, max_len)

    async def serve(self) -> None:
        self.consumer = PullConsumer(
            self, self.protocol.tokenize, TokenizeTask, self.handle,
            capacity=lambda: self.settings.tokenizer_concurrency - len(self.consumer.in_flight),
        )
        self.spawn(self.consumer.run(), "consume")
        self.spawn(self.consumer.keepalive(), "keepalive")

    def heartbeat_fields(self) -> dict:
        consumer = getattr(self, "consumer", None)
        return {"num_running": len(consumer.in_flight) if consumer else 0, "capacity": self.settings.tokenizer_concurrency}

    async def before_drain(self) -> None:
        await self.consumer.drain(self.drain_timeout_s / 2)

    async def handle(self, item: WorkItem) -> str | None:
        task: TokenizeTask = item.message  # type: ignore[assignment]
        meta = task.meta
        if not await self.still_wanted(meta, item.num_delivered):
            await item.ack()
            return "dropped"
        ids = await asyncio.to_thread(self.processor.tokenize, task)
        max_tokens = self.processor.max_tokens_for(len(ids), task.sampling.max_tokens, task.max_tokens_is_default,
                                                   param="prompt" if task.messages is None else "messages")
        sampling = task.sampling
        if max_tokens != sampling.max_tokens:
            sampling = msgspec.structs.replace(sampling, max_tokens=max_tokens)
        extra = hash_extra(self.model_name, self.settings.block_size, meta.cache_salt)
        prefill = PrefillTask(
            meta=meta,
            sampling=sampling,
            prompt_token_ids=ids,
            block_hashes=block_hashes(ids, self.settings.block_size, extra),
        )
        await bus.publish_task(self.js, self.protocol.prefill, prefill, meta.request_id)
        await self.publish(meta.reply_to, Accepted(request_id=meta.request_id, num_prompt_tokens=len(ids),
                                                   max_tokens=max_tokens))
        await item.ack()

    async def on_abort(self, abort: Abort) -> None:
        pass  # tasks check the aborted set when they start; tokenizing is too short to cut


def main_entry() -> None:
    main(TokenizerWorker)
