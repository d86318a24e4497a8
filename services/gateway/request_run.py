"""One API request in flight: its pipeline requests (one per choice), their events, their
deadlines, and aborting them.

A request with ``n`` choices (and, for completions, several prompts) becomes one pipeline
request per choice, each with its own id ``<id>-<k>``; their events are merged here. Every
wait is bounded: by the request's deadline (``PD_REQUEST_TIMEOUT_S``) and by the longest
silence allowed between two events of a request (``PD_STALL_TIMEOUT_S``); past either, the
request fails with a timeout and every stage is told to drop it.

Each choice's text arrives through a :class:`shared.streams.StreamReceiver` (``TEXT_POLICY``):
it orders chunks by character offset, drops text already shown (a resend after a failover),
asks the postfilter for lost text, and fails the request when a hole never closes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.gateway.disconnect import ClientGone, DisconnectWatch
from services.gateway.pipeline import PipelineClient
from shared.deadline import deadline_exceeded
from shared.errors import Aborted, DeadlineExceeded, RelayedError
from shared.messages import Accepted, ErrorEvent, OutputLogprob, SpecStats, TextChunk, TokenizeTask, Usage
from shared.streams import TEXT_POLICY, Ready, StreamGap, StreamReceiver

#: Abort tasks in flight (a reference keeps them from being garbage-collected mid-way).
_background: set[asyncio.Task] = set()


class PipelineError(RelayedError):
    """An ErrorEvent from a stage, re-raised at the gateway with the stage's status."""

    def __init__(self, event: ErrorEvent):
        super().__init__(event.message, status=event.status, type=event.type, param=event.param, code=event.code)


@dataclass(slots=True, eq=False)
class Choice:
    """One output sequence of the API request."""

    index: int
    prompt_index: int
    task: TokenizeTask
    num_prompt_tokens: int = 0
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[OutputLogprob] = field(default_factory=list)
    prompt_logprobs: list[OutputLogprob] | None = None
    accepted: bool = False
    marks: list = field(default_factory=list)
    spec_stats: SpecStats | None = None  # speculative decoding on the decode worker that finished it
    stream: StreamReceiver = field(
        default_factory=lambda: StreamReceiver(TEXT_POLICY, time.monotonic(), unit="character"))

    @property
    def sent_chars(self) -> int:
        """Characters of text delivered so far."""
        return self.stream.next_index

    @property
    def request_id(self) -> str:
        return self.task.meta.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Delta:
    """New output of one choice: text (may be empty on the final delta) starting at character
    ``text_offset`` of the choice's output, and finish."""

    choice: Choice
    text: str
    finish_reason: str | None
    logprobs: list[OutputLogprob]
    text_offset: int = 0
    prompt_logprobs: list[OutputLogprob] | None = None


