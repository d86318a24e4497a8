"""Ordered, gap-free, exactly-once delivery of one request's stream over an unreliable link.

Two streams of a request ride core NATS (no persistence, no acks: a JetStream ack per token
costs too much, ``docs/decisions.md``): its tokens, decode → postfilter (indexed by output
token), and its text, postfilter → gateway (indexed by character offset). A message can be
lost (a broker restart), duplicated (a resend crossing the original), reordered (two
publishers: prefill sends token 0, decode the rest) or come from a worker that no longer owns
the stream (a failover). Both ends of both streams use the two objects here, so that repair
lives in one place and the workers keep only their own stage's logic:

* :class:`StreamSender` — what one request's stream has sent: every item (kept until the
  stream is finished and has aged out of :class:`SentStreams`), how it ended, and where it
  goes. It answers a resend request from any index, and replays everything to a new owner.
* :class:`StreamReceiver` — delivers pieces in index order, each item once: it holds pieces
  that arrive early, trims what was already delivered, asks the sender for the rest when a
  gap stays open or the stream goes quiet, fails the stream when a gap never closes, and
  knows which sender owns the stream (a hand-over on resume or replay).

Neither does I/O or reads a clock: callers pass ``now`` (``time.monotonic()``) and act on
what the methods return, so the logic is tested in milliseconds over an in-memory link
(``tests/unit/test_streams.py``, property-based).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Payload = TypeVar("Payload")


@dataclass(frozen=True, slots=True)
class StreamPolicy:
    """The timing of stream repair, in seconds.

    Attributes:
        gap_timeout_s: a gap (a piece after a missing one) open this long fails the stream.
        gap_resend_after_s: a gap open this long asks the sender for a resend.
        quiet_resend_s: once started, a stream without a piece (or a resend request) for this
            long asks for a resend — its end may have been lost.
        resend_interval_s: at least this long between two resend requests for a gap.
        max_pending: pieces held while waiting for an earlier one; one more fails the stream.
        start_timeout_s: pieces that arrived before the stream's first one are kept this long.
        start_resend_s: when set, a stream with nothing delivered yet asks for a resend from
            item 0 this often (its first piece may have been lost while its sender is unknown:
            :meth:`StreamReceiver.poll` then returns a Resend with ``source=""``, a broadcast).
    """

    gap_timeout_s: float = 5.0
    gap_resend_after_s: float = 1.0
    quiet_resend_s: float = 3.0
    resend_interval_s: float = 1.0
    max_pending: int = 256
    start_timeout_s: float = 30.0
    start_resend_s: float | None = None


#: decode → postfilter: a gap may be a reorder between prefill's first token and decode's
#: next, so the postfilter waits a second before asking.
TOKEN_POLICY = StreamPolicy()
#: postfilter → gateway: one publisher, so a gap is a loss: ask at once; and a request with no
#: text yet asks every 3 s whether its first text was lost (a broker restart can eat it).
TEXT_POLICY = StreamPolicy(gap_resend_after_s=0.0, start_resend_s=3.0)


class StreamGap(Exception):
    """The stream has a hole that will not close (too many pieces held, or too long)."""


@dataclass(frozen=True, slots=True)
class Ready(Generic[Payload]):
    """A piece ready for the consumer: ``payload`` whose first ``skip`` items were already
    delivered (drop them), carrying ``num_new`` new items (0 for a bare final piece)."""

    payload: Payload
    skip: int
    num_new: int
    is_final: bool


@dataclass(frozen=True, slots=True)
class Resend:
    """Ask the stream's sender (``source``) to send again from item ``from_index``."""

    source: str
    from_index: int


@dataclass(slots=True)
class _Pending(Generic[Payload]):
    payload: Payload
    index: int
    length: int
    is_final: bool


