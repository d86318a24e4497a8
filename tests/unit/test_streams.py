"""Stream repair (``shared/streams.py``) over an in-memory link that drops, duplicates,
reorders and delays messages, and kills either end: the receiver must deliver exactly the
sent sequence, each item once, in order.

The property test is derandomized (the same examples every run) so a failure reproduces;
Hypothesis prints the shrunk failing example.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.streams import (
    TEXT_POLICY,
    TOKEN_POLICY,
    Piece,
    Resend,
    SentStreams,
    StreamGap,
    StreamPolicy,
    StreamReceiver,
)

TICK_S = 0.25
#: gaps never fail in the property test: it checks ordering and repair, not the timeout
PATIENT = StreamPolicy(gap_timeout_s=1e9)


@dataclass(frozen=True)
class Fault:
    drop: bool = False
    duplicate: bool = False
    delay_ticks: int = 0


PERFECT = Fault()


class Link:
    """Messages in flight, delivered at their tick; the scripted faults apply in turn, then
    the link is perfect (so repair can finish)."""

    def __init__(self, faults: list[Fault]):
        self.faults = iter(faults)
        self.in_flight: list = []
        self.counter = itertools.count()

    def send(self, message, tick: int, may_drop: bool = True) -> None:
        fault = next(self.faults, PERFECT)
        if fault.drop and may_drop:
            return
        for _ in range(2 if fault.duplicate else 1):
            heapq.heappush(self.in_flight, (tick + fault.delay_ticks, next(self.counter), message))

    def due(self, tick: int) -> list:
        out = []
        while self.in_flight and self.in_flight[0][0] <= tick:
            out.append(heapq.heappop(self.in_flight)[2])
        return out


@dataclass(frozen=True)
class Data:
    source: str
    target: str
    piece: Piece
    replay: bool = False


@dataclass
class Receiver:
    """The consumer side as the postfilter and gateway use it."""

    name: str
    stream: StreamReceiver
    delivered: list = field(default_factory=list)
    superseded: list = field(default_factory=list)

    def on_data(self, msg: Data, now: float) -> None:
        if msg.replay:
            old = self.stream.claim(msg.source)
            if old:
                self.superseded.append(old)
        elif not self.stream.is_from_owner(msg.source):
            return
        p = msg.piece
        for ready in self.stream.offer(p, p.index, len(p.items), p.finish_reason is not None, now):
            new = ready.payload.items[ready.skip:]
            assert len(new) == ready.num_new
            self.delivered.extend(new)


@dataclass
class Scenario:
    sequence: list[int]
    sizes: list[int]
    data_faults: list[Fault]
    control_faults: list[Fault]
    kills: dict[int, str]  # tick → "sender" | "receiver" | "zombie"
    resume_answers: bool


faults = st.builds(Fault, drop=st.booleans(), duplicate=st.booleans(), delay_ticks=st.integers(0, 8))


@st.composite
def scenarios(draw) -> Scenario:
    n = draw(st.integers(1, 40))
    return Scenario(
        sequence=list(range(100, 100 + n)),
        sizes=draw(st.lists(st.integers(1, 4), min_size=1, max_size=10)),
        data_faults=draw(st.lists(faults, max_size=60)),
        control_faults=draw(st.lists(faults, max_size=20)),
        kills=draw(st.dictionaries(st.integers(0, 40), st.sampled_from(["sender", "receiver", "zombie"]),
                                   max_size=3)),
        resume_answers=draw(st.booleans()),
    )


def run(sc: Scenario, policy: StreamPolicy = PATIENT, max_ticks: int = 4000) -> list[Receiver]:
    """Simulate one request's stream; returns every receiver that existed, last one last."""
    data, control = Link(sc.data_faults), Link(sc.control_faults)
    rid = "r"
    senders = SentStreams()
    sender_id, zombie = "s0", None
    receivers = [Receiver("p0", StreamReceiver(policy, 0.0))]
    produced = 0
    sizes = itertools.cycle(sc.sizes)

    def emit(piece: Piece, source: str, target: str, replay: bool = False) -> None:
        # a piece from index 0 opens the stream (it names the reply subject): a lost opening
        # is not repaired here but bounded by the gateway's first-token timeout
        data.send(Data(source, target, piece, replay), tick, may_drop=piece.index > 0)

    for tick in range(max_ticks):
        now = tick * TICK_S
        rx = receivers[-1]
        kill = sc.kills.get(tick)
        if kill in ("sender", "zombie") and produced < len(sc.sequence):
            # a new owner takes over: it resumes after what the receiver has (when the
            # receiver answers), else replays from the start
            # the old one may live on as a zombie, still sending (correct) items
            zombie = [sender_id, produced] if kill == "zombie" else None
            sender_id = f"s{tick}"
            if sc.resume_answers:
                senders.open(rid, rx.name, items=list(rx.delivered))
                produced = len(rx.delivered)
                rx.stream.claim(sender_id)
            else:
                emit(senders.open(rid, rx.name).replay(rx.name), sender_id, rx.name, replay=True)
                produced = 0
        elif kill == "receiver":
            receivers.append(Receiver(f"p{tick}", StreamReceiver(policy, now)))
            rx = receivers[-1]
            sender = senders.get(rid)
            if sender is not None and sender.num_items:
                emit(sender.replay(rx.name), sender_id, rx.name, replay=True)
            elif sender is not None:
                sender.target = rx.name
        if senders.get(rid) is None:
            senders.open(rid, rx.name)
        sender = senders.get(rid)
        if produced < len(sc.sequence):
            new = sc.sequence[produced:produced + next(sizes)]
            produced += len(new)
            finish = "length" if produced == len(sc.sequence) else None
            emit(sender.push(new, finish), sender_id, sender.target)
            if finish:
                senders.finish(rid, now)
        if zombie is not None and zombie[1] < len(sc.sequence):  # a worker that lost the stream
            new = sc.sequence[zombie[1]:zombie[1] + 1]
            emit(Piece(zombie[1], new, None), zombie[0], sender.target)
            zombie[1] += 1
        for msg in data.due(tick):
            target = next((r for r in receivers if r.name == msg.target), None)
            if target is rx:  # a dead receiver's messages are lost
                target.on_data(msg, now)
        resend = rx.stream.poll(now)
        if resend is not None:
            control.send((resend, rx.name), tick)
        for req, reply_to in control.due(tick):
            assert isinstance(req, Resend)
            if req.source == sender_id:
                piece = senders.get(rid).resend(req.from_index)
                if piece is not None:
                    emit(piece, sender_id, reply_to)
        if rx.stream.is_finished:
            break
    return receivers


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_receiver_delivers_exactly_the_sent_sequence(sc: Scenario):
    receivers = run(sc)
    last = receivers[-1]
    assert last.stream.is_finished
    assert last.delivered == sc.sequence
    for rx in receivers:  # a receiver that died saw a prefix, never a wrong or repeated item
        assert rx.delivered == sc.sequence[:len(rx.delivered)]


