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
import json
import time

import msgspec

from services.common.consumer import PullConsumer, WorkItem
from services.common.runtime import Worker, main
from shared import bus
from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.hashing import block_hashes, hash_extra
from shared.messages import Accepted, Abort, PrefillTask, TokenizeTask


class PromptProcessor:
    """Chat template, tokenization and context checks (no I/O; shared with /tokenize).

    Args:
        tokenizer: a transformers tokenizer.
        vocab_size: the model's vocabulary size.
        max_model_len: context length in tokens.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (a list of ChatMessage or dicts).

        Raises:
            InvalidRequest: the template rejects the conversation.
        """
        conversation = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as exc:  # jinja raises TemplateError and friends
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from None

    def tokenize(self, task: TokenizeTask) -> list[int]:
        """Prompt token ids of a task.

        Raises:
            InvalidRequest: empty prompt, or token ids outside the vocabulary.
        """
        if task.prompt_token_ids is not None:
            ids = list(task.prompt_token_ids)
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        elif task.messages is not None:
            text = self.render_chat(task.messages, task.add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(task.prompt or "")
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt" if task.messages is None else "messages")
        return ids

    def max_tokens_for(self, num_prompt_tokens: int, requested: int, is_default: bool) -> int:
        """The output budget; with no ``max_tokens`` given, the rest of the context.

        Raises:
            ContextLengthExceeded: the prompt leaves no room, or prompt + max_tokens is over
                the context.
        """
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"has {num_prompt_tokens} tokens, which leaves no room for a completion.",
                param="messages",
            )
        if is_default:
            return min(requested, room)
        if num_prompt_tokens + requested > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the messages, {requested} in "
                "the completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        return requested


def model_limits(folder, max_model_len_setting: int) -> tuple[int, int]:
    """(vocab_size, max_model_len) from a model folder's config.json, without torch."""
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    vocab = int(text["vocab_size"])
    max_len = max_model_len_setting or int(text.get("max_position_embeddings", 2048))
    return vocab, max_len


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

    async def handle(self, item: WorkItem) -> None:
        task: TokenizeTask = item.message  # type: ignore[assignment]
        meta = task.meta
        if meta.request_id in self.aborted or time.time() > meta.deadline_at:
            await item.ack()
            return
        ids = await asyncio.to_thread(self.processor.tokenize, task)
        max_tokens = self.processor.max_tokens_for(len(ids), task.sampling.max_tokens, task.max_tokens_is_default)
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