class RequestRun:
    """Drives the pipeline requests of one API request.

    Args:
        client: the gateway's pipeline client.
        choices: one per pipeline request.
        deadline_at: unix seconds.
        stall_timeout_s: longest silence allowed between events once text flows.
        first_token_timeout_s: longest silence allowed before the first text (default: the
            stall timeout); Progress events from a busy stage count as not silent.
        tick_s: period of the idle callback while waiting.
        on_tick: coroutine function called every ``tick_s`` of silence; it may raise (a
            client that went away raises Aborted).
        ticket: its admission ticket (the caller, its rate-limit reservation), settled by the gateway.
        watch: a :class:`~services.gateway.disconnect.DisconnectWatch` on the client's connection:
            its disconnect ends the run at once (``Aborted``), whatever it waits for.
        timeline, span: its timeline (``/debug/timeline``) and trace span, ended by the gateway.

    Use it as ``async with run:`` — entering registers every choice's event route and submits
    its task; leaving unregisters them and aborts the unfinished ones at every stage.
    """

    def __init__(self, client: PipelineClient, choices: list[Choice], deadline_at: float, stall_timeout_s: float,
                 tick_s: float = 1.0, on_tick=None, first_token_timeout_s: float | None = None, *,
                 ticket=None, timeline=None, span=None, watch: DisconnectWatch | None = None):
        self.client = client
        self.watch = watch
        self.ticket = ticket
        self.timeline = timeline
        self.span = span
        self.last_token_at: float | None = None  # monotonic: the last text delivered (for ITL)
        self.first_token_timeout_s = first_token_timeout_s or stall_timeout_s
        self.tick_s = tick_s
        self._on_tick = on_tick
        self.choices = choices
        self.by_id = {c.request_id: c for c in choices}
        self.deadline_at = deadline_at
        self.stall_timeout_s = stall_timeout_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self._early: list = []
        self._last_event_at = time.monotonic()

    async def __aenter__(self) -> RequestRun:
        for c in self.choices:
            self.client.register(c.request_id, self.queue)
        if self.watch is not None:
            self.watch.start(self.queue.put_nowait)
        try:
            for c in self.choices:
                await self.client.submit(c.task)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, None)
            raise
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        """Unregister, and tell every stage to drop unfinished choices. The abort runs as a
        task of its own: when the client went away the caller is being cancelled, and an
        await here would be cancelled before the abort was sent."""
        if self.watch is not None:
            self.watch.stop()
        self._unregister()
        if any(not c.finished for c in self.choices):
            reason = "client_disconnected" if exc_type in (asyncio.CancelledError, GeneratorExit) else "error"
            if isinstance(exc, DeadlineExceeded):
                reason = "deadline"
            elif isinstance(exc, Aborted):
                reason = "client_disconnected"
            task = asyncio.get_running_loop().create_task(self.abort(reason))
            _background.add(task)
            task.add_done_callback(_background.discard)

    async def on_tick(self) -> None:
        if self._on_tick is not None:
            await self._on_tick()
        for c in self.choices:
            if not c.finished:
                self._repair(c)  # a hole in its text, or a quiet stream whose end may be lost

    def _repair(self, choice: Choice) -> None:
        """Ask the choice's postfilter for lost text, if its stream says so.

        Raises:
            PipelineError: a hole in the text never closed (502 ``stream_gap``).
        """
        try:
            resend = choice.stream.poll(time.monotonic())
        except StreamGap as exc:
            raise PipelineError(ErrorEvent(request_id=choice.request_id, status=502, code="stream_gap",
                                           message=f"text was lost in transit: {exc}")) from None
        if resend is not None:
            task = asyncio.get_running_loop().create_task(
                self.client.resend_text(resend.source, choice.request_id, resend.from_index))
            _background.add(task)
            task.add_done_callback(_background.discard)

    def _unregister(self) -> None:
        for c in self.choices:
            self.client.unregister(c.request_id)

    async def abort(self, reason: str) -> None:
        await asyncio.gather(*(self.client.abort(c.request_id, reason) for c in self.choices if not c.finished))

    async def _next_event(self, tick_s: float | None = None):
        """The next event; None after ``tick_s`` of silence (for keep-alives and
        disconnect checks).

        Raises:
            DeadlineExceeded: past the deadline, or silent for ``stall_timeout_s``.
        """
        now = time.time()
        if now >= self.deadline_at:
            raise deadline_exceeded("waiting for the pipeline")
        # before the first token a request may wait behind others' prefills; after it, the
        # stream must keep moving
        limit = self.stall_timeout_s if self.first_token_at is not None else self.first_token_timeout_s
        stall_left = limit - (time.monotonic() - self._last_event_at)
        if stall_left <= 0:
            raise DeadlineExceeded(
                f"no progress from the pipeline for {limit:.0f}s (a stage may be down or stuck)"
            )
        timeout = min(stall_left, self.deadline_at - now, tick_s if tick_s is not None else float("inf"))
        try:
            event = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            if tick_s is not None and timeout == tick_s:
                return None
            return await self._next_event(tick_s)  # re-checks which limit passed
        if isinstance(event, ClientGone):
            raise Aborted("client disconnected")
        if self._is_progress(event):
            self._last_event_at = time.monotonic()
        if isinstance(event, TextChunk) and event.text and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        return event

    def _is_progress(self, event) -> bool:
        """Whether an event moves the request on (a resend of text already delivered does not,
        so it cannot keep a stuck request alive)."""
        if not isinstance(event, TextChunk):
            return True
        choice = self.by_id.get(event.request_id)
        if choice is None:
            return False
        return event.finish_reason is not None or event.text_offset + len(event.text) > choice.sent_chars

    def _apply(self, event) -> list[Delta]:
        """The new output an event brings (text chunks wait for the ones before them).

        Raises:
            PipelineError: an ErrorEvent, or a hole in the text that never closed.
        """
        choice = self.by_id.get(event.request_id)
        if choice is None:
            return []
        if isinstance(event, ErrorEvent):
            raise PipelineError(event)
        if isinstance(event, Accepted):
            choice.accepted = True
            choice.num_prompt_tokens = event.num_prompt_tokens
            return []
        if not isinstance(event, TextChunk) or choice.finished:
            return []
        choice.accepted = True  # text implies the prompt was accepted (its Accepted may be lost)
        choice.stream.claim(event.source)  # the postfilter to ask for lost text
        try:
            ready = choice.stream.offer(event, event.text_offset, len(event.text), event.finish_reason is not None,
                                        time.monotonic())
        except StreamGap as exc:
            raise PipelineError(ErrorEvent(request_id=event.request_id, status=502, code="stream_gap",
                                           message=f"text was lost in transit: {exc}")) from None
        if choice.stream.gap_since:
            self._repair(choice)  # text in between never arrived: ask for it, never show a hole
        return [self._delta(choice, r) for r in ready]

    @staticmethod
    def _delta(choice: Choice, ready: Ready) -> Delta:
        event: TextChunk = ready.payload
        text = event.text[ready.skip:]  # without what was already delivered (a resend)
        choice.text.append(text)
        choice.num_tokens = max(choice.num_tokens, event.num_tokens)
        new_logprobs: list[OutputLogprob] = []
        if event.logprobs:
            # entries cover output tokens num_tokens - len .. num_tokens - 1: skip known ones
            first = event.num_tokens - len(event.logprobs)
            new_logprobs = list(event.logprobs[max(0, len(choice.logprobs) - first):])
            choice.logprobs.extend(new_logprobs)
        prompt_logprobs = None
        if event.prompt_logprobs is not None and choice.prompt_logprobs is None:
            choice.prompt_logprobs = prompt_logprobs = list(event.prompt_logprobs)
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            choice.usage = event.usage
            choice.marks = list(event.marks)
            choice.spec_stats = event.spec_stats
        return Delta(choice, text, event.finish_reason, new_logprobs, event.text_offset + ready.skip, prompt_logprobs)

    async def wait_accepted(self) -> None:
        """Until every choice is accepted by the tokenizer (its prompt is valid).

        Text that overtakes its Accepted is kept for :meth:`deltas`.

        Raises:
            PipelineError: a stage rejected the request (e.g. context too long: a 400).
            DeadlineExceeded: no answer in time.
        """
        while not all(c.accepted for c in self.choices):
            event = await self._next_event(self.tick_s)
            if event is None:
                await self.on_tick()
                continue
            if isinstance(event, (Accepted, ErrorEvent)):
                self._apply(event)
            else:
                self._early.append(event)
                choice = self.by_id.get(getattr(event, "request_id", ""))
                if choice is not None and isinstance(event, TextChunk):
                    choice.accepted = True  # text implies acceptance (its Accepted may be lost)

    async def deltas(self) -> AsyncIterator[Delta | None]:
        """New text of every choice as it arrives, until all have finished; None after each
        ``tick_s`` of silence (the caller sends a keep-alive or checks the client).

        Raises:
            PipelineError, DeadlineExceeded.
        """
        last_tick = time.monotonic()
        while not all(c.finished for c in self.choices):
            event = self._early.pop(0) if self._early else await self._next_event(self.tick_s)
            if event is None or time.monotonic() - last_tick >= self.tick_s:
                # also while events flow: a client can leave mid-stream
                last_tick = time.monotonic()
                await self.on_tick()
            if event is None:
                yield None
                continue
            for delta in self._apply(event):
                yield delta