def test_pieces_from_a_superseded_owner_are_ignored():
    rx = StreamReceiver(TOKEN_POLICY, now=0.0)
    assert rx.is_from_owner("d1")
    rx.offer([1, 2], 0, 2, False, now=0.0)
    assert rx.claim("d2") == "d1"  # a replay or resume hands the stream to d2: d1 is told to stop
    assert not rx.is_from_owner("d1")
    assert rx.is_from_owner("d2") and rx.claim("d2") == ""


def test_perfect_link_needs_no_resend():
    sc = Scenario(list(range(10)), [3], [], [], {}, True)
    receivers = run(sc, policy=TOKEN_POLICY)
    assert receivers[-1].delivered == list(range(10))
    assert receivers[-1].stream.last_resend_at == float("-inf")


def test_gap_that_never_closes_fails_the_stream():
    rx = StreamReceiver(TOKEN_POLICY, now=0.0, source="d1")
    assert [r.num_new for r in rx.offer("a", 0, 2, False, now=0.0)] == [2]
    assert rx.offer("c", 5, 1, False, now=0.5) == []  # items 2..4 are missing
    assert rx.poll(1.0) is None  # a reorder may still close it
    assert rx.poll(1.6) == Resend("d1", 2)
    assert rx.poll(2.0) is None  # at most one request per resend_interval_s
    with pytest.raises(StreamGap):
        rx.poll(5.6)


def test_too_many_pieces_held_fails_the_stream():
    rx = StreamReceiver(StreamPolicy(max_pending=3), now=0.0)
    rx.offer("a", 0, 1, False, now=0.0)
    for i in range(2, 5):
        rx.offer("x", i, 1, False, now=0.0)
    with pytest.raises(StreamGap):
        rx.offer("y", 5, 1, False, now=0.0)


def test_quiet_stream_asks_for_its_end_every_quiet_period():
    rx = StreamReceiver(TEXT_POLICY, now=0.0, source="pf")
    rx.offer("hello", 0, 5, False, now=0.0)
    assert rx.poll(2.9) is None
    assert rx.poll(3.1) == Resend("pf", 5)
    assert rx.poll(4.0) is None
    assert rx.poll(6.2) == Resend("pf", 5)
    [ready] = rx.offer("hello world", 0, 11, True, now=6.5)  # the resend overlaps what arrived
    assert (ready.skip, ready.num_new, ready.is_final) == (5, 6, True)
    assert rx.poll(100.0) is None


def test_sender_answers_resends_and_replays():
    streams = SentStreams(max_finished=2, finished_ttl_s=10.0)
    s = streams.open("a", "p1", empty="")
    assert s.push("hel") == Piece(0, "hel", None)
    assert s.push("lo") == Piece(3, "lo", None)
    assert s.resend(5) is None  # nothing the receiver lacks
    assert s.resend(1) == Piece(1, "ello", None)
    s.push("", "stop")
    streams.finish("a", now=0.0)
    assert streams.get("a").resend(5) == Piece(5, "", "stop")
    assert s.replay("p2") == Piece(0, "hello", "stop") and s.target == "p2"
    for rid in ("b", "c"):
        streams.open(rid, "p1").push([1], "length")
        streams.finish(rid, now=5.0)
    assert streams.get("a") is None  # only the newest max_finished are kept
    assert [rid for rid, _ in streams.finished_since(4.0)] == ["c", "b"]
    # "b" was replayed in full to a new owner at 8.0: watched from then on, "c" no longer
    streams.refresh("b", now=8.0)
    assert [rid for rid, _ in streams.finished_since(6.0)] == ["b"]
    streams.refresh("gone", now=8.0)  # not kept (or never finished): nothing to watch
    streams.expire(now=16.0)
    assert streams.get("c") is None and streams.get("b") is not None
    streams.expire(now=20.0)
    assert streams.get("b") is None


def test_unstarted_stream_goes_stale():
    rx = StreamReceiver(TOKEN_POLICY, now=0.0)
    rx.offer("later", 3, 1, False, now=0.0)
    assert rx.poll(10.0) is None  # nothing to resend from: its first piece names the reply subject
    assert not rx.is_stale(29.0) and rx.is_stale(31.0)
