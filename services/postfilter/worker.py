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
close within ``GAP_TIMEOUT_S`` fails the request cleanly.

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

from services.common.runtime import RecentSet, Worker, main
from services.postfilter.text import Detokenizer, StopMatcher, TokenText
from services.stages.api import TextFilter, load_class, refs
from shared import bus
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
    encode,
)
from shared.metrics import stage_metrics
from shared.timeline import now_mark
from shared.tracing import start_span

#: Chunks held while waiting for an earlier one, per request, before the request fails.
MAX_OUT_OF_ORDER = 256
#: Seconds a missing chunk may be late before the request fails.
GAP_TIMEOUT_S = 5.0
#: Seconds chunks that arrived before their request's first chunk are kept.
EARLY_TIMEOUT_S = 30.0
#: Finished requests kept (their text) for a gateway that missed some of it.
MAX_DONE_STATES = 4096
DONE_STATE_TTL_S = 120.0
#: Seconds without a chunk before the owner of a running stream is asked for a resend.
QUIET_RESEND_S = 3.0


@dataclass(slots=True, eq=False)
class RequestState:
    spec: StreamSpec
    detok: Detokenizer
    stop: StopMatcher
    next_index: int = 0
    text_offset: int = 0
    opened_at: float = 0.0
    pending: dict[int, TokenChunk] = field(default_factory=dict)
    gap_since: float = 0.0
    owner: str = ""
    last_chunk_at: float = field(default_factory=time.monotonic)
    emitted: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    span: object = None
    filters: list = field(default_factory=list)
    #: logprob entries of tokens whose text is not out yet (an incomplete UTF-8 sequence): they
    #: go with the next text, so every token keeps its entry
    held_logprobs: list = field(default_factory=list)


