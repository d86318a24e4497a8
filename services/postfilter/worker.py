"""Postfilter stage: TokenChunk stream → TextChunk stream (detokenized, stop strings cut).

Per-request state (detokenizer offsets, text held back for stop strings, counts) lives in
exactly one postfilter instance: prefill picks the owner of each request by rendezvous
hashing over live postfilter heartbeats and names the owner's inbox subject
(``<ns>.postfilter.<instance>.tokens``) in the DecodeTask, so every token of a request —
from prefill's first token to decode's last — reaches the same replica, in order (one
publisher per phase, one subscriber). Several replicas therefore each hold whole requests;
nothing is shared between them. Chunks carry their output index: a chunk re-sent after a
failover is de-duplicated, chunks that arrive early (the first token comes from prefill, the
rest from decode: two publishers) wait for the ones before them, and a gap that does not
close fails the request cleanly — all of that is :class:`shared.streams.StreamReceiver`'s
job (``TOKEN_POLICY``); the text sent on is kept by a :class:`shared.streams.StreamSender`
to answer a gateway's resend.

Life cycle of a request here:

1. index 0 (with its StreamSpec: reply subject, stop strings, prompt counts) opens the state;
2. each token is detokenized incrementally; new text goes through the stop matcher;
3. text that is safe to show goes to the gateway as a TextChunk with its character offset;
4. a matched stop string ends the request ("stop") and broadcasts an Abort so decode stops;
   an upstream finish ("stop"/"length") flushes held text and ends it; the final TextChunk
   carries usage.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from services.common.model import servable_model_folder
from services.common.runtime import RecentSet, Worker, main
from services.plugins.api import TextFilter, load_class, refs
from services.postfilter.text import Detokenizer, StopMatcher, TokenText
from shared.bus import Bus
from shared.config import Settings
from shared.errors import PoisonMessage
from shared.messages import (
    Abort,
    ErrorEvent,
    OutputLogprob,
    ResumeQuery,
    ResumeState,
    StreamSpec,
    TextChunk,
    TextResend,
    TokenChunk,
    TokenLogprob,
    TokenResend,
    TopLogprob,
    Usage,
    decode_as,
)
from shared.metrics import stage_metrics
from shared.model_files import load_tokenizer
from shared.streams import TOKEN_POLICY, Ready, SentStreams, StreamGap, StreamReceiver, StreamSender
from shared.timeline import now_mark
from shared.tracing import start_span

#: Finished requests kept (their text) for a gateway that missed some of it.
MAX_DONE_STATES = 4096
DONE_STATE_TTL_S = 120.0


@dataclass(slots=True, eq=False)
class RequestState:
    """One request's detokenizer state; ``spec`` is None until its first chunk (index 0)
    arrives — chunks that overtook it wait in ``tokens``."""

    tokens: StreamReceiver
    spec: StreamSpec | None = None
    text: StreamSender | None = None
    detok: Detokenizer | None = None
    stop: StopMatcher | None = None
    num_tokens: int = 0
    usage: Usage | None = None
    span: object = None
    filters: list = field(default_factory=list)
    #: logprob entries of tokens whose text is not out yet (an incomplete UTF-8 sequence): they
    #: go with the next text, so every token keeps its entry
    held_logprobs: list = field(default_factory=list)
    #: prompt logprobs (echo + logprobs) until the request's first TextChunk carries them
    prompt_logprobs: list | None = None


class PostfilterWorker(Worker):
    stage = "postfilter"

    def __init__(self, settings: Settings, bus: Bus | None = None):
        super().__init__(settings, bus)
        self.states: dict[str, RequestState] = {}  # open requests' detokenizer and stop-string state
        self.inbox = self.protocol.postfilter_inbox(self.instance_id)

    async def setup(self) -> None:
        folder = await asyncio.to_thread(servable_model_folder, self.settings)
        tokenizer = await asyncio.to_thread(load_tokenizer, folder)
        self.tokenizer = tokenizer.backend_tokenizer
        self.token_text = TokenText(self.tokenizer)
        self.text_filters = []
        for ref in refs(self.settings.text_filters):
            cls = load_class(ref)
            if not issubclass(cls, TextFilter):
                raise SystemExit(f"{ref} is not a TextFilter")
            self.text_filters.append(cls(self.settings))
        self.texts = SentStreams(MAX_DONE_STATES, DONE_STATE_TTL_S)
        self.finished = RecentSet(ttl_s=600.0)
        self.metrics = stage_metrics(self.stage)

    async def serve(self) -> None:
        await self.bus.subscribe(self.inbox, self._on_message)
        await self.bus.serve(self.protocol.postfilter_resume(self.inbox), self._on_resume)
        await self.bus.subscribe(self.protocol.postfilter_control(self.inbox), self._on_control_message)
        await self.bus.subscribe(self.protocol.resend, self._on_control_message)  # broadcast: from offset 0
        self.spawn(self._expire_loop(), "expire")

    async def _on_control_message(self, message) -> None:
        """A gateway missed text (a broker restart lost it): send it again from its offset (a
        broadcast one, for a request this worker never saw, is ignored)."""
        if not isinstance(message, TextResend):
            return
        sender = self.texts.get(message.request_id)
        piece = sender.resend(message.from_offset) if sender is not None else None
        if piece is not None:
            st: RequestState = sender.context
            self.post(sender.target, TextChunk(
                request_id=message.request_id, text=piece.items, text_offset=piece.index, num_tokens=st.num_tokens,
                finish_reason=piece.finish_reason, usage=st.usage, source=self.inbox,
            ))

    async def _on_resume(self, data: bytes) -> ResumeState | None:
        """A decode worker took over one of our requests: tell it which tokens we have."""
        try:
            query = decode_as(data, ResumeQuery)
        except PoisonMessage:
            return None
        rid = query.request_id
        st = self.states.get(rid)
        if st is not None and st.spec is not None:
            self._hand_over(rid, st, query.worker)
            state = ResumeState(request_id=rid, output_token_ids=list(st.detok.token_ids), known=True)
        else:
            state = ResumeState(request_id=rid, known=rid in self.finished, finished=rid in self.finished)
        return state

    def heartbeat_fields(self) -> dict:
        return {"inbox": self.inbox, "num_running": len(self.states)}

    async def on_abort(self, abort: Abort) -> None:
        if self.states.pop(abort.request_id, None) is not None:
            self.finished.add(abort.request_id)

    async def _expire_loop(self) -> None:
        """Once a second: forget requests past their deadline (their gateway has given up),
        and repair stalled token streams (ask their decode worker to resend, or fail them)."""
        while True:
            await asyncio.sleep(1.0)
            now, mono = time.time(), time.monotonic()
            for rid, st in list(self.states.items()):
                if st.spec is None:
                    if st.tokens.is_stale(mono):  # its first chunk never came
                        self.states.pop(rid, None)
                    continue
                if st.spec.deadline_at and now > st.spec.deadline_at + 5:
                    self.states.pop(rid, None)
                    self.finished.add(rid)
                    continue
                try:
                    resend = st.tokens.poll(mono)
                except StreamGap as exc:
                    self._fail(rid, st, f"token stream gap: {exc}")
                    continue
                if resend is not None:  # to its decode worker; to all when none has spoken yet
                    self.post(self.protocol.decode_control(resend.source) if resend.source else self.protocol.resend,
                              TokenResend(request_id=rid, from_index=resend.from_index))
            self.texts.expire(mono)

    async def _on_message(self, message) -> None:
        if isinstance(message, TokenChunk):
            started = time.perf_counter()
            self._on_chunk(message)
            self.metrics.process_seconds.observe(time.perf_counter() - started)

    def _on_chunk(self, chunk: TokenChunk) -> None:
        """One incoming chunk: the stream receiver orders it; each ready piece is consumed."""
        rid = chunk.request_id
        if rid in self.finished:
            return
        st = self.states.get(rid)
        if st is None:
            if chunk.index == 0 and chunk.spec is None:
                return  # a resend of a stream this worker never opened
            st = self.states[rid] = RequestState(StreamReceiver(TOKEN_POLICY, time.monotonic(), unit="token"))
        if chunk.replay and chunk.worker:
            self._hand_over(rid, st, chunk.worker)
        elif chunk.index > 0 and not st.tokens.is_from_owner(chunk.worker):
            return  # a worker that lost the request to another; it was told to stop
        try:
            ready = st.tokens.offer(chunk, chunk.index, len(chunk.token_ids), chunk.finish_reason is not None,
                                    time.monotonic())
        except StreamGap as exc:
            if st.spec is None:
                self.log.warning("chunks_without_start", request_id=rid, error=str(exc))
                self.states.pop(rid, None)
            else:
                self._fail(rid, st, f"token stream gap: {exc}")
            return
        for piece in ready:
            if self.states.get(rid) is not st:
                break  # finished (a stop string) or failed
            if st.spec is None:
                self._open(rid, st, piece.payload.spec)
            self._consume(rid, st, piece)

    def _open(self, rid: str, st: RequestState, spec: StreamSpec) -> None:
        """The request's first chunk (index 0, with its StreamSpec) arrived."""
        st.spec = spec
        st.detok = Detokenizer(self.tokenizer, spec.skip_special_tokens)
        st.stop = StopMatcher(spec.stop, spec.include_stop_str_in_output)
        st.span = start_span("postfilter", spec.headers, request_id=rid)
        st.filters = [(f, f.open(rid)) for f in self.text_filters]
        st.text = self.texts.open(rid, spec.reply_to, empty="", context=st)

    def _detokenize(self, st: RequestState, new_tokens: list[int], finish_reason: str | None) -> tuple[str, int, str | None]:
        """(text safe to show, tokens consumed, finish reason) for the new tokens of a chunk;
        a stop string consumes tokens up to the one completing it."""
        pieces = []
        consumed = 0
        stopped = False
        # a stop token id ends the text without appearing in it (as vLLM does), unless asked
        hide_last = (finish_reason == "stop" and new_tokens and not st.spec.include_stop_str_in_output
                     and new_tokens[-1] in st.spec.stop_token_ids)
        for i, token_id in enumerate(new_tokens):
            consumed += 1
            if hide_last and i == len(new_tokens) - 1:
                break
            text, stopped = st.stop.feed(st.detok.step(token_id))
            pieces.append(text)
            if stopped:
                break
        finish = "stop" if stopped else finish_reason
        if finish is not None and not stopped:
            text, stopped = st.stop.feed(st.detok.finish())
            pieces.append(text)
            if stopped:
                finish = "stop"
            else:
                pieces.append(st.stop.flush())
        return self._filter(st, "".join(pieces), final=finish is not None), consumed, finish

    def _consume(self, rid: str, st: RequestState, ready: Ready) -> None:
        chunk: TokenChunk = ready.payload
        text, consumed, finish = self._detokenize(st, chunk.token_ids[ready.skip:], chunk.finish_reason)
        st.num_tokens += consumed
        entries = ([self._logprob_entry(lp) for lp in chunk.logprobs[ready.skip : ready.skip + consumed]]
                   if chunk.logprobs else [])
        if chunk.prompt_logprobs is not None and chunk.index == 0 and ready.skip == 0:
            st.prompt_logprobs = [self._logprob_entry(lp) for lp in chunk.prompt_logprobs]
        if not text and finish is None:
            st.held_logprobs.extend(entries)
            return
        if finish is not None:
            st.usage = Usage(prompt_tokens=st.spec.num_prompt_tokens, completion_tokens=st.num_tokens,
                             cached_tokens=st.spec.num_cached_tokens)
            st.span.end()
        logprobs = None
        if chunk.logprobs:
            logprobs, st.held_logprobs = [*st.held_logprobs, *entries], []
        marks = [*chunk.marks, now_mark("postfilter.final")] if finish is not None and chunk.marks else []
        piece = st.text.push(text, finish)
        self.post(st.spec.reply_to, TextChunk(
            request_id=rid, text=text, text_offset=piece.index, num_tokens=st.num_tokens,
            finish_reason=finish, usage=st.usage if finish else None, logprobs=logprobs, source=self.inbox,
            marks=marks, prompt_logprobs=st.prompt_logprobs, spec_stats=chunk.spec_stats if finish else None,
        ))
        st.prompt_logprobs = None
        if finish is not None:
            self.states.pop(rid, None)
            self.finished.add(rid)
            self.texts.finish(rid, time.monotonic())  # kept a while, to resend lost text
            if finish == "stop" and chunk.finish_reason is None:
                self.post(self.protocol.abort, Abort(request_id=rid, reason="stop"))

    @staticmethod
    def _filter(st: RequestState, text: str, final: bool) -> str:
        """The pluggable text filters (``PD_TEXT_FILTERS``), in order."""
        for text_filter, state in st.filters:
            text = text_filter.feed(state, text)
            if final:
                text += text_filter.finish(state)
        return text

    def _hand_over(self, rid: str, st: RequestState, worker: str) -> None:
        """``worker`` now owns the request's stream; the previous owner is told to stop."""
        previous = st.tokens.claim(worker)
        if previous:
            self.post(self.protocol.abort, Abort(request_id=rid, reason="superseded", worker=previous))

    def _logprob_entry(self, lp: TokenLogprob) -> OutputLogprob:
        text, raw = self.token_text(lp.token_id)
        top = []
        for token_id, value in lp.top:
            t, b = self.token_text(token_id)
            top.append(TopLogprob(token=t, logprob=value, bytes=b))
        return OutputLogprob(token=text, logprob=lp.logprob, bytes=raw, top=top)

    def _fail(self, rid: str, st: RequestState, message: str) -> None:
        """End the request with a stream_gap error event (its stream cannot be repaired)."""
        self.log.error("stream_failed", request_id=rid, error=message)
        self.post(st.spec.reply_to, ErrorEvent(request_id=rid, status=500, message=message, code="stream_gap"))
        self.post(self.protocol.abort, Abort(request_id=rid, reason="error"))
        self.states.pop(rid, None)
        self.finished.add(rid)


def main_entry() -> None:
    main(PostfilterWorker)
