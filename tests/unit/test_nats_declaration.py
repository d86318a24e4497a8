"""Declaring a work queue through a meta-leader election: a node that does not yet know the
stream's assignment answers "stream not found" (JetStream error 10059) for a stream that exists.
The declaration must wait for a leader's answer instead of failing the process that declares
(seen once in CI: the cluster test's publisher died on a 404 while the meta leader was down)."""

from __future__ import annotations

import asyncio
import types

import pytest
from nats.js.errors import NotFoundError

from shared import nats_bus
from shared.config import Settings
from shared.nats_queues import consumer_config, stream_config
from shared.subjects import Protocol


class ElectingJetStream:
    """A JetStream context whose stream exists, but whose consumer lookups and creations answer
    "stream not found" for the first ``not_found`` calls (an election in progress)."""

    def __init__(self, queue, settings, not_found: int):
        self.queue, self.settings = queue, settings
        self.not_found = not_found
        self.calls = 0
        self.consumer_added = False
        self.streams_added = 0

    def _electing(self):
        self.calls += 1
        if self.calls <= self.not_found:
            raise NotFoundError(code=404, err_code=10059, description="stream not found")

    async def stream_info(self, name):
        return types.SimpleNamespace(config=stream_config(self.queue, self.settings.nats_replicas))

    async def add_stream(self, config):
        self.streams_added += 1

    async def consumer_info(self, stream, durable):
        self._electing()
        if not self.consumer_added:
            raise NotFoundError(code=404, err_code=10014, description="consumer not found")
        return types.SimpleNamespace(config=consumer_config(self.queue, self.settings))

    async def add_consumer(self, stream, config):
        self._electing()
        self.consumer_added = True


def bus_over(js, settings) -> nats_bus.NatsBus:
    nc = types.SimpleNamespace(jetstream=lambda: js)
    return nats_bus.NatsBus(nc, settings)


def test_a_not_found_during_an_election_is_waited_out():
    settings = Settings.from_env({}, namespace="t-elect", nats_replicas=3)
    queue = Protocol("t-elect").decode
    js = ElectingJetStream(queue, settings, not_found=3)
    asyncio.run(bus_over(js, settings).ensure_queues([queue]))
    assert js.consumer_added
    assert js.calls > 3
    assert js.streams_added == 0  # the stream was found: nothing re-created


def test_a_not_found_that_never_clears_still_fails(monkeypatch):
    monkeypatch.setattr(nats_bus, "PUBLISH_RETRY_S", 0.5)
    settings = Settings.from_env({}, namespace="t-elect", nats_replicas=3)
    queue = Protocol("t-elect").decode
    js = ElectingJetStream(queue, settings, not_found=10**9)
    with pytest.raises(NotFoundError):
        asyncio.run(bus_over(js, settings).ensure_queues([queue]))
    assert js.calls > 1  # it was asked again before giving up


def test_publishing_does_not_retry_a_not_found():
    """A publish's "not found" is not an election answer (JetStream answers a publish to a
    leaderless stream with "no responders" or 503), so only the declaration waits on it."""
    exc = NotFoundError(code=404, err_code=10059, description="stream not found")
    assert nats_bus.is_retryable_declaration(exc)
    assert not nats_bus.is_retryable(exc)