class StreamReceiver(Generic[Payload]):
    """The receiving end of one request's stream (tokens or text).

    Pieces are offered with their index (of their first item), length (items) and whether
    they end the stream; :meth:`offer` returns those now deliverable, in order, with the
    items already delivered marked to skip. Items are whatever the stream counts: token ids
    (index = output token) or characters (index = text offset).
    """

    def __init__(self, policy: StreamPolicy, now: float, source: str = "", unit: str = "item"):
        self.policy = policy
        self.unit = unit  # what an item is, for error messages ("token", "character")
        self.next_index = 0
        self.is_finished = False
        self.has_started = False
        self.source = source
        self.opened_at = now
        self.last_piece_at = now
        self.gap_since = 0.0
        self.last_resend_at = float("-inf")
        self.pending: dict[int, _Pending[Payload]] = {}

    # --- ownership ------------------------------------------------------------------------
    def claim(self, source: str) -> str:
        """``source`` now owns the stream (a replay, or a resume hand-over); returns the
        previous owner to tell to stop ("" when none, or the same)."""
        previous = self.source if self.source and self.source != source else ""
        if source:
            self.source = source
        return previous

    def is_from_owner(self, source: str) -> bool:
        """Whether a piece from ``source`` counts: the first sender to speak becomes the
        owner; a sender that lost the stream to another is ignored."""
        if not source:
            return True
        if not self.source:
            self.source = source
        return source == self.source

    # --- delivery -------------------------------------------------------------------------
    def offer(self, payload: Payload, index: int, length: int, is_final: bool, now: float) -> list[Ready[Payload]]:
        """The pieces deliverable now, in order, once ``payload`` has arrived.

        Raises:
            StreamGap: more than ``policy.max_pending`` pieces wait for a missing one.
        """
        self.last_piece_at = now
        if self.is_finished:
            return []
        if index > self.next_index:
            self.pending[index] = self._merge(self.pending.get(index), _Pending(payload, index, length, is_final))
            self.gap_since = self.gap_since or now
            if len(self.pending) > self.policy.max_pending:
                raise StreamGap(f"expected {self.unit} {self.next_index}, got {min(self.pending)}")
            return []
        ready = self._take(_Pending(payload, index, length, is_final))
        while not self.is_finished and self.pending:
            waiting = [i for i in self.pending if i <= self.next_index]
            if not waiting:
                break
            ready.extend(self._take(self.pending.pop(min(waiting))))
        if not self.pending or self.is_finished:
            self.pending.clear()
            self.gap_since = 0.0
        return ready

    @staticmethod
    def _merge(old: _Pending | None, new: _Pending) -> _Pending:
        """Of two pieces at one index, the one that says more (a resend may be longer)."""
        if old is None or (new.length, new.is_final) > (old.length, old.is_final):
            return new
        return old

    def _take(self, piece: _Pending[Payload]) -> list[Ready[Payload]]:
        skip = self.next_index - piece.index
        num_new = max(0, piece.length - skip)
        if num_new == 0 and not piece.is_final:
            return []  # a duplicate
        self.next_index += num_new
        self.has_started = True
        self.is_finished = piece.is_final
        return [Ready(piece.payload, skip, num_new, piece.is_final)]

    # --- repair ---------------------------------------------------------------------------
    def poll(self, now: float) -> Resend | None:
        """What to do about a stalled stream, called about once a second.

        Returns:
            a :class:`Resend` to send to the owner (``source=""``: owner unknown, nothing
            arrived yet: ask every possible sender), or None.

        Raises:
            StreamGap: a gap stayed open past ``policy.gap_timeout_s``.
        """
        p = self.policy
        if self.is_finished:
            return None
        if not self.has_started:
            if p.start_resend_s is None or now - max(self.opened_at, self.last_resend_at) < p.start_resend_s:
                return None
            self.last_resend_at = now
            return Resend(self.source, 0)
        if self.gap_since and now - self.gap_since > p.gap_timeout_s:
            raise StreamGap(f"{self.unit} {self.next_index} never arrived")
        # an unknown owner (nothing came from it yet: only a first piece from another sender)
        # gets a Resend with source "": the caller asks every possible sender
        gap_open = self.gap_since and now - self.gap_since >= p.gap_resend_after_s
        if gap_open and now - self.last_resend_at >= p.resend_interval_s:
            return self._resend(now)
        if now - max(self.last_piece_at, self.last_resend_at) > p.quiet_resend_s:
            return self._resend(now)
        return None

    def _resend(self, now: float) -> Resend:
        self.last_resend_at = now
        return Resend(self.source, self.next_index)

    def is_stale(self, now: float) -> bool:
        """Pieces arrived but never the first one, for ``policy.start_timeout_s``: forget it."""
        return not self.has_started and now - self.opened_at > self.policy.start_timeout_s


@dataclass(frozen=True, slots=True)
class Piece:
    """What a sender sends: ``items`` starting at item ``index``; ``finish_reason`` when it
    ends the stream (None while it runs)."""

    index: int
    items: Any
    finish_reason: str | None