class PostfilterWorker(Worker):
    stage = "postfilter"

    async def setup(self) -> None:
        from engine.model_loader import ensure_model, load_tokenizer

        folder = await asyncio.to_thread(ensure_model, self.settings)
        tokenizer = await asyncio.to_thread(load_tokenizer, folder)
        self.tokenizer = tokenizer.backend_tokenizer
        self.token_text = TokenText(self.tokenizer)
        self.text_filters = []
        for ref in refs(self.settings.text_filters):
            cls = load_class(ref)
            if not issubclass(cls, TextFilter):
                raise SystemExit(f"{ref} is not a TextFilter")
            self.text_filters.append(cls(self.settings))
        self.states: dict[str, RequestState] = {}
        self.done_states: dict[str, tuple[RequestState, float]] = {}
        self.early: dict[str, dict[int, TokenChunk]] = {}
        self.early_at: dict[str, float] = {}
        self.finished = RecentSet(ttl_s=600.0)
        self.inbox = self.protocol.postfilter_inbox(self.instance_id)
        self.metrics = stage_metrics(self.stage)

    async def serve(self) -> None:
        await bus.subscribe_messages(self.nc, self.inbox, self._on_message)
        await self.nc.subscribe(self.protocol.postfilter_resume(self.inbox), cb=self._on_resume)
        await bus.subscribe_messages(self.nc, self.protocol.postfilter_control(self.inbox), self._on_control_message)
        self.spawn(self._expire_loop(), "expire")

    async def _on_control_message(self, message) -> None:
        """A gateway missed text (a broker restart lost it): send it again from its offset."""
        if not isinstance(message, TextResend):
            return
        rid = message.request_id
        st = self.states.get(rid) or self.done_states.get(rid, (None, 0.0))[0]
        if st is None:
            return
        text = "".join(st.emitted)[message.from_offset:]
        self.post(st.spec.reply_to, TextChunk(
            request_id=rid, text=text, text_offset=message.from_offset, num_tokens=st.next_index,
            finish_reason=st.finish_reason, usage=st.usage, source=self.inbox,
        ))

    async def _on_resume(self, msg) -> None:
        """A decode worker took over one of our requests: tell it which tokens we have."""
        try:
            query = decode_as(msg.data, ResumeQuery)
        except PoisonMessage:
            return
        rid = query.request_id
        st = self.states.get(rid)
        if st is not None:
            self._hand_over(rid, st, query.worker)
            state = ResumeState(request_id=rid, output_token_ids=list(st.detok.token_ids), known=True)
        else:
            state = ResumeState(request_id=rid, known=rid in self.finished, finished=rid in self.finished)
        if msg.reply:
            await self.nc.publish(msg.reply, encode(state))

    def heartbeat_fields(self) -> dict:
        return {"inbox": getattr(self, "inbox", ""), "num_running": len(getattr(self, "states", {}))}

    async def on_abort(self, abort: Abort) -> None:
        if self.states.pop(abort.request_id, None) is not None:
            self.finished.add(abort.request_id)

    async def _expire_loop(self) -> None:
        """Forget requests whose deadline has passed (their gateway has given up on them)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for rid in [r for r, st in self.states.items() if st.spec.deadline_at and now > st.spec.deadline_at + 5]:
                self.states.pop(rid, None)
                self.finished.add(rid)
            mono = time.monotonic()
            for rid, st in list(self.states.items()):
                if st.gap_since and mono - st.gap_since > GAP_TIMEOUT_S:
                    self._fail(rid, st, f"token stream gap: token {st.next_index} never arrived")
                elif st.owner and ((st.gap_since and mono - st.gap_since > 1.0)
                                   or mono - st.last_chunk_at > QUIET_RESEND_S):
                    # tokens are missing (a gap), or the stream went quiet (its end may be lost):
                    # ask the decode worker that owns it to send again from what we have
                    st.last_chunk_at = mono
                    self.post(self.protocol.decode_control(st.owner),
                              TokenResend(request_id=rid, from_index=st.next_index))
            for rid in [r for r, (_, at) in self.done_states.items() if mono - at > DONE_STATE_TTL_S]:
                self.done_states.pop(rid, None)
            for rid in [r for r, at in self.early_at.items() if mono - at > EARLY_TIMEOUT_S]:
                self.early.pop(rid, None)
                self.early_at.pop(rid, None)

    async def _on_message(self, message) -> None:
        if isinstance(message, TokenChunk):
            started = time.perf_counter()
            self._on_chunk(message)
            self.metrics.process_seconds.observe(time.perf_counter() - started)

    def _on_chunk(self, chunk: TokenChunk) -> None:
        rid = chunk.request_id
        if rid in self.finished:
            return
        st = self.states.get(rid)
        if st is None:
            if chunk.index != 0 or chunk.spec is None:
                # overtook the request's first chunk (it comes from another publisher): keep it
                early = self.early.setdefault(rid, {})
                early[chunk.index] = chunk
                self.early_at.setdefault(rid, time.monotonic())
                if len(early) > MAX_OUT_OF_ORDER:
                    self.log.warning("chunks_without_start", request_id=rid, count=len(early))
                    self.early.pop(rid, None)
                    self.early_at.pop(rid, None)
                return
            spec = chunk.spec
            st = RequestState(spec, Detokenizer(self.tokenizer, spec.skip_special_tokens),
                              StopMatcher(spec.stop, spec.include_stop_str_in_output), opened_at=time.monotonic(),
                              span=start_span("postfilter", spec.headers, request_id=rid),
                              filters=[(f, f.open(rid)) for f in self.text_filters])
            self.states[rid] = st
            self.early_at.pop(rid, None)
            st.pending.update(self.early.pop(rid, {}))
        st.last_chunk_at = time.monotonic()
        if chunk.replay and chunk.worker:
            self._hand_over(rid, st, chunk.worker)
        elif chunk.index > 0 and chunk.worker:
            if not st.owner:
                st.owner = chunk.worker
            elif chunk.worker != st.owner:
                return  # a worker that lost the request to another; it was told to stop
        if chunk.index > st.next_index:
            st.pending[chunk.index] = chunk
            st.gap_since = st.gap_since or time.monotonic()
            if len(st.pending) > MAX_OUT_OF_ORDER:
                self._fail(rid, st, f"token stream gap: expected token {st.next_index}, got {min(st.pending)}")
            return
        self._consume(rid, st, chunk)
        while rid in self.states and st.pending:
            ready = [i for i in st.pending if i <= st.next_index]
            if not ready:
                break
            self._consume(rid, st, st.pending.pop(min(ready)))
        if not st.pending:
            st.gap_since = 0.0

    def _consume(self, rid: str, st: RequestState, chunk: TokenChunk) -> None:
        skip = st.next_index - chunk.index
        new_tokens = chunk.token_ids[skip:]
        if not new_tokens and chunk.finish_reason is None:
            return  # a duplicate
        pieces = []
        consumed = 0
        stopped = False
        # a stop token id ends the text without appearing in it (as vLLM does), unless asked
        hide_last = (chunk.finish_reason == "stop" and new_tokens and not st.spec.include_stop_str_in_output
                     and new_tokens[-1] in st.spec.stop_token_ids)
        for i, token_id in enumerate(new_tokens):
            consumed += 1
            if hide_last and i == len(new_tokens) - 1:
                break
            text, stopped = st.stop.feed(st.detok.step(token_id))
            pieces.append(text)
            if stopped:
                break
        st.next_index += consumed
        finish = "stop" if stopped else chunk.finish_reason
        if finish is not None and not stopped:
            text, stopped = st.stop.feed(st.detok.finish())
            pieces.append(text)
            if stopped:
                finish = "stop"
            else:
                pieces.append(st.stop.flush())
        text = self._filter(st, "".join(pieces), final=finish is not None)
        entries = [self._logprob_entry(lp) for lp in chunk.logprobs[skip : skip + consumed]] if chunk.logprobs else []
        if not text and finish is None:
            st.held_logprobs.extend(entries)
            return
        usage = None
        if finish is not None:
            usage = Usage(prompt_tokens=st.spec.num_prompt_tokens, completion_tokens=st.next_index,
                          cached_tokens=st.spec.num_cached_tokens)
        logprobs = None
        if chunk.logprobs:
            logprobs, st.held_logprobs = [*st.held_logprobs, *entries], []
        marks = []
        if finish is not None:
            marks = [*chunk.marks, now_mark("postfilter.final")] if chunk.marks else []
            st.span.end()
        self.post(st.spec.reply_to, TextChunk(
            request_id=rid, text=text, text_offset=st.text_offset, num_tokens=st.next_index,
            finish_reason=finish, usage=usage, logprobs=logprobs, source=self.inbox, marks=marks,
        ))
        st.text_offset += len(text)
        st.emitted.append(text)
        if finish is not None:
            st.finish_reason, st.usage = finish, usage
            self.states.pop(rid, None)
            self.finished.add(rid)
            self.done_states[rid] = (st, time.monotonic())  # kept a while, to resend lost text
            while len(self.done_states) > MAX_DONE_STATES:
                self.done_states.pop(next(iter(self.done_states)))
            if stopped and chunk.finish_reason is None:
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
        if worker and worker != st.owner:
            if st.owner:
                self.post(self.protocol.abort, Abort(request_id=rid, reason="superseded", worker=st.owner))
            st.owner = worker

    def _logprob_entry(self, lp: TokenLogprob) -> OutputLogprob:
        text, raw = self.token_text(lp.token_id)
        top = []
        for token_id, value in lp.top:
            t, b = self.token_text(token_id)
            top.append(TopLogprob(token=t, logprob=value, bytes=b))
        return OutputLogprob(token=text, logprob=lp.logprob, bytes=raw, top=top)

    def _fail(self, rid: str, st: RequestState, message: str) -> None:
        self.log.error("stream_failed", request_id=rid, error=message)
        self.post(st.spec.reply_to, ErrorEvent(request_id=rid, status=500, message=message, code="stream_gap"))
        self.post(self.protocol.abort, Abort(request_id=rid, reason="error"))
        self.states.pop(rid, None)
        self.finished.add(rid)


def main_entry() -> None:
    main(PostfilterWorker)