@dataclass(slots=True, eq=False)
class StreamSender:
    """The sending end of one request's stream: all it sent, and where to.

    Args:
        target: where the stream goes (the owner's inbox); changed by :meth:`retarget`.
        empty: ``[]`` for token ids, ``""`` for text; items are concatenations of these.
    """

    target: str
    empty: Any = field(default_factory=list)
    finish_reason: str | None = None
    finished_at: float = 0.0
    context: Any = None  # the caller's record of the request (a task, a spec)
    _parts: list = field(default_factory=list)
    _length: int = 0

    @property
    def num_items(self) -> int:
        return self._length

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def items(self, from_index: int = 0):
        """Every item sent from ``from_index`` on (a list, or a str for text)."""
        if isinstance(self.empty, str):
            return "".join(self._parts)[from_index:]
        return list(itertools.chain.from_iterable(self._parts))[from_index:]

    def push(self, items, finish_reason: str | None = None) -> Piece:
        """Record ``items`` as sent (and the end, if ``finish_reason``); the piece to send."""
        piece = Piece(self._length, items, finish_reason)
        if items:
            self._parts.append(items)
            self._length += len(items)
        if finish_reason is not None:
            self.finish_reason = finish_reason
        return piece

    def resend(self, from_index: int) -> Piece | None:
        """The piece answering "send again from ``from_index``", or None when there is
        nothing the receiver lacks (nothing new and no end) or it asks past the end."""
        if from_index > self._length or (from_index == self._length and not self.is_finished):
            return None
        return Piece(from_index, self.items(from_index), self.finish_reason)

    def replay(self, target: str) -> Piece:
        """Everything so far, from index 0, for a new owner ``target``."""
        self.target = target
        return Piece(0, self.items(), self.finish_reason)


class SentStreams:
    """The sender side of a worker's streams: running ones, and finished ones kept a while
    (at most ``max_finished``, for ``finished_ttl_s``) to answer resends and replays.

    Args:
        max_finished: finished streams kept (oldest dropped first).
        finished_ttl_s: seconds a finished stream is kept.
    """

    def __init__(self, max_finished: int = 4096, finished_ttl_s: float = 120.0):
        self.running: dict[str, StreamSender] = {}
        self.finished: OrderedDict[str, StreamSender] = OrderedDict()
        self.max_finished = max_finished
        self.finished_ttl_s = finished_ttl_s

    def open(self, request_id: str, target: str, empty=None, items=None, context=None) -> StreamSender:
        """A running stream (``items`` already sent before this sender took over)."""
        sender = StreamSender(target, [] if empty is None else empty, context=context)
        if items:
            sender.push(items)
        self.finished.pop(request_id, None)
        self.running[request_id] = sender
        return sender

    def get(self, request_id: str) -> StreamSender | None:
        return self.running.get(request_id) or self.finished.get(request_id)

    def finish(self, request_id: str, now: float) -> None:
        """The stream ended (its final piece was pushed): keep it a while for resends."""
        sender = self.running.pop(request_id, None)
        if sender is None:
            return
        sender.finished_at = now
        self.finished.pop(request_id, None)
        self.finished[request_id] = sender
        while len(self.finished) > self.max_finished:
            self.finished.popitem(last=False)

    def refresh(self, request_id: str, now: float) -> None:
        """A finished stream was sent again in full (replayed to a new owner): count it as
        finished ``now``, so :meth:`finished_since` keeps offering it while its new owner
        might still die before delivering it."""
        sender = self.finished.pop(request_id, None)
        if sender is not None:
            sender.finished_at = now
            self.finished[request_id] = sender

    def drop(self, request_id: str) -> None:
        """Forget a running stream (aborted: nobody will ask for it)."""
        self.running.pop(request_id, None)

    def expire(self, now: float) -> None:
        while self.finished:
            rid, sender = next(iter(self.finished.items()))
            if now - sender.finished_at <= self.finished_ttl_s:
                break
            self.finished.popitem(last=False)

    def finished_since(self, horizon: float) -> Iterator[tuple[str, StreamSender]]:
        """Finished streams newer than ``horizon`` (monotonic seconds), newest first."""
        for rid, sender in reversed(list(self.finished.items())):
            if sender.finished_at < horizon:
                break
            yield rid, sender
